"""The orphan and deferred-free protocol: files whose last name went while they were
open, or too big to free in one transaction.

An orphan record ``o/LAYER/INO`` names the mount that holds the unlinked file open;
that mount frees it when its last handle here closes (``free_unlinked``), a batch of
chunks per transaction for a big one; a mount that finds records of dead mounts frees
those (``reap_orphans``: at mount, and at each upkeep sweep on etcd volumes).

Deferred frees on shared volumes (opt-in: BMFS_ORPHAN_GRACE=SECONDS in every mount's
environment; FileSystem.defers_free). Orphan records then say who holds an unlinked
file: a comma-separated list of mount ids, or UNCLAIMED and the id of the mount that
let it go (unlinked it while no handle of its own was open, closed its last handle,
or found its holders dead). A mount that holds it open claims it (puts its id in); an
unclaimed one is freed by a mount that has seen it unclaimed for Settings.orphan_grace seconds
(reap_orphans), long enough for every live mount to sweep a few times. Off by
default: see docs/etcd.md for what it does not handle yet.
"""
from __future__ import annotations

import logging
from typing import Callable

import trio

from ..errors import FsError
from ..meta import keys, trees
from ..meta import namespace as ns
from ..meta.keys import CHUNK_SIZE
from ..format.records import Inode
from .needs import Namespace

log = logging.getLogger(__name__)
# Chunks released per transaction when a big file is deleted or cut short: a chunk
# costs up to ~33 operations (its slice list, and each stripe's record and GC entry),
# and etcd limits a transaction's operations (--max-txn-ops, docs/etcd.md).
FREE_BATCH = 64
# Small unlinked files a sweep frees together in one transaction (_free_orphans), each
# of at most FREE_FILE_CHUNKS chunks (the same budget of operations as FREE_BATCH).
FREE_FILES = 16
FREE_FILE_CHUNKS = FREE_BATCH // FREE_FILES
UNCLAIMED = b"?"


def unclaimed(mount_id: str) -> bytes:
    return UNCLAIMED + mount_id.encode()


def holders(value: bytes) -> list[str]:
    """The mounts an orphan record names as holding the file open."""
    if not value or value.startswith(UNCLAIMED):
        return []
    return [h for h in value.decode(errors="replace").split(",") if h]


class Orphans:
    """The orphan records of one mount's files. ``is_open(view, ino)``: whether this
    mount holds the file open (through any view of its tree); ``any_open()``: whether
    it holds any file open."""

    def __init__(self, fs: Namespace, is_open: Callable[[object, int], bool],
                 any_open: Callable[[], bool]):
        self.fs, self.kv = fs, fs.kv
        self.is_open, self.any_open = is_open, any_open
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
        unclaimed for Settings.orphan_grace seconds (at once if no other mount lives: none can
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
        if view is None or not self.fs.defers_free(view) or not self.any_open():
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
