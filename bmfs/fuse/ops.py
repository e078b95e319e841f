"""pyfuse3 Operations: unpack arguments, call the vfs, translate errors; and the
KernelNotifier, which tells the kernel to drop what it cached when a tree changes under
it and counts the inodes the kernel holds (the vfs's close-to-open bookkeeping).

Caveats: pyfuse3 lets handlers raise only FUSEError, so every FsError becomes one and
anything unexpected is logged and reported as EIO (never a crash of the daemon).
Locks (flock/fcntl) are not passed by pyfuse3, so the kernel keeps them per mount.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time

import pyfuse3
import trio

from .. import metrics
from ..errors import FsError, NotFound
from ..vfs.control import Caller
from ..vfs.attr import Attr
from ..vfs.views import CTL_FILE, CTL_PROGRESS, VIEW_SHIFT
from .idle import IdleSpin

log = logging.getLogger(__name__)


def _entry(a: Attr, timeout: float) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = a.ino
    e.generation = 0
    e.entry_timeout = timeout
    e.attr_timeout = timeout
    e.st_mode = a.mode
    e.st_nlink = a.nlink
    e.st_uid = a.uid
    e.st_gid = a.gid
    e.st_rdev = a.rdev
    e.st_size = a.size
    e.st_blksize = 1 << 20
    e.st_blocks = (a.size + 511) // 512
    e.st_atime_ns = a.atime_ns
    e.st_mtime_ns = a.mtime_ns
    e.st_ctime_ns = a.ctime_ns
    return e


# pyfuse3 SetattrFields flag -> vfs setattr keyword -> EntryAttributes field
_SETATTR = (("update_mode", "mode", "st_mode"), ("update_uid", "uid", "st_uid"),
            ("update_gid", "gid", "st_gid"), ("update_size", "size", "st_size"),
            ("update_atime", "atime_ns", "st_atime_ns"),
            ("update_mtime", "mtime_ns", "st_mtime_ns"),
            ("update_ctime", "ctime_ns", "st_ctime_ns"))


_READ_BYTES = metrics.FUSE_BYTES.labels("read")
_WRITE_BYTES = metrics.FUSE_BYTES.labels("write")
_nospace_logged = {}  # message -> when it was last logged (time.monotonic)


def _log_nospace(op: str, e: Exception, every: float = 10.0) -> None:
    now = time.monotonic()
    what = f"{op}: {e}"
    if now - _nospace_logged.get(what, -every) >= every:
        if len(_nospace_logged) > 100:
            _nospace_logged.clear()
        _nospace_logged[what] = now
        log.warning("%s", what)


def translate(fn):
    """An Operations handler that raises only FUSEError (domain errors through their
    errno, anything else logged and EIO), and tells the idle spin (fuse/idle.py) when
    a request starts and ends."""
    op = fn.__name__
    seconds = metrics.FUSE_SECONDS.labels(op)  # (looked up once, not per request)
    count = metrics.FUSE_OPS.labels(op)

    @functools.wraps(fn)
    async def wrapper(self, *args, **kw):
        idle = self.idle
        idle.begin()
        t0 = time.perf_counter()
        try:
            return await fn(self, *args, **kw)
        except FsError as e:
            if e.errno == errno.EIO:  # the metadata store or devices failed: say why
                log.warning("%s: %s", op, e)
            elif e.errno == errno.ENOSPC:  # too few devices, or full: say why (once a
                _log_nospace(op, e)  # while: a writer may retry and retry)
            _count_error(op, e.errno)
            raise pyfuse3.FUSEError(e.errno)
        except pyfuse3.FUSEError as e:
            _count_error(op, e.errno)
            raise
        except OSError as e:
            log.warning("%s: %s", op, e)
            _count_error(op, e.errno or errno.EIO)
            raise pyfuse3.FUSEError(e.errno or errno.EIO)
        except Exception:
            log.exception("internal error in %s", op)
            _count_error(op, errno.EIO)
            raise pyfuse3.FUSEError(errno.EIO)
        finally:
            idle.end()
            if metrics.ON:
                count.inc()
                seconds.observe(time.perf_counter() - t0)
    return wrapper


def _count_error(op: str, err: int) -> None:
    if metrics.ON and (op != "lookup" or err != errno.ENOENT):  # (a name looked up and not there: usual)
        metrics.FUSE_ERRORS.labels(op, errno.errorcode.get(err, str(err))).inc()


class KernelNotifier:
    """Tells the kernel to forget cached data when a tree changes under it (merge, reset,
    another mount's change seen by the watch, a file changed elsewhere found at open).

    With the writeback cache the kernel keeps its own size of a cached regular file
    and ignores the size in our replies, so invalidating attributes is not enough:
    the names the kernel knows for the inode are invalidated too, which evicts the
    inode once nobody holds it open, and the next lookup sees the new state. The
    calls run in a worker thread: the kernel may need this daemon to answer other
    requests before it can drop pages, so the event loop must keep running.

    It also counts the kernel's lookups of each inode (replies that hand one out, minus
    FUSE forgets), so it knows which inodes the kernel holds, and tells ``files`` (the
    vfs's open files: close-to-open bookkeeping) when the kernel got or dropped one.
    """

    def __init__(self, files=None, held=None):
        self.files = files
        self.held = held  # the vfs's HeldDirs: directories the kernel holds
        self.names: dict[int, set[tuple[int, bytes]]] = {}  # names the kernel holds
        self.lookups: dict[int, int] = {}                   # the kernel's lookup counts
        self.dirs: set[int] = set()
        self._retried: dict[int, tuple] = {}  # inode -> staleness answered ESTALE

    def saw(self, parent: int, name: bytes, a: Attr) -> None:
        """A reply gave the kernel ``a.ino`` under ``parent/name`` (one lookup)."""
        self.names.setdefault(a.ino, set()).add((parent, name))
        self.lookups[a.ino] = self.lookups.get(a.ino, 0) + 1
        if stat.S_ISDIR(a.mode):
            self.dirs.add(a.ino)
            if self.held is not None:
                self.held.saw(a)
        if self.files is not None:
            self.files.client_saw(a.ino, a.mode, a.size, a.mtime_ns, a.ctime_ns)

    def forget(self, fino: int, nlookup: int) -> None:
        left = self.lookups.get(fino, 0) - nlookup
        if left > 0:
            self.lookups[fino] = left
            return
        self.lookups.pop(fino, None)
        self.names.pop(fino, None)
        self.dirs.discard(fino)
        if self.held is not None:
            self.held.forgot(fino)
        if self.files is not None:
            self.files.client_forgot(fino)

    def holds(self, fino: int) -> bool:
        """Whether the kernel may cache ``fino`` (the root it holds without a lookup)."""
        return fino in self.lookups or fino == pyfuse3.ROOT_INODE

    async def inode(self, fino: int) -> None:
        await trio.to_thread.run_sync(self._call, pyfuse3.invalidate_inode, fino)
        for parent, name in list(self.names.get(fino, ())):
            await self.entry(parent, name)

    async def attributes(self, fino: int) -> None:
        """Drop the kernel's cached attributes of ``fino`` (not its pages), while a
        request of the kernel's on ``fino`` is being answered (an open).

        Called here on the event loop's thread, not in a worker thread as the other
        invalidations (a thread hop costs more than the open it would serve): while
        the kernel waits for the answer it holds the inode, so the inode cannot be on
        its way out (eviction writes times back to this daemon: an invalidation
        would wait for it), and an attributes-only invalidation touches no page."""
        if self.holds(fino):
            self._call(pyfuse3.invalidate_inode, fino, True)

    async def entry(self, parent: int, name: bytes) -> None:
        await trio.to_thread.run_sync(self._call, pyfuse3.invalidate_entry, parent, name)

    async def invalidate(self, inodes: dict[int, bool], entries: set[tuple[int, bytes]]) -> None:
        """Forget the attributes and pages of ``inodes`` (and, where the value is True,
        every name the kernel holds for the inode, to evict it) and the names in
        ``entries``, in one worker-thread call. What the kernel does not hold is skipped."""
        todo = [f for f in inodes if self.holds(f)]
        names = {(p, n) for p, n in entries if self.holds(p)}
        for f in todo:
            if inodes[f]:
                names |= self.names.get(f, set())
        if todo or names:
            await trio.to_thread.run_sync(self._many, todo, sorted(names))

    async def invalidate_view(self, view_id: int | None) -> None:
        """Everything the kernel holds of one view (None: of every view)."""
        finos = [f for f in self.lookups
                 if view_id is None or f >> VIEW_SHIFT == view_id]
        if view_id is None or view_id == 0:
            finos.append(pyfuse3.ROOT_INODE)
        # a directory's own names are dropped only for a replaced tree (see watch.py)
        await self.invalidate({f: view_id is not None or f not in self.dirs for f in finos},
                              set())

    async def opened(self, fino: int, stale: tuple[int | None, int] | None, tail) -> bool:
        """A file is being opened; ``stale`` (from the vfs, ``Files.client_stale``) says
        whether another mount changed it since the kernel got it: ``(the kernel's size,
        or None if unknown, the stored size)``. Returns whether the kernel is now in
        step (the open drops its pages itself, with keep_cache off).

        A file that grew: its size is pushed to the kernel (``resync``). One that
        shrank: the kernel cannot be told a smaller size, so its names are dropped and
        the open answered ESTALE, once: the kernel walks the path again, and the inode,
        evicted unless something else holds it, is looked up afresh.

        Raises:
            FUSEError(ESTALE): to make the kernel retry the open, as above.
        """
        retried = self._retried.pop(fino, None)
        if stale is None:
            return False
        if stale[0] is not None and stale[1] < stale[0] and retried != stale:
            await self.invalidate({}, self.names.get(fino, set()))
            self._retried[fino] = stale
            raise pyfuse3.FUSEError(errno.ESTALE)
        return await self.resync(fino, *stale, tail)

    async def resync(self, fino: int, kernel_size: int | None, size: int, tail) -> bool:
        """Another mount changed a file this kernel caches (found at open).

        The kernel keeps its own size of a cached file; a size can only be pushed up,
        by storing data past it: the last page of the file (read with ``await
        tail(offset, length)``) is stored, which moves the kernel's size to ``size`` if
        it was smaller. The names are dropped too, so the inode is read afresh once
        nobody holds it. Returns whether the kernel's size is now right: a file that
        shrank keeps its old size in this kernel while it stays held (docs/etcd.md).
        """
        fixed = kernel_size is not None and size == kernel_size
        if size > 0 and (kernel_size is None or size > kernel_size):
            start = (size - 1) // 4096 * 4096
            data = await tail(start, size - start)
            if len(data) == size - start:
                fixed = await trio.to_thread.run_sync(self._call, pyfuse3.notify_store,
                                                      fino, start, data)
        await self.invalidate({}, self.names.get(fino, set()))
        return fixed

    def _many(self, inodes, entries) -> None:
        for f in inodes:
            self._call(pyfuse3.invalidate_inode, f)
        for parent, name in entries:
            self._call(pyfuse3.invalidate_entry, parent, name)

    @staticmethod
    def _call(fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except (OSError, pyfuse3.FUSEError):
            return False  # the kernel did not know it: nothing to drop


class Operations(pyfuse3.Operations):
    enable_writeback_cache = True

    def __init__(self, fs, timeout: float = 1.0, idle_spin: float = 0.0):
        super().__init__()
        self.fs = fs
        self.idle = IdleSpin(idle_spin)  # its task is the mount's (fuse/mount.py)
        self.notifier = fs.notify = KernelNotifier(fs.files, fs.held)
        self.timeout = timeout
        self.supports_dot_lookup = True
        self.enable_acl = False
        self._dirs: dict[int, list] = {}
        self._dir_ino: dict[int, int] = {}
        self._next_dh = 1

    def _e(self, a: Attr) -> pyfuse3.EntryAttributes:
        return _entry(a, self.timeout)

    @translate
    async def lookup(self, parent_inode, name, ctx=None):
        return self._named(parent_inode, name, await self.fs.lookup(parent_inode, name))

    def _named(self, parent: int, name: bytes, a: Attr) -> pyfuse3.EntryAttributes:
        self.notifier.saw(parent, name, a)
        return self._e(a)

    @translate
    async def getattr(self, inode, ctx=None):
        return self._e(await self.fs.getattr(inode))

    @translate
    async def setattr(self, inode, attr, fields, fh, ctx):
        kw = {name: getattr(attr, st) for flag, name, st in _SETATTR
              if getattr(fields, flag, False)}
        return self._e(await self.fs.setattr(inode, **kw))

    @translate
    async def readlink(self, inode, ctx):
        return await self.fs.readlink(inode)

    @translate
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._named(parent_inode, name, await self.fs.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @translate
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._named(parent_inode, name, await self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @translate
    async def unlink(self, parent_inode, name, ctx):
        await self.fs.unlink(parent_inode, name)

    @translate
    async def rmdir(self, parent_inode, name, ctx):
        await self.fs.rmdir(parent_inode, name)

    @translate
    async def symlink(self, parent_inode, name, target, ctx):
        return self._named(parent_inode, name, await self.fs.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @translate
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @translate
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._named(new_parent_inode, new_name, await self.fs.link(inode, new_parent_inode, new_name))

    def _kernel_flags(self, flags: int) -> int:
        # With the writeback cache the kernel implements O_APPEND itself and writes back
        # whole pages at their own offsets (through any writable handle): appending again
        # here would move that data to the end of the file.
        return flags & ~os.O_APPEND if self.enable_writeback_cache else flags

    @translate
    async def open(self, inode, flags, ctx):
        if inode == CTL_FILE:  # its requests are checked against who opened it
            await self.fs.control.load_group()
            fh = self.fs.control.open(Caller.of_process(ctx.uid, ctx.gid, ctx.pid))
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        if inode == CTL_PROGRESS:  # (read afresh at every open: never cached)
            return pyfuse3.FileInfo(fh=self.fs.control.open_progress(), direct_io=True)
        fh = await self.fs.open(inode, self._kernel_flags(flags))
        stale = self.fs.files.client_stale(fh)  # changed by another mount (close-to-open)
        try:
            if await self.notifier.opened(inode, stale,
                                          lambda off, n: self.fs.files.read(fh, off, n)):
                self.fs.files.client_resynced(fh)
        except BaseException:
            await self.fs.files.release(fh)
            raise
        return pyfuse3.FileInfo(fh=fh, keep_cache=stale is None)

    @translate
    async def create(self, parent_inode, name, mode, flags, ctx):
        fh, a = await self.fs.create_file(parent_inode, name, mode, self._kernel_flags(flags),
                                          ctx.uid, ctx.gid)
        return pyfuse3.FileInfo(fh=fh), self._named(parent_inode, name, a)

    @translate
    async def read(self, fh, off, size):
        if self.fs.control.owns(fh):
            return self.fs.control.read(fh, off, size)
        data = await self.fs.files.read(fh, off, size)
        if metrics.ON:
            _READ_BYTES.inc(len(data))
        return data

    @translate
    async def write(self, fh, off, buf):
        if self.fs.control.owns(fh):
            return await self.fs.control.write(fh, buf)
        n = await self.fs.files.write(fh, off, buf)
        if metrics.ON:
            _WRITE_BYTES.inc(n)
        return n

    @translate
    async def flush(self, fh):
        if not self.fs.control.owns(fh):
            await self.fs.files.flush(fh)

    @translate
    async def release(self, fh):
        if self.fs.control.owns(fh):
            self.fs.control.release(fh)
        else:
            await self.fs.files.release(fh)

    @translate
    async def fsync(self, fh, datasync):
        if not self.fs.control.owns(fh):
            await self.fs.files.fsync(fh, datasync)

    @translate
    async def opendir(self, inode, ctx):
        entries = await self.fs.readdir(inode, dots=True)
        dh = self._next_dh
        self._next_dh += 1
        self._dirs[dh] = entries
        self._dir_ino[dh] = inode
        return dh

    @translate
    async def readdir(self, fh, start_id, token):
        # pyfuse3 answers with READDIRPLUS: the kernel caches these attributes, so they
        # must be complete (and each reply takes a lookup reference).
        entries = self._dirs.get(fh, [])
        for i in range(start_id, len(entries)):
            name, a = entries[i]
            try:
                a = await self.fs.getattr(a.ino)
            except NotFound:
                # removed since opendir, unless the name is still there: then lookup
                # answers for it (MetaDamaged if it names an inode with no record).
                # Anything else fails the listing: a damaged record must not make it
                # silently short.
                if name in (b".", b".."):
                    continue
                try:
                    a = await self.fs.lookup(self._dir_ino.get(fh, 0), name)
                except NotFound:
                    continue
            if not pyfuse3.readdir_reply(token, name, self._e(a), i + 1):
                break
            if name not in (b".", b".."):  # (the kernel takes no lookup of those)
                self.notifier.saw(self._dir_ino.get(fh, 0), name, a)

    @translate
    async def releasedir(self, fh):
        self._dirs.pop(fh, None)
        self._dir_ino.pop(fh, None)

    @translate
    async def fsyncdir(self, fh, datasync):
        await self.fs.fsyncdir()

    @translate
    async def statfs(self, ctx):
        s = await self.fs.statfs()
        r = pyfuse3.StatvfsData()
        r.f_bsize = r.f_frsize = s["bsize"]
        r.f_blocks = s["blocks"]
        r.f_bfree = r.f_bavail = s["bfree"]
        r.f_files = s["files"]
        r.f_ffree = r.f_favail = s["ffree"]
        r.f_namemax = s["namemax"]
        return r

    @translate
    async def getxattr(self, inode, name, ctx):
        return await self.fs.getxattr(inode, name)

    @translate
    async def setxattr(self, inode, name, value, ctx):
        await self.fs.setxattr(inode, name, value)

    @translate
    async def listxattr(self, inode, ctx):
        return await self.fs.listxattr(inode)

    @translate
    async def removexattr(self, inode, name, ctx):
        await self.fs.removexattr(inode, name)

    async def forget(self, inode_list):
        # not translate: pyfuse3 ends its main loop on anything forget raises, FUSEError
        # included, so nothing is raised; the idle spin counts it as every handler
        self.idle.begin()
        try:
            for fino, nlookup in inode_list:
                self.notifier.forget(fino, nlookup)
        except Exception:
            log.exception("internal error in forget")
        finally:
            self.idle.end()


__all__ = ["Operations", "os"]
