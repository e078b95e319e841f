"""pyfuse3 Operations: unpack arguments, call the vfs, translate errors. Nothing else.

Caveats: pyfuse3 lets handlers raise only FUSEError, so every FsError becomes one and
anything unexpected is logged and reported as EIO (never a crash of the daemon).
Locks (flock/fcntl) are not passed by pyfuse3, so the kernel keeps them per mount.
"""
from __future__ import annotations

import errno
import functools
import logging
import os

import pyfuse3
import trio

from ..errors import FsError
from ..vfs.fs import Attr
from ..vfs.views import CTL_FILE

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


def translate(fn):
    @functools.wraps(fn)
    async def wrapper(*args, **kw):
        try:
            return await fn(*args, **kw)
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            log.warning("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO)
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO)
    return wrapper


class KernelNotifier:
    """Tells the kernel to forget cached data when a tree changes under it (merge, reset).

    With the writeback cache the kernel keeps its own size of a cached regular file
    and ignores the size in our replies, so invalidating attributes is not enough:
    the names the kernel knows for the inode are invalidated too, which evicts the
    inode once nobody holds it open, and the next lookup sees the new state. The
    calls run in a worker thread: the kernel may need this daemon to answer other
    requests before it can drop pages, so the event loop must keep running.
    """

    def __init__(self):
        self.names: dict[int, set[tuple[int, bytes]]] = {}  # names the kernel holds

    def saw(self, parent: int, name: bytes, fino: int) -> None:
        self.names.setdefault(fino, set()).add((parent, name))

    def forget(self, fino: int) -> None:
        self.names.pop(fino, None)

    async def inode(self, fino: int) -> None:
        await trio.to_thread.run_sync(self._call, pyfuse3.invalidate_inode, fino)
        for parent, name in list(self.names.get(fino, ())):
            await self.entry(parent, name)

    async def entry(self, parent: int, name: bytes) -> None:
        await trio.to_thread.run_sync(self._call, pyfuse3.invalidate_entry, parent, name)

    @staticmethod
    def _call(fn, *args):
        try:
            fn(*args)
        except (OSError, pyfuse3.FUSEError):
            pass  # the kernel did not know it: nothing to drop


class Operations(pyfuse3.Operations):
    enable_writeback_cache = True

    def __init__(self, fs, timeout: float = 1.0):
        super().__init__()
        self.fs = fs
        self.notifier = fs.notify = KernelNotifier()
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
        self.notifier.saw(parent, name, a.ino)
        return self._e(a)

    @translate
    async def getattr(self, inode, ctx=None):
        return self._e(await self.fs.getattr(inode))

    @translate
    async def setattr(self, inode, attr, fields, fh, ctx):
        kw = {}
        if fields.update_mode:
            kw["mode"] = attr.st_mode
        if fields.update_uid:
            kw["uid"] = attr.st_uid
        if fields.update_gid:
            kw["gid"] = attr.st_gid
        if fields.update_size:
            kw["size"] = attr.st_size
        if fields.update_atime:
            kw["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            kw["mtime_ns"] = attr.st_mtime_ns
        if getattr(fields, "update_ctime", False):
            kw["ctime_ns"] = attr.st_ctime_ns
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

    @translate
    async def open(self, inode, flags, ctx):
        fh = await self.fs.open(inode, flags)
        return pyfuse3.FileInfo(fh=fh, direct_io=inode == CTL_FILE, keep_cache=inode != CTL_FILE)

    @translate
    async def create(self, parent_inode, name, mode, flags, ctx):
        fh, a = await self.fs.create_file(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        return pyfuse3.FileInfo(fh=fh), self._named(parent_inode, name, a)

    @translate
    async def read(self, fh, off, size):
        if self.fs.control.owns(fh):
            return self.fs.control.read(fh, off, size)
        return await self.fs.files.read(fh, off, size)

    @translate
    async def write(self, fh, off, buf):
        if self.fs.control.owns(fh):
            return await self.fs.control.write(fh, buf)
        return await self.fs.files.write(fh, off, buf)

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
        entries = await self.fs.readdir(inode)
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
            except FsError:
                continue  # removed since opendir
            if not pyfuse3.readdir_reply(token, name, self._e(a), i + 1):
                break
            self.notifier.saw(self._dir_ino.get(fh, 0), name, a.ino)

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
        for fino, _ in inode_list:
            self.notifier.forget(fino)


__all__ = ["Operations", "os"]
