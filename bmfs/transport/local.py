"""Local transport: devices in this process, each call run in a worker thread.

Fragment I/O is blocking file I/O, so it runs off the event loop; the limiter keeps
the number of threads bounded. Buffers are handed over without copies.
"""
from __future__ import annotations

import trio

from . import DeviceError, run_in_thread


class LocalTransport:
    def __init__(self, stores: dict, threads: int = 12):
        self.stores = stores  # dev id -> store (or an exception saying why it is absent)
        self._limiter = trio.CapacityLimiter(threads)

    async def _call(self, dev, method, *args):
        store = self.stores.get(dev)
        if store is None or isinstance(store, Exception):
            raise DeviceError(dev, str(store) if store else "unknown device")
        try:
            return await run_in_thread(getattr(store, method), *args, limiter=self._limiter)
        except OSError as e:
            raise DeviceError(dev, f"{method} failed: {e}") from e

    async def put(self, dev: int, name: str, parts) -> None:
        await self._call(dev, "write", name, parts)

    async def read(self, dev: int, name: str, ranges) -> list[bytes]:
        return await self._call(dev, "read_parts", name, ranges)

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
                for other in stores[1:]:
                    other.take_pending()  # taken before the syncfs starts: covered by it
                await self._call(stores[0].dev, "sync", True)
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
