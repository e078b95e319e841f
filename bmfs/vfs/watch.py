"""Coherence between mounts of one etcd volume: watch the metadata, invalidate the kernel.

Every mount keeps the kernel's caches (names, attributes, pages; 1 s timeouts, and a
writeback cache whose file sizes never time out). When another mount creates, renames,
unlinks or writes, this mount learns it from one etcd watch over the keys
``[b/, o0)`` (branch and snapshot records, inodes, entries, chunks, orphans: see
bmfs/meta/keys.py) and tells the kernel to forget what changed, typically within
milliseconds:

- ``d/PARENT/NAME@L`` (an entry appeared, vanished or now names another inode): the
  kernel's name PARENT/NAME;
- ``i/INO@L``, ``c/INO/...@L``: the inode's attributes and pages; for a file also every
  name the kernel holds for it, so the inode is evicted once unused and its size (which
  the writeback cache keeps) is read afresh (directories keep their names: dropping
  one would make getcwd fail in processes inside it);
- ``o/LAYER/INO``: a file unlinked (or let go of) by another mount: if it is open
  here, this mount claims it at once (Orphans.claim_if_open), so it stays until closed;
- ``b/NAME``, ``n/NAME``: a branch or snapshot record changed: the views are
  re-read (a branch's head moves when a snapshot or branch is taken from it; its
  layers are then read at their new positions). If a branch's tree was replaced
  (reset, fast-forward merge) everything the kernel holds of it is dropped.

Only keys in the top layer of a branch this mount shows can change a tree it shows
(layers below are frozen). Changes this mount made itself are left out by the engine
(``watch(skip_own=True)``): the kernel already knows them. Engines without a watch
(memory, sqlite: one process owns the volume) need none of this.

If the watch breaks for longer than the engine's timeout (etcd unreachable) it is
started again; as changes may have been missed meanwhile, everything the kernel holds is
dropped then. The open-time check in files.py (``client_stale``) does not depend on the
watch, so close-to-open holds even if an event comes late.
"""
from __future__ import annotations

import logging

import trio

from ..errors import FsError
from ..meta import keys
from ..meta.layers import layered
from ..format.records import Inode
from .views import CTL_BRANCHES, CTL_SNAPSHOTS, VIEW_SHIFT

log = logging.getLogger(__name__)
WATCH_START, WATCH_END = keys.BRANCH_PREFIX, keys.span(keys.ORPHAN_PREFIX)[1]  # b/ c/ ... o/
BATCH = 4096                            # changes handled (and deduplicated) together
RETRY_DELAY = 1.0


async def watch_devices(fs) -> None:
    """Take up the device records' changes that other mounts make (a device marked
    draining, one added) as they are committed, not at the next upkeep round: one watch
    over the records, each batch of changes read with Volume.refresh_devices. While it
    is broken, the upkeep loop still reads them every few seconds. Runs until
    cancelled; returns at once where no other client writes (or without watches)."""
    kv = fs.kv
    if kv.caps.single_writer or not kv.caps.watch:
        return
    while True:
        try:
            async with kv.watch(keys.DEVICE_PREFIX, keys.DEVICE_PREFIX + b"\xff") as changes:
                await fs.volume.refresh_devices()  # what changed before it began
                async for _ in changes:
                    while True:  # the rest of the batch: one read takes all of it up
                        try:
                            changes.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    await fs.volume.refresh_devices()
        except FsError as e:
            log.warning("the device records' watch broke (%s); the upkeep loop takes "
                        "their changes up meanwhile", e)
        except Exception:  # noqa: BLE001 (logged; the mount goes on, the upkeep loop too)
            log.exception("the device records' watch failed; starting it again")
        await trio.sleep(RETRY_DELAY)


class Watcher:
    """Invalidates the kernel's caches of one mount when other mounts change the volume.

    ``await nursery.start(watcher.run)`` returns once the watch is established (or at
    once for engines without watches); it runs until cancelled.
    """

    def __init__(self, fs):
        self.fs = fs
        self.kv = fs.kv
        self.batches = 0   # statistics: batches of changes handled
        self.changes = 0   # statistics: changes seen (other mounts' only)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self.kv.caps.single_writer or not self.kv.caps.watch:
            task_status.started()
            return
        started = False
        while True:
            try:
                async with self.kv.watch(WATCH_START, WATCH_END, skip_own=True) as changes:
                    if started:  # changes may have been missed while it was down
                        await self.fs.views.refresh()
                        await self._notify("invalidate_view", None)
                        await self.fs.files.orphans.claim_open()
                    else:
                        started = True
                        task_status.started()
                    await self._consume(changes)
            except FsError as e:
                log.warning("metadata watch broke (%s); the kernel caches may lag for up "
                            "to their timeouts until it is back", e)
            if not started:  # serve anyway: timeouts and the open-time check still hold
                started = True
                task_status.started()
            await trio.sleep(RETRY_DELAY)

    async def _consume(self, changes) -> None:
        async for first in changes:
            batch = [first]
            while len(batch) < BATCH:
                try:
                    batch.append(changes.receive_nowait())
                except trio.WouldBlock:
                    break
            self.batches += 1
            self.changes += len(batch)
            try:
                await self.apply(batch)
            except FsError as e:  # e.g. the views could not be re-read: timeouts cover it
                log.warning("could not apply metadata changes from other mounts: %s", e)

    async def apply(self, batch: list[tuple[bytes, bytes | None]]) -> None:
        """Invalidate what ``batch`` (``(key, value or None)`` in commit order) changed."""
        inodes: dict[int, bool] = {}   # fino -> also drop its names (evict the inode)
        entries: set[tuple[int, bytes]] = set()
        claims: list[tuple[bytes, bytes]] = []  # orphan records put by other mounts
        tops = self._tops()
        for key, value in batch:
            kind = keys.kind(key)
            if kind in (keys.BRANCH_PREFIX, keys.SNAPSHOT_PREFIX):
                # apply what came before under the old views, then move the views
                await self._flush(inodes, entries)
                await self._tree_changed(kind, keys.tree_name_of(key).encode(), value)
                tops = self._tops()
                continue
            if kind == keys.ORPHAN_PREFIX:
                if value is not None:
                    claims.append((key, value))
                continue
            if kind not in (keys.INODE_PREFIX, keys.DENTRY_PREFIX, keys.CHUNK_PREFIX):
                continue
            split = layered(key)
            if split is None or split[1] not in tops:
                continue
            sub, lay = split
            for view_id in tops[lay]:
                base = view_id << VIEW_SHIFT
                if kind == keys.DENTRY_PREFIX:
                    parent, name = keys.dentry_of(sub)
                    entries.add((base | parent, name))
                    continue
                fino = base | keys.ino_of(sub)
                evict = True
                if kind == keys.INODE_PREFIX and value is not None and value[:1] == keys.LIVE:
                    evict = not Inode.unpack(value[1:]).is_dir()
                inodes[fino] = inodes.get(fino, False) or evict
        await self._flush(inodes, entries)
        for key, value in claims:
            # a file another mount unlinked (or let go of): if it is open here, say so
            # now, long before the sweep would free it (Orphans.claim_if_open)
            try:
                lay, ino = keys.orphan_of(key)
            except ValueError:
                continue
            try:
                await self.fs.files.orphans.claim_if_open(lay, ino, value)
            except FsError as e:  # the sweep claims it at its next round
                log.warning("could not claim orphan inode %d: %s", ino, e)

    def _tops(self) -> dict[int, list[int]]:
        """Top layer -> ids of the writable views (branches) this mount shows on it."""
        tops: dict[int, list[int]] = {}
        for view in list(self.fs.views.by_id.values()):
            if view.writable:
                tops.setdefault(view.chain.top, []).append(view.id)
        return tops

    async def _flush(self, inodes: dict, entries: set) -> None:
        if inodes or entries:
            await self._notify("invalidate", dict(inodes), set(entries))
            inodes.clear()
            entries.clear()

    async def _tree_changed(self, kind: bytes, name: bytes, value: bytes | None) -> None:
        """A branch or snapshot record changed: re-read the views; drop what the kernel
        holds of a tree whose content was replaced rather than built upon."""
        views = self.fs.views
        before = {v.id: v.chain.layers for v in views.by_id.values()}
        await views.refresh()
        for view in list(views.by_id.values()):
            old = before.get(view.id)
            new = view.chain.layers
            if old is not None and new[len(new) - len(old):] != old:
                await self._notify("invalidate_view", view.id)
        if value is None:  # deleted: the kernel may still hold /.bm/<kind>/NAME
            parent = CTL_BRANCHES if kind == keys.BRANCH_PREFIX else CTL_SNAPSHOTS
            await self._notify("invalidate", {}, {(parent, name)})

    async def _notify(self, method: str, *args) -> None:
        notify = self.fs.notify
        if notify is not None and hasattr(notify, method):
            await getattr(notify, method)(*args)
