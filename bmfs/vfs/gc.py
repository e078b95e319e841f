"""Garbage collection of stripes no tree references any more.

The transaction that drops a stripe's last reference moves its record to
``g/<stripe>``; this deletes the fragments from the devices and then the queue
entry, so a crash in between only means the deletion is done again.
"""
from __future__ import annotations

from ..meta import keys
from ..meta.records import Stripe


BATCH = 1000  # stripes a collect() call deletes by default


async def collect(volume, limit: int = BATCH) -> int:
    """Delete the fragments of up to ``limit`` queued stripes; returns how many."""
    rows = await volume.kv.range(b"g/", b"g0", limit)
    for k, raw in rows:
        sid = int(k[2:], 16)
        await volume.data.delete_stripe(sid, Stripe.unpack(raw))
        txn = volume.kv.begin()
        txn.delete(k)
        for dk, _ in await volume.kv.range(b"h/%016x/" % sid, b"h/%016x0" % sid):
            txn.delete(dk)
        await volume.kv.commit(txn)
    return len(rows)


__all__ = ["collect", "keys"]


MOUNTED = b"v/mounted"  # present while a single-owner volume is mounted


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
    from ..transport import DeviceError
    listed: dict[int, list[str]] = {}
    for dev in sorted(volume.device_paths):
        if dev in volume.removed:  # forgotten: its directory may be another device now
            continue
        try:
            listed[dev] = await volume.transport.names(dev)
        except DeviceError:
            continue
    in_flight = set(volume.data.uncommitted)
    owned: dict[int, set[str]] = {}
    for prefix in (b"t/", b"g/"):
        for k, v in await volume.kv.range(prefix, prefix[:1] + b"0"):
            st = Stripe.unpack(v)
            for i, dev in enumerate(st.devices):
                owned.setdefault(dev, set()).add(fr.fragment_name(int(k[2:], 16), i))
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
    if not volume.kv.single_writer:
        return 0
    swept = 0
    if await volume.kv.get(MOUNTED) is not None:
        swept = await sweep_leaked(volume)
    txn = volume.kv.begin()
    txn.put(MOUNTED, b"1")
    await volume.kv.commit(txn)
    return swept


async def end_session(volume) -> None:
    if volume.kv.single_writer:
        txn = volume.kv.begin()
        txn.delete(MOUNTED)
        await volume.kv.commit(txn)
