"""POSIX rules over the namespace and the data path, without FUSE.

``FileSystem`` takes kernel-style inode numbers (see views.py) and names as bytes,
returns :class:`Attr` records, and raises :class:`~bmfs.errors.FsError` subclasses.
Permission checks are the kernel's (the mount uses ``default_permissions``); this
layer keeps what the kernel cannot: name limits, directory emptiness, link counts,
set-gid inheritance, read-only snapshots, branch boundaries. Each mutation is one
metadata transaction (retried on conflict, ``FileSystem.mutate``); file data goes
through files.py.

This module holds the filesystem's state, its transactions and what it answers
(getattr, lookup, readdir, readlink, statfs); the calls that change names are in
names.py (``Names``), those that change an inode's attributes and xattrs in
inode_attrs.py (``InodeAttrs``).
"""
from __future__ import annotations

import json
import logging
import os
import stat
import time

import trio

from ..config import MAX_NAME, get_settings
from ..errors import FsError, Invalid, IsDir, MetaDamaged, NameTooLong, NotDir, NotFound, ReadOnly
from ..lru import LRU
from ..meta import keys
from ..meta import namespace as ns
from ..format.records import Inode
from .attr import Attr, attr_of
from .files import Files
from .held import HeldDirs
from .inode_attrs import InodeAttrs
from .names import Names
from .views import (CTL_BRANCHES, CTL_FILE, CTL_NAME, CTL_PROGRESS, CTL_ROOT, CTL_SNAPSHOTS,
                    CTL_VIEW, INO_MASK, VIEW_SHIFT, Views)

log = logging.getLogger(__name__)

GONE_KEPT = 4096  # freed inodes remembered (FileSystem.freed)


class FileSystem(Names, InodeAttrs):
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

