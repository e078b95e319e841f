"""Local transport: devices in this process, each call run in a worker thread.

Fragment I/O is blocking file I/O, so it runs off the event loop; the limiter keeps
the number of threads bounded. Buffers are handed over without copies.
"""
from __future__ import annotations

import trio

from . import DeviceError


class LocalTransport:
    def __init__(self, stores: dict, threads: int = 12):
        self.stores = stores  # dev id -> store (or an exception saying why it is absent)
        self._limiter = trio.CapacityLimiter(threads)

    async def _call(self, dev, method, *args):
        store = self.stores.get(dev)
        if store is None or isinstance(store, Exception):
            raise DeviceError(dev, str(store) if store else "unknown device")
        try:
            return await trio.to_thread.run_sync(getattr(store, method), *args,
                                                 limiter=self._limiter)
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
