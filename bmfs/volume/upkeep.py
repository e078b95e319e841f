"""The upkeep of a mounted volume: what a mount does beside serving requests.

- a leased presence record (session.keep_alive, etcd), which also says which device
  changes the mount has taken up (session.confirm_devices: drain waits for it);
- every GC_INTERVAL seconds a round (``_rounds``): device changes made elsewhere,
  damage seen by reads recorded for repair, layers of deleted trees collected,
  unreferenced stripes deleted, orphans of dead mounts freed (etcd), and every
  repair_rounds rounds (BMFS_REPAIR_ROUNDS) a repair of what is queued;
- on an etcd volume, the watch of the device records (vfs/watch.py), and the engine's
  own upkeep (compaction), run by the mount that leads (session.leads_repair: the
  oldest live one), as are background repair and layer collection, so that work is
  not done twice.

fuse/mount.py runs it: ``begin`` before the filesystem is created, ``run`` in the
mount's nursery, ``end`` once it is closed.
"""
from __future__ import annotations

import logging

import trio

from ..config import get_settings
from ..errors import FsError
from ..meta import branches, keys
from ..vfs import gc
from ..vfs.watch import watch_devices
from . import repair, session

log = logging.getLogger(__name__)
GC_INTERVAL = 5.0


async def begin(volume) -> None:
    """Before a mount serves: on a single-owner volume whose last mount crashed, delete
    the fragment files of the writes it never committed (gc.begin_session)."""
    swept = await gc.begin_session(volume)
    if swept:
        log.warning("the last mount crashed: deleted %d fragment files of writes it "
                    "never committed", swept)


async def end(volume) -> None:
    """After a mount closed its filesystem: it ended cleanly (gc.end_session)."""
    await gc.end_session(volume)


async def run(fs, mountpoint: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Keep the volume of mount ``fs`` (at ``mountpoint``) up until cancelled; started
    once the mount's presence record is put and, on a shared volume, the device
    records are taken up."""
    shared = not fs.kv.caps.single_writer  # etcd: other mounts change devices
    async with trio.open_nursery() as nursery:
        await nursery.start(session.keep_alive, fs, mountpoint)
        if shared:
            # a drain that looked for mounts before this one's record was put did not
            # wait for it: take up any mark it made, now that drains see the record
            # (nothing is placed yet, so it is confirmed too)
            volume = fs.volume
            await volume.refresh_devices()
            volume.devices_confirmed = volume.devices_seq
            volume.confirmed_changed.unpark_all()
        task_status.started()
        nursery.start_soon(_rounds, fs)
        if shared:
            nursery.start_soon(watch_devices, fs)
            nursery.start_soon(session.confirm_devices, fs)
            nursery.start_soon(fs.kv.upkeep, lambda: session.leads_repair(fs))


async def _rounds(fs) -> None:
    """Background upkeep: take up device changes made elsewhere (Volume.refresh_devices),
    record damage seen by reads, delete garbage stripes, free orphans of dead mounts
    (etcd), and every repair_rounds rounds (BMFS_REPAIR_ROUNDS) repair the fragments
    queued as missing or corrupt. On a shared (etcd) volume only one mount repairs in the background (the
    oldest live one, session.leads_repair), so fragments are not rebuilt twice."""
    shared = not fs.kv.caps.single_writer  # other mounts may die holding orphans
    rounds, repair_rounds = 0, get_settings().repair_rounds
    while True:
        with trio.move_on_after(GC_INTERVAL):
            await fs.collect_now.wait()  # a tree deleted here: its layers at once
        asked, fs.collect_now = fs.collect_now.is_set(), trio.Event()
        rounds += not asked  # (repairs come every repair_rounds timed rounds)
        try:
            await fs.volume.refresh_devices()  # devices added or drained elsewhere
            await fs.volume.record_damage()
            await _collect_layers(fs, asked, shared)
            await fs.volume_gc()
            if shared:
                await session.sweep_orphans(fs)
            # (not while a repair, scrub, drain or rebalance of this mount runs: that
            # would hold the rest of the upkeep up until it ends)
            if rounds % repair_rounds == 0 and not repair.busy(fs.volume) and \
                    await fs.kv.range(*keys.span(keys.DAMAGE_PREFIX), 1) and \
                    (not shared or await session.leads_repair(fs)):
                result = await repair.repair(fs.volume)
                if result["fragments_rebuilt"] or result["stripes_failed"]:
                    log.warning("background repair: %s", result)
        except FsError as e:  # e.g. the metadata store is unreachable: no traceback
            log.warning("garbage collection failed (%s); will retry", e)
        except Exception:
            log.exception("garbage collection failed; will retry")


async def _collect_layers(fs, asked: bool, shared: bool) -> None:
    """Collect the layers of deleted branches and snapshots (branches.collect_pending),
    then delete the fragments of the stripes that freed, all of them: if a tree was
    deleted through this mount, or another mount's delete left them (it was unmounted
    or crashed first) and this mount leads the upkeep of a shared volume."""
    if not asked and (await fs.kv.get(keys.COLLECT_LAYERS) is None
                      or (shared and not await session.leads_repair(fs))):
        return
    from ..vfs.control import progress_into
    entry = {"op": "collect", "pid": 0, "done": 0, "total": 0}  # ("progress" lists it)
    running = fs.control.running if fs.control is not None else {}
    running["collect"] = entry
    try:
        freed = await branches.collect_pending(fs.kv, progress_into(entry))
    finally:
        running.pop("collect", None)
    if freed is None:
        return
    while await fs.volume_gc() >= gc.BATCH:
        pass
    log.info("collected %d layers of deleted branches and snapshots", freed)
