"""In-memory engine: the reference implementation and the fake for unit tests.

``memory:`` is a fresh, empty store each time it is opened. ``memory:NAME`` names a
store kept for the life of the process, so a volume made on it (tests: mkfs, then
open) can be opened again; like a SQLite database it has one owner at a time
(opening it while open raises VolumeError), which keeps ``caps.single_writer`` true.
"""
from __future__ import annotations

import bisect

from ..errors import Conflict, VolumeError
from . import KV, Capabilities


class _Store:
    """The keys of one store: sorted keys, key -> (value, revision), the last revision."""

    __slots__ = ("keys", "data", "rev", "owner")

    def __init__(self):
        self.keys: list[bytes] = []
        self.data: dict[bytes, tuple[bytes, int]] = {}
        self.rev = 0
        self.owner: MemoryKV | None = None


_NAMED: dict[str, _Store] = {}  # memory:NAME -> its store, for the life of the process


class MemoryKV(KV):
    caps = Capabilities(single_writer=True)

    def __init__(self, url="memory:", store: _Store | None = None):
        self.url = url
        self._s = store or _Store()
        self.commits = 0  # statistics: transactions applied

    @classmethod
    async def create(cls, url: str = "memory:") -> "MemoryKV":
        """Open ``memory:`` (a fresh store) or ``memory:NAME`` (the process's store of
        that name).

        Raises:
            VolumeError: ``memory:NAME`` is open already.
        """
        name = url.split(":", 1)[1] if ":" in url else ""
        if not name:
            return cls(url)
        store = _NAMED.setdefault(name, _Store())
        if store.owner is not None:
            raise VolumeError(f"the metadata store {url} is in use (opened and not closed)")
        kv = cls(url, store)
        store.owner = kv
        return kv

    async def _get(self, key):
        return self._s.data.get(key, (None, 0))

    async def _range(self, start, end, limit):
        keys = self._s.keys
        i = bisect.bisect_left(keys, start)
        j = bisect.bisect_left(keys, end) if end else len(keys)
        if limit:
            j = min(j, i + limit)
        data = self._s.data
        return [(k, *data[k]) for k in keys[i:j]]

    async def _commit(self, reads, writes):
        s = self._s
        for k, rev in reads.items():
            if s.data.get(k, (None, 0))[1] != rev:
                raise Conflict(k)
        s.rev += 1
        for k, v in writes.items():
            if v is None:
                if s.data.pop(k, None) is not None:
                    del s.keys[bisect.bisect_left(s.keys, k)]
            else:
                if k not in s.data:
                    bisect.insort(s.keys, k)
                s.data[k] = (v, s.rev)
        self.commits += 1
        self._published(writes)

    async def sync(self):
        pass

    async def _aclose(self):
        if self._s.owner is self:
            self._s.owner = None
