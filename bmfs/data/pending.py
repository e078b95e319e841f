"""Stripes pending: fragments on devices that no committed record names yet."""
from __future__ import annotations

import contextlib

import trio


class Pending:
    """The stripes whose fragments are on devices while no committed record names them
    yet: being written (vfs/writes.py), rebuilt or moved (volume/repair.py). The leak
    sweep passes their fragments by (gc.sweep_leaked, ``now``), and a mount that took
    up a device change waits until those placed before it are committed or dropped
    (session.confirm_devices, ``settled``). Whoever opens the window holds it:
    ``with data.pending(sid): ...``; a stripe held twice (a rebuild of one being
    written) stays pending until both let go."""

    def __init__(self):
        self._held: dict[int, int] = {}  # sid -> holders
        self._released = trio.lowlevel.ParkingLot()

    @contextlib.contextmanager
    def __call__(self, sid: int):
        self._held[sid] = self._held.get(sid, 0) + 1
        try:
            yield
        finally:
            left = self._held.pop(sid) - 1
            if left:
                self._held[sid] = left
            self._released.unpark_all()

    def now(self) -> frozenset[int]:
        """The stripes pending at this moment."""
        return frozenset(self._held)

    async def settled(self, sids) -> None:
        """Wait until none of ``sids`` is pending."""
        while any(sid in self._held for sid in sids):
            await self._released.park()
