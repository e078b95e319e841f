"""The write pipeline: write buffers, stripes stored in the background, truncate.

Writes are gathered per inode into one contiguous buffer and stored a stripe at a
time (k x fragment size, e.g. 4 MiB): encode, store fragments, then one transaction
adds the slice and the new size. While a file has buffered data, its size and mtime
come from memory (Files.overlay), so stat sees every write.

Durability: close() and flush() store the buffered data on the devices and commit
its metadata (both survive a crash of this process); fsync() also makes the
fragments and the metadata durable on stable storage.

A store that fails for good takes the file's later writes with it (``_lose``): the
range is Lost, reported by fsync and close and read as EIO.
"""
from __future__ import annotations

import logging
import os
import time

import trio

from ..config import MAX_FILE_SIZE
from ..data.codec import stripe_length
from ..errors import IsDir, NotFound, ReadOnly, TooBig
from ..lru import LRU
from ..meta import keys
from ..meta import namespace as ns
from ..meta.keys import CHUNK_SIZE
from ..format.records import Slice, compact
from . import orphans
from .attr import attr_of
from .needs import Namespace, StripeStore
from .openfile import Handle, KernelCopies, Lost, OpenFile, WriteBuffer, state

log = logging.getLogger(__name__)
COMPACT_AT = 64  # slices per chunk before dropping shadowed ones
COMPACTED_KEPT = 4096  # chunks whose last compaction's length is remembered


class Writes:
    """The write side of the open files of one mount."""

    def __init__(self, fs: Namespace, data: StripeStore, stripe_size: int,
                 kernel: KernelCopies):
        self.fs, self.kv, self.data = fs, fs.kv, data
        self.stripe_size = stripe_size
        self.kernel = kernel
        self.nursery: trio.Nursery | None = None  # background stripe stores run here
        self._sid_next = self._sid_end = 0
        # (view id, ino, chunk) -> slices its list kept at its last compaction here: the
        # next waits until the list has doubled (many small writes scattered over a
        # chunk leave as many slices that all show; compacting them at every write
        # would cost each write the whole list)
        self._compacted = LRU(COMPACTED_KEPT)

    async def _alloc_sid(self) -> int:
        if self._sid_next >= self._sid_end:
            self._sid_next = await ns.allocate(self.kv, "stripe", 256)
            self._sid_end = self._sid_next + 256
        self._sid_next += 1
        return self._sid_next - 1

    async def write(self, h: Handle, offset: int, data) -> int:
        of = h.of
        if not of.view.writable:
            raise ReadOnly()
        async with of.lock:
            if h.flags & os.O_APPEND:
                await self.flush_locked(of)
                offset = await self.size(of)
            if offset + len(data) > MAX_FILE_SIZE:
                raise TooBig()
            if of.buf and offset != of.buf_start + len(of.buf):
                await self.flush_locked(of)
            if self._past_lost(of, offset, len(data)):
                return len(data)
            await self.size(of)
            if not of.buf:
                of.buf_start = offset
            of.buf.append(data)
            of.size = max(of.size, offset + len(data))
            of.mtime_ns = time.time_ns()
            of.dirty = True
            # store whole stripes as soon as they are complete, aligned to stripe size
            while True:
                cut = (of.buf_start // self.stripe_size + 1) * self.stripe_size - of.buf_start
                if len(of.buf) < cut:
                    break
                await self._store_behind(of, cut)
        return len(data)

    def _past_lost(self, of: OpenFile, offset: int, n: int) -> bool:
        """Whether the ``n`` bytes written at ``offset`` start past the file's lost range
        (Lost): then they are dropped with it (the range grows over them) and reported
        with it at fsync and close; stored, they would make the lost bytes a hole that
        reads as zeros. Bytes written from its start on (the writer trying again) take
        it back, as far as they reach: if they fail too, the range is lost again."""
        key = (of.view.id, of.ino)
        lost = self.kernel.lost.get(key)
        if lost is None:
            return False
        if offset > lost.start:
            lost.end = max(lost.end, offset + n)
            return True
        lost.start = max(lost.start, offset + n)
        if lost.start >= lost.end:
            del self.kernel.lost[key]
        return False

    async def _store_behind(self, of: OpenFile, n: int) -> None:
        """Store the first ``n`` buffered bytes (a full stripe) in the background, when the
        mount gave us a nursery: encoding and fragment I/O of stripe n+1 overlap the
        commit of stripe n, while the commits stay in file order (a later write must
        shadow an earlier one). Called with ``of.lock`` held. A failure is not raised
        here but recorded (_lose), to be reported by fsync and close."""
        if self.nursery is None:
            start = of.buf_start
            data = of.buf.take(n)
            of.buf_start += n
            await self._store_or_lose(of, start, data)
            return
        await of.inflight.acquire()  # back-pressure: at most PIPELINE stripes in flight
        if len(of.buf) < n:  # a store failed meanwhile: the buffer went with it (_lose)
            of.inflight.release()
            return
        # no await from here on: the bytes leave the buffer and the event readers wait
        # for appears in one step, so a reader never finds them in neither place
        prev, done = of.last_commit, trio.Event()
        of.last_commit = done
        start = of.buf_start
        data = of.buf.take(n)
        of.buf_start += n
        self.nursery.start_soon(self._store_task, of, start, data, prev, done, of.failures)

    async def _store_task(self, of, start, data, prev, done, failures) -> None:
        try:
            await self._store(of, start, data, wait_for=prev, failures=failures)
        except Exception as e:  # noqa: BLE001 - reported by fsync and close (_lose)
            log.warning("storing %d bytes at %d of inode %d failed: %s", stripe_length(data),
                        start, of.ino, e)
            if prev is not None:
                await prev.wait()  # the stripes before this one are committed first
            if failures == of.failures:  # (else lost already, with all after the failure)
                self._lose(of, start, start + stripe_length(data), e)
        finally:
            done.set()
            of.inflight.release()

    async def _store_or_lose(self, of: OpenFile, start: int, data: list) -> None:
        """_store now; a failure is recorded (_lose), to be reported by fsync and close."""
        try:
            await self._store(of, start, data)
        except Exception as e:  # noqa: BLE001 - reported by fsync and close
            log.warning("storing %d bytes at %d of inode %d failed: %s", stripe_length(data),
                        start, of.ino, e)
            self._lose(of, start, start + stripe_length(data), e)

    def _lose(self, of: OpenFile, start: int, end: int, e: BaseException) -> None:
        """Storing bytes [start, end) failed for good (the stripes before them are
        committed). Everything written after them goes too: the buffer, and the stripes
        in flight, which see ``failures`` move on and are not committed: stored, they
        would leave these bytes a hole that reads as zeros. The file is then what is
        stored (what a remount shows), and the range written and not stored is Lost.
        No await: the writers (holding ``of.lock``) find the buffer emptied in one step."""
        key = (of.view.id, of.ino)
        end = max(end, of.buf_start + len(of.buf))
        lost = self.kernel.lost.get(key)
        if lost is None:
            self.kernel.lost[key] = Lost(start, end, e)
        else:
            lost.start, lost.end = min(lost.start, start), max(lost.end, end)
        if key in self.kernel.client:  # (the kernel's size is past the stored one: the
            # next open finds it stale and has the kernel look the inode up afresh)
            self.kernel.client[key] = (self.kernel.lost[key].end, -1, -1)
        of.failures += 1
        of.buf = WriteBuffer()
        of.dirty = False
        of.size = of.mtime_ns = None
        of.read_cache = None

    async def report_lost(self, h: Handle) -> None:
        """Raise the error of the file's lost range (Lost) at each fsync and close of a
        writable handle while the range lasts, as Linux reports a writeback error: a
        writer that tries again never gets "done" for bytes stored nowhere. First the
        kernel drops its pages of the file and its names for the inode (so that it is
        evicted once closed, and looked up afresh at its stored size): its reads then
        come here, and find the range unreadable."""
        of = h.of
        lost = self.kernel.lost.get((of.view.id, of.ino))
        if lost is None:
            return
        if self.fs.notify is not None:
            await self.fs.notify.inode(self.fs.join(of.view, of.ino))
        if (h.flags & os.O_ACCMODE) != os.O_RDONLY:
            raise lost.error(of.ino)

    @staticmethod
    async def drain(of: OpenFile) -> None:
        """Wait until every stripe stored in the background is committed (or lost)."""
        if of.last_commit is not None:
            await of.last_commit.wait()

    async def size(self, of: OpenFile) -> int:
        """The file's size, loading it into ``of.size`` when nothing is buffered."""
        if of.size is None:
            i = await ns.get_inode(self.kv.begin(), of.view.chain, of.ino)
            if i is None:
                raise NotFound()
            of.size = i.size
        return of.size

    async def flush_locked(self, of: OpenFile) -> None:
        """Store what is buffered; a failure is recorded (_lose), not raised. Called with
        ``of.lock`` held."""
        await self.drain(of)
        if of.buf:
            await self._store_or_lose(of, of.buf_start, of.buf.take(len(of.buf)))
        if of.dirty:
            # nothing buffered, but size/mtime may be ahead of the metadata (extending write
            # of zero bytes cannot happen; sparse extension happens through truncate)
            of.dirty = False
            of.size = None
            of.mtime_ns = None

    async def _store(self, of: OpenFile, start: int, data: list,
                     wait_for: trio.Event | None = None, failures: int | None = None) -> None:
        """Store ``data`` (pieces, within one chunk) as a new stripe and commit its slice
        (after ``wait_for``: the commit of the stripe written before it), unless a
        store failed since ``failures`` (then its fragments are deleted: see _lose)."""
        end = start + stripe_length(data)
        assert start // CHUNK_SIZE == (end - 1) // CHUNK_SIZE
        sid = await self._alloc_sid()
        with self.data.pending(sid):  # until committed, or never to be
            await self._store_stripe(of, start, data, sid, wait_for, failures)

    async def _store_stripe(self, of, start, data, sid, wait_for, failures) -> None:
        st = await self.data.write_stripe(sid, data)
        end = start + st.length
        if wait_for is not None:
            await wait_for.wait()
        if failures is not None and failures != of.failures:
            await self.data.delete_stripe(sid, st)
            return
        mtime = of.mtime_ns or time.time_ns()
        idx, pos = divmod(start, CHUNK_SIZE)
        damaged = self.data.needs_repair(st) if st.kind else []

        async def fn(txn, chain):
            nonlocal before
            i = await ns.get_inode(txn, chain, of.ino)
            if i is None:
                raise NotFound("file deleted during write")
            before = state(i)
            txn.put(keys.stripe(sid), st.pack())
            for d in damaged:
                txn.put(keys.damage(sid, d), b"missing or doubled up at write")
            key = (of.view.id, of.ino, idx)
            hint = self._compacted.hit(key, 0)
            kept, made = await ns.append_slice(txn, chain, of.ino, idx,
                                               Slice(pos, st.length, sid, 0),
                                               max(COMPACT_AT, 2 * hint))
            if kept is not None:
                self._compacted.put(key, kept)
            i.count("chunks", made)
            i.size = max(i.size, end)
            i.mtime_ns = i.ctime_ns = mtime
            await ns.put_inode(txn, chain, of.ino, i)
            return i
        before = None
        i = await self.fs.mutate(of.view, fn)  # (sets ``before``: read it after)
        self.kernel.moved(of.view, of.ino, before, i)

    # -- truncate ---------------------------------------------------------------------------
    async def truncate(self, of: OpenFile | None, view, ino: int, size: int, mtime_ns=None,
                       ctime_ns=None):
        """Cut or extend file ``ino`` of ``view`` to ``size`` (``of``: its open file
        here, if any: what it buffers is stored first); its Attr."""
        if size > MAX_FILE_SIZE:
            raise TooBig()
        if of is not None:
            async with of.lock:
                await self.flush_locked(of)
                await self._cut_lost(view, ino, size)
                return await self._truncate(view, ino, size, mtime_ns, ctime_ns)
        await self._cut_lost(view, ino, size)
        return await self._truncate(view, ino, size, mtime_ns, ctime_ns)

    async def _cut_lost(self, view, ino: int, size: int) -> None:
        """A cut to ``size`` at or before the start of the file's lost range (Lost) ends
        it (a writer starting over); a cut past it keeps what it keeps of it, and is
        refused (with the range's error) if it would extend the stored file over it:
        the lost bytes would read as a hole of zeros."""
        key = (view.id, ino)
        lost = self.kernel.lost.get(key)
        if lost is None:
            return
        if size <= lost.start:
            del self.kernel.lost[key]
            return
        i = await ns.get_inode(self.kv.begin(), view.chain, ino)
        if i is not None and i.size < min(size, lost.end):
            raise lost.error(ino)
        lost.end = min(lost.end, size)

    async def _truncate(self, view, ino, size, mtime_ns, ctime_ns):
        before = None
        batch = orphans.FREE_BATCH

        async def fn(txn, chain):
            nonlocal before
            i = await ns.get_inode(txn, chain, ino)
            if i is None:
                raise NotFound()
            if i.is_dir():
                raise IsDir()
            before = state(i)
            if size < i.size:
                last = (size + CHUNK_SIZE - 1) // CHUNK_SIZE  # first chunk wholly beyond
                beyond = [x for x in await ns.chunk_indexes(txn, chain, ino) if x >= last]
                if len(beyond) > batch:
                    # a big cut: whole chunks past the new end go a batch per transaction
                    # (the size changes in the last one; meanwhile they read as holes)
                    for idx in beyond[-batch:]:
                        i.count("chunks", await ns.put_chunk(txn, chain, ino, idx, []))
                    await ns.put_inode(txn, chain, ino, i)
                    return None
                for idx in beyond:
                    i.count("chunks", await ns.put_chunk(txn, chain, ino, idx, []))
                if size == 0:
                    i.chunks = 0  # (known now, if it was not: a file of an older revision)
                if size % CHUNK_SIZE:
                    idx = size // CHUNK_SIZE
                    slices = await ns.get_chunk(txn, chain, ino, idx)
                    if slices:
                        slices = compact(slices, size % CHUNK_SIZE)
                        i.count("chunks", await ns.put_chunk(txn, chain, ino, idx, slices))
                        self._compacted.pop((view.id, ino, idx), None)
            now = time.time_ns()
            i.size = size
            i.mtime_ns = mtime_ns if mtime_ns is not None else now
            i.ctime_ns = ctime_ns if ctime_ns is not None else now
            await ns.put_inode(txn, chain, ino, i)
            return i
        while (i := await self.fs.mutate(view, fn)) is None:
            pass
        self.kernel.moved(view, ino, before, i)
        return attr_of(self.fs.join(view, ino), i)
