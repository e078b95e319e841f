"""A bounded dict that forgets what was least recently used: the caches and "last N"
memories of the data client, the vfs and the storage node."""
from __future__ import annotations

import collections


class LRU(collections.OrderedDict):
    """At most ``limit`` entries. ``put`` stores an entry as the most recent one and
    drops the oldest beyond ``limit``; ``hit`` looks one up and makes it the most
    recent; the other dict operations (``get``, ``pop``, ``in``, ``[]``) do not
    reorder."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def copy(self) -> "LRU":
        out = LRU(self.limit)
        out.update(self)
        return out

    def __reduce__(self):  # copy.copy and pickle: keep the limit
        return self.__class__, (self.limit,), None, None, iter(self.items())

    def put(self, key, value):
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.limit:
            self.popitem(last=False)
        return value

    def hit(self, key, default=None):
        value = self.get(key, self)
        if value is self:
            return default
        self.move_to_end(key)
        return value
