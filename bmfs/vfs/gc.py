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
