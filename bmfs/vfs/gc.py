"""Garbage collection of stripes no tree references any more.

The transaction that drops a stripe's last reference moves its record to
``g/<stripe>``; this deletes the fragments from the devices and then the queue
entry, so a crash in between only means the deletion is done again.
"""
from __future__ import annotations

from ..meta import keys
from ..meta.records import Stripe


async def collect(volume, limit: int = 1000) -> int:
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
    """Delete fragment files no stripe owns (left by writes a crash interrupted).

    Only safe when nobody else can be writing: the single-owner engines (sqlite,
    memory) while this process holds the volume. A fragment is written before the
    transaction that records its stripe, so a crash in between leaves it unowned.
    """
    from ..data import fragment as fr
    from ..transport import DeviceError
    owned: dict[int, set[str]] = {}
    for prefix in (b"t/", b"g/"):
        for k, v in await volume.kv.range(prefix, prefix[:1] + b"0"):
            st = Stripe.unpack(v)
            for i, dev in enumerate(st.devices):
                owned.setdefault(dev, set()).add(fr.fragment_name(int(k[2:], 16), i))
    deleted = 0
    for dev in sorted(volume.device_paths):
        try:
            names = await volume.transport.names(dev)
        except DeviceError:
            continue
        for name in names:
            if name not in owned.get(dev, ()):
                await volume.transport.delete(dev, name)
                deleted += 1
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
