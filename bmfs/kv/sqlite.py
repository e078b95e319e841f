"""SQLite engine: the embedded default for one machine.

WAL mode with ``synchronous=NORMAL``: a commit is durable against a crash of the
process as soon as it returns (the WAL is written with write(2)), and :meth:`sync`
fsyncs the WAL for power-loss durability, which fsync(2)/fsyncdir on the mount call.
One process owns the database (an exclusive lock file), so the optimistic
compare-and-swap never conflicts across processes; it still guards concurrent trio
tasks of that process. Calls run on the event loop thread: each is a B-tree lookup
of microseconds, cheaper than a hop to a worker thread.
"""
from __future__ import annotations

import fcntl
import os
import sqlite3

from ..errors import Conflict, VolumeError
from . import KV


class SqliteKV(KV):
    single_writer = True  # one process owns the database (lock file)

    def __init__(self, url, db, lockfd, path):
        self.url = url
        self._db = db
        self._lockfd = lockfd
        self._path = path
        self._rev = db.execute("SELECT coalesce(max(rev), 0) FROM kv").fetchone()[0]
        self.commits = 0

    @classmethod
    async def create(cls, url: str) -> "SqliteKV":
        path = url.split(":", 1)[1]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError("sqlite: URL needs a path, e.g. sqlite:/var/lib/bmfs/meta.db")
        lockfd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lockfd)
            raise VolumeError(f"{path} is in use by another bmfs process (mounted already?)")
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
        return cls(url, db, lockfd, path)

    async def _get(self, key):
        row = self._db.execute("SELECT v, rev FROM kv WHERE k=?", (key,)).fetchone()
        return (row[0], row[1]) if row else (None, 0)

    async def _range(self, start, end, limit):
        q = "SELECT k, v, rev FROM kv WHERE k>=?"
        args: list = [start]
        if end:
            q += " AND k<?"
            args.append(end)
        q += " ORDER BY k"
        if limit:
            q += " LIMIT ?"
            args.append(limit)
        return self._db.execute(q, args).fetchall()

    async def _commit(self, reads, writes):
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            for k, rev in reads.items():
                row = db.execute("SELECT rev FROM kv WHERE k=?", (k,)).fetchone()
                if (row[0] if row else 0) != rev:
                    raise Conflict(k)
            self._rev += 1
            dels = [(k,) for k, v in writes.items() if v is None]
            puts = [(k, v, self._rev) for k, v in writes.items() if v is not None]
            if dels:
                db.executemany("DELETE FROM kv WHERE k=?", dels)
            if puts:
                db.executemany("INSERT OR REPLACE INTO kv (k, v, rev) VALUES (?,?,?)", puts)
            db.execute("COMMIT")
            self.commits += 1
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def sync(self):
        try:
            fd = os.open(self._path + "-wal", os.O_RDONLY)
        except FileNotFoundError:
            fd = os.open(self._path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def aclose(self):
        if self._db is not None:
            self._db.close()
            self._db = None
            os.close(self._lockfd)
