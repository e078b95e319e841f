"""Write-behind for the etcd engine: one client at a time commits asynchronously.

Why: an etcd transaction costs milliseconds (JSON gateway, Raft, fsync on a quorum),
so a mount that waits for one per create is bound by that latency, not by its CPU. CephFS's
asynchronous directory operations answer the same problem with capabilities; this is
the simplest form of that idea: a volume-wide **write-behind token**.

The token (key ``TOKEN``, attached to a 5 s lease the holder keeps alive) names the one
client that may commit behind. While it holds the token:
- every transaction is decided locally: ``fn(txn)`` runs against the client's own
  queued writes (an overlay) over its read cache, which is exact, because no one else
  can commit (below); the writes go to the overlay and a queue, and ``transact``
  returns at once;
- a committer task sends the queue to etcd in order, as few transactions as possible
  (each carries every entry queued meanwhile; its compares are the entries' reads
  plus the token's revision, so nothing commits if the token was lost), each after
  letting the batch gather a moment (``_gather``);
- ``sync()`` (fsync, fsyncdir) and ``aclose()`` wait until the queue is committed.

Why a local decision is exact, and stays so:
- decisions run one at a time (``_local``), each on the cache plus the queue's writes;
- a value read from the queue has "revision" ``-seq`` (the entry that wrote it); the
  entry does not compare it: the entries before it in the queue commit first, in the
  same or an earlier transaction, under the same token;
- a synchronous commit by the holder itself (``commit``: gc, repair) first commits the
  queue, then compares what it read from the queue at the revision that write got
  (``landed``; if a later entry overwrote it, it conflicts), with no local decision
  meanwhile;
- while this client takes the token, its synchronous commits already in flight land
  first and new ones wait (``acquiring``, ``syncs``), so the cache, caught up with the
  token's revision, has them all.
- if the committer cannot reach etcd (``stalled``), nothing more is decided locally:
  operations wait for the queue and fail with Unavailable (EIO) after the engine's
  timeout; the queue is kept and committed when etcd answers.

Every other client's transaction reads the token (so its commit compares it): if
another client holds it, it first **recalls** it: it writes ``RECALL + holder``, the
holder (which sees the key through its cache's watch) commits its queue, deletes
the token and stops holding it for ``QUIET`` seconds; then the transaction runs as
usual. ``barrier()`` (open: close-to-open) recalls too, so an open elsewhere sees
every file closed here. If the holder is dead, its lease ends the token within 5 s.

Consequences (documented in docs/etcd.md): reads on other clients see the holder's
changes once committed (milliseconds behind); the first change another client makes
after the holder was active waits for the recall (one queue flush); if the
holder is killed (kill -9, power loss) the changes still queued are lost (at most
a batch's gathering time and commit of operations: they were never fsync'ed), as a local filesystem loses
un-fsync'ed metadata in a crash. If the holder loses its lease (cut off from etcd for
over 5 s) the queue cannot commit: its entries are dropped and logged as lost.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import os

import trio

from ..errors import Conflict, FsError, IOFailure, NoSpace, NotFound, Unavailable
from .etcd_wire import b64 as _b64
from .etcd_wire import new_request_id

log = logging.getLogger(__name__)

TOKEN = b"\xff\xff\xff\xffwb"           # engine-private keys (>= RESERVED, see etcd.py)
RECALL = b"\xff\xff\xff\xffwbr/"
LEASE_TTL = 5         # seconds: a dead holder's token ends this long after its last renewal
QUIET = 5.0           # seconds after a recall before this client takes the token again
MAX_QUEUE = 4096      # entries queued before transact waits for the committer
MAX_BATCH_OPS = 4000  # compares + writes in one etcd transaction (etcd: --max-txn-ops)
MAX_LANDED = 100_000  # last committed queue write per key kept (see ``landed``)
GROUP_WAIT = 0.02     # seconds a batch may gather entries before it is sent
GROUP_ENTRIES = 256   # entries that send a batch at once


class _Entry:
    __slots__ = ("reads", "writes", "seq")

    def __init__(self, reads, writes, seq):
        self.reads = reads
        self.writes = writes
        self.seq = seq  # its place in the queue: a value read from the overlay has
                        # "revision" -seq of the entry that wrote it


class WriteBehind:
    """The token, the overlay and the committer of one EtcdKV (see the module doc)."""

    def __init__(self, kv):
        self.kv = kv
        self.me = os.urandom(8).hex().encode()
        self.enabled = False     # only a mount takes the token (enable_write_behind)
        self.holding = False
        self.token_rev = 0
        self.lease = 0
        self.queue: list[_Entry] = []
        self.overlay: dict[bytes, tuple[bytes | None, int]] = {}  # key -> (value, seq)
        self._sorted: list[bytes] | None = []  # the overlay's keys in order (None: to sort)
        self.seq = 0
        # key -> (seq, revision) of the last queued write of key that was committed
        self.landed: dict[bytes, tuple[int, int]] = {}
        self.recalled = False
        self.quiet = QUIET
        self.acquiring = False   # taking the token: synchronous commits wait
        self.recall_seen = False  # a recall for this client arrived since _acquire began
        self.renewed = float("-inf")  # when the token's lease was last renewed
        self.syncs = 0           # synchronous commits of this client in flight
        self.stalled = False     # the committer cannot reach etcd: decide nothing locally
        self.last_recall = float("-inf")
        self.lost = 0            # statistics: acknowledged entries that could not commit
        self.batches = 0
        self.entries = 0
        self.given_up = 0        # statistics: times the token was given up
        self.group_wait = GROUP_WAIT
        self.waiting = 0         # tasks waiting for the queue (drain): send at once
        self._wake = trio.Event()      # the committer has work (or a recall)
        self._state = trio.Event()     # set (and replaced) when holding/recalled/stalled change
        self._lock = trio.Lock()       # one acquisition or release at a time
        self._local = trio.Lock()      # one local decision at a time (serializable)
        self._scope: trio.CancelScope | None = None
        kv.cache.on_change = self._changed
        kv.cache.on_stop = self._cache_stopped

    def exclusive(self) -> bool:
        """Whether no other client can have committed anything this client's cache
        has not seen: it holds the token (taken after the cache caught up) and has not
        been asked for it back."""
        return (self.holding and not (self.recalled or self.stalled) and self.kv.cache.live
                # a lease not renewed lately may have ended (this process paused, etcd
                # cut off): then another client may be committing
                and trio.current_time() - self.renewed < LEASE_TTL * 0.6)

    def _notify(self) -> None:
        self._state.set()
        self._state = trio.Event()

    # -- reads through the overlay -------------------------------------------------
    def lookup(self, key: bytes):
        """``(value, -seq)`` if a queued write (entry ``seq``) has ``key``, else None."""
        hit = self.overlay.get(key)
        if hit is not None:
            return hit[0], -hit[1]
        return None

    def changes_in(self, start: bytes, end: bytes) -> list:
        """``(key, value or None, -seq)`` of the queued writes in [start, end)."""
        if not self.overlay:
            return []
        # (a range reads the keys in it, not the whole queue: the queue is thousands of
        # keys while etcd is slow, and unlinks, listings and writes range over one
        # inode's prefix each)
        if self._sorted is None:
            self._sorted = sorted(self.overlay)
        keys = self._sorted
        hi = bisect.bisect_left(keys, end) if end else len(keys)
        out = []
        for k in keys[bisect.bisect_left(keys, start):hi]:
            v, seq = self.overlay[k]
            out.append((k, v, -seq))
        return out

    # -- transactions ----------------------------------------------------------------
    async def transact(self, fn, attempts, base_transact):
        """``KV.transact`` for this engine: queued while holding the token, else as usual
        (``commit`` then recalls the token from any other holder).

        Raises:
            Unavailable: this client holds the token but has not been able to commit its
                queue for ``timeout`` seconds (etcd unreachable).
        """
        deadline = trio.current_time() + self.kv.timeout
        while True:
            if self.exclusive():
                async with self._local:  # one decision at a time: each sees the last
                    decided, result = await self._decide(fn)
                if decided:
                    return result
                continue  # recalled meanwhile: decide again
            if self.holding:  # being given up, or stalled: wait for the queue
                state = self._state
                with trio.move_on_at(deadline):
                    await state.wait()
                    continue
                raise Unavailable("etcd metadata: this mount's queued changes cannot be "
                                  "committed (etcd unreachable)")
            if self.enabled and await self._try_acquire():
                continue
            return await base_transact(fn, attempts)

    async def commit(self, txn) -> None:
        """A synchronous commit of ``txn`` (``KV.commit``): it compares its reads plus
        the token's revision, after recalling the token from any other holder. The
        holder first commits its queue, compares what it read from the queue at the
        revision that got, and decides nothing locally meanwhile (a decision on a
        value this commit is changing would be lost). While this client takes the
        token, no such commit is sent (``_try_acquire`` waits for those in flight)."""
        while self.acquiring:
            await self._state.wait()
        if self.holding:
            async with self._local:
                if not self.holding:
                    return await self.commit(txn)  # given up meanwhile
                await self.drain(self.kv.timeout)
                reads = {TOKEN: self.token_rev}
                for k, r in txn.reads.items():
                    if r < 0:  # read from the queue: the revision its write got
                        seq, rev = self.landed.get(k, (0, 0))
                        if seq != -r:
                            raise Conflict("a queued change was overwritten since read")
                        r = rev
                    reads[k] = r
                await self.kv._commit(reads, txn.writes)
            return
        self.syncs += 1
        try:
            value, rev = await self.kv._get(TOKEN)
            while value is not None and value != self.me:
                await self.recall(value)
                value, rev = await self.kv._get_fresh(TOKEN)
            await self.kv._commit({**txn.reads, TOKEN: rev}, txn.writes)
        finally:
            self.syncs -= 1
            if not self.syncs:
                self._notify()

    async def _decide(self, fn):
        """Run ``fn`` on the local state and queue its writes: ``(True, its result)``, or
        ``(False, None)`` if the token was recalled meanwhile (what it read may be
        stale). Its errors stand: the state it saw is exact."""
        if not self.exclusive():
            return False, None
        txn = self.kv.begin()
        try:
            result = await fn(txn)
        except Exception:
            if self.exclusive():
                raise
            return False, None
        if txn.writes:
            while len(self.queue) >= MAX_QUEUE:
                await self._state.wait()  # (notified after each batch)
            if not self.exclusive():
                return False, None
            self._enqueue(txn)
        return True, result

    def _enqueue(self, txn) -> None:
        # (what it read from the queue is compared through the entries that wrote it)
        reads = {k: r for k, r in txn.reads.items() if r >= 0}
        self.seq += 1
        self.queue.append(_Entry(reads, dict(txn.writes), self.seq))
        for k, v in txn.writes.items():
            if self._sorted is not None and k not in self.overlay:
                bisect.insort(self._sorted, k)
            self.overlay[k] = (v, self.seq)
        self._wake.set()

    async def drain(self, timeout: float) -> None:
        """Wait until everything queued before this call is committed (or dropped as
        lost).

        Raises:
            Unavailable: it is not after ``timeout`` seconds, or the committer could
                not reach etcd (then the queue stays and is committed once etcd answers
                again).
            IOFailure: queued changes were lost meanwhile (the token's lease ended).
        """
        last, lost = self.seq, self.lost  # (not what is queued meanwhile: under load,
        self.waiting += 1                   # the queue is never empty)
        self._wake.set()  # the committer stops gathering (_gather)
        try:
            with trio.move_on_after(timeout) as scope:
                while self.queue and self.queue[0].seq <= last and not self.stalled:
                    await self._state.wait()
        finally:
            self.waiting -= 1
        if not scope.cancelled_caught:
            if self.lost > lost:
                raise IOFailure("etcd metadata: queued changes of this mount could not be "
                                "committed and are lost (see the mount's log)")
            if not self.queue or self.queue[0].seq > last:
                return
        raise Unavailable(f"etcd metadata: {len(self.queue)} queued changes of this mount "
                          f"not committed after {timeout:.0f} s (etcd unreachable)")

    # -- the token -------------------------------------------------------------------
    async def _try_acquire(self) -> bool:
        """Take the token if nobody holds it and no recall came lately."""
        if trio.current_time() - self.last_recall < self.quiet or not self.kv.cache.live:
            return False
        try:
            held, _ = await self.kv._get(TOKEN)  # (cached: the watch keeps it current)
        except (Unavailable, FsError):
            return False
        if held is not None:
            return False
        async with self._lock:
            if self.holding or trio.current_time() - self.last_recall < self.quiet:
                return self.holding
            self.acquiring = True
            try:
                return await self._acquire()
            finally:
                self.acquiring = False
                self._notify()

    async def _acquire(self) -> bool:
        while self.syncs:  # synchronous commits in flight land before the token
            await self._state.wait()
        self.recall_seen = False
        try:
            self.lease = await self.kv.grant_lease(LEASE_TTL)
            key = _b64(TOKEN)
            data = await self.kv._call("/v3/kv/txn", {
                "compare": [{"key": key, "target": "MOD", "result": "EQUAL",
                             "mod_revision": "0"}],
                "success": [{"request_put": {"key": key, "value": _b64(self.me),
                                             "lease": str(self.lease)}}]})
        except (Unavailable, FsError):
            return False
        if not data.get("succeeded"):
            with contextlib.suppress(Unavailable, FsError):
                await self.kv.revoke_lease(self.lease)
            return False
        self.token_rev = int(data["header"]["revision"])
        self.renewed = trio.current_time()
        # the cache must hold every change made before the token was taken
        if not await self.kv.cache.wait_for(self.token_rev):
            await self._release_token()
            return False
        self.holding, self.recalled = True, False
        self._notify()
        self._start_committer()
        if self.recall_seen:  # asked for it back while taking it
            self._stop_deciding()
        return True

    async def recall(self, holder: bytes) -> None:
        """Ask ``holder`` to commit its queue and give the token up; wait until it has
        (or its lease has ended).

        Raises:
            Unavailable: the token is still held after the lease time plus 5 s.
        """
        if holder == self.me:
            return
        self.last_recall = trio.current_time()  # and do not grab it back at once
        await self.kv._call("/v3/kv/put", {"key": _b64(RECALL + holder),
                                           "value": _b64(self.me)})
        with trio.move_on_after(LEASE_TTL + 5):
            while True:
                value, _ = await self.kv._get_fresh(TOKEN)
                if value != holder:
                    return
                await trio.sleep(0.005)
        raise Unavailable(f"etcd metadata: client {holder.decode()} holds the write-behind "
                          "token and does not give it up")

    async def holder(self) -> bytes | None:
        """The other client holding the token, if any (after a barrier, the cache is
        current)."""
        value, _ = await self.kv._get(TOKEN)
        return value if value is not None and value != self.me else None

    def _changed(self, key: bytes, value: bytes | None) -> None:
        """Watch hook: someone asked for the token back."""
        if value is not None and key == RECALL + self.me:
            self.recall_seen = True  # (also while taking it: see _acquire)
            if self.holding:
                self.last_recall = trio.current_time()
                self._stop_deciding()

    def _cache_stopped(self) -> None:
        """Without its watch the cache is no longer exact: stop deciding locally."""
        if self.holding:
            self._stop_deciding()

    def _stop_deciding(self) -> None:
        """Decide nothing more locally: commit the queue and give the token up."""
        self.recalled = True
        self._wake.set()
        self._notify()

    async def _release_token(self) -> None:
        key = _b64(TOKEN)
        try:
            await self.kv._call("/v3/kv/txn", {
                "compare": [{"key": key, "target": "VALUE", "result": "EQUAL",
                             "value": _b64(self.me)}],
                "success": [{"request_delete_range": {"key": key}},
                            {"request_delete_range": {"key": _b64(RECALL + self.me)}}]})
            await self.kv.revoke_lease(self.lease)
        except (Unavailable, FsError):
            pass  # the lease ends it

    # -- the committer ---------------------------------------------------------------
    def _start_committer(self) -> None:
        if self._scope is None:
            self._scope = trio.CancelScope()
            trio.lowlevel.spawn_system_task(self._run, name="bmfs etcd write-behind")

    async def _run(self):
        with self._scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keepalive)
                while True:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    while self.queue:
                        await self._gather()
                        await self._commit_batch()
                    if self.holding and self.recalled:
                        await self._give_up()

    async def _gather(self) -> None:
        """Let the batch grow before it is sent: until GROUP_ENTRIES are queued or
        ``group_wait`` has passed, or at once when someone waits for the queue (fsync,
        a synchronous commit, unmount) or the token is being given up.

        Why: every etcd transaction costs the mount a request and a watch event and
        each member a Raft round and an fsync, whatever it carries. Operations that
        each write a key or two (an atime at every first read, an unlink) would
        otherwise go one or two per transaction, as fast as etcd takes them, and that
        work, on the machines the mount shares with etcd, is what the operations wait
        for. Nothing waits for the batch meanwhile (the operations have returned);
        what a crash of the holder loses is at most this much more."""
        with trio.move_on_after(self.group_wait):
            while (len(self.queue) < GROUP_ENTRIES and not self.waiting
                   and not self.recalled):
                await self._wake.wait()
                self._wake = trio.Event()

    async def _keepalive(self):
        while True:
            await trio.sleep(LEASE_TTL / 4)
            if self.holding:
                try:
                    await self.kv.keepalive(self.lease)
                    self.renewed = trio.current_time()
                    self._notify()
                except NotFound:
                    log.warning("etcd write-behind: the token's lease ended; giving it up")
                    self._stop_deciding()
                except (Unavailable, FsError):
                    pass

    async def _give_up(self) -> None:
        async with self._lock:
            await self._release_token()
            self.holding = self.recalled = False
            self.given_up += 1
            self.last_recall = trio.current_time()
            self._notify()

    async def _commit_batch(self) -> None:
        reads: dict[bytes, int] = {TOKEN: self.token_rev}
        writes: dict[bytes, bytes | None] = {}
        n = 0
        for e in self.queue:
            if n and len(reads) + len(writes) + len(e.reads) + len(e.writes) > MAX_BATCH_OPS:
                break
            for k, r in e.reads.items():
                if k not in writes:
                    reads.setdefault(k, r)
            writes.update(e.writes)
            n += 1
        batch, rid, rev = self.queue[:n], new_request_id(), None
        delay = 0.05
        while True:
            try:
                rev = await self.kv._commit(reads, writes, rid=rid)
                if self.stalled:
                    log.warning("etcd write-behind: etcd answers again; %d queued changes "
                                "committed", n)
                    self.stalled = False
                    self._notify()
                break
            except (Unavailable, NoSpace) as e:  # keep trying: these were acknowledged
                # (NoSpace: etcd's NOSPACE alarm, which the upkeep disarms once it has
                # compacted and defragmented: bmfs/kv/etcd_compact.py)
                if not self.stalled:
                    log.warning("etcd write-behind: %s; %d queued changes wait (new ones "
                                "fail with EIO meanwhile)", e, len(self.queue))
                    self.stalled = True
                    self._notify()
                await trio.sleep(delay)
                delay = min(delay * 2, 1.0)
            except (Conflict, FsError) as e:
                self.lost += n
                log.error("etcd write-behind: %d acknowledged metadata changes could not be "
                          "committed and are lost (%s)", n, e)
                self._stop_deciding()  # decide everything afresh
                break
        del self.queue[:n]
        self.batches += 1
        self.entries += n
        if len(self.landed) > MAX_LANDED:
            self.landed.clear()  # (a read that old, if committed, just conflicts)
        for e in batch:
            for k in e.writes:
                if rev is not None:
                    self.landed[k] = (e.seq, rev)
                if self.overlay[k][1] == e.seq:  # no later entry wrote it
                    del self.overlay[k]
                    self._sorted = None  # (sorted again at the next range: once a batch)
        self._notify()  # (drain waits for its part of the queue)

    async def aclose(self) -> None:
        if self._scope is None:
            return
        try:
            await self.drain(30)
        except (Unavailable, IOFailure) as e:
            self.lost += len(self.queue)
            log.error("etcd write-behind: closing with %s; they are lost", e)
        if self.holding:
            await self._give_up()
        self._scope.cancel()

    def statistics(self) -> dict:
        return {"holding": self.holding, "queued": len(self.queue), "batches": self.batches,
                "entries": self.entries, "lost": self.lost, "given_up": self.given_up}

