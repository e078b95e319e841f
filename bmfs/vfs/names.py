"""Names: creating, linking, removing and renaming (FileSystem's half that changes
directories).

POSIX's rules for names kept here because the kernel cannot keep them: name limits,
directory emptiness, link counts, set-gid inheritance, EXDEV across branches; a name
whose inode loses its last link is freed, kept for its open handles, or left to the
orphan sweep (orphans.py). Each call is one transaction (``FileSystem.mutate``).
``Names`` is a part of :class:`~bmfs.vfs.fs.FileSystem`, which provides ``mutate``,
``split``, ``join``, ``_get``, ``_dir``, ``_alloc_ino``, ``check_writable``,
``defers_free``, ``freed``, ``files``, ``kv`` and ``mount_id``.
"""
from __future__ import annotations

import stat
import time

from ..config import MAX_NAME
from ..errors import CrossDevice, Exists, Invalid, IsDir, NameTooLong, NotDir, NotEmpty, NotFound, Perm
from ..meta import keys
from ..meta import namespace as ns
from ..format.records import Inode
from .attr import Attr, attr_of
from .inode_attrs import now_ns
from .orphans import unclaimed
from .views import CTL_NAME, CTL_VIEW, VIEW_SHIFT

RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def check_name(name: bytes) -> None:
    if len(name) > MAX_NAME:
        raise NameTooLong(f"name of {len(name)} bytes; the limit is {MAX_NAME}")
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise Invalid(f"invalid name {name!r}")


def touch(i: Inode, now: int) -> None:
    """A directory's entries changed at ``now``: its mtime and ctime."""
    i.mtime_ns = i.ctime_ns = now


class Names:
    """Creating, linking, removing and renaming names (a part of FileSystem)."""

    # -- creating ---------------------------------------------------------------------------
    async def _make(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                    rdev: int = 0, target: bytes | None = None) -> Attr:
        check_name(name)
        if parent >> VIEW_SHIFT == CTL_VIEW:
            raise Perm("the control directory cannot hold files")
        self.check_writable()
        view, pino = self.split(parent)
        ino = await self._alloc_ino()
        self.kv.known_empty((keys.inode(ino) + b"@", keys.dir_prefix(ino), keys.chunk_prefix(ino),
                             keys.xattr_prefix(ino), keys.symlink(ino) + b"@"))

        async def fn(txn, chain):
            p = await self._dir(txn, chain, pino)
            if await ns.lookup(txn, chain, pino, name) is not None or \
                    (pino == 1 and view.id == 0 and name == CTL_NAME):
                raise Exists()
            now = now_ns()
            g, md = gid, mode
            if p.mode & stat.S_ISGID:
                g = p.gid
                if stat.S_ISDIR(mode):
                    md |= stat.S_ISGID
            i = Inode(md, uid, g, 2 if stat.S_ISDIR(mode) else 1, 0, now, now, now, rdev,
                      pino if stat.S_ISDIR(mode) else 0)
            if target is not None:
                i.size = len(target)
                await ns.set_symlink(txn, chain, ino, target)
            await ns.put_inode(txn, chain, ino, i)
            await ns.link_entry(txn, chain, pino, name, ino, md)
            if stat.S_ISDIR(mode):
                p.nlink += 1
            touch(p, now)
            await ns.put_inode(txn, chain, pino, p)
            return i
        i = await self.mutate(view, fn)
        return attr_of(self.join(view, ino), i)

    async def mknod(self, parent, name, mode, rdev, uid, gid) -> Attr:
        if stat.S_IFMT(mode) == 0:
            mode |= stat.S_IFREG
        return await self._make(parent, name, mode, uid, gid, rdev)

    async def mkdir(self, parent, name, mode, uid, gid) -> Attr:
        return await self._make(parent, name, stat.S_IFDIR | (mode & 0o7777), uid, gid)

    async def symlink(self, parent, name, target: bytes, uid, gid) -> Attr:
        if len(target) > 4095:
            raise NameTooLong("symlink target longer than 4095 bytes")
        return await self._make(parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target)

    async def link(self, fino: int, new_parent: int, name: bytes) -> Attr:
        check_name(name)
        self.check_writable()
        view, ino = self.split(fino)
        pview, pino = self.split(new_parent)
        if pview is not view:
            raise CrossDevice("hard links cannot cross branches")

        async def fn(txn, chain):
            i = await self._get(txn, chain, ino)
            if i.is_dir():
                raise Perm("hard links to directories are not allowed")
            p = await self._dir(txn, chain, pino)
            if await ns.lookup(txn, chain, pino, name) is not None:
                raise Exists()
            if i.nlink == 0:
                raise NotFound("the file was deleted")
            now = time.time_ns()
            i.nlink += 1
            i.ctime_ns = now
            touch(p, now)
            await ns.link_entry(txn, chain, pino, name, ino, i.mode)
            await ns.put_inode(txn, chain, ino, i)
            await ns.put_inode(txn, chain, pino, p)
            return i
        i = await self.mutate(view, fn)
        self.files.overlay(view, ino, i)
        return attr_of(fino, i)

    # -- removing ---------------------------------------------------------------------------
    async def _drop_link(self, txn, chain, view, ino: int, i: Inode, now: int) -> None:
        """One name of ``ino`` is gone: free it when no name and no open handle is left."""
        i.nlink -= 1 if not i.is_dir() else i.nlink
        i.ctime_ns = now
        if i.nlink > 0:
            await ns.put_inode(txn, chain, ino, i)
        elif self.files.is_open(view, ino) or (self.files.orphans.is_big(i) and not self.defers_free(view)):
            await ns.put_inode(txn, chain, ino, i)
            txn.put(keys.orphan(chain.top, ino), self.mount_id.encode())
            self.files.orphans.orphaned[(view.id, ino)] = chain.top  # (harmless if this try fails)
        elif i.is_reg() and self.defers_free(view):
            # another mount may hold it open: freed by the sweep unless one claims it
            await ns.put_inode(txn, chain, ino, i)
            txn.put(keys.orphan(chain.top, ino), unclaimed(self.mount_id))
            self.files.orphans.let_go(chain.top, ino)  # (harmless if this try fails)
        else:
            self.freed(view, ino, i)
            await ns.delete_inode(txn, chain, ino, i)

    async def unlink(self, parent: int, name: bytes) -> None:
        await self._remove(parent, name, want_dir=False)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self._remove(parent, name, want_dir=True)

    async def _remove(self, parent, name, want_dir):
        if len(name) > MAX_NAME:
            raise NameTooLong()
        if parent >> VIEW_SHIFT == CTL_VIEW:
            raise Perm("use `bmfs branch delete` / `bmfs snapshot delete`")
        view, pino = self.split(parent)
        if name == b".":
            raise Invalid()
        if name == b"..":
            raise NotEmpty()
        self.check_writable()

        async def fn(txn, chain):
            p = await self._dir(txn, chain, pino)
            ent = await ns.lookup(txn, chain, pino, name)
            if ent is None:
                raise NotFound()
            ino = ent[0]
            i = await self._get(txn, chain, ino)
            if want_dir and not i.is_dir():
                raise NotDir()
            if not want_dir and i.is_dir():
                raise IsDir()
            if i.is_dir():
                if not await ns.dir_is_empty(txn, chain, ino):
                    raise NotEmpty()
                p.nlink -= 1
            now = time.time_ns()
            await ns.unlink_entry(txn, chain, pino, name)
            touch(p, now)
            await ns.put_inode(txn, chain, pino, p)
            await self._drop_link(txn, chain, view, ino, i, now)
            return ino, i
        ino, i = await self.mutate(view, fn)
        self.files.overlay_update(view, ino, i)
        await self.files.orphans.free_unlinked(view, ino)  # a big file: a batch at a time

    async def rename(self, p1: int, n1: bytes, p2: int, n2: bytes, flags: int = 0) -> None:
        check_name(n2)
        if len(n1) > MAX_NAME:
            raise NameTooLong()
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == 3:
            raise Invalid("unsupported rename flags")
        if CTL_VIEW in (p1 >> VIEW_SHIFT, p2 >> VIEW_SHIFT):
            raise Perm("use `bmfs branch` commands for the control directory")
        self.check_writable()
        v1, d1 = self.split(p1)
        v2, d2 = self.split(p2)
        if v1 is not v2:
            raise CrossDevice("rename across branches")
        view = v1

        async def fn(txn, chain):
            pa = await self._dir(txn, chain, d1)
            pb = pa if d2 == d1 else await self._dir(txn, chain, d2)
            src = await ns.lookup(txn, chain, d1, n1)
            if src is None:
                raise NotFound()
            dst = await ns.lookup(txn, chain, d2, n2)
            si = await self._get(txn, chain, src[0])
            if flags & RENAME_EXCHANGE and dst is None:
                raise NotFound()
            if flags & RENAME_NOREPLACE and dst is not None:
                raise Exists()
            if dst is not None and dst[0] == src[0]:
                return None  # two names of one file: POSIX says do nothing
            if si.is_dir() and d2 != d1:
                await self._check_not_ancestor(txn, chain, src[0], d2)
            di = await self._get(txn, chain, dst[0]) if dst is not None else None
            if di is not None and di.is_dir() and flags & RENAME_EXCHANGE and d2 != d1:
                await self._check_not_ancestor(txn, chain, dst[0], d1)
            now = time.time_ns()
            if flags & RENAME_EXCHANGE:
                await ns.link_entry(txn, chain, d1, n1, dst[0], di.mode)
                await ns.link_entry(txn, chain, d2, n2, src[0], si.mode)
                if si.is_dir() != di.is_dir() and d1 != d2:
                    delta = 1 if di.is_dir() else -1
                    pa.nlink += delta
                    pb.nlink -= delta
                for ino_, i_, par in ((src[0], si, d2), (dst[0], di, d1)):
                    i_.ctime_ns = now
                    if i_.is_dir():
                        i_.parent = par
                    await ns.put_inode(txn, chain, ino_, i_)
            else:
                if di is not None:
                    if si.is_dir() and not di.is_dir():
                        raise NotDir()
                    if not si.is_dir() and di.is_dir():
                        raise IsDir()
                    if di.is_dir():
                        if not await ns.dir_is_empty(txn, chain, dst[0]):
                            raise NotEmpty()
                        pb.nlink -= 1
                    await self._drop_link(txn, chain, view, dst[0], di, now)
                await ns.unlink_entry(txn, chain, d1, n1)
                await ns.link_entry(txn, chain, d2, n2, src[0], si.mode)
                if si.is_dir() and d1 != d2:
                    pa.nlink -= 1
                    pb.nlink += 1
                si.ctime_ns = now
                if si.is_dir():
                    si.parent = d2
                await ns.put_inode(txn, chain, src[0], si)
            touch(pa, now)
            await ns.put_inode(txn, chain, d1, pa)
            if pb is not pa:
                touch(pb, now)
                await ns.put_inode(txn, chain, d2, pb)
            return dst[0] if dst and not flags & RENAME_EXCHANGE else None, di
        res = await self.mutate(view, fn)
        if res and res[0] is not None:
            self.files.overlay_update(view, res[0], res[1])
            await self.files.orphans.free_unlinked(view, res[0])

    async def _check_not_ancestor(self, txn, chain, dir_ino: int, target_parent: int):
        """EINVAL if ``target_parent`` is ``dir_ino`` or inside it."""
        cur, seen = target_parent, 0
        while cur and cur != 1:
            if cur == dir_ino:
                raise Invalid("cannot move a directory into itself")
            cur = (await self._get(txn, chain, cur)).parent
            seen += 1
            if seen > 100000:
                break
        if cur == dir_ino:
            raise Invalid("cannot move a directory into itself")

