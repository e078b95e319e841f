"""Staying awake for the next request while requests come back to back.

A program that issues one request after another (a reader doing random 4 KiB preads,
`ls -l` of a directory) sends the next one a few tens of microseconds after it got
its answer. By then the mount's thread has gone to sleep in the event loop, and on
a virtual machine whose idle CPUs halt (this one's guest halt polling is off),
waking it costs far more than the gap: each request pays a wake-up before any work
starts. So after answering, while no request is under way and the previous request
came within ``window`` of the answer before it, the mount keeps its event loop
turning (epoll without sleeping) for up to ``window``: the next request is picked
up at once. A lone request's wait for a node's reply is the same idea
(Connection._spin_loop, BMFS_SPIN_US); this is the wait between requests.

The cost is CPU: at most ``window`` of spinning after each answer, and only while
requests keep coming faster than that (a program that pauses longer turns it off
by its first pause). It is off unless BMFS_IDLE_SPIN_US is set in the mount's
environment (microseconds; 300 is a good start; config.Settings.idle_spin): on this 2-core VM it made one
program's back-to-back small reads 5-15% faster, but the CPU it burns is taken from
the program itself, the storage nodes and the mount's own threads, and in the
benchmark's runs other workloads (creates, unlinks, 4 concurrent readers) came
out 5-9% slower with it (rmdirs up to 18% in a single run) (docs/benchmarks.md).
"""
from __future__ import annotations

import math

import trio


class IdleSpin:
    """Keeps the event loop from sleeping between back-to-back requests.

    Request handlers call ``begin()`` and ``end()`` (ops.translate); ``run()`` is a task
    of the mount's nursery. While requests are under way it does nothing: their own
    waits sleep or spin as they choose."""

    def __init__(self, window: float):
        self.window = window
        self.active = 0            # requests under way
        self.last = -math.inf      # trio time the last request ended
        self.hot = False           # the last request came within window of an answer
        self._wake: trio.Event | None = None  # what run() sleeps on while not spinning
        self.spinning = False
        self.stats = {"spins": 0, "caught": 0}  # spins, and those a request ended

    def begin(self) -> None:
        if self.active == 0:
            self.hot = trio.current_time() - self.last < self.window
        self.active += 1

    def end(self) -> None:
        self.active -= 1
        self.last = trio.current_time()
        if self.active == 0 and self.hot and self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        if self.window <= 0:
            return
        while True:
            self._wake = trio.Event()
            await self._wake.wait()
            self._wake = None
            self.stats["spins"] += 1
            self.spinning = True
            # each checkpoint lets the loop run a round, epoll included, without sleeping
            while self.active == 0 and trio.current_time() - self.last < self.window:
                await trio.lowlevel.checkpoint()
            self.spinning = False
            if self.active:
                self.stats["caught"] += 1


def watch_handlers(ops, idle: IdleSpin) -> None:
    """Make every coroutine handler of ``ops`` (a pyfuse3.Operations) tell ``idle`` when
    it starts and ends, as bmfs's own do (ops.translate): for the benchmark's
    reference daemons (tools/memfs.py), so that they and bmfs spin alike."""
    import functools
    import inspect

    def watched(fn):
        @functools.wraps(fn)
        async def handler(*args, **kw):
            idle.begin()
            try:
                return await fn(*args, **kw)
            finally:
                idle.end()
        return handler

    for name in dir(ops):
        fn = getattr(ops, name)
        if not name.startswith("_") and inspect.iscoroutinefunction(fn):
            setattr(ops, name, watched(fn))
