"""Local transport: devices in this process, each call run in a worker thread.

Fragment I/O is blocking file I/O, so it runs off the event loop; the limiter keeps
the number of threads bounded. Buffers are handed over without copies.

Small reads are the exception (see ``read``): a worker thread costs two wake-ups
and the GIL passed back and forth, more than reading a few KiB
from an NVMe device, so a small read is done on the event loop itself, as s3ql reads
its cache files; concurrent small reads too, one after the other (4 random readers:
+10-48% against sending them to threads while others waited).

Two kinds of device are read otherwise:
- a *slow* one, whose inline reads average more than ``SLOW_INLINE`` (a disk slower
  than a thread hop): reads one after the other would keep its queue at depth one,
  so while other requests wait (queued on the FUSE device, or reads in threads)
  its reads go to threads; a lone request is still read inline, the thread hop
  being a large share of such a read (cold random reads measured faster inline on
  a slow disk);
- a *stalled* one, of which one read took over ``STALL``: read from threads for a
  while, twice as long each time it stalls again. The risk taken: while one inline
  read waits for a device, the whole mount waits; a device that stalls is found out
  by its first stall and then read from threads for longer and longer.
"""
from __future__ import annotations

import functools
import math
import os
import select
import time

import trio

from ..config import get_settings
from ..errors import DeviceError
from ..native import NATIVE
from . import read_side_by_side, run_in_thread

INLINE_MAX = 64 << 10   # reads up to this size may be done on the event loop
SLOW_INLINE = 0.00015   # a device whose inline reads average more than this is slow
STALL = 0.02            # a device one of whose reads took longer than this ...
SLOW_FOR = 10.0         # ... is read from threads for this long, doubled each time it
SLOW_FOR_MAX = 3600.0   # happens again (a disk that keeps stalling), up to this
# reads of one read_many that go to worker threads at once (a direct client's batch):
# more than a stripe's k+m, so a degraded read's k reads keep the inline path
BATCH_THREADED = 17
# a direct client's batch (read_many(batch=True)): its small reads of fragment files
# are done in C (native pread_batch) by up to this many threads at once, without the
# GIL; a read of more than BATCH_NATIVE_MAX bytes goes to the worker threads
BATCH_NATIVE_THREADS = 16
BATCH_NATIVE_MAX = 64 << 10


class LocalTransport:
    def __init__(self, stores: dict, threads: int = 12):
        self.stores = stores  # dev id -> store (or an exception saying why it is absent)
        for dev, store in stores.items():
            self.add_device(dev, store)  # large reads land in the mount's page cache
        self._limiter = trio.CapacityLimiter(threads)
        self._threads = threads
        self._stalled: dict[int, float] = {}  # dev -> time until which reads use threads
        self._stalls: dict[int, int] = {}     # dev -> times it stalled
        self._latency: dict[int, float] = {}  # dev -> smoothed inline read time
        self._threaded = 0                    # reads under way in worker threads
        self._waiting = None                  # poll() of the FUSE device, if watched
        self.stats = {"inline_reads": 0, "thread_reads": 0, "batch_reads": 0}
        self.inline_reads = get_settings().inline_reads  # False: every read in a thread
        self.side_by_side = 0  # (Transport: local reads never hold the event loop long)

    def add_device(self, dev: int, store) -> None:
        """Serve device ``dev`` from ``store`` (or an exception saying why it is absent)."""
        if hasattr(store, "drop_behind"):
            store.drop_behind = True
        self.stores[dev] = store

    def forget_device(self, dev: int) -> None:
        """Serve ``dev`` no more (removed from the volume)."""
        self.stores.pop(dev, None)

    def watch_requests(self, fd: int) -> None:
        """``fd`` is the FUSE device: requests queued on it are others waiting, which
        a slow device's reads should not keep waiting (see the module docstring)."""
        self._waiting = select.poll()
        self._waiting.register(fd, select.POLLIN)

    async def _call(self, dev, method, *args):
        """``store.method(*args)`` in a worker thread; ``method`` is a name, or a
        callable taking the arguments."""
        store = self.stores.get(dev)
        if store is None or isinstance(store, Exception):
            raise DeviceError(dev, str(store) if store else "unknown device")
        fn = getattr(store, method) if isinstance(method, str) else method
        try:
            return await run_in_thread(fn, *args, limiter=self._limiter)
        except OSError as e:
            raise DeviceError(dev, f"{getattr(method, '__name__', method)} failed: {e}",
                              e.errno) from e

    def _inline(self, dev, ranges) -> bool:
        if not self.inline_reads or sum(n for _, n in ranges) > INLINE_MAX:
            return False
        if self._stalled and self._stalled.get(dev, 0.0) > time.monotonic():
            return False
        if self._latency.get(dev, 0.0) <= SLOW_INLINE:
            return True
        # a slow device: inline only for a lone request
        return not self._threaded and (self._waiting is None or not self._waiting.poll(0))

    async def put(self, dev: int, name: str, parts) -> None:
        await self._call(dev, "write", name, parts)

    async def read(self, dev: int, name: str, ranges, check=None,
                   deadline: float = math.inf, into=None) -> list:
        """The byte ranges of a fragment; ``check(parts)``, if given, is run on them
        where they were read (in the worker thread: a large read's checksums are
        computed beside the event loop, not on it) and may raise. ``deadline`` is
        not used: local devices are not hedged (expected_latency is 0). ``into``: the
        buffer the last range is read into (store.read_parts)."""
        store = self.stores.get(dev)
        if store is None or isinstance(store, Exception) or not self._inline(dev, ranges):
            self.stats["thread_reads"] += 1
            self._threaded += 1
            try:
                return await self._call(dev, _ReadChecked(store, check, into), name, ranges)
            finally:
                self._threaded -= 1
        self.stats["inline_reads"] += 1
        t0 = time.monotonic()
        try:
            out = store.read_parts(name, ranges, into)
        except OSError as e:
            raise DeviceError(dev, f"read_parts failed: {e}") from e
        finally:
            took = time.monotonic() - t0
            if took > STALL:
                n = self._stalls[dev] = self._stalls.get(dev, 0) + 1
                self._stalled[dev] = t0 + took + min(SLOW_FOR * 2 ** (n - 1), SLOW_FOR_MAX)
            else:
                self._latency[dev] = 0.9 * self._latency.get(dev, 0.0) + 0.1 * took
        if check is not None:
            check(out)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return out

    async def read_many(self, reads, deadline: float = math.inf,
                        batch: bool = False, into=None) -> list:
        """Several reads side by side. A batch (a direct client's read_many: at least
        BATCH_THREADED reads) is cut into one job per worker thread, each job reading
        its share one after another: as many reads in flight as threads, without a
        hand-off to a thread per read (which would cost the event loop more than a
        small read does). Read inline instead, each read missing the page cache would
        wait for the disk alone."""
        if len(reads) < BATCH_THREADED:
            return await read_side_by_side(self, reads, deadline, into)
        out: list = [None] * len(reads)
        rest = range(len(reads))
        if batch and NATIVE is not None:
            rest = self._read_native(reads, into, out)
        jobs = min(self._threads, len(rest))

        def job(first: int) -> None:
            for i in rest[first::jobs]:
                dev, name, ranges, check = reads[i]
                store = self.stores.get(dev)
                try:
                    if store is None or isinstance(store, Exception):
                        raise DeviceError(dev, str(store) if store else "unknown device")
                    parts = store.read_parts(name, ranges, into[i] if into else None)
                    if check is not None:
                        check(parts)
                    out[i] = parts
                except OSError as e:
                    out[i] = DeviceError(dev, f"read_parts failed: {e}", e.errno)
                except Exception as e:  # noqa: BLE001 - DeviceError, or what check raised
                    out[i] = e
        self.stats["thread_reads"] += len(rest)
        async with trio.open_nursery() as nursery:
            for first in range(jobs):
                nursery.start_soon(functools.partial(run_in_thread, job, first,
                                                     limiter=self._limiter))
        return out

    def _read_native(self, reads, into, out: list) -> list[int]:
        """read_many's small reads of fragment files, done in C on this thread (the
        event loop is held meanwhile: batch=True says the caller allows it) and
        checked here, into ``out``; the indexes of the reads it left."""
        mine, jobs, rest = [], [], []
        for i, (dev, name, ranges, _) in enumerate(reads):
            store = self.stores.get(dev)
            path_of = getattr(store, "path_of", None)
            if path_of is None or sum(n for _, n in ranges) > BATCH_NATIVE_MAX:
                rest.append(i)
                continue
            mine.append(i)
            jobs.append((os.fsencode(path_of(name)), ranges, into[i] if into else None))
        if not jobs:
            return rest
        got = NATIVE.pread_batch(jobs, BATCH_NATIVE_THREADS)
        self.stats["batch_reads"] += len(jobs)
        for i, parts in zip(mine, got):
            dev, _, _, check = reads[i]
            if isinstance(parts, OSError):
                out[i] = DeviceError(dev, f"read_parts failed: {parts}", parts.errno)
                continue
            try:
                if check is not None:
                    check(parts)
                out[i] = parts
            except Exception as e:  # noqa: BLE001 - what check raised, as the jobs do
                out[i] = e
        return rest

    async def delete(self, dev: int, name: str) -> None:
        await self._call(dev, "delete", name)

    async def sync(self, dev: int) -> None:
        await self._call(dev, "sync")

    async def sync_many(self, devs) -> None:
        """Sync several devices; devices sharing one filesystem (the single-machine
        default) are synced together with one syncfs when many files are pending."""
        groups: dict[object, list] = {}
        for dev in devs:
            store = self.stores.get(dev)
            if store is None or isinstance(store, Exception) or not hasattr(store, "fsid"):
                if store is not None and not isinstance(store, Exception):
                    await self._call(dev, "sync")
                continue
            try:
                groups.setdefault(store.fsid(), []).append(store)
            except OSError as e:
                raise DeviceError(dev, f"sync failed: {e}") from e
        for stores in groups.values():
            many = sum(s.pending() for s in stores) >= 32
            if many:  # one syncfs covers every device of this filesystem
                await self._call(stores[0].dev, "sync", True, stores[1:])
            else:
                for st in stores:
                    await self._call(st.dev, "sync")

    async def names(self, dev: int) -> list[str]:
        return await self._call(dev, "names_list")

    async def stat(self, dev: int) -> dict:
        return await self._call(dev, "usage")

    def is_up(self, dev: int) -> bool:
        store = self.stores.get(dev)
        return store is not None and not isinstance(store, Exception)

    def expected_latency(self, dev: int) -> float:
        return 0.0  # local devices: no hedging

    async def aclose(self) -> None:
        pass


class _ReadChecked:
    """``store.read_parts`` followed by ``check`` (if any) on what it read, in one
    thread job."""
    __name__ = "read_parts"
    __slots__ = ("store", "check", "into")

    def __init__(self, store, check, into=None):
        self.store, self.check, self.into = store, check, into

    def __call__(self, name, ranges):
        parts = self.store.read_parts(name, ranges, self.into)
        if self.check is not None:
            self.check(parts)
        return parts
