"""Open files: handles, write buffers, the read path, truncate, fsync, release.

Writes are gathered per inode into one contiguous buffer and stored a stripe at a
time (k x fragment size, e.g. 4 MiB): encode, store fragments, then one transaction
adds the slice and the new size. Reads look up the slices that show through at each
offset and read just those ranges of the stripes. While a file has buffered data,
its size and mtime come from memory (``overlay``), so stat sees every write.

Durability: close() and flush() store the buffered data on the devices and commit
its metadata (both survive a crash of this process); fsync() also makes the
fragments and the metadata durable on stable storage.

Close-to-open across mounts (etcd): the kernel's writeback cache keeps its own size
and times of a cached regular file whatever our replies say. ``client`` records, per
file the kernel holds, the stored (size, mtime, ctime) the kernel's copy reflects: set
when the kernel gets the inode, moved on by this mount's own changes, dropped when the
kernel forgets it. ``open`` compares it with the stored inode; a difference means
another mount changed the file, and the front end drops the kernel's pages and fixes
its size (see ``client_stale``).
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time
from functools import partial

import trio

from ..config import MAX_FILE_SIZE
from ..data.codec import stripe_length
from ..errors import FsError, IOFailure, IsDir, NotFound, TooBig
from ..lru import LRU
from ..meta import keys, trees
from ..meta import namespace as ns
from ..meta.keys import CHUNK_SIZE
from ..meta.records import UNCOUNTED, Inode, Slice, SliceMap, compact
from .attr import attr_of
from .views import INO_MASK, VIEW_SHIFT

log = logging.getLogger(__name__)
COMPACT_AT = 64  # slices per chunk before dropping shadowed ones
COMPACTED_KEPT = 4096  # chunks whose last compaction's length is remembered
PIPELINE = 2  # full stripes of one file stored in the background at once
# Chunks released per transaction when a big file is deleted or cut short: a chunk
# costs up to ~33 operations (its slice list, and each stripe's record and GC entry),
# and etcd limits a transaction's operations (--max-txn-ops, docs/etcd.md).
FREE_BATCH = 64
# Small unlinked files a sweep frees together in one transaction (_free_orphans), each
# of at most FREE_FILE_CHUNKS chunks (the same budget of operations as FREE_BATCH).
FREE_FILES = 16
FREE_FILE_CHUNKS = FREE_BATCH // FREE_FILES
# Deferred frees on shared volumes (opt-in: BMFS_ORPHAN_GRACE=SECONDS in every mount's
# environment; FileSystem.defers_free). Orphan records (o/LAYER/INO) then say who holds
# an unlinked file: a comma-separated list of mount ids, or UNCLAIMED and the id of the
# mount that let it go (unlinked it while no handle of its own was open, closed its
# last handle, or found its holders dead). A mount that holds it open claims it (puts
# its id in); an unclaimed one is freed by a mount that has seen it unclaimed for
# Settings.orphan_grace seconds (reap_orphans), long enough for every live mount to sweep a few
# times. Off by default: see docs/etcd.md for what it does not handle yet.
UNCLAIMED = b"?"


def unclaimed(mount_id: str) -> bytes:
    return UNCLAIMED + mount_id.encode()


def holders(value: bytes) -> list[str]:
    """The mounts an orphan record names as holding the file open."""
    if not value or value.startswith(UNCLAIMED):
        return []
    return [h for h in value.decode(errors="replace").split(",") if h]


class WriteBuffer:
    """Bytes written but not stored yet, kept as the pieces the kernel sent: no copy
    until a stripe is cut out of them (fresh memory is slow to touch on these VMs)."""

    __slots__ = ("pieces", "length")

    def __init__(self):
        self.pieces: list[bytes] = []
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def append(self, data) -> None:
        self.pieces.append(data if isinstance(data, bytes) else bytes(data))
        self.length += len(data)

    def take(self, n: int) -> list:
        """Remove and return the first ``n`` bytes, as a list of pieces: not joined
        (the encoder reads them in place; a join is a 4 MiB copy per stripe on the
        event loop's thread)."""
        out, got = [], 0
        while got < n:
            p = self.pieces[0]
            if got + len(p) <= n:
                out.append(p)
                got += len(p)
                self.pieces.pop(0)
            else:
                cut = n - got
                out.append(p[:cut])
                self.pieces[0] = p[cut:]
                got = n
        self.length -= n
        return out


class Lost:
    """Bytes [start, end) of a file, written here, that could not be stored: what the
    devices or the metadata said (``errno``, ``why``). Until they are written again or
    cut off, reads of them fail (EIO) and so do fsync and close of the file's writable
    handles: the kernel may still show the file's size with them (its writeback cache
    keeps its own), and a read it sent here must never find them as a hole of zeros."""
    __slots__ = ("start", "end", "errno", "why")

    def __init__(self, start: int, end: int, e: BaseException):
        self.start, self.end = start, end
        self.errno = e.errno if isinstance(e, FsError) else errno.EIO
        self.why = str(e)

    def error(self, ino: int) -> FsError:
        return FsError(f"bytes {self.start}-{self.end} of inode {ino} were not stored: "
                       f"{self.why}", self.errno)


class OpenFile:
    __slots__ = ("view", "ino", "opens", "lock", "buf", "buf_start", "size", "mtime_ns",
                 "dirty", "stripes", "inflight", "last_commit", "failures", "read_cache")

    def __init__(self, view, ino):
        self.view, self.ino = view, ino
        self.opens = 0
        self.lock = trio.Lock()
        self.buf = WriteBuffer()
        self.buf_start = 0
        self.size: int | None = None     # in-memory size while dirty
        self.mtime_ns: int | None = None
        self.dirty = False
        self.stripes: dict[int, object] = {}  # stripe records seen (immutable but refs)
        # write pipeline: stripes being stored in the background, committed in order
        self.inflight = trio.Semaphore(PIPELINE)
        self.last_commit: trio.Event | None = None
        # stores that failed so far: a stripe taken from the buffer before the last
        # failure is not committed (_lose)
        self.failures = 0
        # what reads looked up: [kv commit count, chain, inode, {chunk index: slices}]
        self.read_cache: list | None = None


class Handle:
    __slots__ = ("of", "flags", "stale", "state")

    def __init__(self, of, flags):
        self.of, self.flags = of, flags
        self.stale: tuple[int | None, int] | None = None  # see Files.client_stale
        self.state: tuple[int, int, int] | None = None    # the stored state at open


def _state(i: Inode) -> tuple[int, int, int]:
    return i.size, i.mtime_ns, i.ctime_ns


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
        self.nursery = None  # set by the mount daemon: background stripe stores run here
        # (view id, ino) -> stored (size, mtime, ctime) the kernel's inode reflects
        self.client: dict[tuple[int, int], tuple[int, int, int]] = {}
        # (view id, ino) -> the range written here that could not be stored (Lost): kept
        # while a handle is open or the kernel holds the inode (it may show the range)
        self.lost: dict[tuple[int, int], Lost] = {}
        # (view id, ino) -> layer of the o/ record: files this mount unlinked while open
        # or too big to free in one transaction; freed on release (or at once). Another
        # mount deletes a file it unlinks at once (it does not know of opens here), so
        # only these can need freeing at release.
        self.orphaned: dict[tuple[int, int], int] = {}
        # (tree's top layer, layer, ino) of orphan records in frozen layers whose inode
        # this mount has freed in that tree (_free_if_orphan): its sweeps pass them by
        self._freed_here: set[tuple[int, int, int]] = set()
        # (layer, ino) of records this mount made unclaimed itself (its unlink, its last
        # close): with no other mount alive, freed without the grace (_sweep_shared)
        self._let_go: set[tuple[int, int]] = set()
        # (layer, ino, record) -> trio time this mount first saw it unclaimed
        self._unclaimed_since: dict[tuple[int, int, bytes], float] = {}
        # (view id, ino, chunk) -> slices its list kept at its last compaction here: the
        # next waits until the list has doubled (many small writes scattered over a
        # chunk leave as many slices that all show; compacting them at every write
        # would cost each write the whole list)
        self._compacted = LRU(COMPACTED_KEPT)

    # -- bookkeeping ------------------------------------------------------------------------
    def is_open(self, view, ino) -> bool:
        """Whether this mount holds the file open, through ``view`` or another view of
        the same tree (the mounted branch is also under /.bm)."""
        return any((v.id, ino) in self.open_files for v in self.fs.views.of_tree(view))

    @staticmethod
    def is_big(i: Inode) -> bool:
        """Too big to free in one transaction: freed through an orphan record, a batch
        of chunks at a time (see ``_free_if_orphan``)."""
        return i.is_reg() and i.size > FREE_BATCH * CHUNK_SIZE

    async def free_unlinked(self, view, ino: int) -> None:
        """Free now a file whose last name went and that is not open here (a big one)."""
        view = next((v for v in self.fs.views.of_tree(view) if (v.id, ino) in self.orphaned),
                    view)  # (the view it was unlinked through)
        lay = self.orphaned.get((view.id, ino))
        if lay is not None and not self.is_open(view, ino):
            del self.orphaned[(view.id, ino)]
            if self.fs.defers_free(view):
                await self._set_holders(view, ino, lay, drop=self.fs.mount_id)
                self.let_go(lay, ino)
            elif self.fs.shared and self.fs.orphan_grace is not None:
                # (a branch under /.bm: freed now unless a mount of that branch claimed
                # it meanwhile, which then lets it go in its turn)
                me = self.fs.mount_id
                await self._free_if_orphan(view, ino, lay, expect=me.encode())
                await self._set_holders(view, ino, lay, drop=me, expect=None)
            else:
                await self._free_if_orphan(view, ino, lay)

    def overlay(self, view, ino, i: Inode) -> None:
        of = self.open_files.get((view.id, ino))
        if of is not None and of.dirty:
            i.size = of.size
            i.mtime_ns = i.ctime_ns = of.mtime_ns

    def set_mtime(self, view, ino, mtime_ns: int | None) -> bool:
        """The kernel's writeback cache sets a file's times once it has written to it:
        if the file has data buffered here, keep the time for the store that commits
        the data (rather than a transaction of its own). False if it has none."""
        of = self.open_files.get((view.id, ino))
        if mtime_ns is None or of is None or not of.dirty:
            return False
        of.mtime_ns = mtime_ns
        return True

    def overlay_update(self, view, ino, i: Inode) -> None:
        """Metadata of an open file changed elsewhere (nothing to do: sizes live in KV)."""

    # -- what the kernel caches (close-to-open; see the module doc) -------------------------
    def client_saw(self, fino: int, mode: int, size: int, mtime_ns: int, ctime_ns: int) -> None:
        """The kernel got an inode from a reply (lookup, create, readdirplus). Only the
        first reply counts: while the kernel holds a regular file it ignores later ones."""
        if stat.S_ISREG(mode):
            self.client.setdefault(fino_parts(fino), (size, mtime_ns, ctime_ns))

    def client_forgot(self, fino: int) -> None:
        """The kernel dropped the inode (FUSE forget brought its lookup count to 0)."""
        key = fino_parts(fino)
        self.client.pop(key, None)
        if key not in self.open_files:
            self.lost.pop(key, None)

    def client_stale(self, fh: int) -> tuple[int | None, int] | None:
        """None if the kernel's cache of the file opened as ``fh`` was up to date at
        open; else ``(size the kernel may still have, or None if unknown, stored size)``:
        another mount changed the file since the kernel got it. It stays stale for
        later opens until the front end calls :meth:`client_resynced`."""
        return self.handles[fh].stale

    def client_resynced(self, fh: int) -> None:
        """The kernel's copy of the file opened as ``fh`` now matches the stored state
        read at open (its pages dropped, its size pushed to the stored one)."""
        h = self.handles[fh]
        self.client[(h.of.view.id, h.of.ino)] = h.state

    def client_moved(self, view, ino: int, before: tuple, i: Inode) -> None:
        """This mount changed the file from ``before`` to ``i``: the kernel did it (or
        was told), so its copy moves on, unless it was already behind someone else."""
        key = (view.id, ino)
        if self.client.get(key) == before:
            self.client[key] = _state(i)

    async def open(self, fino: int, flags: int, created=None) -> int:
        """A handle on a file. ``created``: the Attr of the file this mount has just
        created (nothing to read back)."""
        view, ino = self.fs.split(fino)
        if created:
            state = (created.size, created.mtime_ns, created.ctime_ns)
        else:
            await self.kv.barrier()  # close-to-open: see what other mounts closed
            i = await ns.get_inode(self.kv.begin(), view.chain, ino)
            if i is None:
                raise NotFound()
            if i.is_dir():
                raise IsDir()
            state = _state(i)
        if not view.writable and (flags & os.O_ACCMODE) != os.O_RDONLY:
            # refused here: with the writeback cache a write would "succeed" into the
            # kernel's page cache and fail only at close
            from ..errors import ReadOnly
            raise ReadOnly()
        of = self.open_files.get((view.id, ino))
        if of is None:
            of = self.open_files[(view.id, ino)] = OpenFile(view, ino)
            if created:
                of.size = created.size
        of.opens += 1
        fh = self._next_fh
        self._next_fh += 1
        h = self.handles[fh] = Handle(of, flags)
        truncating = flags & os.O_TRUNC and (flags & os.O_ACCMODE) != os.O_RDONLY
        h.state = state
        seen = self.client.get((view.id, ino))
        if seen != h.state and not truncating:  # (an O_TRUNC open resets the kernel too)
            h.stale = (seen[0] if seen else None, state[0])
        else:
            self.client[(view.id, ino)] = h.state
        if truncating and not created:
            try:
                await self.truncate(view, ino, 0)
            except BaseException:
                await self.release(fh)
                raise
        elif not created and (flags & os.O_ACCMODE) != os.O_WRONLY:
            # (a read served from the kernel's page cache never reaches the daemon)
            await self.fs.accessed(view, ino, i, tell_kernel=True)
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
            if self._past_lost(of, offset, len(data)):
                return len(data)
            await self._size(of)
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
        lost = self.lost.get(key)
        if lost is None:
            return False
        if offset > lost.start:
            lost.end = max(lost.end, offset + n)
            return True
        lost.start = max(lost.start, offset + n)
        if lost.start >= lost.end:
            del self.lost[key]
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
        lost = self.lost.get(key)
        if lost is None:
            self.lost[key] = Lost(start, end, e)
        else:
            lost.start, lost.end = min(lost.start, start), max(lost.end, end)
        if key in self.client:  # (the kernel's size is past the stored one: the next
            # open finds it stale and has the kernel look the inode up afresh)
            self.client[key] = (self.lost[key].end, -1, -1)
        of.failures += 1
        of.buf = WriteBuffer()
        of.dirty = False
        of.size = of.mtime_ns = None
        of.read_cache = None

    async def _report_lost(self, h: Handle) -> None:
        """Raise the error of the file's lost range (Lost) at each fsync and close of a
        writable handle while the range lasts, as Linux reports a writeback error: a
        writer that tries again never gets "done" for bytes stored nowhere. First the
        kernel drops its pages of the file and its names for the inode (so that it is
        evicted once closed, and looked up afresh at its stored size): its reads then
        come here, and find the range unreadable."""
        of = h.of
        lost = self.lost.get((of.view.id, of.ino))
        if lost is None:
            return
        if self.fs.notify is not None:
            await self.fs.notify.inode(self.fs.join(of.view, of.ino))
        if (h.flags & os.O_ACCMODE) != os.O_RDONLY:
            raise lost.error(of.ino)

    async def _drain(self, of: OpenFile) -> None:
        """Wait until every stripe stored in the background is committed (or lost)."""
        if of.last_commit is not None:
            await of.last_commit.wait()

    async def _size(self, of: OpenFile) -> int:
        """The file's size, loading it into ``of.size`` when nothing is buffered."""
        if of.size is None:
            i = await ns.get_inode(self.kv.begin(), of.view.chain, of.ino)
            if i is None:
                raise NotFound()
            of.size = i.size
        return of.size

    async def _flush_locked(self, of: OpenFile) -> None:
        """Store what is buffered; a failure is recorded (_lose), not raised."""
        await self._drain(of)
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
        try:
            await self._store_stripe(of, start, data, sid, wait_for, failures)
        finally:
            self.data.uncommitted.discard(sid)  # committed, or never will be

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
            before = _state(i)
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
        self.client_moved(of.view, of.ino, before, i)

    async def flush(self, fh: int) -> None:
        h = self.handles.get(fh)
        if h is None:
            return
        async with h.of.lock:
            await self._flush_locked(h.of)
        await self._report_lost(h)

    async def fsync(self, fh: int, datasync: bool = False) -> None:
        await self.flush(fh)
        await self.data.sync()
        await self.kv.sync()

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            return
        of = h.of
        key = (of.view.id, of.ino)
        try:
            async with of.lock:
                await self._flush_locked(of)
            await self._report_lost(h)
        finally:
            of.opens -= 1
            if of.opens == 0:
                del self.open_files[key]
                if key not in self.client:  # (nothing shows the lost range any more)
                    self.lost.pop(key, None)
                await self.free_unlinked(of.view, of.ino)  # if unlinked here while open

    async def _free_if_orphan(self, view, ino: int, lay: int | None = None,
                              expect: bytes | None = None) -> None:
        """Free inode ``ino`` if no name is left, and drop its orphan record (``lay``:
        the layer it was recorded under). A big file goes a batch of chunks per
        transaction; if this mount dies half way, another one (or its next mount)
        finishes the job from the orphan record. With ``expect``, only while the
        record still says that (a mount that claimed it meanwhile keeps it)."""
        if not view.writable:
            return
        done = []

        async def fn(txn, chain):
            done.clear()
            return await self._free_step(txn, chain, view, ino, lay, expect, done)
        while not await self.fs.mutate(view, fn):
            pass  # (a batch of a big file's chunks released: nothing freed yet)
        self._freed(view, done)

    async def _free_orphans(self, view, due: list) -> int:
        """_free_if_orphan for each (ino, layer, expect) of ``due``, FREE_FILES files a
        transaction (a sweep after `rm -rf` of many small files would otherwise cost
        a transaction per file, as many as the unlinks); a file too big to go whole,
        and every file of a group whose transaction failed, goes by itself. A file
        open here meanwhile is left. Returns how many were dealt with."""
        if not view.writable:
            return 0
        left, done = [], []
        for at in range(0, len(due), FREE_FILES):
            group = due[at:at + FREE_FILES]

            async def fn(txn, chain, group=group):
                left.clear()
                done.clear()
                for ino, lay, expect in group:
                    if self.is_open(view, ino):
                        continue
                    if not await self._free_step(txn, chain, view, ino, lay, expect, done,
                                                 whole=True):
                        left.append((ino, lay, expect))
                return True
            try:
                await self.fs.mutate(view, fn)
            except FsError as e:  # (too big together, say): one at a time
                log.warning("freeing %d unlinked files together failed (%s); one at a "
                            "time", len(group), e)
                left[:] = group
            else:
                self._freed(view, done)
            for ino, lay, expect in left:
                try:
                    await self._free_if_orphan(view, ino, lay, expect)
                except FsError as e:  # the next sweep tries again
                    log.warning("could not free unlinked inode %d: %s", ino, e)
        return len(due)

    async def _free_step(self, txn, chain, view, ino: int, lay: int | None,
                         expect: bytes | None, done: list, whole: bool = False) -> bool:
        """In ``txn``: free what _free_if_orphan frees of ``ino`` in one transaction,
        noting in ``done`` what _freed applies once it is committed. False if it is not
        done: a big file had a batch of chunks released (or, with ``whole``, nothing,
        being too big to go whole with others)."""
        at = chain.top if lay is None else lay
        if expect is not None and await txn.get(keys.orphan(at, ino)) != expect:
            return True
        i = await ns.get_inode(txn, chain, ino)
        if i is not None and i.nlink == 0:
            idxs = await ns.chunk_indexes(txn, chain, ino)
            if len(idxs) > (FREE_FILE_CHUNKS if whole else FREE_BATCH):
                if whole:
                    return False
                for idx in idxs[-FREE_BATCH:]:
                    i.count("chunks", await ns.put_chunk(txn, chain, ino, idx, []))
                await ns.put_inode(txn, chain, ino, i)
                return False
            done.append((ino, i, None))
            await ns.delete_inode(txn, chain, ino, i)
        if at == chain.top or not await self._seen_elsewhere(txn, chain, at, ino):
            txn.delete(keys.orphan(at, ino))
        else:
            # the record's layer is frozen: a snapshot or branch taken since shares
            # it, nameless inode and all. The record stays for those trees (fsck,
            # a mount of that branch frees its own copy) and goes with the layer
            # (layer_gc.collect_layers), or once no tree has the inode; this tree's
            # copy is gone now.
            done.append((ino, None, (chain.top, at, ino)))
        return True

    async def _seen_elsewhere(self, txn, chain, lay: int, ino: int) -> bool:
        """Whether a tree other than ``chain``'s, through frozen layer ``lay`` (an
        orphan record's), still has inode ``ino``: a snapshot or branch taken while
        the file was open unlinked. Once none has (they were deleted, or freed their
        copy), the record is of no more use: kept, no pass would ever drop it (the
        layer stays under this tree's; a pruned version took with it the only sign).
        A tree made meanwhile (a new layer) makes the transaction's check fail."""
        counter, others = await trees.trees_through(self.kv, lay)
        if await txn.get(keys.counter("layer")) != counter:
            return True
        for other in others:
            if other.top != chain.top and await ns.get_inode(txn, other, ino) is not None:
                return True
        return False

    def _freed(self, view, done: list) -> None:
        """What committed _free_steps freed: the inodes (FileSystem.freed) and the
        frozen layers' records this tree is done with (``_freed_here``)."""
        for ino, i, here in done:
            if i is not None:
                self.fs.freed(view, ino, i)
            if here is not None:
                self._freed_here.add(here)
        done.clear()

    async def reap_orphans(self, view) -> int:
        """Free inodes unlinked while open by a mount that then died.

        An orphan record names the mount holding the inode; one whose mount still has
        its leased ``m/`` record (another live mount of an etcd volume) is left alone.
        """
        shared = self.fs.defers_free(view)
        now, seen, live = trio.current_time(), {}, set()
        if shared:  # the mounts with a live record, this one aside
            live = {keys.mount_id_of(k)
                    for k, _ in await self.kv.range(*keys.span(keys.MOUNT_PREFIX))}
            live.discard(self.fs.mount_id)
        due = []  # (ino, layer, expect): freed together at the end (_free_orphans)
        for k, owner in await self.kv.range(*keys.span(keys.ORPHAN_PREFIX)):
            lay, ino = keys.orphan_of(k)
            if lay not in view.chain.layers or (view.chain.top, lay, ino) in self._freed_here:
                continue
            if shared:
                await self._sweep_shared(view, lay, ino, owner, now, seen, live, due)
                continue
            if self.is_open(view, ino):
                continue
            if owner and owner.decode() != self.fs.mount_id and \
                    await self.kv.get(keys.mount(owner.decode())) is not None:
                continue
            due.append((ino, lay, None))
        if shared:
            self._unclaimed_since = seen
        n = await self._free_orphans(view, due)
        self._let_go.difference_update((lay, ino) for ino, lay, _ in due)
        return n

    async def _sweep_shared(self, view, lay: int, ino: int, record: bytes, now: float,
                            seen: dict, live: set, due: list) -> None:
        """One orphan record of a shared volume (see UNCLAIMED), ``live`` the other
        mounts with a live record: claim it if this mount holds the file open; free an
        unclaimed one that is this mount's, or a dead mount's, once it has been seen
        unclaimed for FileSystem.orphan_grace seconds (at once if no other mount lives: none can
        hold it), by putting it in ``due``; make it unclaimed once every holder it
        names is gone."""
        me = self.fs.mount_id
        named = holders(record)
        if self.is_open(view, ino):
            await self.claim_if_open(lay, ino, record)
            return
        if record.startswith(UNCLAIMED):
            owner = record[len(UNCLAIMED):].decode(errors="replace")
            if owner in live:
                return  # its mount frees it (one mount's frees, not every mount's)
            first = seen[(lay, ino, record)] = self._unclaimed_since.get((lay, ino, record), now)
            # (alone, a file this mount let go of is nobody's: one it took over from
            # holders that seemed dead waits, as their records may just be late)
            alone = not live and (lay, ino) in self._let_go
            if alone or now - first >= self.fs.orphan_grace:
                due.append((ino, lay, record))  # (freed only if it still says this)
            return
        if any(h in live for h in named):
            return  # held by a live mount
        # every holder is gone (died, or this mount without a handle now)
        await self._set_holders(view, ino, lay, expect=record, drop=me)

    def let_go(self, lay: int, ino: int) -> None:
        """This mount made the orphan record of (``lay``, ``ino``) unclaimed itself."""
        self._let_go.add((lay, ino))

    async def claim_open(self) -> None:
        """Claim the orphan records of every file open here that do not name this
        mount (the watch restarted: their changes may have been missed)."""
        view = self.fs.views.get(0)
        if view is None or not self.fs.defers_free(view) or not self.open_files:
            return
        for k, record in await self.kv.range(*keys.span(keys.ORPHAN_PREFIX)):
            lay, ino = keys.orphan_of(k)
            try:
                await self.claim_if_open(lay, ino, record)
            except FsError as e:  # the sweep tries again
                log.warning("could not claim orphan inode %d: %s", ino, e)

    async def claim_if_open(self, lay: int, ino: int, record: bytes) -> None:
        """The orphan record of (``lay``, ``ino``) now says ``record`` (another mount
        put it): if this mount holds the file open and is not named, claim it."""
        view = self.fs.views.get(0)
        if (view is None or not self.fs.defers_free(view) or lay not in view.chain.layers
                or not self.is_open(view, ino)
                or self.fs.mount_id in holders(record)):
            return
        await self._set_holders(view, ino, lay, add=self.fs.mount_id, expect=record)
        self.orphaned[(view.id, ino)] = lay

    async def _set_holders(self, view, ino: int, lay: int, add: str | None = None,
                           drop: str | None = None, expect: bytes | None = None) -> None:
        """Rewrite the orphan record of ``ino``: with ``add`` named as a holder,
        ``drop`` not, and without holders that have no live ``m/`` record; unclaimed
        (by ``drop``, or this mount) if none is left. With ``expect``, only if the
        record still says that. Nothing if the record is gone (freed meanwhile)."""
        me = self.fs.mount_id
        key = keys.orphan(lay, ino)

        async def fn(txn, chain):
            rec = await txn.get(key)
            if rec is None or (expect is not None and rec != expect):
                return
            keep = []
            for h in holders(rec):
                if h == drop or h in keep:
                    continue
                if h == add or (h != me and await txn.get(keys.mount(h)) is not None):
                    keep.append(h)
            if add is not None and add not in keep:
                keep.append(add)
            new = ",".join(keep).encode() if keep else unclaimed(drop or me)
            if new != rec:
                txn.put(key, new)
        await self.fs.mutate(view, fn)

    async def close_all(self) -> None:
        """Release every handle (each one, whatever the others' errors; the first is
        raised)."""
        failed = None
        for fh in list(self.handles):
            try:
                await self.release(fh)
            except FsError as e:
                failed = failed or e
        if failed is not None:
            raise failed

    # -- truncate ---------------------------------------------------------------------------
    async def truncate(self, view, ino: int, size: int, mtime_ns=None, ctime_ns=None):
        if size > MAX_FILE_SIZE:
            raise TooBig()
        of = self.open_files.get((view.id, ino))
        if of is not None:
            async with of.lock:
                await self._flush_locked(of)
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
        lost = self.lost.get(key)
        if lost is None:
            return
        if size <= lost.start:
            del self.lost[key]
            return
        i = await ns.get_inode(self.kv.begin(), view.chain, ino)
        if i is not None and i.size < min(size, lost.end):
            raise lost.error(ino)
        lost.end = min(lost.end, size)

    async def _truncate(self, view, ino, size, mtime_ns, ctime_ns):
        before = None

        async def fn(txn, chain):
            nonlocal before
            i = await ns.get_inode(txn, chain, ino)
            if i is None:
                raise NotFound()
            if i.is_dir():
                raise IsDir()
            before = _state(i)
            if size < i.size:
                last = (size + CHUNK_SIZE - 1) // CHUNK_SIZE  # first chunk wholly beyond
                beyond = [x for x in await ns.chunk_indexes(txn, chain, ino) if x >= last]
                if len(beyond) > FREE_BATCH:
                    # a big cut: whole chunks past the new end go a batch per transaction
                    # (the size changes in the last one; meanwhile they read as holes)
                    for idx in beyond[-FREE_BATCH:]:
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
        self.client_moved(view, ino, before, i)
        return attr_of(self.fs.join(view, ino), i)

    # -- reading ----------------------------------------------------------------------------
    async def read(self, fh: int, offset: int, size: int) -> bytes:
        of = self.handles[fh].of
        if of.buf or of.lock.locked() or (of.last_commit is not None
                                          and not of.last_commit.is_set()):
            # written data not committed yet (buffered, being stored, or being flushed
            # by another request): take the lock, so the bytes are never in limbo
            async with of.lock:
                await self._drain(of)
                if of.buf and offset < of.buf_start + len(of.buf) and \
                        offset + size > of.buf_start:
                    await self._flush_locked(of)
        lost = self.lost.get((of.view.id, of.ino))
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
