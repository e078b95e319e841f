"""Repair, scrub and drain: keep every stripe at full redundancy on distinct devices.

- ``repair`` rebuilds fragments that are missing, corrupt (queued as ``h/`` keys by
  reads, writes and scrub), doubled up on one device (written while nodes were down),
  or on a device being drained: the stripe is read (decoding from any k intact
  fragments), re-encoded, and each bad fragment is written to a live device that holds
  no other fragment of the stripe; then the stripe record is updated in a transaction
  that re-reads it, so concurrent reference changes are kept.
- One repair runs at a time per volume (background repair, ``bmfs repair``, scrub and
  drain of one mount share a lock): two runs would rebuild the same fragment twice
  and one's stale device list could overwrite the other's, pointing a fragment at a
  copy the other had deleted. A run that waited starts from the records as they are
  then. Across mounts (etcd) the commit only moves a fragment whose record still
  names the device it replaced; otherwise its new copy is deleted.
- ``scrub`` reads every fragment in full, checks every block checksum, queues the bad
  ones and repairs them.
- ``drain`` marks a device as draining (no new fragments), repairs everything off it,
  and with ``remove`` forgets it; ``undrain`` puts a drained device back in service;
  ``add_device`` adds a device to the volume (new stripes use it from then on).
"""
from __future__ import annotations

import json
import logging
import os
import weakref

import trio

from ..data import fragment as fr
from ..data.codec import codec
from ..errors import Invalid, IOFailure, NoSpace, NotFound, VolumeError
from ..meta import keys
from ..meta.records import EC, NO_DEVICE, Stripe
from ..transport import DeviceError

log = logging.getLogger(__name__)
_locks: "weakref.WeakKeyDictionary[object, trio.Lock]" = weakref.WeakKeyDictionary()


def _lock(volume) -> trio.Lock:
    lock = _locks.get(volume)
    if lock is None:
        lock = _locks[volume] = trio.Lock()
    return lock


async def _queued(volume) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for k, _ in await volume.kv.range(b"h/", b"h0"):
        out.setdefault(int(k[2:18], 16), set()).add(int(k[19:], 16))
    return out


async def _stripes(volume):
    for k, v in await volume.kv.range(b"t/", b"t0"):
        st = Stripe.unpack(v)
        if st.kind == EC:
            yield int(k[2:], 16), st


def _bad(volume, st: Stripe, queued: set[int], avoid: set[int]) -> list[int]:
    out = set(queued) | set(volume.data.needs_repair(st))
    for i, d in enumerate(st.devices):
        if d in avoid or not volume.transport.is_up(d):
            out.add(i)
    return sorted(out)


async def repair_stripe(volume, sid: int, st: Stripe, bad: list[int], avoid: set[int]) -> int:
    """Rebuild fragments ``bad`` of one stripe; returns how many were moved."""
    volume.data.uncommitted.add(sid)  # new fragments not in the record yet: not leaks
    try:
        return await _repair_stripe(volume, sid, st, bad, avoid)
    finally:
        volume.data.uncommitted.discard(sid)


def _targets(volume, sid: int, st: Stripe, bad: list[int], avoid: set[int]) -> dict[int, int]:
    """Index -> the live device each bad fragment goes to (one with no other fragment of
    the stripe, in a new failure domain if possible); indexes with no spare are left out."""
    devices, out = list(st.devices), {}
    for i in bad:
        holding = {d for j, d in enumerate(devices) if j != i}
        candidates = [d for d in volume.data.devices
                      if d not in avoid and d not in holding and volume.transport.is_up(d)]
        if not candidates:
            log.debug("stripe %d fragment %d: no spare device; stays degraded", sid, i)
            continue
        doms = volume.data.domains
        used = {doms.get(d, d) for d in holding}
        fresh = [d for d in candidates if doms.get(d, d) not in used]  # a new failure domain
        pool = fresh or candidates
        out[i] = devices[i] = pool[(sid + i) % len(pool)]
    return out


async def _repair_stripe(volume, sid: int, st: Stripe, bad: list[int], avoid: set[int]) -> int:
    targets = _targets(volume, sid, st, bad, avoid)
    if not targets:  # nowhere to put them (nodes down): no read, they stay queued
        return 0
    data = await volume.data.read(sid, st, 0, st.length)
    frags = await trio.to_thread.run_sync(codec(st.k, st.m).encode, data)
    if len(frags[0]) != st.frag_len:
        raise IOFailure(f"stripe {sid}: re-encoding gave another fragment size")
    devices = list(st.devices)
    moved: dict[int, int] = {}  # index -> the device it was moved from
    for i, target in targets.items():
        head = fr.build_header(sid, i, st.k, st.m, frags[i], st.frag_version)
        try:
            await volume.transport.put(target, fr.fragment_name(sid, i), [head, frags[i]])
        except DeviceError as e:
            log.warning("stripe %d fragment %d: %s", sid, i, e)
            continue
        moved[i], devices[i] = devices[i], target

    applied: list[int] = []
    final: list[int] = []  # the device list as committed

    async def fn(txn):
        applied.clear()
        raw = await txn.get(keys.stripe(sid))
        if raw is None:
            return  # freed meanwhile: fsck --repair sweeps the rebuilt fragments
        cur = Stripe.unpack(raw)
        for i, old in moved.items():
            if cur.devices[i] == old:  # nobody else moved it meanwhile
                cur.devices[i] = devices[i]
                applied.append(i)
        final[:] = cur.devices
        txn.put(keys.stripe(sid), cur.pack())
        for i in applied:
            txn.delete(keys.damage(sid, i))
    await volume.kv.transact(fn)
    for i, old in moved.items():
        # names are per index, so other fragments stay. The replaced copy goes; so does
        # our new one if another repair moved the fragment elsewhere first.
        gone = old if i in applied else devices[i]
        if final and gone not in (NO_DEVICE, final[i]):
            try:
                await volume.transport.delete(gone, fr.fragment_name(sid, i))
            except DeviceError:
                pass  # gone with its device; fsck --repair sweeps leftovers
    return len(applied)


async def repair(volume, avoid: set[int] | None = None, progress=None) -> dict:
    async with _lock(volume):
        return await _repair(volume, avoid or set(), progress)


async def _repair(volume, avoid: set[int], progress) -> dict:
    await volume.record_damage()  # damage seen by reads so far joins the queue first
    queued = await _queued(volume)
    todo = []
    async for sid, st in _stripes(volume):
        bad = _bad(volume, st, queued.pop(sid, set()), avoid)
        if bad:
            todo.append((sid, st, bad))
    # queue entries of stripes that no longer exist
    if queued:
        txn = volume.kv.begin()
        for sid, idxs in queued.items():
            for i in idxs:
                txn.delete(keys.damage(sid, i))
        await volume.kv.commit(txn)
    moved = failed = 0
    for n, (sid, st, bad) in enumerate(todo, 1):
        try:
            raw = await volume.kv.get(keys.stripe(sid))
            if raw is not None:  # else freed meanwhile
                moved += await repair_stripe(volume, sid, Stripe.unpack(raw), bad, avoid)
        except (IOFailure, DeviceError) as e:
            failed += 1
            log.warning("repair of stripe %d failed: %s", sid, e)
        if progress:
            progress(n, len(todo))
    swept = 0
    if volume.kv.single_writer:
        # copies a node stored but could not acknowledge before dying (the client put
        # them elsewhere), and what repair moved away from devices that were down
        from .gc import sweep_leaked
        swept = await sweep_leaked(volume)
    return {"stripes": len(todo), "fragments_rebuilt": moved, "stripes_failed": failed,
            "stale_fragments_deleted": swept}


async def scrub(volume, progress=None) -> dict:
    bad = 0
    stripes = [x async for x in _stripes(volume)]
    for n, (sid, st) in enumerate(stripes, 1):
        for i, dev in enumerate(st.devices):
            if dev == NO_DEVICE:
                continue
            try:
                await volume.data._read_fragment(sid, st, i)
            except (DeviceError, fr.CorruptFragment):
                bad += 1  # _read_fragment queued it through on_damage
        if progress:
            progress(n, len(stripes))
    await volume.record_damage()
    result = await repair(volume)
    return {"fragments_checked": sum(len(st.devices) for _, st in stripes),
            "bad_fragments": bad, **result}


async def drain(volume, device: int, remove: bool = False, progress=None) -> dict:
    raw = await volume.kv.get(keys.device(device))
    if raw is None:
        raise NotFound(f"no device {device}")
    rec = json.loads(raw)
    k, m = volume.data.k, volume.data.m
    others = [d for d in volume.data.devices if d != device]
    if len(others) < k + m:
        # its fragments could go nowhere, and new stripes would be written a fragment
        # short for as long as it stays drained: refused, nothing changed
        raise NoSpace(f"cannot drain device {device}: {k}+{m} stripes need {k + m} "
                      f"devices, and {len(others)} would be left; add a device first")
    await set_device(volume, device, draining=True)
    result = await repair(volume, avoid={device}, progress=progress)
    left = sum(st.devices.count(device) for _, st in [x async for x in _stripes(volume)])
    if remove and left == 0:
        await set_device(volume, device, removed=True)
    return {**result, "fragments_left_on_device": left, "removed": bool(remove and left == 0)}


async def set_device(volume, device: int, **changes) -> dict:
    """Change device ``device``'s record (``draining``/``removed``: True sets, False
    clears) in a transaction, and take the records up (Volume._take_up): new stripes
    go to the devices in service from the next write on. The record, changed."""
    from .volume import device_records

    async def fn(txn):
        raw = await txn.get(keys.device(device))
        if raw is None:
            raise NotFound(f"no device {device}")
        rec = json.loads(raw)
        for key, on in changes.items():
            if on:
                rec[key] = True
            else:
                rec.pop(key, None)
        txn.put(keys.device(device), json.dumps(rec).encode())
        return rec
    rec = await volume.kv.transact(fn)
    volume._take_up(await device_records(volume.kv))
    return rec


async def undrain(volume, device: int, progress=None) -> dict:
    """Put a drained (or draining) device back in service: new stripes may go to it
    again. Its fragments stay where the drain moved them (as with Ceph's ``osd in``,
    nothing moves back by itself). A removed device was forgotten: add it again."""
    from .volume import device_records
    rec = (await device_records(volume.kv)).get(device)
    if rec is None:
        raise NotFound(f"no device {device}")
    if rec.get("removed"):
        raise Invalid(f"device {device} was removed; add its directory again as a new "
                      f"device (bmfs node add)")
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
    from ..store.pmem import format_store, open_store
    from .volume import DEFAULT_LAYOUT, device_records
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
        try:
            if not path.startswith("pmem:") and \
                    not os.path.exists(os.path.join(path, "DEVICE")):
                layout = layout or _layout_of(volume, records) or DEFAULT_LAYOUT
                await trio.to_thread.run_sync(format_store, path, volume.settings.uuid,
                                              device, layout)
            # a directory of another volume or device is refused here
            open_store(path, volume.settings.uuid, device)
        except (VolumeError, OSError) as e:
            raise Invalid(f"cannot use {path} as device {device}: {e}") from e
    else:
        if ":" not in address or not address.rpartition(":")[2].isdigit():
            raise Invalid(f"a node address is HOST:PORT, not {address!r}")
        volume.transport.add_device(device, address)
        try:
            with trio.fail_after(5):
                await volume.transport.stat(device)
        except (DeviceError, OSError, trio.TooSlowError) as e:
            volume.transport.device_node.pop(device, None)
            raise Invalid(f"the node at {address} does not serve device {device} ({e}); "
                          f"start it with: bmfs node serve --device {device}=PATH ...")

    async def fn(txn):
        if await txn.get(keys.device(device)) is not None:
            raise Invalid(f"device {device} exists already")
        txn.put(keys.device(device), json.dumps(rec).encode())
    await volume.kv.transact(fn)
    volume._take_up(await device_records(volume.kv))
    return {"device": device, "path": path, "node": rec["node"],
            "devices_in_service": len(volume.data.devices)}


def _layout_of(volume, records) -> str | None:
    """The layout (pool or files) of the volume's first local device directory."""
    from ..store.pool import is_pool
    for rec in records.values():
        p = rec.get("path", "")
        if rec.get("node", "local") == "local" and not p.startswith("pmem:") \
                and os.path.isdir(p):
            return "pool" if is_pool(p) else "files"
    return None
