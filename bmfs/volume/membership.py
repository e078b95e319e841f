"""Node membership and liveness in the metadata (etcd engine): leased records.

A node started with ``--meta etcd://...`` keeps ``v/node/<name>`` alive under an
etcd lease (TTL 10 s, renewed every 3 s): its address, devices and usage. When the
node dies the lease expires and the record vanishes, so `bmfs status` (and anything
placing fragments) sees who is alive from the metadata. At start, such a node also
announces its address for the devices it serves (``announce``). With the embedded SQLite
engine the mount owns the metadata; the mount then asks nodes directly (STAT).

The node itself (bmfs/node/) keeps nothing but its devices and opens no metadata:
``keeper`` is what `bmfs node serve --meta` runs beside it (run_node's ``beside``),
as a 3FS storage service's heartbeats to its manager are a client beside the
storage engine.
"""
from __future__ import annotations

import json
import logging
import time

import trio

from ..errors import FsError
from ..meta import keys

log = logging.getLogger(__name__)
TTL = 10
RENEW_EVERY = 3.0


def keeper(meta: str, name: str, volume_uuid: str, secret: bytes, tls=None):
    """run_node's ``beside`` for a node started with ``--meta``: open the metadata at
    ``meta`` (etcd, this volume's), keep the node's leased record ``name`` there and
    announce its advertised address for the devices it serves (in the background:
    etcd may be slow or unreachable). Metadata without leases, or not this volume's,
    is left alone. ``tls``: the client SSL context that reaches the other nodes."""
    async def keep(stores: dict, address: str, advertise: str | None,
                   task_status=trio.TASK_STATUS_IGNORED) -> None:
        from ..kv import open_kv
        # (no read cache: its watch of the whole keyspace would cost etcd and this
        # node a copy of every metadata change, for a record renewed every few seconds)
        kv = await open_kv(meta, cache=False)
        try:
            if not kv.caps.leases:
                task_status.started()
                return
            try:
                ours = await is_volume(kv, volume_uuid)
            except FsError:  # unreachable for now: registered once it answers
                ours = True
            if not ours:
                log.warning("the metadata at %s is not volume %s's: not registered "
                            "there, no addresses announced", meta, volume_uuid)
                task_status.started()
                return
            async with trio.open_nursery() as nursery:
                if advertise:
                    nursery.start_soon(announce, kv, stores, advertise, volume_uuid,
                                       secret, 12, tls)
                await nursery.start(keep_registered, kv, name, address, stores)
                task_status.started()
        finally:
            await kv.aclose()
    return keep


async def keep_registered(kv, name: str, address: str, stores: dict, task_status=trio.TASK_STATUS_IGNORED):
    """Register this node and keep its lease alive until cancelled."""
    started = time.time()
    lease = None
    first = True
    while True:
        try:
            if lease is None:
                lease = await kv.grant_lease(TTL)
            usage = {dev: await trio.to_thread.run_sync(st.usage) for dev, st in stores.items()}
            record = {"address": address, "devices": sorted(stores), "usage": usage,
                      "started": started, "heartbeat": time.time()}
            await kv.put_with_lease(keys.node(name), json.dumps(record).encode(), lease)
            if first:
                task_status.started()
                first = False
            for _ in range(3):
                await trio.sleep(RENEW_EVERY)
                await kv.keepalive(lease)
        except FsError as e:  # lease expired (NotFound) or etcd unreachable (Unavailable)
            log.warning("membership: %s; registering again", e)
            lease = None
            if first:
                task_status.started()
                first = False
            await trio.sleep(1.0)


async def announce(kv, devices, address: str, volume_uuid: str, secret: bytes,
                   tries: int = 12, tls=None) -> list[int]:
    """Make ``address`` the node address of each of ``devices`` (ids this node serves:
    it opened and locked their directories, which say they are this volume's) whose
    device record names another: the node came back on a new IP or port. Mounts take
    the change up through their watch, as `bmfs node set-address` makes it.

    Left alone: devices not added yet or removed; a record whose node still answers
    for the device (another process serves a copy of it: the record is not taken from
    it); a loopback address over one that is not (clients elsewhere could not reach
    it). Metadata that is not this volume's changes nothing. When etcd cannot be
    reached it is tried again, every 5 s, ``tries`` times. ``tls``: the client SSL
    context that reaches the other nodes (TLS clusters). The ids changed."""
    for _ in range(tries):
        try:
            return await _announce(kv, devices, address, volume_uuid, secret, tls)
        except FsError as e:
            log.warning("device addresses not announced yet: %s", e)
            await trio.sleep(5.0)
    return []


def _loopback(address: str) -> bool:
    import ipaddress
    host = address.rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def _answers(address: str, dev: int, volume_uuid: str, secret: bytes,
                   tls=None) -> bool:
    """Whether the node at ``address`` serves device ``dev`` of this volume now."""
    from ..errors import DeviceError
    from ..transport.tcp import stat_device
    try:
        info = await stat_device(address, dev, secret, timeout=3.0, tls=tls)
    except (DeviceError, OSError, trio.TooSlowError):
        return False
    return info.get("volume", volume_uuid) == volume_uuid


async def _announce(kv, devices, address: str, volume_uuid: str, secret: bytes,
                    tls=None) -> list[int]:
    from .devices import change_device
    from .volume import device_records
    if not await is_volume(kv, volume_uuid):
        log.warning("the metadata at --meta is not volume %s's: device addresses not "
                    "announced", volume_uuid)
        return []
    records = await device_records(kv)
    changed = []
    for dev in sorted(devices):
        rec = records.get(dev)
        if rec is None or rec.get("removed") or rec.get("node", "local") in ("local", address):
            continue
        old = rec["node"]
        if _loopback(address) and not _loopback(old):
            log.warning("device %d: not announcing loopback address %s over %s", dev,
                        address, old)
            continue
        if await _answers(old, dev, volume_uuid, secret, tls):
            log.warning("device %d: %s still serves it: a copy of the device? Its record "
                        "stays", dev, old)
            continue
        # (in the transaction: unless it was removed or moved again meanwhile)
        if await change_device(kv, dev, only_if=lambda now, was=old:
                               not now.get("removed") and now.get("node") == was,
                               node=address) is None:
            continue
        log.warning("device %d: its record named node %s; now %s (this node)", dev,
                    old, address)
        changed.append(dev)
    return changed


async def is_volume(kv, volume_uuid: str) -> bool:
    """Whether the metadata ``kv`` is volume ``volume_uuid``'s."""
    raw = await kv.get(keys.SETTINGS)
    return raw is not None and json.loads(raw).get("uuid") == volume_uuid


async def live_nodes(kv) -> dict[str, dict]:
    return {keys.node_of(k): json.loads(v)
            for k, v in await kv.range(*keys.span(keys.NODE_PREFIX))}
