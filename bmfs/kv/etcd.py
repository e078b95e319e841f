"""etcd engine: the metadata of a cluster in etcd (its Raft log is the replicated log).

``await EtcdKV.create("etcd://host:port,host:port,...")`` talks to etcd's JSON gateway
(``POST /v3/kv/range``, ``/v3/kv/txn``, ``/v3/kv/put``, ``/v3/lease/...``, ``/v3/watch``;
keys and values are base64) over one ``httpx.AsyncClient``; the etcd3/aetcd packages are
not used. A revision is etcd's ``mod_revision`` (0 = absent, which etcd compares too), and
a commit is one etcd Txn: compares ``mod_revision == rev`` for each key read, then puts
and deletes.

Idempotent commits: every commit also writes a random request id under
:data:`REQ_PREFIX` (attached to a lease, so ids vanish after 5 to 10 minutes) and
compares that id absent; its failure branch reads the id back. A commit whose outcome is
unknown (timeout, dropped connection, ``leader changed``) is retried on the next
endpoint; if the retry fails its compares and the id is present, the earlier attempt
committed and the commit returns success. Compares are on ``mod_revision``, which only
grows, so a late-applied earlier attempt can never succeed after a retry reported
Conflict.

Requests, failover, tokens and the members' maintenance calls: bmfs/kv/etcd_gateway.py.

Access: the URL's options name a CA, a client certificate and a user's password file
(bmfs/kv/etcd_auth.py); with a user, every request carries a token, fetched again
once when etcd says it is invalid. History: ``upkeep`` compacts it and defragments
members (bmfs/kv/etcd_compact.py).

Reserved keys: keys starting with :data:`RESERVED` (four 0xFF bytes) belong to the
engine. Every key >= RESERVED starts with it, so ranges simply end there and the ids
never show up in ``range`` (the conformance suite ranges over the whole keyspace). The
layers above must not use such keys. (A full range starts at key ``b"\\0"``: the gateway
rejects an empty key with "key is not provided".)

Failover: requests go to the current endpoint; on a connection error, a timeout
(``request_timeout``, 2 s), an HTTP 5xx or a gRPC Unavailable/DeadlineExceeded/
ResourceExhausted answer (``etcdserver: leader changed``, ``request timed out``, ``no
leader``) the engine moves to the next endpoint in URL order (sticky, shared by all
tasks), backing off once it has tried every endpoint, and raises Unavailable after
``timeout`` (10 s) naming the endpoints and their last errors. Reads are linearizable
(etcd's default), so a follower never answers with stale data.

A leader's loss stalls commits for about an election, longer when every task waits on
a proposal lost with the leader (only ``request_timeout`` frees them); no acknowledged
commit is lost (docs/architecture.md has the measured stall). A watch on a member cut
off from the quorum ends after about three election timeouts (etcd checks
``hasleader`` once per election timeout and gives up after three).

Deployment needs: etcd's ``--max-txn-ops`` (default 128) bounds the operations of one
transaction (compares and puts, plus one for the request id) and ``--max-request-bytes``
(1.5 MiB) its size; run etcd with ``--max-txn-ops 10000 --max-request-bytes 10485760``
(bmfs/cluster/etcd.py does). A transaction over either limit fails at once with
IOFailure (EIO) naming the flag to raise, not after the retry timeout.

Own writes: ``watch(..., skip_own=True)`` leaves out the changes this client made
itself. Each commit notes ``key -> hash(value)`` of its writes before it is sent (a
watch event can arrive before the commit's answer) and forgets them if it fails; an
event that matches a note is dropped and consumes it. A change by someone else that
writes the very same value to the same key while a note is pending is dropped too;
in bmfs (values carry nanosecond times and unique ids) that takes two mounts racing
to make the same change, e.g. both deleting one name, where the one whose note it is
fails; the kernel's cache timeouts bound the harm.
"""
from __future__ import annotations

import contextlib
import json
import logging

import httpx
import trio

from ..errors import Access, Conflict, IOFailure, NotFound, Unavailable
from . import KV, Capabilities, merge_rows, prefix_end
from .etcd_auth import EtcdAccess, diagnose_tls, parse_url, refusal, token_expired
from .etcd_cache import COMPLETE_KEYS, ReadCache
from .etcd_compact import Compactor
from .etcd_gateway import Expired, Gateway, Retry, answer_json, error_text
from .etcd_wire import REQ_PREFIX, RESERVED, new_request_id  # noqa: F401  (re-exported)
from .etcd_wire import b64 as _b64
from .etcd_wire import unb64 as _unb64
from .etcd_writeback import WriteBehind

log = logging.getLogger(__name__)
REQ_TTL = 600                   # seconds of the lease request ids are attached to
BIG_PREFIX_PAUSE = 60.0         # seconds before prefetch tries a too-big prefix again


def _rows(data: dict) -> list[tuple[bytes, bytes, int]]:
    return [(_unb64(kv["key"]), _unb64(kv.get("value")), int(kv["mod_revision"]))
            for kv in data.get("kvs", ())]


def _revision(data: dict) -> int:
    """The etcd revision an answer reflects."""
    return int(data["header"]["revision"])



class EtcdKV(Gateway, KV):
    """The KV interface on an etcd cluster, with leases, watches and a read cache (see
    the module doc)."""

    caps = Capabilities(leases=True, watch=True, read_cache=True)

    def __init__(self, url: str, access: EtcdAccess, *, timeout: float = 10.0,
                 request_timeout: float = 2.0):
        Gateway.__init__(self, access, timeout, request_timeout)
        self.url = url
        self._req_lease = (0, float("-inf"))  # (lease id, trio time it was granted)
        self._lease_lock = trio.Lock()
        self.commits = 0    # statistics: transactions applied
        # key -> hash(value) of writes of this client that no watch has seen yet;
        # None until a watch with skip_own=True asks for it (see the module doc)
        self._own: dict[bytes, int] | None = None
        self.cache = ReadCache()  # live once start_cache() has its watch running
        self.wb = WriteBehind(self)  # bmfs/kv/etcd_writeback.py
        self._cache_scope: trio.CancelScope | None = None
        self._cache_watch_scope = trio.CancelScope()
        self._big: dict[bytes, float] = {}  # prefixes with too many keys to prefetch
        self.compactor = Compactor(self)  # bmfs/kv/etcd_compact.py

    @classmethod
    async def create(cls, url: str, *, timeout: float = 10.0, request_timeout: float = 2.0,
                     connect_timeout: float = 3.0, cache: bool = True) -> "EtcdKV":
        """Connect to the cluster named by ``etcd://host:port,host:port,...[?options]``
        (certificates, user and password file: bmfs/kv/etcd_auth.py); with ``cache``,
        keep a read cache (bmfs/kv/etcd_cache.py).

        Raises:
            ValueError: the URL names no endpoint, or its options are wrong.
            Access: etcd refused the certificates, the user or the password, or
                requires credentials the URL does not give; or a file it names
                cannot be read.
            Unavailable: no quorum answered within ``connect_timeout`` seconds.
        """
        kv = cls(url, parse_url(url), timeout=timeout,
                 request_timeout=min(request_timeout, connect_timeout))
        try:
            if kv.access.user is not None:
                await kv._authenticate(None, connect_timeout)
            await kv._request_lease(timeout=connect_timeout)  # a write: proves a quorum
            # (granting a lease needs no user: a read proves etcd lets us in)
            await kv._call("/v3/kv/range", {"key": _b64(REQ_PREFIX), "count_only": True},
                           connect_timeout)
        except Unavailable as e:
            await kv.aclose()
            why = await trio.to_thread.run_sync(diagnose_tls, kv.access, kv.endpoints[0])
            if why:
                raise Access(why) from None
            raise e
        except BaseException:
            await kv.aclose()
            raise
        kv.request_timeout = request_timeout
        if cache:
            kv.start_cache()
        return kv

    # -- the KV primitives -------------------------------------------------------------
    async def _get(self, key):
        hit = self.wb.lookup(key) or self.cache.lookup(key)
        return hit if hit is not None else await self._get_fresh(key)

    async def _get_fresh(self, key):
        hit = self.wb.lookup(key)  # this client's queued write: newer than etcd's
        if hit is not None:
            return hit
        data = await self._call("/v3/kv/range", {"key": _b64(key)})
        rows = _rows(data)
        value, rev = (rows[0][1], rows[0][2]) if rows else (None, 0)
        self.cache.fetched(key, value, rev, _revision(data))
        return value, rev

    async def _range(self, start, end, limit, fresh=False):
        end = RESERVED if not end or end > RESERVED else end
        if (start or b"\0") >= end:
            return []
        # this client's queued writes in the range can hide rows (deletes) or add some
        # past the last row fetched: fetch as many more, and cut at that row
        queued = self.wb.changes_in(start, end)
        lim = limit + len(queued) if limit else 0
        rows = None if fresh else self.cache.range(start, end)
        if rows is None:
            body = {"key": _b64(start or b"\0"), "range_end": _b64(end), "limit": lim}
            data = await self._call("/v3/kv/range", body)
            rows, at = _rows(data), _revision(data)
            for k, v, rev in rows:
                self.cache.fetched(k, v, rev, at)
            if start and end == prefix_end(start) and (not lim or len(rows) < lim):
                self.cache.ranged(start, rows, at)  # every key under the prefix
        elif lim:
            rows = rows[:lim]
        return merge_rows(rows, queued, limit, lim)

    async def range(self, start, end, limit=0):
        """Outside a transaction: always from etcd (with this client's queued writes)."""
        self._check_open()
        return [(k, self.unseal(k, v))
                for k, v, _ in await self._range(start, end, limit, fresh=True)]

    def statistics(self) -> dict:
        return {"commits": self.commits, "failovers": self.failovers,
                "authentications": self.authentications,
                "cache": self.cache.statistics(), "write_behind": self.wb.statistics(),
                "history": self.compactor.statistics()}

    def known_empty(self, prefixes) -> None:
        self.cache.known_empty(prefixes)

    async def prefetch(self, prefix: bytes) -> None:
        """Read every key under ``prefix`` into the cache, unless there are too many
        (then do not try that prefix again for ``BIG_PREFIX_PAUSE`` seconds)."""
        if not self.cache.live or self.cache.covers(prefix):
            return
        now = trio.current_time()
        if now - self._big.get(prefix, float("-inf")) < BIG_PREFIX_PAUSE:
            return
        rows = await self._range(prefix, prefix_end(prefix), COMPLETE_KEYS + 1, fresh=True)
        if len(rows) > COMPLETE_KEYS:
            if len(self._big) > 10_000:
                self._big.clear()
            self._big[prefix] = now

    async def _commit(self, reads, writes, rid: bytes | None = None):
        """One etcd Txn; see the module docstring for how retries stay idempotent
        (``rid``: the request id, to send one commit again after Unavailable).

        Raises:
            Conflict: a compared revision changed; nothing was written.
            Unavailable: no quorum within ``timeout``; if an earlier attempt's outcome was
                unknown, the commit may or may not have happened.
            IOFailure: etcd rejected the transaction (too many operations, too large).

        Returns the revision it committed at.
        """
        rid = _b64(rid or new_request_id())
        compare = [{"key": _b64(k), "target": "MOD", "result": "EQUAL", "mod_revision": str(rev)}
                   for k, rev in reads.items()]
        compare.append({"key": rid, "target": "MOD", "result": "EQUAL", "mod_revision": "0"})
        ops = [{"request_delete_range": {"key": _b64(k)}} if v is None
               else {"request_put": {"key": _b64(k), "value": _b64(v)}}
               for k, v in writes.items()]
        own = self._own
        if own is not None:
            if len(own) > 100_000:  # notes no watch consumed (e.g. a watch restarted)
                own.clear()
            for k, v in writes.items():
                own[k] = hash(v)
        try:
            lease = None
            for retry in (False, True):
                lease = await self._request_lease(stale=lease)
                body = {"compare": compare, "failure": [{"request_range": {"key": rid}}],
                        "success": ops + [{"request_put": {"key": rid, "lease": str(lease)}}]}
                try:
                    data = await self._call("/v3/kv/txn", body)
                    break
                except NotFound:  # the request-id lease vanished (revoked, restored backup)
                    if retry:
                        raise
            if not data.get("succeeded"):  # the gateway omits "succeeded": false
                if not data["responses"][0]["response_range"].get("kvs"):
                    raise Conflict("etcd: a compared revision changed")
                # an earlier attempt committed: its revision is the request id's
                rev = int(data["responses"][0]["response_range"]["kvs"][0]["mod_revision"])
            else:
                rev = _revision(data)
        except BaseException:
            if own is not None:  # nothing was written (or, if unknown, let it show)
                for k, v in writes.items():
                    if own.get(k) == hash(v):
                        del own[k]
            self.cache.forget(reads)   # a conflict: some were stale
            self.cache.forget(writes)  # outcome unknown: read them afresh
            raise
        self.cache.committed(writes, rev)
        self.commits += 1
        return rev

    # -- write-behind (bmfs/kv/etcd_writeback.py) ----------------------------------------
    def enable_write_behind(self) -> None:
        """Let this client take the write-behind token (a mount does; tools do not)."""
        self.wb.enabled = True

    async def transact(self, fn, attempts: int = 64):
        self._check_open()
        return await self.wb.transact(fn, attempts, super().transact)

    async def commit(self, txn) -> None:
        self._check_open()
        if txn.writes:
            await self.wb.commit(txn)
            self.keys_written += len(txn.writes)

    async def _stale(self, reads):
        """One etcd Txn of compares only: did any key read change since?"""
        compare = [{"key": _b64(k), "target": "MOD", "result": "EQUAL", "mod_revision": str(rev)}
                   for k, rev in reads.items()]
        stale = not (await self._call("/v3/kv/txn", {"compare": compare})).get("succeeded")
        if stale:
            self.cache.forget(reads)
        return stale

    async def _request_lease(self, stale: int | None = None, timeout: float | None = None) -> int:
        """The lease request ids are attached to: renewed every REQ_TTL/2 s, or if ``stale``.

        One task renews it; the others go on with the old lease while it is still valid.
        """
        lease, granted = self._req_lease
        age = trio.current_time() - granted
        if lease != stale and (age < REQ_TTL / 2 or (self._lease_lock.locked()
                                                     and age < REQ_TTL - 60)):
            return lease
        async with self._lease_lock:
            if self._req_lease[0] == lease:  # nobody renewed it meanwhile
                self._req_lease = (await self.grant_lease(REQ_TTL, timeout), trio.current_time())
            return self._req_lease[0]

    async def sync(self):
        """Wait for the write-behind queue: an acknowledged etcd commit is already on
        disk on a quorum."""
        await self.wb.drain(self.timeout)

    async def _aclose(self):
        await self.wb.aclose()
        if self._cache_scope is not None:
            self._cache_scope.cancel()
        self.cache.stopped()
        await self._close_transport()

    # -- the read cache (bmfs/kv/etcd_cache.py) ------------------------------------------
    def start_cache(self) -> None:
        """Keep a read cache current with a watch of the whole keyspace, in a trio system
        task that lives until ``aclose`` (or the end of the trio run)."""
        if self._cache_scope is None:
            self._cache_scope = trio.CancelScope()
            trio.lowlevel.spawn_system_task(self._cache_loop, name="bmfs etcd read cache")

    async def _cache_loop(self):
        with self._cache_scope:
            while True:
                with trio.CancelScope() as self._cache_watch_scope:
                    try:
                        await self._watch(b"\0", b"", False, None, cache=self.cache)
                    except Exception:  # noqa: BLE001 - unreachable or compacted: start afresh
                        pass
                self.cache.stopped()
                await trio.sleep(0.5)

    async def barrier(self) -> bool:
        """Close-to-open: wait until the cache reflects every commit made before this
        call (etcd's current revision, read linearizably), and have another client
        committing behind commit its queue. No-op (False) while this client holds the
        write-behind token: no one else can have committed."""
        if self.wb.exclusive():
            return False
        for _ in range(2):
            if self.cache.live:
                data = await self._call("/v3/kv/range", {"key": _b64(REQ_PREFIX),
                                                         "count_only": True})
                if not await self.cache.wait_for(_revision(data)):
                    self._cache_watch_scope.cancel()  # a stuck watch: start a new one
            # another client committing behind: have it commit what it closed
            holder = await self.wb.holder() if not self.wb.holding else None
            if holder is None:
                break
            await self.wb.recall(holder)
        return True

    # -- history and maintenance (bmfs/kv/etcd_compact.py) -------------------------------
    async def upkeep(self, leads):
        """Keep etcd's history bounded while a mount runs (until cancelled)."""
        await self.compactor.run(leads)

    async def revision(self) -> int:
        """etcd's current revision (read linearizably)."""
        data = await self._call("/v3/kv/range", {"key": _b64(REQ_PREFIX), "count_only": True})
        return _revision(data)

    # -- leases (node liveness) --------------------------------------------------------
    async def grant_lease(self, ttl: int, timeout: float | None = None) -> int:
        """A new lease of ``ttl`` seconds; keys put with it vanish when it expires.

        Raises:
            Unavailable: no quorum within the timeout.
        """
        return int((await self._call("/v3/lease/grant", {"TTL": ttl}, timeout))["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease`` for its full TTL; returns the TTL in seconds.

        Raises:
            NotFound: the lease has expired (its keys are gone).
            Unavailable: no quorum within the timeout.
        """
        ttl = int((await self._call("/v3/lease/keepalive", {"ID": str(lease)})).get("TTL", 0))
        if ttl <= 0:  # the gateway answers an unknown lease with TTL omitted
            raise NotFound(f"etcd lease {lease:x} has expired")
        return ttl

    async def revoke_lease(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys.

        Raises:
            NotFound: the lease has already expired.
            Unavailable: no quorum within the timeout.
        """
        await self._call("/v3/lease/revoke", {"ID": str(lease)})

    async def put_with_lease(self, key: bytes, value: bytes, lease: int) -> None:
        """Put ``key`` outside any transaction, deleted when ``lease`` expires.

        Raises:
            NotFound: the lease has expired.
            Unavailable: no quorum within the timeout.
        """
        await self._call("/v3/kv/put", {"key": _b64(key), "value": _b64(self.seal(key, value)),
                                        "lease": str(lease)})

    # -- watch -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def watch(self, prefix: bytes, end: bytes | None = None, skip_own: bool = False):
        """Changes under ``prefix`` from now on, as ``(key, value or None)`` on a channel::

            async with kv.watch(b"n/") as changes:
                async for key, value in changes: ...

        With ``end``, the changes of keys in ``[prefix, end)`` instead (one stream, in
        revision order). With ``skip_own``, changes committed through this engine
        object are left out (see the module doc). On failover it reconnects to the
        next endpoint and resumes after the last change delivered, so no change is
        lost or repeated.

        Raises:
            Unavailable: (from the ``async with``) no endpoint could be watched for
                ``timeout`` seconds.
            IOFailure: etcd compacted away the revisions needed to resume: changes
                may have been missed, read the state afresh.
            Access: etcd refused the credentials.
        """
        send, recv = trio.open_memory_channel(256)
        try:
            async with trio.open_nursery() as nursery:
                if skip_own and self._own is None:
                    self._own = {}
                await nursery.start(self._watch, prefix, end, skip_own, send)
                try:
                    yield recv
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # trio wraps errors: raise the lone one as is
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from group.exceptions[0].__cause__
            raise

    def _watch_canceled(self, reason: str) -> None:
        """Raise what etcd's cancelling a watch means."""
        if token_expired(reason):
            raise Expired(reason)
        refused = refusal(reason, self.access)
        if refused is not None:
            raise refused
        raise Retry(reason)

    async def _watch(self, prefix, end, skip_own, send, task_status=trio.TASK_STATUS_IGNORED,
                     cache: ReadCache | None = None):
        """The watch loop: changes go to ``send``, or with ``cache``, into the cache."""
        end = prefix_end(prefix) if end is None else end
        req = {"key": _b64(prefix or b"\0"), "range_end": _b64(end or b"\0")}
        # hasleader: the member ends the watch if it loses the leader (partitioned)
        headers = {"Grpc-Metadata-hasleader": "true"}
        started, attempt, errors, reauthenticated = False, 0, {}, False
        deadline = trio.current_time() + self.timeout
        while True:
            i = self._cur
            ep = self.endpoints[i]
            token = self._token
            try:
                async with self._client.stream("POST", ep + "/v3/watch",
                                               headers={**headers, **(self._headers(token) or {})},
                                               json={"create_request": req}) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        self._check(ep + "/v3/watch", resp.status_code, answer_json(ep, resp))
                        raise Retry(f"HTTP {resp.status_code}")
                    async for line in resp.aiter_lines():
                        if not line.strip():
                            continue
                        res = self._check(ep + "/v3/watch", resp.status_code, json.loads(line))
                        if int(res.get("compact_revision", 0)):
                            # the revision to resume from is gone: the caller must read
                            # the state afresh (a new watch starts from now)
                            raise IOFailure(f"etcd watch of {prefix!r}: revisions up to "
                                            f"{res['compact_revision']} compacted")
                        if res.get("canceled"):  # (refused at creation: also "created")
                            self._watch_canceled(res.get("cancel_reason") or "watch canceled")
                        if res.get("created"):
                            now = int(res["header"]["revision"])
                            req.setdefault("start_revision", str(now + 1))
                            attempt, errors, reauthenticated = 0, {}, False
                            if not started:
                                started = True
                                if cache is not None:
                                    cache.started(now)
                                task_status.started()
                        elif cache is not None and not cache.live:
                            raise IOFailure("the read cache gave up waiting for this watch")
                        rev = 0
                        for ev in res.get("events", ()):
                            kv = ev["kv"]
                            rev = int(kv["mod_revision"])
                            req["start_revision"] = str(rev + 1)
                            key = _unb64(kv["key"])
                            value = None if ev.get("type") == "DELETE" else _unb64(kv.get("value"))
                            if cache is not None:
                                cache.changed(key, value, rev)
                                continue
                            if skip_own and self._own.get(key, 0) == hash(value) and \
                                    self._own.pop(key, None) is not None:
                                continue
                            if self.cache.live and self.cache.watch_rev < rev:
                                # whoever acts on this change (e.g. invalidates the
                                # kernel's cache, which then reads again) must read it
                                await self.cache.wait_for(rev)
                            await send.send((key, self.unseal_change(key, value)))
                        if cache is not None and rev:
                            cache.reached(rev)
                errors[ep] = "watch stream ended"
            except Expired as e:
                if not reauthenticated:
                    reauthenticated = True
                    await self._authenticate(token, self.timeout)
                    continue
                errors[ep] = error_text(e)
            except (httpx.HTTPError, ValueError, Retry) as e:
                self._refused_tls(ep, e)
                errors[ep] = error_text(e)
            if attempt == 0:
                deadline = trio.current_time() + self.timeout
            await self._failover(i, attempt, deadline, errors)
            attempt += 1
