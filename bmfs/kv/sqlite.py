"""SQLite engine: the embedded default for one machine.

Caveat first: a commit is not an SQLite transaction. It is appended to a redo log
(``PATH-redo``, one write(2) of a checksummed record) and kept in memory; batches of
commits are applied to SQLite later in one transaction each (``apply_keys`` keys, or
at sync/close; the limits named here are config.SqliteLimits). An SQLite commit
writes every B-tree page it touched to the WAL (a small-file unlink touches ~8
pages: ~16 write calls and 32 KiB); the log record is
one call of a few hundred bytes, and a batch shares the pages. Reads see the pending
commits first, so nothing above can tell. Single-key reads then look in a cache of
what SQLite holds for keys read or applied lately (``cache_keys``; absent keys too;
values up to ``cache_value_max`` bytes, ``cache_bytes`` of them in all: a small
file's inline data is one), exact because this process is the
database's only writer: an unlink reads ~6 keys, most of them just written or read
by the operations before it. Range reads of a prefix the layer above said was empty
when it allocated an inode number (``known_empty``: its chunks, xattrs, ...) are
answered from memory too: the engine keeps the keys written under such a prefix
since (``complete_prefixes`` prefixes, ``complete_keys`` keys in all, a prefix with
over ``complete_prefix_keys`` forgotten), so unlinking a file made by this mount
scans neither its chunks nor its xattrs in SQLite.

Durability, as before: a commit survives a crash of the process as soon as it
returns (its record is in the page cache), and :meth:`sync`, which fsync(2)/fsyncdir
on the mount call, applies what is pending and fsyncs SQLite's WAL. The log is cut
back only then, once everything it holds is durable in SQLite, so after a power loss
replaying it (from the start, stopping at the first torn record) restores a prefix
of the commits: SQLite's state is always a prefix of the log's, and replay rewrites
whole values in order, so replaying records already applied changes nothing. Opening
the database replays the log (also in `bmfs fsck`). A damaged record with valid newer
ones after it is refused rather than replayed past or dropped (``_records``); a power
loss that kept a later page of the log but not an earlier one looks the same, and is
refused too: the operator decides to cut the log there.

WAL mode with ``synchronous=NORMAL`` underneath. One process owns the database (an
exclusive lock file), so the optimistic compare-and-swap never conflicts across
processes; it still guards concurrent trio tasks of that process. Calls run on the
event loop thread: each is a B-tree lookup of microseconds, cheaper than a hop to a
worker thread.

Damage: a database SQLite cannot open is refused (VolumeError); a read that SQLite
finds damaged, or a range read whose keys are out of order on disk (a key changed in
place: the B-tree scan would stop at it, and a listing end early), raises MetaDamaged
(EIO). ``check_store`` runs SQLite's own integrity check (fsck).
"""
from __future__ import annotations

import bisect
import fcntl
import itertools
import logging
import os
import sqlite3
import struct

from crc32c import crc32c

from ..config import get_settings
from ..errors import Conflict, InUse, InUseHere, MetaDamaged, VolumeError
from . import KV, Capabilities, merge_rows, prefix_end

log = logging.getLogger(__name__)
_REC = struct.Struct("<II")  # record: body length, crc32c of the body; body follows
_BODY = struct.Struct("<QI")  # body: revision, number of entries; entries follow
_ENTRY = struct.Struct("<II")  # entry: key length, value length + 1 (0: a delete)
# revisions after the last one replayed that a search past a damaged record looks for:
# more records than that damaged in a row go unnoticed (replay stops at the first)
RESYNC_REVS = 256


def _record(rev: int, writes: dict) -> bytes:
    parts = [_BODY.pack(rev, len(writes))]
    for k, v in writes.items():
        parts.append(_ENTRY.pack(len(k), 0 if v is None else len(v) + 1))
        parts.append(k)
        if v is not None:
            parts.append(v)
    body = b"".join(parts)
    return _REC.pack(len(body), crc32c(body)) + body


def _records(buf: bytes, floor: int = 0, name: str = "the redo log") -> tuple[list, int, str]:
    """The intact records at the head of the log, ``[(rev, [(key, value or None)])]``,
    the offset where they end, and why they end there: ``"end"`` (all of it read),
    ``"torn"`` (a last record whose length runs past the end: a write cut short by a
    crash), ``"stale"`` (a record whose revision does not follow: one of before a
    cut, left behind the new ones by a power loss; already in SQLite, and older), or
    ``"damaged"`` (a whole record that fails its crc32c).

    Raises:
        VolumeError: valid records newer than ``floor`` (SQLite's own revision) and
            than those read follow a torn or damaged one: replaying the head alone
            would silently drop commits that were acknowledged.
    """
    pos, last, out = 0, -1, []
    while pos < len(buf):
        if pos + _REC.size > len(buf):
            why = "torn"
            break
        n, crc = _REC.unpack_from(buf, pos)
        body = buf[pos + _REC.size:pos + _REC.size + n]
        if len(body) != n or n < _BODY.size or crc32c(body) != crc:
            why = "torn" if len(body) != n else "damaged"
            break
        rev, count = _BODY.unpack_from(body)
        if rev <= last:
            return out, pos, "stale"
        last = rev
        at, entries = _BODY.size, []
        for _ in range(count):
            klen, vlen = _ENTRY.unpack_from(body, at)
            at += _ENTRY.size
            key = body[at:at + klen]
            at += klen
            entries.append((key, body[at:at + vlen - 1] if vlen else None))
            at += max(vlen - 1, 0)
        out.append((rev, entries))
        pos += _REC.size + n
    else:
        return out, pos, "end"
    after = _next_record(buf, pos + 1, max(last, floor))
    if after is not None:
        raise VolumeError(
            f"{name}: the record at offset {pos} is damaged and valid records follow "
            f"it (from offset {after}): refusing to drop committed metadata; to open "
            f"the volume without the commits from offset {pos} on, cut the log there "
            f"(truncate -s {pos} {name}) and run bmfs fsck")
    return out, pos, why


def _next_record(buf: bytes, start: int, floor: int) -> int | None:
    """The offset of an intact record at or after ``start`` whose revision is among the
    ``RESYNC_REVS`` after ``floor`` (the next ones a lost record would be followed by),
    or None. Found by the revision's bytes, not by trying every offset: the log may
    be tens of MiB."""
    for rev in range(floor + 1, floor + 1 + RESYNC_REVS):
        pattern = struct.pack("<Q", rev)
        at = buf.find(pattern, start + _REC.size)
        while at >= 0:
            pos = at - _REC.size
            n, crc = _REC.unpack_from(buf, pos)
            if n >= _BODY.size and pos + _REC.size + n <= len(buf) and \
                    crc32c(buf[at:at + n]) == crc:
                return pos
            at = buf.find(pattern, at + 1)
    return None


def _holds(keys: list[bytes], key: bytes) -> bool:
    i = bisect.bisect_left(keys, key)
    return i < len(keys) and keys[i] == key


def _open_own(path: str, flags: int) -> int:
    """``path`` opened (made 0600 with O_CREAT) without following a link, and only if
    it is a file of ours: the database may sit in a directory others write, where a
    link planted in advance would have the redo log written (and emptied) through it.

    Raises:
        VolumeError: a link, or not a plain file of ours.
    """
    from ..ownfile import check_own_file
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:  # (ELOOP; EACCES when the link is another's in a sticky directory)
        if os.path.islink(path):
            raise VolumeError(f"{path} is a symbolic link: the metadata database's files "
                              f"are not written through one") from None
        raise
    try:
        check_own_file(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _locked(url: str, how: int) -> tuple[str, int]:
    """The database path of ``url`` and its lock file, locked ``how`` (LOCK_EX: the
    owner; LOCK_SH: readers beside each other, no owner).

    Raises:
        VolumeError: a symbolic link among its files. InUse (a VolumeError): the
            lock is taken.
    """
    path = url.split(":", 1)[1]
    if path.startswith("//"):
        path = path[2:]
    if not path:
        raise ValueError("sqlite: URL needs a path, e.g. sqlite:/var/lib/bmfs/meta.db")
    for name in (path, path + "-wal", path + "-shm"):  # (SQLite's follow links)
        if os.path.islink(name):
            raise VolumeError(f"{name} is a symbolic link: the metadata database "
                              f"and its files are not written through one")
    lockfd = _open_own(path + ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lockfd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lockfd)
        if _held_here(path + ".lock"):
            raise InUseHere(
                f"{path} is in use by this process already: another client of the "
                f"volume is open here (a one-machine volume has one writer, and no "
                f"reader beside it: a writable bmfs.connect or fsspec instance writes "
                f"one branch); close that one first, or mount the volume and use every "
                f"branch through the mount") from None
        raise InUse(f"{path} is in use by another bmfs process (mounted already?)") \
            from None
    return path, lockfd


def _held_here(lock: str) -> bool:
    """Whether this process has ``lock`` open (the lock file of a database it owns or
    reads: flock's locks belong to an open file, so a second open here conflicts)."""
    target = os.path.realpath(lock)
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                return True
        except OSError:
            pass
    return False


class SqliteKV(KV):
    caps = Capabilities(single_writer=True)  # one process owns the database (lock file)

    def __init__(self, url, db, lockfd, path, read_only=False):
        self.url = url
        self.read_only = read_only
        self._db = db
        self._lockfd = lockfd
        self._path = path
        self.limits = get_settings().sqlite  # (config.SqliteLimits)
        self._rev = db.execute("SELECT coalesce(max(rev), 0) FROM kv").fetchone()[0]
        self.commits = 0
        # committed, not yet applied to SQLite: key -> (value or None, revision), and
        # the same keys sorted (range reads merge them in)
        self._pending: dict[bytes, tuple[bytes | None, int]] = {}
        self._pending_keys: list[bytes] = []
        # key -> (value or None, revision) as SQLite has it, for keys read or applied
        # lately: exact, since nothing but this process writes the database
        self._cache: dict[bytes, tuple[bytes | None, int]] = {}
        self._cache_bytes = 0  # of the values in _cache
        # prefix -> sorted keys that exist under it, every one (see known_empty)
        self._complete: dict[bytes, list[bytes]] = {}
        self._complete_lengths: set[int] = set()
        self._complete_count = 0  # keys in the lists
        self._log = -1 if read_only else \
            _open_own(path + "-redo", os.O_RDWR | os.O_CREAT | os.O_APPEND)
        self._log_size = 0

    @classmethod
    async def create(cls, url: str) -> "SqliteKV":
        path, lockfd = _locked(url, fcntl.LOCK_EX)
        try:
            return cls._open(url, path, lockfd)
        except sqlite3.DatabaseError as e:
            os.close(lockfd)
            raise VolumeError(f"{path}: the metadata database cannot be read ({e})")
        except BaseException:
            os.close(lockfd)
            raise

    @classmethod
    async def open_shared(cls, url: str) -> "SqliteKV":
        """The database opened read-only beside other readers, for a direct client
        (bmfs/client): the lock file is held shared, so no owner (a mount, a writing
        client, fsck) can take the database meanwhile, and readers never see it
        change. Commits the last owner left in the redo log (it crashed) are read
        from it, not applied. Commits raise ReadOnly (EROFS).

        Raises:
            VolumeError: the database is owned by another process (mounted), or
                cannot be read.
        """
        path, lockfd = _locked(url, fcntl.LOCK_SH)
        try:
            # (no owner can write while the shared lock is held: plain read-only
            # access, no WAL index needed between readers)
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA query_only=1")
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
            kv = cls(url, db, lockfd, path, read_only=True)
            kv._take_log(os.O_RDONLY | os.O_CREAT)
            return kv
        except sqlite3.DatabaseError as e:
            os.close(lockfd)
            raise VolumeError(f"{path}: the metadata database cannot be read ({e})")
        except BaseException:
            os.close(lockfd)
            raise

    @classmethod
    def _open(cls, url: str, path: str, lockfd: int) -> "SqliteKV":
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        # one process owns the database: no file locking on every transaction
        db.execute("PRAGMA locking_mode=EXCLUSIVE")
        db.execute("PRAGMA wal_autocheckpoint=8192")
        # Truncate the WAL when a checkpoint resets it, so later commits append instead
        # of rewriting it from the start: a WAL frame (24 + 4096 bytes) straddles OS
        # pages, and once those pages left the page cache (memory pressure, dropped
        # caches) every frame written over them first waits for a read of the old page
        # from disk. Small-file unlinks after a cache drop: ~1,300 -> ~1,800/s.
        db.execute("PRAGMA journal_size_limit=0")
        db.execute("PRAGMA cache_size=-65536")
        db.execute("CREATE TABLE IF NOT EXISTS kv (k BLOB PRIMARY KEY, v BLOB NOT NULL, "
                   "rev INTEGER NOT NULL) WITHOUT ROWID")
        kv = None
        try:
            kv = cls(url, db, lockfd, path)
            kv._replay()
        except BaseException:
            if kv is not None:
                os.close(kv._log)
            db.close()
            raise
        return kv

    def check_store(self, full: bool) -> list[str]:
        """SQLite's integrity check (``full``) or its quicker structural one."""
        try:
            rows = self._db.execute("PRAGMA integrity_check" if full
                                    else "PRAGMA quick_check").fetchall()
        except sqlite3.DatabaseError as e:
            return [f"metadata database {self._path}: {e}"]
        return [f"metadata database {self._path}: {r[0]}" for r in rows if r[0] != "ok"]

    def _replay(self) -> None:
        """Apply the redo log left by the last owner (it crashed, or lost power).

        Raises:
            VolumeError: a damaged record with valid newer ones after it.
        """
        self._take_log(os.O_RDONLY)
        self._cut_log()

    def _take_log(self, flags: int) -> None:
        """Remember the commits of the redo log (opened with ``flags``) as pending ones.

        Raises:
            VolumeError: a damaged record with valid newer ones after it.
        """
        log_path = self._path + "-redo"
        with os.fdopen(_open_own(log_path, flags), "rb") as f:
            buf = f.read()
        records, end, why = _records(buf, self._rev, log_path)
        if why == "damaged":
            log.warning("metadata redo log %s: the record at offset %d fails its "
                        "checksum; replay ends there, dropping its last %d bytes "
                        "(%d records replayed)", log_path, end, len(buf) - end,
                        len(records))
        elif why != "end":
            log.info("metadata redo log %s: %s record at offset %d: %d bytes not "
                     "replayed", log_path, why, end, len(buf) - end)
        for rev, entries in records:
            for key, value in entries:
                self._remember(key, value, rev)
            self._rev = max(self._rev, rev)

    # -- reads: pending commits first ----------------------------------------------------
    async def _get(self, key):
        pending = self._pending.get(key)
        if pending is not None:
            return pending if pending[0] is not None else (None, 0)
        got = self._cache.get(key)
        if got is None and self._complete:
            keys = self._complete_keys(key)
            if keys is not None and not _holds(keys, key):
                return (None, 0)
        if got is None:
            try:
                row = self._db.execute("SELECT v, rev FROM kv WHERE k=?", (key,)).fetchone()
            except sqlite3.DatabaseError as e:
                raise MetaDamaged(f"metadata database {self._path}: {e}")
            got = (row[0], row[1]) if row else (None, 0)
            self._keep({key: got})
        return got

    def _keep(self, values: dict) -> None:
        """Remember values SQLite now holds (not those over limits.cache_value_max bytes,
        whose keys are forgotten instead); past limits.cache_keys keys or
        limits.cache_bytes of values, the oldest go, down to three quarters of both."""
        cache = self._cache
        for k, got in values.items():
            old = cache.pop(k, None)  # (kept again at the end: the newest)
            if old is not None and old[0] is not None:
                self._cache_bytes -= len(old[0])
            if got[0] is None:
                cache[k] = got
            elif len(got[0]) <= self.limits.cache_value_max:
                cache[k] = got
                self._cache_bytes += len(got[0])
        if len(cache) > self.limits.cache_keys or self._cache_bytes > self.limits.cache_bytes:
            limits = self.limits
            keys_left, bytes_left = limits.cache_keys * 3 // 4, limits.cache_bytes * 3 // 4
            for k in list(cache):
                if len(cache) <= keys_left and self._cache_bytes <= bytes_left:
                    break
                v = cache.pop(k)[0]
                if v is not None:
                    self._cache_bytes -= len(v)

    def known_empty(self, prefixes) -> None:
        for p in prefixes:
            self._complete_count -= len(self._complete.pop(p, ()))
            self._complete[p] = []
            self._complete_lengths.add(len(p))
        if len(self._complete) > self.limits.complete_prefixes:
            self._forget_complete(len(self._complete) - self.limits.complete_prefixes // 2)

    def _forget_complete(self, n: int) -> None:
        """Forget the ``n`` oldest complete prefixes."""
        for p in list(itertools.islice(self._complete, n)):
            self._complete_count -= len(self._complete.pop(p))

    def _complete_keys(self, key: bytes) -> list[bytes] | None:
        """The key list of a complete prefix ``key`` lies under, if any (each is exact,
        nested ones too)."""
        for n in self._complete_lengths:
            keys = self._complete.get(key[:n])
            if keys is not None:
                return keys
        return None

    def _note_complete(self, key: bytes, present: bool) -> None:
        """``key`` now exists (or not): update the list of every complete prefix it
        lies under; one that grows past limits.complete_prefix_keys is forgotten."""
        for n in self._complete_lengths:
            keys = self._complete.get(key[:n])
            if keys is None:
                continue
            i = bisect.bisect_left(keys, key)
            there = i < len(keys) and keys[i] == key
            if there and not present:
                del keys[i]
                self._complete_count -= 1
            elif present and not there:
                keys.insert(i, key)
                self._complete_count += 1
                if len(keys) > self.limits.complete_prefix_keys:
                    del self._complete[key[:n]]
                    self._complete_count -= len(keys)
        if self._complete_count > self.limits.complete_keys:
            self._forget_complete(len(self._complete) // 2)

    def _from_complete(self, start, end, limit):
        """A range read over a whole complete prefix, from memory; None if it is not
        one, or a value is neither pending nor cached (a large one)."""
        keys = self._complete.get(start)
        if keys is None or end != prefix_end(start):
            return None
        rows = []
        for k in keys[:limit] if limit else keys:
            got = self._pending.get(k) or self._cache.get(k)
            if got is None or got[0] is None:
                return None
            rows.append((k, got[0], got[1]))
        return rows

    async def _range(self, start, end, limit):
        if self._complete:
            rows = self._from_complete(start, end, limit)
            if rows is not None:
                return rows
        keys = self._pending_keys
        lo = bisect.bisect_left(keys, start)
        hi = bisect.bisect_left(keys, end) if end else len(keys)
        # pending deletes can hide up to hi - lo of the rows SQLite returns
        sql_limit = limit + hi - lo if limit else 0
        try:
            rows = self._select(start, end, sql_limit)
        except sqlite3.DatabaseError as e:
            raise MetaDamaged(f"metadata database {self._path}: {e}")
        return merge_rows(rows, [(k, *self._pending[k]) for k in keys[lo:hi]], limit,
                          sql_limit)

    def _select(self, start: bytes, end: bytes, limit: int) -> list:
        """SQLite's rows in [start, end), at most ``limit`` (0: all). The scan runs on
        past ``end`` by two rows: a key changed in place on disk is out of order, and
        SQLite, which stops at the first key >= end, would end the range there without
        a word; the row after it, smaller, gives it away."""
        if not end:
            q = "SELECT k, v, rev FROM kv WHERE k>=? ORDER BY k"
            return self._db.execute(q + (" LIMIT ?" if limit else ""),
                                    (start, limit) if limit else (start,)).fetchall()
        cur = self._db.execute("SELECT k, v, rev FROM kv WHERE k>=? ORDER BY k", (start,))
        try:
            rows = []
            for row in cur:
                if row[0] >= end:
                    after = cur.fetchone()
                    if after is not None and after[0] < row[0]:
                        raise MetaDamaged(f"metadata database {self._path}: key {row[0]!r} "
                                          "is out of order (changed on disk?)", row[0])
                    break
                rows.append(row)
                if limit and len(rows) >= limit:
                    break
            return rows
        finally:
            cur.close()

    # -- commits: a redo record now, SQLite in batches -----------------------------------
    async def _commit(self, reads, writes):
        if self.read_only:
            from ..errors import ReadOnly
            raise ReadOnly("the metadata is open read-only (beside other readers)")
        for k, rev in reads.items():
            if (await self._get(k))[1] != rev:
                raise Conflict(k)
        rec = _record(self._rev + 1, writes)
        if os.write(self._log, rec) != len(rec):  # (a regular file: only on a full disk)
            raise OSError("short write to the metadata redo log")
        self._rev += 1
        self._log_size += len(rec)
        for k, v in writes.items():
            self._remember(k, v, self._rev)
        self.commits += 1
        self._published(writes)
        if len(self._pending) >= self.limits.apply_keys:
            # The commit is done: a failure to apply the batch must not be reported as
            # its failure (a retry would run the operation twice). It stays pending,
            # in memory and in the log, and the next batch or sync() tries again.
            try:
                self._apply()
                if self._log_size >= self.limits.log_max:
                    self._cut_log()
            except (sqlite3.Error, OSError) as e:
                log.warning("applying metadata commits to SQLite failed (will retry): %s", e)

    def _remember(self, key: bytes, value: bytes | None, rev: int) -> None:
        if key not in self._pending:
            bisect.insort(self._pending_keys, key)
        self._pending[key] = (value, rev)
        if self._complete:
            self._note_complete(key, value is not None)

    def _apply(self) -> None:
        """Write the pending commits to SQLite in one transaction."""
        if not self._pending:
            return
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            dels = [(k,) for k, (v, _) in self._pending.items() if v is None]
            puts = [(k, v, rev) for k, (v, rev) in self._pending.items() if v is not None]
            if dels:
                db.executemany("DELETE FROM kv WHERE k=?", dels)
            if puts:
                db.executemany("INSERT OR REPLACE INTO kv (k, v, rev) VALUES (?,?,?)", puts)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self._keep({k: (v, rev) if v is not None else (None, 0)
                    for k, (v, rev) in self._pending.items()})
        self._pending.clear()
        self._pending_keys.clear()

    def _sync_sqlite(self) -> None:
        try:
            fd = os.open(self._path + "-wal", os.O_RDONLY)
        except FileNotFoundError:
            fd = os.open(self._path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _cut_log(self) -> None:
        """Apply what is pending, make SQLite durable, then empty the redo log."""
        self._apply()
        self._sync_sqlite()
        os.ftruncate(self._log, 0)
        self._log_size = 0

    async def sync(self):
        if not self.read_only:
            self._cut_log()

    async def _aclose(self):
        if self._db is not None and self.read_only:
            self._db.close()
            self._db = None
            os.close(self._lockfd)
        if self._db is not None:
            self._cut_log()
            self._db.close()
            self._db = None
            os.close(self._log)
            os.close(self._lockfd)
