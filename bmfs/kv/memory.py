"""In-memory engine: the reference implementation and the fake for unit tests."""
from __future__ import annotations

import bisect

from ..errors import Conflict
from . import KV, Capabilities


class MemoryKV(KV):
    caps = Capabilities(single_writer=True)

    def __init__(self, url="memory:"):
        self.url = url
        self._keys: list[bytes] = []
        self._data: dict[bytes, tuple[bytes, int]] = {}
        self._rev = 0
        self.commits = 0  # statistics: transactions applied

    @classmethod
    async def create(cls, url: str = "memory:") -> "MemoryKV":
        return cls(url)

    async def _get(self, key):
        return self._data.get(key, (None, 0))

    async def _range(self, start, end, limit):
        i = bisect.bisect_left(self._keys, start)
        j = bisect.bisect_left(self._keys, end) if end else len(self._keys)
        if limit:
            j = min(j, i + limit)
        return [(k, *self._data[k]) for k in self._keys[i:j]]

    async def _commit(self, reads, writes):
        for k, rev in reads.items():
            if self._data.get(k, (None, 0))[1] != rev:
                raise Conflict(k)
        self._rev += 1
        for k, v in writes.items():
            if v is None:
                if self._data.pop(k, None) is not None:
                    del self._keys[bisect.bisect_left(self._keys, k)]
            else:
                if k not in self._data:
                    bisect.insort(self._keys, k)
                self._data[k] = (v, self._rev)
        self.commits += 1
        self._published(writes)

    async def sync(self):
        pass

    async def _aclose(self):
        pass
