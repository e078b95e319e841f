"""Open files: handles and the files they share, what the kernel holds of each file
(close-to-open), and the entry points of file I/O, which go to their own modules:

- writes.py: the write pipeline (buffers, stripes stored in the background, fsync,
  truncate, ranges lost to failed stores);
- reads.py: the read path;
- orphans.py: files unlinked while open, or too big to free in one transaction.

Close-to-open across mounts (etcd): see openfile.py. ``open`` compares the state the
kernel's copy reflects with the stored inode; a difference means another mount
changed the file, and the front end drops the kernel's pages and fixes its size
(``client_stale``).
"""
from __future__ import annotations

import os
import stat

from ..errors import FsError, IsDir, NotFound, ReadOnly
from ..meta import namespace as ns
from ..format.records import Inode
from .needs import Namespace, StripeStore
from .openfile import Handle, KernelCopies, OpenFile, state
from .orphans import Orphans
from .reads import Reads
from .views import INO_MASK, VIEW_SHIFT
from .writes import Writes


class Files:
    def __init__(self, fs: Namespace, data: StripeStore, stripe_size: int):
        self.fs = fs
        self.kv = fs.kv
        self.data = data
        self.open_files: dict[tuple[int, int], OpenFile] = {}
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        self.kernel = KernelCopies()
        self.writes = Writes(fs, data, stripe_size, self.kernel)
        self.reads = Reads(fs, data, self.kernel, self.writes)
        self.orphans = Orphans(fs, self.is_open, lambda: bool(self.open_files))

    @property
    def nursery(self):
        """Where full stripes are stored in the background (set by the mount daemon;
        None: each is stored before the write returns)."""
        return self.writes.nursery

    @nursery.setter
    def nursery(self, nursery) -> None:
        self.writes.nursery = nursery

    # -- bookkeeping ------------------------------------------------------------------------
    def is_open(self, view, ino) -> bool:
        """Whether this mount holds the file open, through ``view`` or another view of
        the same tree (the mounted branch is also under /.bm)."""
        return any((v.id, ino) in self.open_files for v in self.fs.views.of_tree(view))

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
            self.kernel.client.setdefault(fino_parts(fino), (size, mtime_ns, ctime_ns))

    def client_forgot(self, fino: int) -> None:
        """The kernel dropped the inode (FUSE forget brought its lookup count to 0)."""
        key = fino_parts(fino)
        self.kernel.client.pop(key, None)
        if key not in self.open_files:
            self.kernel.lost.pop(key, None)

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
        self.kernel.client[(h.of.view.id, h.of.ino)] = h.state

    def client_moved(self, view, ino: int, before: tuple, i: Inode) -> None:
        """This mount changed the file from ``before`` to ``i`` (KernelCopies.moved)."""
        self.kernel.moved(view, ino, before, i)

    # -- handles ----------------------------------------------------------------------------
    async def open(self, fino: int, flags: int, created=None) -> int:
        """A handle on a file. ``created``: the Attr of the file this mount has just
        created (nothing to read back)."""
        view, ino = self.fs.split(fino)
        if created:
            now = (created.size, created.mtime_ns, created.ctime_ns)
        else:
            await self.kv.barrier()  # close-to-open: see what other mounts closed
            i = await ns.get_inode(self.kv.begin(), view.chain, ino)
            if i is None:
                raise NotFound()
            if i.is_dir():
                raise IsDir()
            now = state(i)
        if not view.writable and (flags & os.O_ACCMODE) != os.O_RDONLY:
            # refused here: with the writeback cache a write would "succeed" into the
            # kernel's page cache and fail only at close
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
        h.state = now
        seen = self.kernel.client.get((view.id, ino))
        if seen != h.state and not truncating:  # (an O_TRUNC open resets the kernel too)
            h.stale = (seen[0] if seen else None, now[0])
        else:
            self.kernel.client[(view.id, ino)] = h.state
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

    async def write(self, fh: int, offset: int, data) -> int:
        return await self.writes.write(self.handles[fh], offset, data)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        return await self.reads.read(self.handles[fh].of, offset, size)

    async def truncate(self, view, ino: int, size: int, mtime_ns=None, ctime_ns=None):
        return await self.writes.truncate(self.open_files.get((view.id, ino)), view, ino,
                                          size, mtime_ns, ctime_ns)

    async def flush(self, fh: int) -> None:
        h = self.handles.get(fh)
        if h is None:
            return
        async with h.of.lock:
            await self.writes.flush_locked(h.of)
        await self.writes.report_lost(h)

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
                await self.writes.flush_locked(of)
            await self.writes.report_lost(h)
        finally:
            of.opens -= 1
            if of.opens == 0:
                del self.open_files[key]
                if key not in self.kernel.client:  # (nothing shows the lost range any more)
                    self.kernel.lost.pop(key, None)
                await self.orphans.free_unlinked(of.view, of.ino)  # if unlinked here while open

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


def fino_parts(fino: int) -> tuple[int, int]:
    return fino >> VIEW_SHIFT, fino & INO_MASK
