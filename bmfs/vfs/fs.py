"""POSIX rules over the namespace and the data path, without FUSE.

``FileSystem`` takes kernel-style inode numbers (see views.py) and names as bytes,
returns :class:`Attr` records, and raises :class:`~bmfs.errors.FsError` subclasses.
Permission checks are the kernel's (the mount uses ``default_permissions``); this
layer keeps what the kernel cannot: name limits, directory emptiness, link counts,
set-gid inheritance, read-only snapshots, branch boundaries. Each mutation is one
metadata transaction (retried on conflict); file data goes through files.py.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import time
from functools import partial

import trio

from ..config import MAX_NAME, get_settings
from ..errors import (CrossDevice, Exists, FsError, Invalid, IsDir, MetaDamaged, NameTooLong,
                      NoAttr, NotDir, NotEmpty, NotFound, NotSupported, Perm, Range, ReadOnly)
from ..lru import LRU
from ..meta import keys
from ..meta import namespace as ns
from ..meta.records import UNCOUNTED, Inode
from .attr import Attr, attr_of
from .files import Files
from .orphans import unclaimed
from .held import HeldDirs
from .views import (CTL_BRANCHES, CTL_FILE, CTL_NAME, CTL_PROGRESS, CTL_ROOT, CTL_SNAPSHOTS,
                    CTL_VIEW, INO_MASK, VIEW_SHIFT, Views)

log = logging.getLogger(__name__)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
XATTR_CREATE, XATTR_REPLACE = 1, 2


GONE_KEPT = 4096  # freed inodes remembered (FileSystem.freed)


def now_ns() -> int:
    """The time the kernel stamps files with (its coarse clock): the times of the
    writes it caches come from it, so a file created or read here is never stamped
    after a write the kernel makes to it later (which relatime compares)."""
    return time.clock_gettime_ns(CLOCK_REALTIME_COARSE)


CLOCK_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)  # (Linux's number)
COARSE_TICK = 10**7  # ns: how far the coarse clock may lag the fine one (a tick, <= 10 ms)


ATIME_MODES = ("relatime", "strictatime", "noatime")
RELATIME_AGE = 24 * 3600 * 10**9  # relatime: an atime older than this is updated anyway


def check_name(name: bytes) -> None:
    if len(name) > MAX_NAME:
        raise NameTooLong(f"name of {len(name)} bytes; the limit is {MAX_NAME}")
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise Invalid(f"invalid name {name!r}")


class FileSystem:
    """One mount's view of a volume. Create with ``await FileSystem.create(volume)``."""

    def __init__(self, volume, views: Views):
        self.volume = volume
        self.kv = volume.kv
        self.views = views
        self.files = Files(self, volume.data, volume.settings.stripe_size)
        self.control = None  # set by control.py (branch commands through /.bm/ctl)
        # set when a branch or snapshot deleted here has layers to collect: the mount's
        # upkeep (volume/upkeep.py) collects them at once, in the background
        self.collect_now = trio.Event()
        self.notify = None   # set by the front end: async inode(fino), entry(parent, name)
        self._ino_next = self._ino_end = 0
        self._start = time.time_ns()
        # names this mount in orphan records (o/) and, on etcd, in its leased m/ record
        self.mount_id = os.urandom(8).hex()
        # other mounts share the volume (etcd): they may hold open a file this one
        # unlinks (with BMFS_ORPHAN_GRACE set, its last name going then frees it only
        # through the orphan sweep: defers_free)
        self.shared = not self.kv.caps.single_writer
        # None: a file is freed when its last name and handle here go; else deferred
        # frees (files.py, "Deferred frees"; opt-in: docs/etcd.md)
        self.orphan_grace = get_settings().orphan_grace
        self._heads: dict[str, tuple[int, int]] = {}  # branch -> (head, record revision)
        # (view id, ino) -> the last inodes freed here, as they were (see setattr)
        self.gone = LRU(GONE_KEPT)
        self._parsed_heads: dict[str, tuple[bytes, int]] = {}  # branch -> (record, head)
        # removed directories the kernel still holds answer from here (held.py)
        self.held = HeldDirs()
        # the mount's options (fuse/mount.py sets them, and again on a remount): a
        # read-only mount refuses changes with EROFS and keeps atimes as they are
        self.read_only = False
        self.atime = "relatime"

    @classmethod
    async def create(cls, volume, branch: str = "main") -> "FileSystem":
        """The filesystem of ``volume`` showing ``branch`` at its root, or the snapshot
        of that name if no branch has it (read-only).

        Raises:
            NotFound: neither a branch nor a snapshot has that name.
        """
        views = Views(volume.kv)
        try:
            await views.add("branch", branch, view_id=0)
        except NotFound:
            try:
                await views.add("snapshot", branch, view_id=0)
            except NotFound:
                raise NotFound(f"no branch or snapshot named {branch!r}") from None
        fs = cls(volume, views)
        from .control import Control
        fs.control = Control(fs)
        await fs.files.orphans.reap_orphans(views.get(0))
        return fs

    # -- helpers ----------------------------------------------------------------------------
    def freed(self, view, ino: int, i: Inode) -> None:
        """Inode ``ino`` (last ``i``) is being freed. The kernel may hold it still (until
        it sends FORGET), and with the writeback cache it writes the times it keeps
        back to it later (setattr)."""
        gone = self.gone.put((view.id, ino), i.copy())
        gone.nlink = 0
        if i.is_dir():
            self.held.removed(self.join(view, ino), gone)

    def defers_free(self, view) -> bool:
        """Whether a file of ``view`` whose last name goes (and last handle here closes)
        is left to the orphan sweep (Orphans.reap_orphans) rather than freed at once: on
        a shared volume, in the tree the sweep looks after (view 0, and that tree
        under /.bm), where a file unlinked by one mount stays readable and writable
        through the handles other mounts hold, as it does through this mount's."""
        return self.orphan_grace is not None and self.shared and \
            view in self.views.of_tree(self.views.get(0))

    def split(self, fino: int):
        view = fino >> VIEW_SHIFT
        return self.views.get(view), fino & INO_MASK

    def join(self, view, ino: int) -> int:
        return view.id << VIEW_SHIFT | ino

    async def _alloc_ino(self) -> int:
        if self._ino_next >= self._ino_end:
            self._ino_next = await ns.allocate(self.kv, "ino", 1024)
            self._ino_end = self._ino_next + 1024
        self._ino_next += 1
        return self._ino_next - 1

    async def mutate(self, view, fn):
        """Run ``fn(txn, chain)`` as one transaction on a writable view, retrying on conflict.

        The branch record is part of every transaction, so a branch operation that
        moved the head makes a concurrent mutation conflict and retry on the new chain.
        It is not read each time: the first attempt compares the revision it had when
        last read (``txn.reads``, as if read then), saving a round trip to the store.
        If the head has moved, that attempt conflicts (or, if ``fn`` raised, the error
        is found to rest on stale reads: see ``KV.transact``) and the next one reads
        the record afresh.
        """
        if not view.writable:
            raise ReadOnly(f"snapshot {view.name!r} is read-only")
        key = keys.branch(view.name)
        attempts = 0

        async def body(txn):
            nonlocal attempts
            attempts += 1
            known = self._heads.get(view.name)
            # (not if the view has moved on, e.g. refreshed by the watch; nor with an
            # engine that skips the compares when it alone wrote)
            if (attempts == 1 and known is not None and known[0] == view.chain.top
                    and not self.kv.caps.single_writer):
                head, txn.reads[key] = known
            else:
                raw = await txn.get(key)
                if raw is None:
                    self._parsed_heads.pop(view.name, None)
                    raise NotFound(f"branch {view.name!r} was deleted")
                parsed = self._parsed_heads.get(view.name)
                if parsed is not None and parsed[0] == raw:
                    head = parsed[1]  # the same record as last time: not parsed again
                else:
                    head = json.loads(raw)["head"]
                    self._parsed_heads[view.name] = (raw, head)
                self._heads[view.name] = (head, txn.reads[key])
            if head != view.chain.top:
                view.chain = await self.views.chain_from(head, view.name)
            return await fn(txn, view.chain)
        return await self.kv.transact(body)

    async def _get(self, txn, chain, ino) -> Inode:
        i = await ns.get_inode(txn, chain, ino)
        if i is None:
            raise NotFound(f"inode {ino} is gone")
        return i

    async def _dir(self, txn, chain, ino) -> Inode:
        i = await self._get(txn, chain, ino)
        if not i.is_dir():
            raise NotDir()
        return i

    def check_writable(self) -> None:
        """EROFS on a read-only mount (the kernel refuses first; this holds for
        requests already under way at a remount, and for other front ends)."""
        if self.read_only:
            raise ReadOnly("the mount is read-only")

    @staticmethod
    def _touch(i: Inode, now: int, m=True, c=True):
        if m:
            i.mtime_ns = now
        if c:
            i.ctime_ns = now

    # -- reads ------------------------------------------------------------------------------
    async def getattr(self, fino: int) -> Attr:
        if fino >> VIEW_SHIFT == CTL_VIEW:
            return self.control.getattr(fino)
        try:
            view, ino = self.split(fino)
            i = await self._get(self.kv.begin(), view.chain, ino)
        except NotFound:
            a = self.held.dead(fino)  # a removed directory still in use (held.py)
            if a is None:
                raise
            return a
        self.files.overlay(view, ino, i)
        if not view.writable and not stat.S_ISLNK(i.mode):  # symlinks are always 0777
            i.mode &= ~0o222
        a = attr_of(fino, i)
        if i.is_dir():
            self.held.answered(a)
        return a

    def _up(self, a: Attr) -> int:
        """The directory holding directory ``a``: the root's is itself, the root of a
        branch or snapshot under /.bm is /.bm/branches or /.bm/snapshots."""
        if a.parent:
            return a.parent
        view = a.ino >> VIEW_SHIFT
        if view == 0 or view == CTL_VIEW:
            return CTL_ROOT if a.ino in (CTL_BRANCHES, CTL_SNAPSHOTS) else 1
        return CTL_BRANCHES if self.views.get(view).kind == "branch" else CTL_SNAPSHOTS

    async def lookup(self, parent: int, name: bytes) -> Attr:
        if len(name) > MAX_NAME:
            raise NameTooLong()
        if parent >> VIEW_SHIFT == CTL_VIEW:
            return await self.control.lookup(parent, name)
        if parent == 1 and name == CTL_NAME:
            return self.control.getattr(CTL_ROOT)
        view, ino = self.split(parent)
        txn = self.kv.begin()
        if name in (b".", b".."):
            a = await self.getattr(parent)
            if not stat.S_ISDIR(a.mode):
                raise NotDir()
            return a if name == b"." else await self.getattr(self._up(a))
        ent = await ns.lookup(txn, view.chain, ino, name)
        if ent is None and await self.kv.barrier():  # close-to-open for names too: a
            txn = self.kv.begin()                     # file just closed on another mount
            ent = await ns.lookup(txn, view.chain, ino, name)
        if ent is None:
            await self._dir(txn, view.chain, ino)  # ENOTDIR rather than ENOENT
            await self.kv.prefetch(keys.dir_prefix(ino))  # creates follow: see KV.prefetch
            raise NotFound()
        fino = self.join(view, ent[0])
        try:
            return await self.getattr(fino)
        except NotFound:
            # the entry was removed meanwhile (another mount), or it names a record
            # that is not there: damage, which must not pass for a missing name
            await self.kv.barrier()  # (a shared volume's cache: see the removal)
            if await ns.lookup(self.kv.begin(), view.chain, ino, name) == ent:
                raise MetaDamaged(f"damaged metadata: directory entry {name!r} of inode {ino} "
                                  f"names inode {ent[0]}, which has no record") from None
            raise

    async def readlink(self, fino: int) -> bytes:
        view, ino = self.split(fino)
        txn = self.kv.begin()
        t = await ns.get_symlink(txn, view.chain, ino)
        if t is None:
            if stat.S_ISLNK((await self._get(txn, view.chain, ino)).mode):
                raise MetaDamaged(f"damaged metadata: symlink {ino} has no target record")
            raise Invalid("not a symlink")
        return t

    async def readdir(self, fino: int, dots: bool = False) -> list[tuple[bytes, Attr]]:
        """Every entry of a directory (names and types only in the Attr); with
        ``dots``, ``.`` and ``..`` first (POSIX readdir; a removed directory still in
        use lists nothing, as on a local disk). A listing sets the directory's atime
        (see ``accessed``)."""
        if fino >> VIEW_SHIFT == CTL_VIEW:
            ents = await self.control.readdir(fino)
            a = self.control.getattr(fino)
        else:
            view, ino = self.split(fino)
            await self.kv.barrier()  # opendir, like open: see what other mounts closed
            txn = self.kv.begin()
            try:
                d = await self._dir(txn, view.chain, ino)
            except NotFound:
                if dots and self.held.dead(fino) is not None:
                    return []
                raise
            ents = [(name, Attr(self.join(view, cino), fmt))
                    for name, cino, fmt in await ns.list_dir(txn, view.chain, ino)]
            a = attr_of(fino, d)
            if dots:
                await self.accessed(view, ino, d)
        if not dots:
            return ents
        return [(b".", Attr(fino, stat.S_IFDIR)),
                (b"..", Attr(self._up(a), stat.S_IFDIR))] + ents

    async def statfs(self) -> dict:
        """Capacity as user data: raw space x k/(k+m). Devices sharing one filesystem
        (the single-machine default) are counted once."""
        seen, tot, free = set(), 0, 0
        for u in (await self.volume.device_usage()).values():
            if isinstance(u, Exception):
                continue
            key = (u.get("fsid"), u["total"]) if u.get("fsid") is not None else id(u)
            if key in seen:
                continue
            seen.add(key)
            tot += u["total"]
            free += u["free"]
        k, m = self.volume.settings.k, self.volume.settings.m
        return {"bsize": 4096, "blocks": tot * k // (k + m) // 4096,
                "bfree": free * k // (k + m) // 4096,
                "files": 1 << 40, "ffree": 1 << 40, "namemax": MAX_NAME}

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
        request, not after an open). A failure is logged, never the read's."""
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
        if atime is not None and tell_kernel and hasattr(self.notify, "attributes"):
            await self.notify.attributes(self.join(view, ino))

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
            self._touch(p, now)
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
            self._touch(p, now)
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
            self._touch(p, now)
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
            self._touch(pa, now)
            await ns.put_inode(txn, chain, d1, pa)
            if pb is not pa:
                self._touch(pb, now)
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

    # -- files: delegated to files.py -------------------------------------------------------
    async def create_file(self, parent, name, mode, flags, uid, gid):
        a = await self._make(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid)
        fh = await self.files.open(a.ino, flags, created=a)
        return fh, a

    async def open(self, fino: int, flags: int) -> int:
        if fino == CTL_FILE:
            return self.control.open()
        if fino == CTL_PROGRESS:
            return self.control.open_progress()
        if fino >> VIEW_SHIFT == CTL_VIEW:
            raise IsDir()
        if (flags & os.O_ACCMODE) != os.O_RDONLY or flags & os.O_TRUNC:
            self.check_writable()
        return await self.files.open(fino, flags)

    async def volume_gc(self) -> int:
        from .gc import collect
        return await collect(self.volume)

    async def fsyncdir(self) -> None:
        await self.kv.sync()

    async def aclose(self) -> None:
        await self.files.close_all()
        view = self.views.get(0)
        if view is not None and self.defers_free(view):
            # files let go of here: freed now if no other mount lives (else by the
            # others' sweeps, after the grace)
            try:
                await self.files.orphans.reap_orphans(view)
            except FsError as e:
                log.warning("could not free the files unlinked here: %s", e)

