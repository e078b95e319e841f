"""Device administration: drain, undrain, add a device, change its address.

- ``drain`` marks a device as draining (no new fragments), repairs everything off it
  (repair.repair, avoiding it), and with ``remove`` forgets it; ``undrain`` puts a
  drained device back in service; ``add_device`` adds a device to the volume (new
  stripes use it from then on); ``set_address`` points a device at its node's new
  address.
- Every change goes through ``change_device``: one transaction on the device record
  that bumps the records' change number (``seq``), which each mount publishes once it
  has taken the change up (session.confirm_devices) and drain waits for.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import trio

from ..errors import DeviceError, Invalid, NoSpace, NotFound, VolumeError
from ..meta import keys
from ..store.pmem import format_if_new, layout_of
from .repair import _stripes, repair
from .volume import device_records, in_service

log = logging.getLogger(__name__)
# seconds drain waits, on a volume other mounts share, for mounts that do not confirm
# its mark (an older bmfs: more than their upkeep loop's round, GC_INTERVAL in
# volume/upkeep.py, in which each takes the mark up), and before remove's second pass
# when some mount did not confirm (_wait_for_mounts)
OTHER_MOUNTS_SETTLE = 7.0
# how long drain waits for the other mounts to confirm a draining mark (a mount takes
# it up within milliseconds through its watch, then commits the stripes it placed
# before), and how often it looks
MOUNTS_TIMEOUT = 30.0
MOUNTS_POLL = 0.2


async def drain(volume, device: int, remove: bool = False, progress=None,
                limit: float | None = None) -> dict:
    k, m = volume.data.k, volume.data.m

    def room(records):
        left = len(in_service(records))
        if left < k + m:
            # its fragments could go nowhere, and new stripes would be written a
            # fragment short for as long as it stays drained: refused, nothing changed
            raise NoSpace(f"cannot drain device {device}: {k}+{m} stripes need {k + m} "
                          f"devices, and {left} would be left; add a device first")
    rec = await set_device(volume, device, check=room, draining=True)
    shared = not volume.kv.caps.single_writer
    waited = {}
    if shared:
        # other mounts place stripes on it until they take the mark up, and commit
        # those placed before later: wait until each says both are done
        waited = await _wait_for_mounts(volume, rec["seq"])
        # and read what they committed: this engine's cached reads may lag behind
        await volume.kv.barrier()
    result = await repair(volume, avoid={device}, progress=progress, limit=limit)
    if waited.get("mounts_unconfirmed") and remove:
        # a mount that did not say it took the mark up may have committed stripes on
        # the device since: a second pass before the device is forgotten
        await trio.sleep(OTHER_MOUNTS_SETTLE)
        again = await repair(volume, avoid={device}, progress=progress, limit=limit)
        result["fragments_rebuilt"] += again["fragments_rebuilt"]
        for key in ("stripes_failed", "stripes_short", "fragments_short"):
            result[key] = again[key]
    left = sum(st.devices.count(device) for _, st in [x async for x in _stripes(volume)])
    if remove and left == 0:
        await set_device(volume, device, removed=True)
    return {**result, **waited, "fragments_left_on_device": left,
            "removed": bool(remove and left == 0)}


async def _wait_for_mounts(volume, seq: int, timeout: float = MOUNTS_TIMEOUT) -> dict:
    """Wait until every live mount of a shared volume has published, in its ``m/``
    record, that it took up the device records up to change ``seq`` and committed
    every stripe it placed before (session.confirm_devices): from then on no stripe
    lands on a device marked by that change. Mounts of an older bmfs publish nothing:
    for them, OTHER_MOUNTS_SETTLE seconds (their upkeep loop's round, and more) since
    the mark. After ``timeout`` seconds it goes on without the mounts still behind,
    which are logged (dead ones' records go with their leases, session.TTL).
    Returns ``{"mounts_confirmed": n, "mounts_unconfirmed": n}``."""
    start = trio.current_time()
    while True:
        behind, older, confirmed = [], 0, 0
        for _, raw in await volume.kv.range(*keys.span(keys.MOUNT_PREFIX)):
            try:
                rec = json.loads(raw)
                seen = int(rec["devices"]) if "devices" in rec else None
            except (ValueError, TypeError, AttributeError):
                rec, seen = {}, None
            if seen is None:
                older += 1
            elif seen >= seq:
                confirmed += 1
            else:
                behind.append(rec)
        waited = trio.current_time() - start
        if older and not behind and waited < OTHER_MOUNTS_SETTLE:
            await trio.sleep(OTHER_MOUNTS_SETTLE - waited)
            continue
        if not behind or waited >= timeout:
            break
        await trio.sleep(MOUNTS_POLL)
    for rec in behind:
        log.warning("mount %s:%s (pid %s) did not confirm it stopped placing stripes on "
                    "the draining device within %.0f s; going on without it",
                    rec.get("host"), rec.get("mountpoint"), rec.get("pid"), timeout)
    # (an older mount confirms nothing: it counts as unconfirmed, after its wait)
    return {"mounts_confirmed": confirmed, "mounts_unconfirmed": len(behind) + older}


async def set_device(volume, device: int, check=None, **changes) -> dict:
    """Change device ``device``'s record (change_device), then take the records up
    (Volume.refresh_devices): new stripes go to the devices in service from the next
    write on. The record, changed."""
    rec = await change_device(volume.kv, device, check, **changes)
    await volume.refresh_devices()
    return rec


async def change_device(kv, device: int, check=None, only_if=None, **changes) -> dict | None:
    """Change device ``device``'s record (``draining``/``removed``: True sets, False
    clears; other values are set as given) in a transaction, which first calls
    ``check(records)`` with every device record as it would be (it raises to refuse:
    two drains at once cannot both pass it, as each reads the other's record). The
    record, changed; None, and nothing changed, if ``only_if(record)`` is false for
    the record as it was."""
    async def fn(txn):
        records = await device_records(txn)
        rec = records.get(device)
        if rec is None:
            raise NotFound(f"no device {device}")
        if only_if is not None and not only_if(dict(rec)):
            return None
        for key, value in changes.items():
            if value is False:
                rec.pop(key, None)
            else:
                rec[key] = value
        # the records' change number: each mount publishes the one it has taken up
        # (session.confirm_devices), for drain to wait for (_wait_for_mounts)
        rec["seq"] = max(r.get("seq", 0) for r in records.values()) + 1
        if check is not None:
            check(records)
        txn.put(keys.device(device), json.dumps(rec).encode())
        return rec
    return await kv.transact(fn)


async def undrain(volume, device: int, progress=None) -> dict:
    """Put a drained (or draining) device back in service: new stripes may go to it
    again. Its fragments stay where the drain moved them (as with Ceph's ``osd in``,
    nothing moves back by itself). A removed device was forgotten: add it again."""
    rec = (await device_records(volume.kv)).get(device)
    if rec is None:
        raise NotFound(f"no device {device}")
    if rec.get("removed"):
        raise Invalid(f"device {device} was removed; add its directory again as a new "
                      f"device (bmfs node add PATH: it is emptied and formatted anew)")
    was = bool(rec.get("draining"))
    await set_device(volume, device, draining=False)
    return {"device": device, "was_draining": was, "in_service": True}


async def add_device(volume, path: str, address: str | None = None, device: int | None = None,
                     domain: str | None = None, layout: str | None = None,
                     progress=None) -> dict:
    """Add a device to the volume: the directory ``path`` of this machine (formatted
    for the volume here if it is not yet), or on a storage node's volume the device
    ``device`` served by the node at ``address`` (started with
    ``bmfs node serve --device ID=PATH``), which must answer. Its id is the next free
    one unless ``device`` is given; ids of removed devices are not reused. New
    stripes are placed over it with the others from then on; what is stored stays
    where it is."""
    from ..store.pmem import open_store
    from ..config import get_settings
    records = await device_records(volume.kv)
    if device is None:
        device = max(records, default=-1) + 1
    if device < 0 or device > 0xFFFE:
        raise Invalid(f"device id {device} out of range (0-65534)")
    if device in records:
        raise Invalid(f"device {device} exists already" if not records[device].get("removed")
                      else f"device {device} was removed; ids are not reused")
    if volume.on_nodes != (address is not None):
        raise Invalid("this volume's devices are on storage nodes: give the address "
                      "(HOST:PORT) of the node serving the new device" if volume.on_nodes else
                      "this volume's devices are directories of this machine: no node "
                      "address")
    if not path.startswith("pmem:") and not address:
        path = os.path.abspath(path)
    rec = {"path": path, "node": address or "local"}
    if domain:
        rec["domain"] = domain
    for dev, other in records.items():
        if not other.get("removed") and (other.get("node"), other.get("path")) == \
                (rec["node"], path):
            raise Invalid(f"{path} is device {dev} already")
    if address is None:
        layout = layout or _layout_of(volume, records) or get_settings().layout
        try:
            await trio.to_thread.run_sync(_prepare_local, volume.settings.uuid, records,
                                          path, device, layout)
            # a directory of another volume or device is refused here
            open_store(path, volume.settings.uuid, device)
        except (VolumeError, OSError) as e:
            raise Invalid(f"cannot use {path} as device {device}: {e}") from e
    else:
        await _check_node(volume, address, device)
        volume.transport.add_device(device, address)

    async def fn(txn):
        if await txn.get(keys.device(device)) is not None:
            raise Invalid(f"device {device} exists already")
        txn.put(keys.device(device), json.dumps(rec).encode())
    await volume.kv.transact(fn)
    await volume.refresh_devices()
    return {"device": device, "path": path, "node": rec["node"],
            "devices_in_service": len(volume.data.devices)}


async def _check_node(volume, address: str, device: int) -> None:
    """Invalid unless ``address`` is HOST:PORT and the node there serves ``device``
    (asked through a transport of its own: the volume's is left as it is)."""
    from ..transport.tcp import stat_device
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise Invalid(f"a node address is HOST:PORT, not {address!r}")
    try:
        info = await stat_device(address, device, volume.transport.secret,
                                 tls=volume.transport.tls)
    except (DeviceError, OSError, trio.TooSlowError) as e:
        raise Invalid(f"the node at {address} does not serve device {device} ({e}); "
                      f"start it with: bmfs node serve --device {device}=PATH ... (a new "
                      f"directory formatted first: --format, or bmfs node format)") from e
    if info.get("volume", volume.settings.uuid) != volume.settings.uuid:  # (older nodes
        # do not say: they check the directory against their own --volume-uuid only)
        raise Invalid(f"the node at {address} serves device {device} of another volume "
                      f"({info['volume']})")


async def set_address(volume, device: int, address: str, progress=None) -> dict:
    """Reach device ``device`` at the node at ``address`` from now on: its node came
    back on another address (a new IP, another port). The node there must serve the
    device (it checks the directory is this volume's device ``device``). Every mount
    takes the change up as drain's marks are (its watch, or its upkeep round)."""
    rec = (await device_records(volume.kv)).get(device)
    if rec is None:
        raise NotFound(f"no device {device}")
    if rec.get("removed"):
        raise Invalid(f"device {device} was removed")
    if not volume.on_nodes:
        raise Invalid("this volume's devices are directories of this machine: no node "
                      "address")
    old = rec["node"]
    await _check_node(volume, address, device)
    # (its failure domain, unless set, is its node's address: it moves with it)
    await set_device(volume, device, node=address)
    return {"device": device, "was": old, "node": address}


def _prepare_local(uuid: str, records: dict, path: str, device: int, layout: str) -> None:
    """Format ``path`` for the volume as device ``device`` unless it is formatted: a new
    or empty directory, a pmem pool file not made yet, or the directory of a device
    this volume removed (drained before it was: what is left in it is emptied first).
    A directory holding other files is refused; one of another volume or device is
    left for open_store to refuse."""
    marker = os.path.join(path, "DEVICE")
    if not path.startswith("pmem:") and os.path.exists(marker):
        try:
            with open(marker) as f:
                info = json.load(f)
        except (OSError, ValueError):
            return  # open_store says what is wrong with it
        old = records.get(info.get("device")) if info.get("volume") == uuid else None
        if not (old and old.get("removed")):
            return
        for name in os.listdir(path):
            p = os.path.join(path, name)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    format_if_new(path, uuid, device, layout)


def _layout_of(volume, records) -> str | None:
    """The layout (pool or files) of the volume's first local device directory."""
    for rec in records.values():
        p = rec.get("path", "")
        if rec.get("node", "local") == "local" and not p.startswith("pmem:") \
                and os.path.isdir(p):
            return layout_of(p)
    return None
