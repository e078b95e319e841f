"""The mount's metadata socket, in process: bmfs/volume/metasock.py serving an engine,
bmfs/kv/mountsock.py reading it (the real mount's side is in test_t4_client.py)."""
from __future__ import annotations

import os
import socket

import pytest
import trio

from bmfs.errors import MetaDamaged, ReadOnly, Unavailable
from bmfs.kv.memory import MemoryKV
from bmfs.kv.mountsock import SOCKET_NAME, MountSockKV
from bmfs.volume import metasock


async def _served(tmp_path, nursery, rows: dict[bytes, bytes], uid=None):
    kv = await MemoryKV.create()

    async def fill(txn):
        for k, v in rows.items():
            txn.put(k, v)
    await kv.transact(fill)
    await nursery.start(metasock.serve, kv, str(tmp_path), "/mnt/here", uid)
    return kv, os.path.join(tmp_path, SOCKET_NAME)


def test_reads_pages_and_refused_commits(tmp_path):
    rows = {b"k/%05d" % i: os.urandom(i % 700) for i in range(metasock.PAGE_ROWS * 2 + 5)}
    rows.update({b"z/%d" % i: os.urandom(300_000) for i in range(8)})  # > PAGE_BYTES

    async def main():
        async with trio.open_nursery() as nursery:
            _, path = await _served(tmp_path, nursery, rows)
            assert os.stat(path).st_mode & 0o777 == 0o600
            c = await MountSockKV.create(path)
            assert c.mountpoint == "/mnt/here" and not c.caps.single_writer
            assert await c.get(b"k/00003") == rows[b"k/00003"]
            assert await c.get(b"nope") is None
            got = await c.range(b"k/", b"k0")
            assert got == sorted((k, v) for k, v in rows.items() if k.startswith(b"k/"))
            assert await c.range(b"k/", b"k0", limit=1500) == got[:1500]
            assert await c.range(b"z/", b"") == sorted(
                (k, v) for k, v in rows.items() if k.startswith(b"z/"))

            async def write(txn):
                txn.put(b"k/new", b"x")
            with pytest.raises(ReadOnly, match="write through the mount at /mnt/here"):
                await c.transact(write)
            async with trio.open_nursery() as readers:  # requests of tasks side by side
                for i in range(20):
                    readers.start_soon(c.get, b"k/%05d" % i)
            await c.aclose()
            nursery.cancel_scope.cancel()
        assert not os.path.exists(path)  # removed at the end
    trio.run(main)


def test_damaged_value_is_eio_on_the_client(tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            kv, path = await _served(tmp_path, nursery, {b"a": b"good"})
            await kv._commit({}, {b"a": b"bad value, no seal"})
            c = await MountSockKV.create(path)
            with pytest.raises(MetaDamaged):
                await c.get(b"a")
            await c.aclose()
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_other_uids_and_too_many_connections_are_closed(tmp_path, monkeypatch):
    async def main():
        async with trio.open_nursery() as nursery:
            # a server that serves another uid only: this process is refused
            await _served(tmp_path / "a", nursery, {b"a": b"1"}, uid=os.getuid() + 1)
            with pytest.raises(Unavailable, match="metadata socket"):
                await MountSockKV.create(os.path.join(tmp_path / "a", SOCKET_NAME))
            monkeypatch.setattr(metasock, "MAX_CONNECTIONS", 2)
            _, path = await _served(tmp_path / "b", nursery, {b"a": b"1"})
            first = await MountSockKV.create(path)
            held = socket.socket(socket.AF_UNIX)
            held.connect(path)  # the second, idle
            with pytest.raises(Unavailable):
                await MountSockKV.create(path)  # one more: closed at once
            held.close()
            assert await first.get(b"a") == b"1"
            for _ in range(200):  # (until the server has seen it go)
                try:
                    again = await MountSockKV.create(path)
                    break
                except Unavailable:
                    await trio.sleep(0.05)
            assert await again.get(b"a") == b"1"
            for c in (first, again):
                await c.aclose()
            nursery.cancel_scope.cancel()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    trio.run(main)


def test_a_volume_path_longer_than_a_socket_address(tmp_path):
    deep = tmp_path / ("d" * 120)  # (a Unix socket address holds 108 bytes)
    deep.mkdir()

    async def main():
        async with trio.open_nursery() as nursery:
            _, path = await _served(deep, nursery, {b"a": b"1"})
            assert len(path) > 108 and os.path.exists(path)
            c = await MountSockKV.create(path)
            assert await c.get(b"a") == b"1"
            await c.aclose()
            nursery.cancel_scope.cancel()
    trio.run(main)
