"""The vfs without FUSE: a FileSystem over a fresh volume, ending every test with fsck.

``META`` says which metadata engine open_fs makes its volumes on: None (the default,
``sqlite:`` in the volume directory) or a URL (``memory:NAME``, ``etcd://...``); a
test suite run on every engine sets it per test (tests/test_t3_vfs.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import os

from bmfs.vfs.fs import FileSystem
from bmfs.volume.fsck import fsck
from bmfs.volume.volume import Volume, mkfs

O_RDWR = os.O_RDWR
META: contextvars.ContextVar[str | None] = contextvars.ContextVar("META", default=None)


@contextlib.asynccontextmanager
async def open_fs(path, check=True, **mkfs_args):
    if not os.path.exists(os.path.join(path, "volume.json")):
        await mkfs(str(path), **{"meta": META.get(), **mkfs_args})
    vol = await Volume.open(str(path))
    fs = await FileSystem.create(vol)
    try:
        yield fs
    finally:
        await fs.aclose()
        if check:
            problems, _ = await fsck(vol)
            await vol.aclose()
            assert problems == [], problems
        else:
            await vol.aclose()


async def write_file(fs, parent, name: bytes, data: bytes, mode=0o644) -> int:
    fh, a = await fs.create_file(parent, name, mode, O_RDWR, 0, 0)
    if data:
        await fs.files.write(fh, 0, data)
    await fs.files.release(fh)
    return a.ino


async def read_file(fs, ino) -> bytes:
    fh = await fs.open(ino, os.O_RDONLY)
    try:
        return await fs.files.read(fh, 0, 1 << 40)
    finally:
        await fs.files.release(fh)
