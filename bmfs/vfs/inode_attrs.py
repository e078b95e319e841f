"""An inode's attributes: access times, setattr (mode, owner, times, size) and
extended attributes (FileSystem's half that changes inodes in place).

``InodeAttrs`` is a part of :class:`~bmfs.vfs.fs.FileSystem`, which provides
``mutate``, ``split``, ``join``, ``_get``, ``getattr``, ``check_writable``, ``files``,
``held``, ``gone``, ``kv``, ``notify``, ``read_only`` and ``atime``.
"""
from __future__ import annotations

import logging
import stat
import time
from functools import partial

from ..errors import Exists, FsError, Invalid, NoAttr, NotFound, NotSupported, Perm, Range
from ..meta import namespace as ns
from ..format.records import UNCOUNTED, Inode
from .attr import Attr, attr_of
from .views import CTL_VIEW, VIEW_SHIFT

log = logging.getLogger(__name__)
XATTR_CREATE, XATTR_REPLACE = 1, 2


def now_ns() -> int:
    """The time the kernel stamps files with (its coarse clock): the times of the
    writes it caches come from it, so a file created or read here is never stamped
    after a write the kernel makes to it later (which relatime compares)."""
    return time.clock_gettime_ns(CLOCK_REALTIME_COARSE)


CLOCK_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)  # (Linux's number)
COARSE_TICK = 10**7  # ns: how far the coarse clock may lag the fine one (a tick, <= 10 ms)


ATIME_MODES = ("relatime", "strictatime", "noatime")
RELATIME_AGE = 24 * 3600 * 10**9  # relatime: an atime older than this is updated anyway


class InodeAttrs:
    """Access times, setattr and extended attributes (a part of FileSystem)."""

    # -- access times -----------------------------------------------------------------------
    def _atime_due(self, view, i: Inode, now: int) -> bool:
        """Whether a read of ``i`` now moves its atime, by the mount's rule: relatime
        (the default) if the atime is not after the mtime or the ctime, or is a day
        old; strictatime always; noatime, a read-only mount or a snapshot never."""
        if self.read_only or not view.writable or self.atime == "noatime":
            return False
        if self.atime == "strictatime":
            return i.atime_ns < now
        return (i.atime_ns <= i.mtime_ns or i.atime_ns <= i.ctime_ns
                or now - i.atime_ns >= RELATIME_AGE)

    async def accessed(self, view, ino: int, i: Inode, tell_kernel: bool = False) -> None:
        """``ino`` (stored as ``i``) is being read or listed: set its atime if the
        rule says so, in a transaction of its own (under relatime, once per change of
        the file or per day: most reads cost nothing). ``tell_kernel``: drop the
        kernel's cached attributes after (it does so itself after a READ or READDIR
        request, not after an open; only from within the kernel's open of the file:
        Notify.attributes). A failure is logged, never the read's."""
        now = now_ns()
        if not self._atime_due(view, i, now):
            return

        async def fn(txn, chain):
            cur = await ns.get_inode(txn, chain, ino)
            if cur is None or not self._atime_due(view, cur, now):
                return None
            # never before the change it reads, stamped by a finer clock within the
            # coarse one's tick (a time set in the future is not followed)
            last = max(cur.mtime_ns, cur.ctime_ns) + 1
            cur.atime_ns = max(now, last) if last - now < COARSE_TICK else now
            await ns.put_inode(txn, chain, ino, cur)
            return cur.atime_ns
        try:
            atime = await self.mutate(view, fn)
        except FsError as e:
            log.warning("could not set the atime of inode %d: %s", ino, e)
            return
        if atime is not None:
            i.atime_ns = atime
        if atime is not None and tell_kernel and self.notify is not None:
            await self.notify.attributes(self.join(view, ino))

    # -- attributes -------------------------------------------------------------------------
    async def setattr(self, fino: int, mode=None, uid=None, gid=None, size=None,
                      atime_ns=None, mtime_ns=None, ctime_ns=None) -> Attr:
        if fino >> VIEW_SHIFT == CTL_VIEW:
            raise Perm("the control directory cannot be changed")
        view, ino = self.split(fino)
        if mode is not None or uid is not None or gid is not None or size is not None:
            self.check_writable()  # (times: what the kernel writes back of its cache)
        if size is not None:
            return await self.files.truncate(view, ino, size, mtime_ns, ctime_ns)
        if mode is None and uid is None and gid is None and atime_ns is None and \
                self.files.set_mtime(view, ino, mtime_ns):
            return await self.getattr(fino)  # (the next store commits it)
        if mode is None and uid is None and gid is None:
            gone = await self._freed_here(view, ino)
            if gone is not None:
                return attr_of(fino, gone)

        before = None

        async def fn(txn, chain):
            nonlocal before
            i = await self._get(txn, chain, ino)
            before = (i.size, i.mtime_ns, i.ctime_ns)
            if mode is not None:
                i.mode = stat.S_IFMT(i.mode) | (mode & 0o7777)
            if uid is not None:
                i.uid = uid
            if gid is not None:
                i.gid = gid
            if atime_ns is not None:
                i.atime_ns = atime_ns
            if mtime_ns is not None:
                i.mtime_ns = mtime_ns
            i.ctime_ns = ctime_ns if ctime_ns is not None else time.time_ns()
            await ns.put_inode(txn, chain, ino, i)
            return i
        try:
            i = await self.mutate(view, fn)
        except NotFound:
            # times only: what the kernel writes back of an inode it caches, which may
            # be one freed since (created, renamed, unlinked, closed: its times were
            # still dirty). A file that is gone has no times to keep; refusing them
            # made the kernel record ENOENT as a writeback error of the filesystem,
            # and the next syncfs(2) (`sync -f`) on it failed with it.
            a = self.held.change(fino, mode=mode, uid=uid, gid=gid, atime_ns=atime_ns,
                                 mtime_ns=mtime_ns, ctime_ns=ctime_ns)
            if a is not None:  # a removed directory still in use (held.py)
                return a
            gone = self.gone.get((view.id, ino))
            if gone is None or mode is not None or uid is not None or gid is not None:
                raise
            return attr_of(fino, gone)
        self.files.overlay_update(view, ino, i)
        self.files.client_moved(view, ino, before, i)
        self.files.overlay(view, ino, i)
        return attr_of(fino, i)

    async def _freed_here(self, view, ino: int) -> Inode | None:
        """The last state of regular file ``ino`` if this mount freed it and it is
        still absent, else None. The kernel writes back the times it keeps of every
        file it saw unlinked, right after the unlink (and of others as it evicts
        them): a file that is gone has no times to keep, and answering from memory
        spares the unlink a transaction that could only fail (with the checkpoints in
        it, at which the commits and the watch run first). Inode numbers are never
        reused; a number this mount freed reads as absent unless a tree that had it
        came back (a reset), and that tree's file is not the one the kernel's times
        are of. (Directories are left to setattr: one removed while in use keeps the
        times set on it, held.py.)"""
        gone = self.gone.get((view.id, ino))
        if gone is None or not gone.is_reg() or \
                await ns.get_inode(self.kv.begin(), view.chain, ino) is not None:
            return None
        return gone

    # -- xattrs -----------------------------------------------------------------------------
    @staticmethod
    def _xname(name: bytes):
        if not name or len(name) > 255:
            raise Range("bad extended attribute name") if name else Invalid()
        if name.startswith((b"system.", b"security.")):
            raise NotSupported("system.* (ACLs) and security.* attributes are not supported")

    async def getxattr(self, fino: int, name: bytes) -> bytes:
        if fino >> VIEW_SHIFT == CTL_VIEW or name.startswith(b"security."):
            # the kernel asks for security.capability before every write: answer from
            # memory (bmfs stores no security.* attributes: setxattr refuses them)
            raise NoAttr()
        self._xname(name)
        view, ino = self.split(fino)
        v = await ns.get_xattr(self.kv.begin(), view.chain, ino, name)
        if v is None:
            await self._xattr_absent(view, ino, name)
            raise NoAttr()
        return v

    async def _xattr_absent(self, view, ino: int, name: bytes | None) -> None:
        """An xattr found absent (``name``; None: a listing short of the count) stands
        only if the inode counts no more (ns.check_counts; a transaction of its own:
        a change by another mount in between is a retry, not damage).

        Raises:
            MetaDamaged: the counts say a record is gone.
        """
        what = "an xattr" if name is None else f"xattr {name.decode(errors='replace')!r}"
        await self.kv.transact(partial(ns.check_counts, chain=view.chain, ino=ino,
                                       field="xattrs", what=what))

    async def listxattr(self, fino: int) -> list[bytes]:
        if fino >> VIEW_SHIFT == CTL_VIEW:
            return []
        view, ino = self.split(fino)
        txn = self.kv.begin()
        names = await ns.list_xattrs(txn, view.chain, ino)
        i = await ns.get_inode(txn, view.chain, ino)
        if i is not None and i.xattrs != UNCOUNTED and i.xattrs != len(names):
            await self._xattr_absent(view, ino, None)
            names = await ns.list_xattrs(self.kv.begin(), view.chain, ino)
        return names

    async def setxattr(self, fino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        if fino >> VIEW_SHIFT == CTL_VIEW:
            raise Perm()
        self._xname(name)
        if len(value) > 65536:
            raise Range("extended attribute values are limited to 64 KiB")
        self.check_writable()
        view, ino = self.split(fino)

        async def fn(txn, chain):
            i = await self._get(txn, chain, ino)
            old = await ns.get_xattr(txn, chain, ino, name)
            if flags & XATTR_CREATE and old is not None:
                raise Exists()
            if flags & XATTR_REPLACE and old is None:
                raise NoAttr()
            await ns.set_xattr(txn, chain, ino, name, value)
            if old is None:
                i.count("xattrs", +1)
            i.ctime_ns = time.time_ns()
            await ns.put_inode(txn, chain, ino, i)
            return i
        self.files.overlay_update(view, ino, await self.mutate(view, fn))

    async def removexattr(self, fino: int, name: bytes) -> None:
        if fino >> VIEW_SHIFT == CTL_VIEW:
            raise Perm()
        self._xname(name)
        self.check_writable()
        view, ino = self.split(fino)

        async def fn(txn, chain):
            i = await self._get(txn, chain, ino)
            if await ns.get_xattr(txn, chain, ino, name) is None:
                await ns.check_counts(txn, chain, ino, "xattrs", f"xattr {name!r}")
                raise NoAttr()
            await ns.remove_xattr(txn, chain, ino, name)
            i.count("xattrs", -1)
            i.ctime_ns = time.time_ns()
            await ns.put_inode(txn, chain, ino, i)
            return i
        self.files.overlay_update(view, ino, await self.mutate(view, fn))

