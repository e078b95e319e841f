"""Transports carry fragment operations from a client to the devices that store them.

Interface (all async): ``put(dev, name, parts)``, ``read(dev, name, ranges, check=None,
deadline=inf) -> list of bytes`` (``check(parts)`` verifies them where they were read,
and may raise; past ``deadline``, in trio time, a read that is still waiting raises
``TooSlow``), ``read_many(reads, deadline=inf)`` (several reads, ``reads`` a list of
(dev, name, ranges, check): each item's parts or the exception it failed with),
with ``into`` (read and read_many's ``into=``, for a caller reading into buffers of
its own): where given, a writable buffer the last range may be read into (the
part returned is then a view of it; a transport that does not is free to return
a buffer of its own instead, which the caller copies),
``delete(dev, name)``, ``sync(dev)``, ``aclose()``. A transport raises
``DeviceError`` (bmfs/errors.py) when a device cannot serve a request (missing,
down, I/O error); the data client treats that like a lost fragment. ``Transport``
declares the interface.

``run_in_thread`` is how the data path runs blocking or CPU-heavy work off the event
loop.
"""
from __future__ import annotations

import math
from typing import Protocol

import trio

from ..errors import DeviceError


class TooSlow(Exception):
    """A read's ``deadline`` (a hedged read's) passed before the device answered: not a
    failure of the device, which is not marked down."""


class Transport(Protocol):
    """What the data client needs of a transport (local.py, tcp.py). A transport may
    also sync several devices in one call (``sync_many(devs)``: LocalTransport, one
    syncfs per filesystem), which the data client uses where it is there."""
    # reads being started side by side (DataClient.side_by_side counts them): a
    # transport that would hold the event loop for one read (TcpTransport's small
    # reads in C) does not while it is above 0
    side_by_side: int

    async def put(self, dev: int, name: str, parts: list) -> None: ...
    async def read(self, dev: int, name: str, ranges, check=None,
                   deadline: float = math.inf, into=None) -> list: ...
    # batch: the caller's event loop may be held while the replies come (the direct
    # client's batches: TcpTransport pipelines them in C); into: per read, None or
    # the buffer its last range may be read into
    async def read_many(self, reads, deadline: float = math.inf,
                        batch: bool = False, into=None) -> list: ...
    async def delete(self, dev: int, name: str) -> None: ...
    async def sync(self, dev: int) -> None: ...
    async def names(self, dev: int) -> list[str]: ...
    def is_up(self, dev: int) -> bool: ...
    async def aclose(self) -> None: ...


async def run_in_thread(fn, *args, limiter: trio.CapacityLimiter | None = None):
    """``fn(*args)`` in one of trio's cached worker threads; its result or exception.

    Like ``trio.to_thread.run_sync`` (not cancellable while it runs), without the
    per-call naming of the OS thread (two prctl calls and string formatting per job,
    about 5% of the mount's CPU when it writes).
    """
    if limiter is not None:
        async with limiter:
            return await run_in_thread(fn, *args)
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def deliver(result) -> None:
        token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    await trio.lowlevel.checkpoint_if_cancelled()
    trio.lowlevel.start_thread_soon(lambda: fn(*args), deliver)
    return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)


async def read_side_by_side(transport, reads, deadline: float = math.inf,
                            into=None) -> list:
    """``transport.read_many`` as one task per read: for a transport whose reads cost
    the same side by side (local devices: worker threads, or inline)."""
    out: list = [None] * len(reads)

    async def one(i, dev, name, ranges, check):
        raised = []

        def checked(parts):  # what check raises is returned, anything else raised
            try:
                check(parts)
            except Exception as e:
                raised.append(e)
                raise

        try:
            out[i] = await transport.read(dev, name, ranges,
                                          checked if check is not None else None, deadline,
                                          into[i] if into else None)
        except (DeviceError, TooSlow) as e:
            out[i] = e
        except Exception as e:
            if e not in raised:
                raise
            out[i] = e

    async with trio.open_nursery() as nursery:
        for i, read in enumerate(reads):
            nursery.start_soon(one, i, *read)
    return out
