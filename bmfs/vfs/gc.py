"""Garbage collection of stripes no tree references any more.

The transaction that drops a stripe's last reference moves its record to
``g/<stripe>``; this deletes the fragments from the devices and then the queue
entry, so a crash in between only means the deletion is done again.
"""
from __future__ import annotations

from ..meta import keys
from ..format.records import Stripe


BATCH = 1000  # stripes a collect() call deletes by default


async def collect(volume, limit: int = BATCH) -> int:
    """Delete the fragments of up to ``limit`` queued stripes; returns how many."""
    rows = await volume.kv.range(*keys.span(keys.GARBAGE_PREFIX), limit)
    for k, raw in rows:
        sid = keys.stripe_of(k)
        await volume.data.delete_stripe(sid, Stripe.unpack(raw))
        txn = volume.kv.begin()
        txn.delete(k)
        for dk, _ in await volume.kv.range(*keys.span(keys.damage_prefix(sid))):
            txn.delete(dk)
        await volume.kv.commit(txn)
    return len(rows)


__all__ = ["collect", "keys"]


async def sweep_leaked(volume) -> int:
    """Delete fragment files no stripe owns: left by writes a crash interrupted, or by a
    PUT a node stored but could not acknowledge before it died (the client then stored
    that fragment elsewhere).

    Only for the single-owner engines (sqlite, memory), whose only writer is this
    process: it may run while mounted because stripes this process is writing are
    skipped. Order matters: list the devices first, then note the stripes in flight,
    then read which stripes the metadata owns; a stripe is dropped from "in flight"
    only after its record is committed, so nothing being written is taken for a leak.
    """
    from ..format import fragment as fr
    from ..errors import DeviceError
    listed: dict[int, list[str]] = {}
    for dev in sorted(volume.device_paths):
        if dev in volume.removed:  # forgotten: its directory may be another device now
            continue
        try:
            listed[dev] = await volume.transport.names(dev)
        except DeviceError:
            continue
    in_flight = volume.data.pending.now()
    owned: dict[int, set[str]] = {}
    for prefix in (keys.STRIPE_PREFIX, keys.GARBAGE_PREFIX):
        for k, v in await volume.kv.range(*keys.span(prefix)):
            st = Stripe.unpack(v)
            for i, dev in enumerate(st.devices):
                owned.setdefault(dev, set()).add(fr.fragment_name(keys.stripe_of(k), i))
    deleted = 0
    for dev, names in listed.items():
        for name in names:
            if name not in owned.get(dev, ()) and int(name.split(".")[0], 16) not in in_flight:
                try:
                    await volume.transport.delete(dev, name)
                    deleted += 1
                except DeviceError:
                    pass
    return deleted


async def begin_session(volume) -> int:
    """Note that the volume is mounted; if the last mount crashed, sweep first."""
    if not volume.kv.caps.single_writer:
        return 0
    swept = 0
    if await volume.kv.get(keys.MOUNTED) is not None:
        swept = await sweep_leaked(volume)
    txn = volume.kv.begin()
    txn.put(keys.MOUNTED, b"1")
    await volume.kv.commit(txn)
    return swept


async def end_session(volume) -> None:
    if volume.kv.caps.single_writer:
        txn = volume.kv.begin()
        txn.delete(keys.MOUNTED)
        await volume.kv.commit(txn)
