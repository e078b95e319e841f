"""A read cache for the etcd engine, kept current by one watch of the whole keyspace.

Why: every etcd read is a network round trip (through the JSON gateway), and a create
looks up the same few keys (branch record, parent inode, the name) again and again.
With the cache, reads inside a transaction are answered locally when the key is
cached; the commit compares every revision read, as without the cache, so a stale
entry can only make a commit conflict (the engine then drops the entries that
transaction read and the retry reads them afresh). Nothing is ever committed on the
strength of a stale read.

What it promises outside commits: a cached read reflects a state no older than the
watch has delivered. ``barrier()`` (close-to-open: the vfs calls it before opening a
file) asks etcd for its current revision and waits until the watch has delivered
every change up to it, so every read after the barrier sees at least what was
committed before it began.

How entries stay right:
- Each entry is ``(value, mod_revision, as_of)``: the value and revision as of etcd
  revision ``as_of`` (``value`` None and ``mod_revision`` 0: the key was absent).
- The watch covers every key (the engine's request ids too, so that each committed
  transaction moves the watch on and a barrier can be reached). An event at revision
  ``E`` replaces a cached entry only if ``E > as_of``.
- A value fetched at revision ``R`` while the watch is already past ``R`` may have
  missed an event the watch delivered in between (it was not cached then, so nothing
  recorded it). ``recent`` remembers the last revision of every key changed since
  ``floor``; such a fetch is cached only if ``R >= floor`` and the key did not change
  after ``R``.
- This client's own commits are cached at the commit's revision as soon as etcd
  answers.
- If the watch fails (etcd unreachable for longer than the engine's timeout, history
  compacted), the cache is emptied and bypassed until a new watch is running.

Complete prefixes: the cache can also know *every* key under a prefix (a directory's
entries, the chunks of a file), so that a lookup of an absent name or a range read
under it needs no round trip. A prefix becomes complete when the engine has read it
whole at a revision the watch has not yet passed (``ranged``), or when the layer above
says nothing can exist under it yet (``known_empty``: the keys of an inode number just
allocated). It is kept up to date like the entries: the watch and this client's
commits add and remove its keys (creating their entries), changes at or before the
revision it was complete as of are ignored. It is forgotten with the entries (a
conflict on one of its keys, the watch ending, memory limits).
"""
from __future__ import annotations

import bisect
import logging

import trio

from . import prefix_end

log = logging.getLogger(__name__)
MAX_ENTRIES = 500_000     # beyond this, the oldest half is dropped
MAX_RECENT = 100_000      # beyond this, ``recent`` is cleared and ``floor`` raised
MAX_COMPLETE = 200_000    # complete prefixes kept; beyond this, the oldest half is dropped
COMPLETE_KEYS = 10_000    # a prefix read whole with more keys than this is not kept complete
BARRIER_WAIT = 2.0        # seconds a barrier waits for the watch before bypassing it


class ReadCache:
    """The cache proper; the engine feeds it fetched rows, its commits and watch events."""

    def __init__(self):
        self.entries: dict[bytes, tuple[bytes | None, int, int]] = {}
        self.recent: dict[bytes, int] = {}
        self.floor = 0          # every change after ``floor`` is in ``recent``
        self.watch_rev = 0      # every change up to here has been applied
        self.live = False       # a watch is running and caught up with its start
        self._moved = trio.Event()
        # complete prefixes: prefix -> [as_of, sorted list of the keys under it]
        self.complete: dict[bytes, list] = {}
        self._lengths: set[int] = set()  # the lengths of the complete prefixes
        self.on_change = None   # hook: f(key, value) for every change the watch delivers
        self.on_stop = None     # hook: f() when the watch ends
        self.hits = 0           # statistics
        self.misses = 0
        self.gave_up = 0        # waits for the watch that timed out (the cache restarted)

    # -- reads ---------------------------------------------------------------------
    def lookup(self, key: bytes) -> tuple[bytes | None, int] | None:
        """``(value, mod_revision)`` if cached and live, else None."""
        if not self.live:
            return None
        e = self.entries.get(key)
        if e is None:
            if self.complete and self._covering(key) is not None:
                self.hits += 1
                return None, 0
            self.misses += 1
            return None
        self.hits += 1
        return e[0], e[1]

    def range(self, start: bytes, end: bytes) -> list[tuple[bytes, bytes, int]] | None:
        """The rows in [start, end) if that lies within a complete prefix, else None."""
        if not (self.live and self.complete):
            return None
        p = self._covering(start)
        if p is None or not end or end > prefix_end(p):
            return None
        keys = self.complete[p][1]  # sorted: a lookup's small range costs O(log n)
        rows = []
        for k in keys[bisect.bisect_left(keys, start):bisect.bisect_left(keys, end)]:
            e = self.entries[k]
            rows.append((k, e[0], e[1]))
        self.hits += 1
        return rows

    def covers(self, prefix: bytes) -> bool:
        """Whether every key under ``prefix`` is known."""
        return self.live and bool(self.complete) and self._covering(prefix) is not None

    def _covering(self, key: bytes) -> bytes | None:
        """The complete prefix ``key`` lies under, if any."""
        for n in self._lengths:
            if key[:n] in self.complete:
                return key[:n]
        return None

    def fetched(self, key: bytes, value: bytes | None, mod_rev: int, as_of: int) -> None:
        """A value read from etcd at revision ``as_of`` (see the module doc)."""
        if not self.live:
            return
        if as_of < self.watch_rev and (as_of < self.floor or self.recent.get(key, 0) > as_of):
            return  # the watch may have passed over a newer change of this key
        self._put(key, value, mod_rev, as_of)

    def committed(self, writes: dict[bytes, bytes | None], rev: int) -> None:
        """This client's transaction at revision ``rev`` wrote ``writes``."""
        if not self.live:
            return
        for k, v in writes.items():
            self._put(k, v, 0 if v is None else rev, rev)

    def forget(self, keys) -> None:
        """Drop entries a conflict showed to be stale (and complete prefixes over them)."""
        for k in keys:
            self.entries.pop(k, None)
            if self.complete:
                p = self._covering(k)
                if p is not None:
                    del self.complete[p]

    def ranged(self, prefix: bytes, rows, as_of: int) -> None:
        """``rows`` are every key under ``prefix`` at revision ``as_of``."""
        if self.live and as_of >= self.watch_rev and len(rows) <= COMPLETE_KEYS:
            present = [k for k, _, _ in rows]  # (etcd returns them in key order)
            if all(k in self.entries for k in present):  # (none evicted meanwhile)
                self._mark(prefix, as_of, present)

    def known_empty(self, prefixes) -> None:
        """No key under any of ``prefixes`` exists (nor can, but through this client)."""
        if self.live:
            for p in prefixes:
                self._mark(p, self.watch_rev, [])

    def _mark(self, prefix, as_of, present):
        if len(self.complete) >= MAX_COMPLETE:
            for p in list(self.complete)[:MAX_COMPLETE // 2]:
                del self.complete[p]
        self.complete[prefix] = [as_of, present]
        self._lengths.add(len(prefix))

    def _put(self, key, value, mod_rev, as_of):
        e = self.entries.get(key)
        if e is not None and e[2] >= as_of:
            return
        c = self._complete_of(key, e, as_of)
        if c is False:
            return  # older than the prefix's knowledge, which says it is absent
        if len(self.entries) >= MAX_ENTRIES and e is None:
            for k in list(self.entries)[:MAX_ENTRIES // 2]:
                del self.entries[k]
            self._drop_complete()
        self.entries[key] = (value, mod_rev, as_of)
        if c is not None:
            _update_sorted(c, key, value is not None)

    def _complete_of(self, key, e, rev):
        """For a change of ``key`` at ``rev``: the key set of its complete prefix to
        update, None if it lies under none, False if the change is older than what
        that prefix already reflects (and ``key`` has no entry)."""
        if not self.complete:
            return None
        p = self._covering(key)
        if p is None:
            return None
        as_of, present = self.complete[p]
        if e is None and rev <= as_of:
            return False
        return present

    def _drop_complete(self):
        self.complete.clear()
        self._lengths.clear()

    # -- the watch -----------------------------------------------------------------
    def started(self, rev: int) -> None:
        """A new watch delivers every change after ``rev``; the cache starts empty."""
        self.entries.clear()
        self.recent.clear()
        self._drop_complete()
        self.floor = self.watch_rev = rev
        self.live = True
        self._wake()

    def changed(self, key: bytes, value: bytes | None, rev: int) -> None:
        """The watch delivered a change of ``key`` at revision ``rev``."""
        e = self.entries.get(key)
        if e is not None or (self.complete and self._covering(key) is not None):
            self._put(key, value, 0 if value is None else rev, rev)
        if self.on_change is not None:
            self.on_change(key, value)
        if len(self.recent) >= MAX_RECENT:
            self.recent.clear()
            self.floor = self.watch_rev
        self.recent[key] = rev

    def reached(self, rev: int) -> None:
        """Every change up to ``rev`` has been delivered."""
        if rev > self.watch_rev:
            self.watch_rev = rev
            self._wake()

    def stopped(self) -> None:
        """The watch ended: bypass the cache until a new one starts."""
        self.live = False
        self.entries.clear()
        self.recent.clear()
        self._drop_complete()
        self._wake()
        if self.on_stop is not None:
            self.on_stop()

    def _wake(self):
        self._moved.set()
        self._moved = trio.Event()

    async def wait_for(self, rev: int) -> bool:
        """Wait until the watch has delivered revision ``rev``; False if it is not live
        or has not got there within BARRIER_WAIT seconds (then it is stopped, so reads
        go to etcd until it has been restarted)."""
        with trio.move_on_after(BARRIER_WAIT):
            while self.live and self.watch_rev < rev:
                await self._moved.wait()
            return self.live
        # (a mount holding the write-behind token gives it up too: until the cache is
        # live again and the token taken back, every operation is an etcd round trip)
        log.warning("etcd read cache: the watch is still at revision %d, %d behind, "
                    "after %.0f s; reading from etcd until a new watch has caught up",
                    self.watch_rev, rev - self.watch_rev, BARRIER_WAIT)
        self.gave_up += 1
        self.stopped()
        return False

    def statistics(self) -> dict:
        return {"entries": len(self.entries), "complete_prefixes": len(self.complete),
                "hits": self.hits, "misses": self.misses, "gave_up": self.gave_up,
                "live": self.live, "watch_revision": self.watch_rev}


def _update_sorted(keys: list, key: bytes, present: bool) -> None:
    """Add (``present``) or remove ``key`` in the sorted list ``keys``."""
    i = bisect.bisect_left(keys, key)
    there = i < len(keys) and keys[i] == key
    if present and not there:
        keys.insert(i, key)
    elif not present and there:
        del keys[i]
