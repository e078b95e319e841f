"""A mount's presence in the metadata: a leased ``m/<mount id>`` record (etcd only).

Several mounts share an etcd volume, and each may hold files that were unlinked while
open (orphan records ``o/``, naming the mount). Another mount must not free those while
their holder lives, and must free them once it has died. So each mount puts a record
under ``m/<mount id>`` attached to an etcd lease of :data:`TTL` seconds and renews the
lease every ``TTL / 3`` s; if the mount dies, etcd deletes the record when the lease
runs out, and the next orphan sweep of any live mount (every few seconds, see
volume/upkeep.py) frees its orphans. Engines without leases (memory, sqlite) have a single
owner, which frees leftover orphans when it mounts.

The record also says up to which change of the device records the mount has stopped
placing stripes by the old ones (``devices``: confirm_devices), which drain waits for.

Caveat: if etcd is unreachable for longer than the TTL, the lease expires while the
mount lives; the record is put again as soon as etcd answers, but in between another
mount may free a file this mount holds unlinked-but-open.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time

import trio

from ..errors import FsError, NotFound
from ..meta import keys

log = logging.getLogger(__name__)
TTL = 10


async def keep_alive(fs, mountpoint: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Hold this mount's ``m/`` record until cancelled, then revoke it.

    Returns at once (started) for engines without leases. Run it with ``await
    nursery.start(keep_alive, fs, mountpoint)``.
    """
    kv = fs.kv
    if not kv.caps.leases:
        task_status.started()
        return
    volume = fs.volume
    fields = {"host": socket.gethostname(), "pid": os.getpid(),
              "mountpoint": os.path.abspath(mountpoint), "started": time.time()}
    lease = None
    put = started = False
    published = None  # the devices_confirmed the record says
    renewed = 0.0  # trio time the lease was last granted or renewed
    while_ok = TTL / 3
    try:
        while True:
            wait, failed = while_ok, False
            try:
                now = trio.current_time()
                if lease is None:
                    lease, put, renewed = await kv.grant_lease(TTL), False, now
                elif now - renewed >= while_ok:
                    # (a put does not renew the lease: confirmations in quick
                    # succession must not starve the renewal)
                    await kv.keepalive(lease)
                    renewed = now
                confirmed = volume.devices_confirmed
                if not put or confirmed != published:
                    record = json.dumps({**fields, "devices": confirmed}).encode()
                    await kv.put_with_lease(keys.mount(fs.mount_id), record, lease)
                    put, published = True, confirmed
                wait = max(0.0, renewed + while_ok - trio.current_time())
            except NotFound:
                log.warning("the lease of this mount's record expired (etcd unreachable "
                            "for over %d s?); putting it again", TTL)
                lease = None
                continue
            except FsError as e:  # tried again after a round, not at once
                log.warning("could not renew this mount's record: %s", e)
                failed = True
            if not started:
                started = True
                task_status.started()
            with trio.move_on_after(wait):
                if failed:
                    await trio.sleep_forever()
                elif volume.devices_confirmed == published:
                    await volume.confirmed_changed.park()
                # (else a confirmation came meanwhile: put it at once)
    finally:
        if lease is not None:
            with trio.move_on_after(2) as scope:
                scope.shield = True
                try:
                    await kv.revoke_lease(lease)
                except FsError:
                    pass  # it expires by itself


async def confirm_devices(fs) -> None:
    """Each time this mount takes up a change of the device records (a device marked
    draining, say: Volume.devices_seq), wait until every stripe it placed before is
    committed (being written then: DataClient.pending; queued behind: kv.sync),
    then raise ``devices_confirmed``, which keep_alive puts in the ``m/`` record at
    once. A drain waits for every live mount to confirm its mark (devices.drain): from
    then on no stripe lands on the device. Runs until cancelled."""
    volume = fs.volume
    while True:
        while volume.devices_seq <= volume.devices_confirmed:
            await volume.devices_changed.park()
        seq = volume.devices_seq
        # (writes end, stored or failed, within the transport's timeouts; a drain
        # does not wait for a mount longer than devices.MOUNTS_TIMEOUT)
        await volume.data.pending.settled(volume.data.pending.now())
        try:
            await fs.kv.sync()
        except FsError as e:  # etcd unreachable, say: drain waits (up to its limit)
            log.warning("could not confirm device change %d: %s; trying again", seq, e)
            await trio.sleep(1)
            continue
        volume.devices_confirmed = max(volume.devices_confirmed, seq)
        volume.confirmed_changed.unpark_all()


async def leads_repair(fs) -> bool:
    """Whether this mount is the one of a shared volume that repairs in the background:
    the oldest live mount (by its record's start time, then its id). Only it repairs,
    so fragments are not rebuilt twice by several mounts; when it dies, its record
    goes with its lease (TTL s) and the next oldest takes over. Two mounts that
    briefly both think they lead (clocks apart, a record not put yet) only duplicate
    work: repair's commit moves a fragment only if its record still names the device
    it replaced (volume/repair.py)."""
    mine = keys.mount(fs.mount_id)
    oldest = None
    for k, v in await fs.kv.range(*keys.span(keys.MOUNT_PREFIX)):
        try:
            started = float(json.loads(v).get("started", 0))
        except (ValueError, TypeError, AttributeError):
            started = 0.0
        if oldest is None or (started, k) < oldest:
            oldest = (started, k)
    return oldest is not None and oldest[1] == mine


async def sweep_orphans(fs) -> int:
    """Free inodes that dead mounts held unlinked-but-open (a periodic task)."""
    return await fs.files.orphans.reap_orphans(fs.views.get(0))
