"""A read cache for the etcd engine, kept current by one watch of the whole keyspace.

Why: every etcd read is a network round trip (~1-3 ms through the JSON gateway here),
and a create looked up the same few keys (branch record, parent inode, the name) again
and again. With the cache, reads inside a transaction are answered locally when the
key is cached; the commit compares every revision read, exactly as before, so a stale
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
"""
from __future__ import annotations

import trio

MAX_ENTRIES = 500_000     # beyond this, the oldest half is dropped
MAX_RECENT = 100_000      # beyond this, ``recent`` is cleared and ``floor`` raised
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
        self.hits = 0           # statistics
        self.misses = 0

    # -- reads ---------------------------------------------------------------------
    def lookup(self, key: bytes) -> tuple[bytes | None, int] | None:
        """``(value, mod_revision)`` if cached and live, else None."""
        if not self.live:
            return None
        e = self.entries.get(key)
        if e is None:
            self.misses += 1
            return None
        self.hits += 1
        return e[0], e[1]

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
        """Drop entries a conflict showed to be stale."""
        for k in keys:
            self.entries.pop(k, None)

    def _put(self, key, value, mod_rev, as_of):
        e = self.entries.get(key)
        if e is not None and e[2] >= as_of:
            return
        if len(self.entries) >= MAX_ENTRIES and e is None:
            for k in list(self.entries)[:MAX_ENTRIES // 2]:
                del self.entries[k]
        self.entries[key] = (value, mod_rev, as_of)

    # -- the watch -----------------------------------------------------------------
    def started(self, rev: int) -> None:
        """A new watch delivers every change after ``rev``; the cache starts empty."""
        self.entries.clear()
        self.recent.clear()
        self.floor = self.watch_rev = rev
        self.live = True
        self._wake()

    def changed(self, key: bytes, value: bytes | None, rev: int) -> None:
        """The watch delivered a change of ``key`` at revision ``rev``."""
        e = self.entries.get(key)
        if e is not None and rev > e[2]:
            self.entries[key] = (value, 0 if value is None else rev, rev)
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
        self._wake()

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
        self.stopped()
        return False

    def statistics(self) -> dict:
        return {"entries": len(self.entries), "hits": self.hits, "misses": self.misses,
                "live": self.live, "watch_revision": self.watch_rev}
