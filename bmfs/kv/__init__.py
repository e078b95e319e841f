"""The narrow transactional key-value interface every metadata engine implements.

An engine stores byte keys -> byte values, each with a modification revision. A
transaction is optimistic: reads record the revision they saw (0 = absent), writes are
buffered, and ``commit`` applies the writes only if every key read still has the
revision seen (compare-and-swap), raising :class:`~bmfs.errors.Conflict` otherwise.
This is exactly what etcd's Txn offers, so the namespace above works unchanged on
``memory:``, ``sqlite:PATH`` and ``etcd://host:port,...``.

Engines implement five primitives (``_get``, ``_range``, ``_commit``, ``sync``,
``_aclose``). Everything else (retries, range reads merged with a transaction's own
writes) is written once here. What an engine offers beyond them is declared in its
``caps`` (:class:`Capabilities`): leases, watch, whether it is the volume's only
writer, whether its reads may come from a cache. The methods for all of these are on
this interface, with defaults for engines that lack them (leases: NotSupported; the
read hints: nothing to do), so callers ask ``kv.caps``, never the engine's class.

Checksums: every value is stored sealed (bmfs/kv/seal.py: a crc32c of key and value
after it), sealed by ``Txn.put`` and checked wherever a value is read (``get``,
``range``, a transaction's reads, watch events); a value that fails its check raises
:class:`~bmfs.errors.MetaDamaged` (EIO). Engines store and return sealed values as
they are. ``sealed`` is False only while a volume of a format revision before
checksums is read as it is (``bmfs status``, ``bmfs fsck`` without ``--repair``).

Freshness: an engine may answer reads inside a transaction from a cache (etcd does,
bmfs/kv/etcd_cache.py): the commit compares every revision read, so a stale read can
only make it conflict and retry. Reads of a transaction that is never committed
reflect at least every commit made before the engine's last ``barrier()``; ``get``
outside a transaction is always fresh.
"""
from __future__ import annotations

import abc
import contextlib
import logging
import math
import random
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import trio

from ..errors import Conflict, FsError, NotSupported, Unavailable
from . import seal as _seal

T = TypeVar("T")
log = logging.getLogger(__name__)

ENGINES: dict[str, str] = {
    "memory": "bmfs.kv.memory:MemoryKV",
    "sqlite": "bmfs.kv.sqlite:SqliteKV",
    "etcd": "bmfs.kv.etcd:EtcdKV",
}


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b""  # whole keyspace


def merge_rows(rows, changes, limit: int, fetched: int):
    """A range read with changes not yet in the store applied: ``rows`` are the store's
    ``(key, value, revision)`` in key order, read with limit ``fetched`` (0: none);
    ``changes`` are ``(key, value or None, revision)`` in the same range. The store was
    asked for ``limit`` plus one row per change (deletes can hide that many), so if it
    returned ``fetched`` rows, more may follow its last one: the result stops there
    (changes past it belong to a later page)."""
    if not changes:
        return rows[:limit] if limit else rows
    merged = {k: (v, rev) for k, v, rev in rows}
    for k, v, rev in changes:
        if v is None:
            merged.pop(k, None)
        else:
            merged[k] = (v, rev)
    out = sorted((k, v, rev) for k, (v, rev) in merged.items())
    if fetched and len(rows) >= fetched:
        last = rows[-1][0]
        out = [r for r in out if r[0] <= last]
    return out[:limit] if limit else out


@dataclass(frozen=True)
class Capabilities:
    """What an engine supports beyond the primitives (``KV.caps``)."""

    # This process is the volume's only writer (memory, sqlite: one owner): ``commits``
    # counts every change, so a transaction during which it did not move needs no
    # compare, and nothing changes the volume behind this client's back. False: other
    # clients (mounts, tools) share it.
    single_writer: bool = False
    # grant_lease, keepalive, revoke_lease, put_with_lease: keys that vanish when their
    # owner stops renewing them (etcd). Without: they raise NotSupported.
    leases: bool = False
    # watch(): a stream of committed changes. Every engine here has it; single-writer
    # engines see only their own commits.
    watch: bool = True
    # Reads inside transactions may come from a cache that lags other clients' commits
    # until barrier(); known_empty and prefetch feed it (etcd). Without: they are no-ops.
    read_cache: bool = False


class KV(abc.ABC):
    """A transactional KV store. Create with ``await open_kv(url)``; close with ``aclose``."""

    url: str = ""
    caps: Capabilities = Capabilities()
    # statistics (work done, for tests and `bmfs status`): keys read, keys written,
    # transactions applied through this client
    keys_read: int = 0
    keys_written: int = 0
    commits: int = 0
    closed: bool = False
    # values carry checksums (see the module doc); False: an older volume, read as it is
    sealed: bool = True

    # -- primitives an engine implements ---------------------------------------------
    @abc.abstractmethod
    async def _get(self, key: bytes) -> tuple[bytes | None, int]:
        """Value and revision of ``key`` (``(None, 0)`` if absent)."""

    @abc.abstractmethod
    async def _range(self, start: bytes, end: bytes, limit: int) -> list[tuple[bytes, bytes, int]]:
        """``(key, value, revision)`` for start <= key < end in key order (end b"" = no bound)."""

    @abc.abstractmethod
    async def _commit(self, reads: dict[bytes, int], writes: dict[bytes, bytes | None]) -> None:
        """Apply ``writes`` atomically if every key in ``reads`` has the given revision.

        Raises:
            Conflict: a compared revision changed; nothing was written.
            Unavailable: the store cannot be reached; the commit did not happen, or (for
                engines where an outcome can be unknown) the engine has already
                resolved whether it happened before raising.
        """

    @abc.abstractmethod
    async def sync(self) -> None:
        """Make every commit so far durable on stable storage (a barrier for fsync)."""

    @abc.abstractmethod
    async def _aclose(self) -> None:
        """Release the engine's resources (called once)."""

    # -- the interface used by the layers above ---------------------------------------
    async def aclose(self) -> None:
        """Release the engine's resources; after it every read or commit raises
        ``trio.ClosedResourceError``. Closing twice is harmless."""
        if not self.closed:
            self.closed = True
            await self._aclose()

    def _check_open(self) -> None:
        if self.closed:
            raise trio.ClosedResourceError(f"the metadata engine {self.url} was closed")

    def begin(self) -> "Txn":
        self._check_open()
        return Txn(self)

    def seal(self, key: bytes, value) -> bytes:
        """``value`` as stored under ``key`` (with its checksum)."""
        return _seal.seal(key, value) if self.sealed else bytes(value)

    def unseal(self, key: bytes, raw: bytes) -> bytes:
        """The value stored as ``raw`` under ``key``.

        Raises:
            MetaDamaged: its checksum does not match.
        """
        return _seal.unseal(key, raw) if self.sealed else raw

    def unseal_change(self, key: bytes, raw: bytes | None) -> bytes | None:
        """A watched change's value; one that fails its check is logged and reported as
        a deletion, so watchers drop what they hold and whoever reads it gets EIO."""
        if raw is None or not self.sealed:
            return raw
        try:
            return _seal.unseal(key, raw)
        except FsError as e:
            log.warning("a watched change: %s", e)
            return None

    async def raw_get(self, key: bytes) -> bytes | None:
        """The stored bytes of ``key``, unchecked (format upgrades, fsck)."""
        return (await self._get_fresh(key))[0]

    async def raw_range(self, start: bytes, end: bytes,
                        limit: int = 0) -> list[tuple[bytes, bytes]]:
        """The stored ``(key, bytes)`` in [start, end), unchecked (fsck)."""
        return [(k, v) for k, v, _ in await self._range(start, end, limit)]

    def check_store(self, full: bool) -> list[str]:
        """Problems the engine finds in its own store (fsck); ``full``: look at all of it."""
        return []

    async def _get_fresh(self, key: bytes) -> tuple[bytes | None, int]:
        """Like ``_get``, bypassing any read cache the engine keeps."""
        return await self._get(key)

    async def barrier(self) -> bool:
        """Close-to-open: after this, reads (also cached ones in transactions) reflect
        every commit made, by any client, before it was called. Returns whether reads
        made before it may have been older; engines whose reads are never stale need
        do nothing (False)."""
        return False

    def enable_write_behind(self) -> None:
        """Let this client commit behind where the engine can (etcd: a mount does, see
        bmfs/kv/etcd_writeback.py; tools do not). Others commit at once anyway."""

    def statistics(self) -> dict:
        """Engine-specific counters for `bmfs status --json` (``meta_engine``)."""
        return {}

    async def upkeep(self, leads: Callable[[], Awaitable[bool]]) -> None:
        """The engine's own housekeeping, run by every mount until cancelled; work that
        one mount of a volume does is done while ``leads()`` says this one leads
        (etcd: compacting its history, bmfs/kv/etcd_compact.py). None here."""

    def known_empty(self, prefixes) -> None:
        """Hint: no key under any of ``prefixes`` exists yet (the keys of an inode number
        just allocated). Engines with a read cache use it to answer reads there locally."""

    async def prefetch(self, prefix: bytes) -> None:
        """Hint: keys under ``prefix`` are about to be looked up (a directory where a
        name was not found: files are being created). Engines with a read cache may
        read the prefix whole once and answer later lookups there locally."""

    # -- leases (caps.leases) -------------------------------------------------------------
    async def grant_lease(self, ttl: int, timeout: float | None = None) -> int:
        """A new lease of ``ttl`` seconds; keys put with it vanish when it expires.

        Raises:
            NotSupported: the engine has no leases (``caps.leases`` False).
            Unavailable: the store cannot be reached within the timeout.
        """
        raise NotSupported(f"{self.url}: this metadata engine has no leases")

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease`` for its full TTL; returns the TTL in seconds.

        Raises:
            NotFound: the lease has expired (its keys are gone).
            NotSupported, Unavailable: as grant_lease.
        """
        raise NotSupported(f"{self.url}: this metadata engine has no leases")

    async def revoke_lease(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys.

        Raises:
            NotFound: the lease has already expired.
            NotSupported, Unavailable: as grant_lease.
        """
        raise NotSupported(f"{self.url}: this metadata engine has no leases")

    async def put_with_lease(self, key: bytes, value: bytes, lease: int) -> None:
        """Put ``key`` outside any transaction, deleted when ``lease`` expires.

        Raises:
            NotFound: the lease has expired.
            NotSupported, Unavailable: as grant_lease.
        """
        raise NotSupported(f"{self.url}: this metadata engine has no leases")

    # -- watch (caps.watch) ---------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def watch(self, prefix: bytes, end: bytes | None = None,
                    skip_own: bool = False) -> AsyncIterator[trio.MemoryReceiveChannel]:
        """Changes under ``prefix`` (with ``end``: in ``[prefix, end)``) committed from
        now on, in commit order, as ``(key, value or None)`` on a channel::

            async with kv.watch(b"n/") as changes:
                async for key, value in changes: ...

        With ``skip_own``, changes committed through this engine object are left out
        (a single-writer engine then delivers nothing). This one serves engines whose
        commits all go through this object (memory, sqlite); etcd watches the cluster.

        Raises:
            NotSupported: the engine has no watch (``caps.watch`` False).
        """
        if not self.caps.watch:
            raise NotSupported(f"{self.url}: this metadata engine has no watch")
        self._check_open()
        send, recv = trio.open_memory_channel(math.inf)  # commits cannot wait for readers
        entry = (prefix, prefix_end(prefix) if end is None else end, skip_own, send)
        watchers = self.__dict__.setdefault("_watchers", [])
        watchers.append(entry)
        try:
            yield recv
        finally:
            watchers.remove(entry)
            send.close()

    def _published(self, writes: dict[bytes, bytes | None]) -> None:
        """Hand a commit's ``writes`` to this object's watches (engines that serve
        ``watch`` themselves call it after each commit)."""
        for start, end, skip_own, send in self.__dict__.get("_watchers", ()):
            if skip_own:
                continue
            for k, v in writes.items():
                if k >= start and (not end or k < end):
                    send.send_nowait((k, self.unseal_change(k, v)))

    async def get(self, key: bytes) -> bytes | None:
        """Latest committed value, outside any transaction (never from a cache)."""
        self._check_open()
        v = (await self._get_fresh(key))[0]
        return None if v is None else self.unseal(key, v)

    async def range(self, start: bytes, end: bytes, limit: int = 0) -> list[tuple[bytes, bytes]]:
        self._check_open()
        return [(k, self.unseal(k, v)) for k, v, _ in await self._range(start, end, limit)]

    async def commit(self, txn: "Txn") -> None:
        self._check_open()
        if txn.writes:
            unchanged = self.caps.single_writer and txn.epoch == self.commits
            await self._commit({} if unchanged else txn.reads, txn.writes)
            self.keys_written += len(txn.writes)

    async def transact(self, fn: Callable[["Txn"], Awaitable[T]], attempts: int = 64) -> T:
        """Run ``fn(txn)`` and commit, retrying on conflict with a fresh transaction.

        ``fn`` must not have side effects outside the transaction (it may run several
        times). Raises Unavailable if it keeps conflicting.

        If ``fn`` raises, its reads may not have been one consistent state (with
        several writers, another commit can land between two reads): the error stands
        only if every key read still has the revision seen; otherwise it was a
        conflict, and ``fn`` runs again.
        """
        self._check_open()
        for attempt in range(attempts):
            txn = self.begin()
            try:
                result = await fn(txn)
            except Exception:
                if not txn.reads or not await self._changed_since(txn):
                    raise
                await trio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
                continue
            try:
                await self.commit(txn)
                return result
            except Conflict:
                await trio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        raise Unavailable("metadata transaction kept conflicting")

    async def _changed_since(self, txn: "Txn") -> bool:
        """Whether a key ``txn`` read has changed since (False if that cannot be told)."""
        if self.caps.single_writer and txn.epoch == self.commits:
            return False
        try:
            return await self._stale(txn.reads)
        except Exception:  # noqa: BLE001 - the store failed: let the original error stand
            return False

    async def _stale(self, reads: dict[bytes, int]) -> bool:
        """Whether a key in ``reads`` no longer has the given revision. Engines may do
        this in one request (etcd: a transaction of compares only)."""
        for key, rev in reads.items():
            if (await self._get(key))[1] != rev:
                return True
        return False


class Txn:
    """An optimistic transaction: records read revisions, buffers writes (sealed: the
    engines commit them as they are)."""

    __slots__ = ("kv", "reads", "writes", "epoch", "_got")

    def __init__(self, kv: KV):
        self.kv = kv
        self.epoch = kv.commits
        self.reads: dict[bytes, int] = {}
        self.writes: dict[bytes, bytes | None] = {}
        self._got: dict[bytes, bytes | None] = {}  # values read by get: each read once

    async def get(self, key: bytes) -> bytes | None:
        kv = self.kv
        if key in self.writes:
            v = self.writes[key]
            return v if v is None or not kv.sealed else v[:-_seal.SEAL_BYTES]
        if key in self._got:  # the commit compares its revision: no need to ask again
            return self._got[key]
        value, rev = await kv._get(key)
        kv.keys_read += 1
        self.reads.setdefault(key, rev)
        if value is not None and kv.sealed:
            value = _seal.unseal(key, value)  # (damaged: raises, its read recorded)
        if self.reads[key] == rev:
            self._got[key] = value
        return value

    async def range(self, start: bytes, end: bytes, limit: int = 0) -> list[tuple[bytes, bytes]]:
        """Keys in [start, end) as seen by this transaction (its own writes included).

        Only the keys returned are compared at commit; a key inserted into the range
        by someone else is not detected (callers guard such ranges with a key they
        read and write, e.g. the parent directory's inode).
        """
        rows = await self.kv._range(start, end, limit)
        self.kv.keys_read += len(rows)
        out: dict[bytes, bytes | None] = {}
        for k, v, rev in rows:
            self.reads.setdefault(k, rev)
            out[k] = v
        for k, v in self.writes.items():
            if k >= start and (not end or k < end):
                out[k] = v
        items = sorted((k, v) for k, v in out.items() if v is not None)
        if limit and len(rows) >= limit:
            # keys past the engine's last row may be incomplete: cut there
            last = rows[-1][0]
            items = [kv for kv in items if kv[0] <= last]
        if limit:
            items = items[:limit]
        if not self.kv.sealed:
            return items
        unseal = _seal.unseal
        return [(k, unseal(k, v)) for k, v in items]

    def put(self, key: bytes, value: bytes) -> None:
        self.writes[key] = self.kv.seal(key, value)

    def delete(self, key: bytes) -> None:
        self.writes[key] = None


async def open_kv(url: str, shared: bool = False, cache: bool = True) -> KV:
    """Open the engine named by the URL's scheme (``memory:``, ``sqlite:PATH``, ``etcd://...``).
    ``shared``: for a direct client beside other processes; an engine with one owner
    (sqlite) is then opened read-only beside other readers (SqliteKV.open_shared).
    ``cache=False``: no read cache (``caps.read_cache``: etcd's is fed by a watch of
    the whole keyspace, which costs etcd and this process a decoded copy of every
    change), for a long-lived process that reads little, e.g. a storage node's
    membership record."""
    scheme = url.split(":", 1)[0]
    if scheme not in ENGINES:
        raise ValueError(f"unknown metadata engine {scheme!r} in {url!r}; "
                         f"known: {', '.join(sorted(ENGINES))}")
    import importlib
    mod, cls = ENGINES[scheme].split(":")
    engine = getattr(importlib.import_module(mod), cls)
    if shared and hasattr(engine, "open_shared"):
        return await engine.open_shared(url)
    if not cache and engine.caps.read_cache:
        return await engine.create(url, cache=False)
    return await engine.create(url)
