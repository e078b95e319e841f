"""The read path: the slices that show through at each offset, read from their stripes.

A read first waits for what the file has written and not committed yet (buffered,
being stored, being flushed), so bytes are never in limbo; a range lost to a failed
store reads as EIO. The inode and the chunks' slice lists are looked up (and kept per
open file while the engine's commit count stays: ``_read_cache``), and each visible
piece is read from its stripe: holes read as zeros, inline stripes from the record,
erasure-coded ones through the data client.
"""
from __future__ import annotations

from functools import partial

import trio

from ..errors import IOFailure, NotFound
from ..meta import keys
from ..meta import namespace as ns
from ..meta.keys import CHUNK_SIZE
from ..format.records import UNCOUNTED, Slice, SliceMap, Stripe
from .needs import Namespace, StripeStore
from .openfile import KernelCopies, OpenFile
from .writes import Writes

STRIPES_KEPT = 4096  # stripe records an open file keeps (they are immutable)


class Reads:
    """The read side of the open files of one mount."""

    def __init__(self, fs: Namespace, data: StripeStore, kernel: KernelCopies,
                 writes: Writes):
        self.fs, self.kv, self.data = fs, fs.kv, data
        self.kernel = kernel
        self.writes = writes

    async def read(self, of: OpenFile, offset: int, size: int) -> bytes:
        if of.buf or of.lock.locked() or (of.last_commit is not None
                                          and not of.last_commit.is_set()):
            # written data not committed yet (buffered, being stored, or being flushed
            # by another request): take the lock, so the bytes are never in limbo
            async with of.lock:
                await self.writes.drain(of)
                if of.buf and offset < of.buf_start + len(of.buf) and \
                        offset + size > of.buf_start:
                    await self.writes.flush_locked(of)
        lost = self.kernel.lost.get((of.view.id, of.ino))
        if lost is not None and offset < lost.end and offset + size > lost.start:
            raise IOFailure(str(lost.error(of.ino)))
        txn = self.kv.begin()
        chain = of.view.chain
        cache = self._read_cache(of, chain)
        i = cache[2]
        if i is None:
            i = await ns.get_inode(txn, chain, of.ino)
            if i is None:
                raise NotFound()
            cache[2] = i
        await self.fs.accessed(of.view, of.ino, i)
        fsize = i.size if of.size is None else max(i.size, of.size)
        end = min(offset + size, fsize)
        if offset >= end:
            return b""
        pieces = []
        pos = offset
        while pos < end:
            idx, cpos = divmod(pos, CHUNK_SIZE)
            cend = min(end - idx * CHUNK_SIZE, CHUNK_SIZE)
            smap = cache[3].get(idx)
            if smap is None:
                slices = await ns.get_chunk(txn, chain, of.ino, idx)
                if not slices and i.chunks != UNCOUNTED:
                    # a hole, or a record gone (a key changed on disk): the counts say
                    # which (in a transaction of its own: a truncate by another mount
                    # between the reads is a retry, not damage)
                    await self.kv.transact(partial(ns.check_counts, chain=chain, ino=of.ino,
                                                   field="chunks", what=f"chunk {idx}"))
                smap = cache[3][idx] = SliceMap(slices)
            pieces.extend(smap.pieces(cpos, cend))
            pos = idx * CHUNK_SIZE + cend
        if len(pieces) == 1:
            return await self._piece(txn, of, pieces[0])
        out: list[bytes | None] = [None] * len(pieces)

        async def one(j, p):
            out[j] = await self._piece(txn, of, p)
        with self.data.side_by_side():
            async with trio.open_nursery() as nursery:
                for j, p in enumerate(pieces):
                    nursery.start_soon(one, j, p)
        return b"".join(out)

    def _read_cache(self, of: OpenFile, chain) -> list:
        """What reads of ``of`` looked up (its inode, chunk slice lists), while nothing
        was committed since: an engine whose only writer is this process counts its
        commits, so an unchanged count means unchanged metadata. Sequential reads then
        skip two metadata lookups per request. Other engines: a fresh lookup each time
        (returns an empty cache that is not kept)."""
        epoch = self.kv.commits if self.kv.caps.single_writer else None
        cache = of.read_cache
        if cache is None or epoch is None or cache[0] != epoch or cache[1] is not chain:
            cache = [epoch, chain, None, {}]
            if epoch is not None:
                of.read_cache = cache
        return cache

    async def _piece(self, txn, of: OpenFile, p: Slice) -> bytes:
        if p.sid == 0:
            return bytes(p.length)
        st = of.stripes.get(p.sid)
        if st is None:
            raw = await txn.get(keys.stripe(p.sid))
            if raw is None:
                raise IOFailure(f"stripe {p.sid} of inode {of.ino} is missing from the metadata")
            st = Stripe.unpack(raw)
            if len(of.stripes) > STRIPES_KEPT:
                of.stripes.clear()
            of.stripes[p.sid] = st
        data = await self.data.read(p.sid, st, p.soff, p.length)
        if len(data) < p.length:  # a slice past the stripe's end (cannot happen) reads zeros
            data += bytes(p.length - len(data))
        return data
