"""Open files: handles, write buffers, the read path, truncate, fsync, release.

Writes are gathered per inode into one contiguous buffer and stored a stripe at a
time (k x fragment size, e.g. 4 MiB): encode, store fragments, then one transaction
adds the slice and the new size. Reads look up the slices that show through at each
offset and read just those ranges of the stripes. While a file has buffered data,
its size and mtime come from memory (``overlay``), so stat sees every write.

Durability: close() and flush() store the buffered data on the devices and commit
its metadata (both survive a crash of this process); fsync() also makes the
fragments and the metadata durable on stable storage.
"""
from __future__ import annotations

import logging
import os
import time

import trio

from ..config import MAX_FILE_SIZE
from ..errors import IsDir, NotFound, TooBig
from ..meta import keys
from ..meta import namespace as ns
from ..meta.keys import CHUNK_SIZE
from ..meta.records import Inode, Slice, compact, visible
from .views import INO_MASK, VIEW_SHIFT

log = logging.getLogger(__name__)
COMPACT_AT = 64  # slices per chunk before dropping shadowed ones


class OpenFile:
    __slots__ = ("view", "ino", "opens", "lock", "buf", "buf_start", "size", "mtime_ns",
                 "dirty", "stripes")

    def __init__(self, view, ino):
        self.view, self.ino = view, ino
        self.opens = 0
        self.lock = trio.Lock()
        self.buf = bytearray()
        self.buf_start = 0
        self.size: int | None = None     # in-memory size while dirty
        self.mtime_ns: int | None = None
        self.dirty = False
        self.stripes: dict[int, object] = {}  # stripe records seen (immutable but refs)


class Handle:
    __slots__ = ("of", "flags")

    def __init__(self, of, flags):
        self.of, self.flags = of, flags


class Files:
    def __init__(self, fs):
        self.fs = fs
        self.kv = fs.kv
        self.volume = fs.volume
        self.data = fs.volume.data
        self.stripe_size = fs.volume.settings.stripe_size
        self.open_files: dict[tuple[int, int], OpenFile] = {}
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._sid_next = self._sid_end = 0

    # -- bookkeeping ------------------------------------------------------------------------
    def is_open(self, view, ino) -> bool:
        return (view.id, ino) in self.open_files

    def overlay(self, view, ino, i: Inode) -> None:
        of = self.open_files.get((view.id, ino))
        if of is not None and of.dirty:
            i.size = of.size
            i.mtime_ns = i.ctime_ns = of.mtime_ns

    def overlay_update(self, view, ino, i: Inode) -> None:
        """Metadata of an open file changed elsewhere (nothing to do: sizes live in KV)."""

    async def open(self, fino: int, flags: int, created: bool = False) -> int:
        view, ino = self.fs.split(fino)
        i = await ns.get_inode(self.kv.begin(), view.chain, ino)
        if i is None:
            raise NotFound()
        if i.is_dir():
            raise IsDir()
        of = self.open_files.get((view.id, ino))
        if of is None:
            of = self.open_files[(view.id, ino)] = OpenFile(view, ino)
        of.opens += 1
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(of, flags)
        if flags & os.O_TRUNC and not created and (flags & os.O_ACCMODE) != os.O_RDONLY:
            try:
                await self.truncate(view, ino, 0)
            except BaseException:
                await self.release(fh)
                raise
        return fh

    async def _alloc_sid(self) -> int:
        if self._sid_next >= self._sid_end:
            self._sid_next = await ns.allocate(self.kv, "stripe", 256)
            self._sid_end = self._sid_next + 256
        self._sid_next += 1
        return self._sid_next - 1

    # -- writing ----------------------------------------------------------------------------
    async def write(self, fh: int, offset: int, data) -> int:
        h = self.handles[fh]
        of = h.of
        if not of.view.writable:
            from ..errors import ReadOnly
            raise ReadOnly()
        async with of.lock:
            if h.flags & os.O_APPEND:
                await self._flush_locked(of)
                offset = await self._size(of)
            if offset + len(data) > MAX_FILE_SIZE:
                raise TooBig()
            if of.buf and offset != of.buf_start + len(of.buf):
                await self._flush_locked(of)
            await self._size(of)
            if not of.buf:
                of.buf_start = offset
            of.buf += data
            of.size = max(of.size, offset + len(data))
            of.mtime_ns = time.time_ns()
            of.dirty = True
            # store whole stripes as soon as they are complete, aligned to stripe size
            while True:
                cut = (of.buf_start // self.stripe_size + 1) * self.stripe_size - of.buf_start
                if len(of.buf) < cut:
                    break
                await self._store(of, of.buf_start, memoryview(of.buf)[:cut])
                del of.buf[:cut]
                of.buf_start += cut
        return len(data)

    async def _size(self, of: OpenFile) -> int:
        """The file's size, loading it into ``of.size`` when nothing is buffered."""
        if of.size is None:
            i = await ns.get_inode(self.kv.begin(), of.view.chain, of.ino)
            if i is None:
                raise NotFound()
            of.size = i.size
        return of.size

    async def _flush_locked(self, of: OpenFile) -> None:
        if of.buf:
            await self._store(of, of.buf_start, memoryview(of.buf))
            of.buf = bytearray()
        if of.dirty:
            # nothing buffered, but size/mtime may be ahead of the metadata (extending write
            # of zero bytes cannot happen; sparse extension happens through truncate)
            of.dirty = False
            of.size = None
            of.mtime_ns = None

    async def _store(self, of: OpenFile, start: int, data: memoryview) -> None:
        """Store ``data`` (within one chunk) as a new stripe and commit its slice."""
        end = start + len(data)
        assert start // CHUNK_SIZE == (end - 1) // CHUNK_SIZE
        sid = await self._alloc_sid()
        st = await self.data.write_stripe(sid, data)
        mtime = of.mtime_ns or time.time_ns()
        idx, pos = divmod(start, CHUNK_SIZE)
        damaged = self.data.needs_repair(st) if st.kind else []

        async def fn(txn, chain):
            i = await ns.get_inode(txn, chain, of.ino)
            if i is None:
                raise NotFound("file deleted during write")
            txn.put(keys.stripe(sid), st.pack())
            for d in damaged:
                txn.put(keys.damage(sid, d), b"missing or doubled up at write")
            slices = await ns.get_chunk(txn, chain, of.ino, idx)
            slices.append(Slice(pos, len(data), sid, 0))
            if len(slices) > COMPACT_AT:
                slices = compact(slices, CHUNK_SIZE)
            await ns.put_chunk(txn, chain, of.ino, idx, slices)
            i.size = max(i.size, end)
            i.mtime_ns = i.ctime_ns = mtime
            await ns.put_inode(txn, chain, of.ino, i)
        await self.fs.mutate(of.view, fn)

    async def flush(self, fh: int) -> None:
        h = self.handles.get(fh)
        if h is None:
            return
        async with h.of.lock:
            await self._flush_locked(h.of)

    async def fsync(self, fh: int, datasync: bool = False) -> None:
        await self.flush(fh)
        await self.data.sync()
        await self.kv.sync()

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            return
        of = h.of
        try:
            async with of.lock:
                await self._flush_locked(of)
        finally:
            of.opens -= 1
            if of.opens == 0:
                del self.open_files[(of.view.id, of.ino)]
                await self._free_if_orphan(of.view, of.ino)

    async def _free_if_orphan(self, view, ino) -> None:
        if not view.writable:
            return
        i = await ns.get_inode(self.kv.begin(), view.chain, ino)
        if i is not None and i.nlink > 0 and \
                await self.kv.get(keys.orphan(view.chain.top, ino)) is None:
            return  # the common case: a file with a name, closed

        async def fn(txn, chain):
            i = await ns.get_inode(txn, chain, ino)
            if i is not None and i.nlink == 0:
                await ns.delete_inode(txn, chain, ino, i)
            txn.delete(keys.orphan(chain.top, ino))
        await self.fs.mutate(view, fn)

    async def reap_orphans(self, view) -> int:
        """Free inodes unlinked while open by a mount that then died."""
        n = 0
        prefix = b"o/"
        for k, _ in await self.kv.range(prefix, prefix + b"\xff"):
            lay, ino = (int(x, 16) for x in k[2:].split(b"/"))
            if lay in view.chain.layers:
                await self._free_if_orphan(view, ino)
                n += 1
        return n

    async def close_all(self) -> None:
        for fh in list(self.handles):
            await self.release(fh)

    # -- truncate ---------------------------------------------------------------------------
    async def truncate(self, view, ino: int, size: int, mtime_ns=None, ctime_ns=None):
        if size > MAX_FILE_SIZE:
            raise TooBig()
        of = self.open_files.get((view.id, ino))
        if of is not None:
            async with of.lock:
                await self._flush_locked(of)
                return await self._truncate(view, ino, size, mtime_ns, ctime_ns)
        return await self._truncate(view, ino, size, mtime_ns, ctime_ns)

    async def _truncate(self, view, ino, size, mtime_ns, ctime_ns):
        async def fn(txn, chain):
            i = await ns.get_inode(txn, chain, ino)
            if i is None:
                raise NotFound()
            if i.is_dir():
                raise IsDir()
            if size < i.size:
                last = (size + CHUNK_SIZE - 1) // CHUNK_SIZE  # first chunk wholly beyond
                for idx in await ns.chunk_indexes(txn, chain, ino):
                    if idx >= last:
                        await ns.put_chunk(txn, chain, ino, idx, [])
                if size % CHUNK_SIZE:
                    idx = size // CHUNK_SIZE
                    slices = await ns.get_chunk(txn, chain, ino, idx)
                    if slices:
                        await ns.put_chunk(txn, chain, ino, idx,
                                           compact(slices, size % CHUNK_SIZE))
            now = time.time_ns()
            i.size = size
            i.mtime_ns = mtime_ns if mtime_ns is not None else now
            i.ctime_ns = ctime_ns if ctime_ns is not None else now
            await ns.put_inode(txn, chain, ino, i)
            return i
        i = await self.fs.mutate(view, fn)
        from .fs import _attr
        return _attr(self.fs.join(view, ino), i)

    # -- reading ----------------------------------------------------------------------------
    async def read(self, fh: int, offset: int, size: int) -> bytes:
        of = self.handles[fh].of
        if of.buf and offset < of.buf_start + len(of.buf) and offset + size > of.buf_start:
            async with of.lock:
                await self._flush_locked(of)
        txn = self.kv.begin()
        chain = of.view.chain
        i = await ns.get_inode(txn, chain, of.ino)
        if i is None:
            raise NotFound()
        fsize = i.size if of.size is None else max(i.size, of.size)
        end = min(offset + size, fsize)
        if offset >= end:
            return b""
        pieces = []
        pos = offset
        while pos < end:
            idx, cpos = divmod(pos, CHUNK_SIZE)
            cend = min(end - idx * CHUNK_SIZE, CHUNK_SIZE)
            slices = await ns.get_chunk(txn, chain, of.ino, idx)
            for p in visible(slices, cpos, cend):
                pieces.append(p)
            pos = idx * CHUNK_SIZE + cend
        if len(pieces) == 1:
            return await self._piece(txn, of, pieces[0])
        out: list[bytes | None] = [None] * len(pieces)

        async def one(j, p):
            out[j] = await self._piece(txn, of, p)
        async with trio.open_nursery() as nursery:
            for j, p in enumerate(pieces):
                nursery.start_soon(one, j, p)
        return b"".join(out)

    async def _piece(self, txn, of, p: Slice) -> bytes:
        if p.sid == 0:
            return bytes(p.length)
        st = of.stripes.get(p.sid)
        if st is None:
            raw = await txn.get(keys.stripe(p.sid))
            if raw is None:
                from ..errors import IOFailure
                raise IOFailure(f"stripe {p.sid} of inode {of.ino} is missing from the metadata")
            from ..meta.records import Stripe
            st = Stripe.unpack(raw)
            if len(of.stripes) > 4096:
                of.stripes.clear()
            of.stripes[p.sid] = st
        data = await self.data.read(p.sid, st, p.soff, p.length)
        if len(data) < p.length:  # a slice past the stripe's end (cannot happen) reads zeros
            data += bytes(p.length - len(data))
        return data


def fino_parts(fino: int) -> tuple[int, int]:
    return fino >> VIEW_SHIFT, fino & INO_MASK
