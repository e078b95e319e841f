"""A volume's whole metadata to a file and back (``bmfs dump`` / ``bmfs load``).

A dump holds every key of the volume's metadata: settings, device records, every
branch, snapshot and layer, every inode, directory entry, xattr (types included),
symlink and slice list, and every stripe record (inline data of small files, and
for the others which device holds each fragment). It does not hold the fragments:
they stay on the devices the stripe records name, so a volume loaded from a dump
reads the same devices. Left out: what only lives while something runs (mount
records ``m/``, the single-owner mount mark, storage nodes' leased membership
records), which the loaded volume makes again.

File format (docs/formats.md, "Dump files"), version DUMP_VERSION::

    b"bmfs-dump\\n"                      magic
    u32 version                          DUMP_VERSION
    u32 n, n bytes of JSON               header: format revision, uuid, k, m,
                                         made (unix time), bmfs version
    records:  u32 key length, u32 value length, key, value   (values without their
                                         checksums: the loading volume seals them)
    u32 0xffffffff                       end mark
    u64 count                            how many records there are
    32 bytes                             sha256 of everything before it

All integers big-endian. A file that is truncated, damaged (its sha256 or a record's
shape), of another version or of another format revision is refused whole before
anything is written.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time

from ..errors import VolumeError
from ..kv import open_kv
from ..meta import keys

MAGIC = b"bmfs-dump\n"
DUMP_VERSION = 1
END = 0xFFFFFFFF
# what lives only while a mount or node runs: never dumped
TRANSIENT = (keys.MOUNT_PREFIX, keys.NODE_PREFIX, keys.MOUNTED, keys.SEALING)
PAGE = 1000  # keys read per range request
# what one load transaction writes at most (etcd's default --max-txn-ops is 128 and
# --max-request-bytes 1.5 MiB)
BATCH_KEYS, BATCH_BYTES = 100, 1 << 20
_U32, _U64 = struct.Struct(">I"), struct.Struct(">Q")


class DumpError(VolumeError):
    """A dump file that cannot be loaded (one line says why)."""


def _transient(key: bytes) -> bool:
    return any(key.startswith(p) if p.endswith(b"/") else key == p for p in TRANSIENT)


async def _all_keys(kv):
    """Every (key, value) of the engine, values unsealed, in key order."""
    start = b""
    while True:
        rows = await kv.range(start, b"", PAGE)
        for k, v in rows:
            yield k, v
        if len(rows) < PAGE:
            return
        start = rows[-1][0] + b"\0"


async def dump(volume_path: str, out_path: str) -> dict:
    """Write the metadata of the volume at ``volume_path`` (not mounted) to the new file
    ``out_path`` (0600), a page of keys at a time; returns the header, with ``keys``:
    how many were written.

    Raises:
        VolumeError: no volume there, the volume is mounted (or its last mount
            crashed), of an older format revision, or ``out_path`` exists or cannot
            be written.
    """
    from importlib.metadata import PackageNotFoundError, version

    from .volume import read_settings, read_volume_file
    info = read_volume_file(volume_path)
    if os.path.lexists(out_path):
        raise VolumeError(f"{out_path} exists: a dump goes to a new file")
    kv = await open_kv(info["meta"])
    try:
        d = await read_settings(kv, volume_path, info["meta"])
        if d["format"] != keys.FORMAT_REVISION:
            raise VolumeError(f"{volume_path}: format revision {d['format']}: mount it "
                              f"once (it is upgraded to {keys.FORMAT_REVISION}), then dump")
        if await kv.raw_get(keys.MOUNTED) is not None or \
                await kv.raw_range(*keys.span(keys.MOUNT_PREFIX), 1):
            raise VolumeError(f"{volume_path} is mounted (or its last mount crashed: "
                              f"mount and unmount it once): unmount it, then dump")
        try:
            bmfs_version = version("bmfs")
        except PackageNotFoundError:
            bmfs_version = "unknown"
        header = {"format_revision": d["format"], "uuid": d["uuid"], "k": d["k"],
                  "m": d["m"], "made": time.time(), "bmfs": bmfs_version}
        header["keys"] = await _write(kv, out_path, header)
        return header
    finally:
        await kv.aclose()


async def _write(kv, out_path: str, header: dict) -> int:
    """Write the dump file (through a temporary file, renamed when whole); returns how
    many records it holds."""
    tmp = out_path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise VolumeError(f"cannot write {out_path}: {e.strerror}")
    try:
        with os.fdopen(fd, "wb") as f:
            h = hashlib.sha256()

            def put(b: bytes) -> None:
                h.update(b)
                f.write(b)
            hj = json.dumps(header).encode()
            put(MAGIC + _U32.pack(DUMP_VERSION) + _U32.pack(len(hj)) + hj)
            count = 0
            async for k, v in _all_keys(kv):
                if not _transient(k):
                    put(_U32.pack(len(k)) + _U32.pack(len(v)) + k + v)
                    count += 1
            put(_U32.pack(END) + _U64.pack(count))
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, out_path)
        return count
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read(f, n: int, h, path: str) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise DumpError(f"{path}: truncated dump (it ends before its end mark)")
    h.update(b)
    return b


def records(path: str):
    """The dump at ``path``: yields its header (a dict) first, then each (key, value). Only a
    complete pass checks the file's sha256 (the last thing it raises on), so a
    reader that must not act on a damaged file reads it through once first
    (check_dump).

    Raises:
        DumpError: not a dump, another version, truncated, or damaged.
    """
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DumpError(f"cannot read {path}: {e.strerror}")
    with f:
        h = hashlib.sha256()
        if f.read(len(MAGIC)) != MAGIC:
            raise DumpError(f"{path} is not a bmfs dump")
        h.update(MAGIC)
        ver = _U32.unpack(_read(f, 4, h, path))[0]
        if ver != DUMP_VERSION:
            raise DumpError(f"{path}: a dump of version {ver}; this bmfs reads version "
                            f"{DUMP_VERSION}")
        n = _U32.unpack(_read(f, 4, h, path))[0]
        if n > 1 << 20:
            raise DumpError(f"{path}: damaged dump (a header of {n} bytes)")
        try:
            header = json.loads(_read(f, n, h, path))
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise DumpError(f"{path}: damaged dump (its header is not what bmfs writes)")
        yield header
        seen = 0
        while True:
            klen = _U32.unpack(_read(f, 4, h, path))[0]
            if klen == END:
                break
            vlen = _U32.unpack(_read(f, 4, h, path))[0]
            if klen == 0 or klen > 1 << 16 or vlen > 1 << 30:
                raise DumpError(f"{path}: damaged dump (a record of impossible size)")
            k = _read(f, klen, h, path)
            yield k, _read(f, vlen, h, path)
            seen += 1
        count = _U64.unpack(_read(f, 8, h, path))[0]
        digest = f.read(32)
        if len(digest) != 32:
            raise DumpError(f"{path}: truncated dump (its checksum is cut off)")
        if digest != h.digest():
            raise DumpError(f"{path}: damaged dump (its sha256 does not match)")
        if seen != count:
            raise DumpError(f"{path}: damaged dump ({seen} records, its end says {count})")
        if f.read(1):
            raise DumpError(f"{path}: damaged dump (bytes after its checksum)")


def check_dump(path: str) -> dict:
    """Read the dump at ``path`` through: its header, with ``keys`` (how many records
    it holds), if it is whole and loadable.

    Raises:
        DumpError: as records(), or a format revision this bmfs does not load.
    """
    it = records(path)
    header = next(it)
    header["keys"] = sum(1 for _ in it)
    if header.get("format_revision") != keys.FORMAT_REVISION:
        raise DumpError(f"{path}: a dump of volume format revision "
                        f"{header.get('format_revision')}; this bmfs loads revision "
                        f"{keys.FORMAT_REVISION}")
    return header


def _moved(devices: dict[int, dict], nodes: dict[int, str]) -> dict[int, dict]:
    """The device records with ``nodes`` (device id -> HOST:PORT of the storage node
    now serving its directory) applied.

    Raises:
        VolumeError: a device named that the dump does not hold, or some devices in
            service left on this machine while others go to nodes.
    """
    unknown = sorted(set(nodes) - set(devices))
    if unknown:
        raise VolumeError(f"--node: the dump has no device {unknown[0]} (it has "
                          f"{', '.join(map(str, sorted(devices)))})")
    out = {dev: {**rec, "node": nodes[dev]} if dev in nodes else rec
           for dev, rec in devices.items()}
    live = [rec for rec in out.values() if not rec.get("removed")]
    local = [rec for rec in live if rec.get("node", "local") == "local"]
    if local and len(local) != len(live):
        left = sorted(dev for dev, rec in out.items()
                      if not rec.get("removed") and rec.get("node", "local") == "local")
        raise VolumeError(f"--node: devices {', '.join(map(str, left))} stay on this "
                          f"machine: a volume's devices are all local directories or "
                          f"all on storage nodes (give --node for each)")
    return out


async def load(dump_path: str, volume_path: str, meta: str | None = None,
               nodes: dict[int, str] | None = None, secret_file: str | None = None) -> dict:
    """Make a volume in the new or empty directory ``volume_path`` from the dump at
    ``dump_path``, its metadata at ``meta`` (default ``sqlite:VOLUME/meta.db``), which
    must hold nothing; returns the dump's header. The volume keeps the dump's uuid,
    settings and device records: it reads the devices the dumped volume used, where
    they were, or, for the devices in ``nodes`` (id -> HOST:PORT), from the storage
    node serving each. A volume whose devices are nodes' gets the cluster secret in
    ``secret_file`` (the dumped volume's, which its nodes hold), or a new one for the
    nodes to be started with.

    Raises:
        DumpError: the dump cannot be loaded (nothing was written).
        VolumeError: ``meta`` is not empty, ``nodes`` does not fit the devices, or
            writing failed (what was written is deleted again).
    """
    from .volume import VOLUME_FILE, _write_volume_file, check_new_volume_dir, tighten
    header = check_dump(dump_path)
    devices = {}
    it = records(dump_path)
    next(it)  # (the header)
    for k, v in it:
        if k.startswith(keys.DEVICE_PREFIX):
            devices[keys.device_of(k)] = json.loads(v)
    devices = _moved(devices, nodes or {})
    secret = None
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                secret = f.read()
        except OSError as e:
            raise VolumeError(f"--secret-file {secret_file}: {e.strerror}")
    check_new_volume_dir(volume_path)
    if os.path.exists(os.path.join(volume_path, VOLUME_FILE)):
        raise VolumeError(f"{volume_path} already holds a volume: load makes a new one "
                          f"(give a new or empty directory)")
    made_dir = not os.path.exists(volume_path)
    os.makedirs(volume_path, mode=0o700, exist_ok=True)
    meta = meta or f"sqlite:{os.path.realpath(volume_path)}/meta.db"
    written: list[bytes] = []
    kv = None
    try:
        kv = await open_kv(meta)
        if await kv.raw_range(b"", b"", 1):
            raise VolumeError(f"the metadata at {meta} is not empty (it holds another "
                              f"volume's keys): load into empty metadata")
        settings = None
        batch, size = kv.begin(), 0
        it = records(dump_path)
        next(it)
        for k, v in it:
            if k == keys.SETTINGS:  # last: until then no volume is there
                settings = v
                continue
            if k.startswith(keys.DEVICE_PREFIX):
                v = json.dumps(devices[keys.device_of(k)]).encode()
            batch.put(k, v)
            written.append(k)
            size += len(k) + len(v)
            if len(batch.writes) >= BATCH_KEYS or size >= BATCH_BYTES:
                await kv.commit(batch)
                batch, size = kv.begin(), 0
        if settings is None:
            raise DumpError(f"{dump_path}: damaged dump (no volume settings in it)")
        batch.put(keys.SETTINGS, settings)
        written.append(keys.SETTINGS)
        await kv.commit(batch)
        await kv.sync()
    except BaseException:
        if kv is not None and written:
            await _unwrite(kv, written)
        if kv is not None:
            await kv.aclose()
        _remove_made(volume_path, made_dir)
        raise
    await kv.aclose()
    on_nodes = any(rec.get("node", "local") != "local" for rec in devices.values())
    if on_nodes and secret is not None:
        fd = os.open(os.path.join(volume_path, "secret"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
    elif on_nodes:
        from ..node.protocol import make_secret
        make_secret(os.path.join(volume_path, "secret"))  # (unless one is there)
    info = {"magic": "bmfs-volume", "meta": meta, "uuid": header["uuid"],
            "home": os.path.realpath(volume_path), **({"secret": "secret"} if on_nodes else {})}
    _write_volume_file(volume_path, info)
    tighten(volume_path, info, {})
    return {**header, "on_nodes": on_nodes}


async def _unwrite(kv, written: list[bytes]) -> None:
    """Delete what a failed load wrote (the settings first: no half volume is seen)."""
    order = sorted(written, key=lambda k: k != keys.SETTINGS)
    for i in range(0, len(order), BATCH_KEYS):
        txn = kv.begin()
        for k in order[i:i + BATCH_KEYS]:
            txn.delete(k)
        try:
            await kv.commit(txn)
        except Exception:  # (the error that stopped the load is the one to report)
            return


def _remove_made(path: str, made_dir: bool) -> None:
    """Remove what a failed load made in ``path``: the directory if it made it, else
    the SQLite files it made there (the directory was empty before)."""
    import shutil
    if made_dir:
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in os.listdir(path):
        if name.startswith("meta.db"):
            try:
                os.unlink(os.path.join(path, name))
            except OSError:
                pass
