"""Level 3: random vfs operations over the SQLite engine, every engine answer checked.

The SQLite engine answers reads from pending commits, a read cache and complete
prefixes (bmfs/kv/sqlite.py). Here every `_get` and `_range` it answers is compared
with the truth (pending commits, then SQL), through random files, directories,
symlinks, hard links, renames, unlinks, xattrs, writes, snapshots, branches, merges
with a strategy, snapshot deletes with GC, and syncs, with limits small enough that
batches, cache trims and forgotten prefixes happen all the time. Each run ends with
fsck (open_fs), so a merge that leaves a broken tree fails too.
"""
import os
import random

import pytest
import trio

from bmfs.config import SqliteLimits
from bmfs.errors import FsError
from bmfs.kv import sqlite as engine
from bmfs.meta import branches as br
from bmfs.meta import merge
from bmfs.meta import trees
from vfsutil import open_fs, read_file, write_file

ROOT = 1
S_IFMT, S_IFDIR, S_IFREG = 0o170000, 0o040000, 0o100000


def _truth_get(kv, key):
    p = kv._pending.get(key)
    if p is not None:
        return p if p[0] is not None else (None, 0)
    row = kv._db.execute("SELECT v, rev FROM kv WHERE k=?", (key,)).fetchone()
    return (row[0], row[1]) if row else (None, 0)


def _truth_range(kv, start, end, limit):
    """SQLite's rows with the pending commits laid over them, whole, then cut."""
    if end:
        sql = kv._db.execute("SELECT k, v, rev FROM kv WHERE k>=? AND k<?", (start, end))
    else:
        sql = kv._db.execute("SELECT k, v, rev FROM kv WHERE k>=?", (start,))
    rows = {k: (v, rev) for k, v, rev in sql}
    rows.update((k, p) for k, p in kv._pending.items() if start <= k and (not end or k < end))
    out = sorted((k, v, rev) for k, (v, rev) in rows.items() if v is not None)
    return out[:limit] if limit else out


@pytest.fixture
def checked(monkeypatch, use_config):
    """Small limits, and every engine read compared with the truth."""
    use_config(sqlite=SqliteLimits(apply_keys=40, cache_keys=200, cache_bytes=40000,
                                   complete_prefixes=60, complete_keys=300))
    get, rng_, keep = engine.SqliteKV._get, engine.SqliteKV._range, engine.SqliteKV._keep
    seen = {"complete": 0}

    async def _get(self, key):
        got = await get(self, key)
        assert tuple(got) == tuple(_truth_get(self, key)), key
        return got

    async def _range(self, start, end, limit):
        want = _truth_range(self, start, end, limit)
        if self._complete and self._from_complete(start, end, limit) is not None:
            seen["complete"] += 1
        got = await rng_(self, start, end, limit)
        assert [tuple(r) for r in got] == [tuple(r) for r in want], (start, end, limit)
        return got

    def _keep(self, values):
        keep(self, values)
        assert self._cache_bytes == sum(len(v) for v, _ in self._cache.values() if v)
    monkeypatch.setattr(engine.SqliteKV, "_get", _get)
    monkeypatch.setattr(engine.SqliteKV, "_range", _range)
    monkeypatch.setattr(engine.SqliteKV, "_keep", _keep)
    return seen


async def _step(fs, rng, views, step, counter):
    """One random operation in one of the writable trees."""
    vid = rng.choice(views)
    view = fs.views.by_id[vid] if vid else None
    root = (vid << 48) | ROOT
    dirs = [root] + [a.ino for _, a in await fs.readdir(root)
                     if (await fs.getattr(a.ino)).mode & S_IFMT == S_IFDIR]
    d = rng.choice(dirs)
    files = [(n, a.ino) for n, a in await fs.readdir(d)]
    name = b"n%d" % rng.randrange(30)
    op = rng.random()
    if op < 0.2:
        await write_file(fs, d, name, os.urandom(rng.choice([0, 10, 3000, 20000])))
    elif op < 0.3:
        await fs.mkdir(d, name, 0o755, 0, 0)
    elif op < 0.35:
        await fs.symlink(d, name, b"target%d" % step, 0, 0)
    elif op < 0.75 and files:
        n, ino = rng.choice(files)
        if op < 0.45:
            await fs.link(ino, rng.choice(dirs), name)
        elif op < 0.55:
            await fs.rename(d, n, rng.choice(dirs), name)
        elif op < 0.65:
            await (fs.unlink if rng.random() < 0.5 else fs.rmdir)(d, n)
        elif rng.random() < 0.6:
            await fs.setxattr(ino, b"user.%d" % rng.randrange(3), b"v%d" % step)
        else:
            await fs.removexattr(ino, b"user.%d" % rng.randrange(3))
    elif op < 0.8 and files:
        _, ino = rng.choice(files)
        if (await fs.getattr(ino)).mode & S_IFMT == S_IFREG:
            await read_file(fs, ino)
            fh = await fs.open(ino, os.O_RDWR)
            await fs.files.write(fh, rng.randrange(100), b"x" * rng.choice([5, 5000]))
            await fs.files.release(fh)
    elif op < 0.87:
        counter[0] += 1
        source = view.name if view else "main"
        if op < 0.84:
            await br.op_snapshot_create(fs.kv, "s%d" % counter[0], source)
            await fs.views.refresh()
        else:
            await br.op_branch_create(fs.kv, "b%d" % counter[0], source)
            await fs.views.refresh()
            views.append((await fs.views.add("branch", "b%d" % counter[0])).id)
    elif op < 0.9 and len(views) > 1:
        source = fs.views.by_id[rng.choice(views[1:])].name
        strategy = rng.choice(["theirs", "ours"])
        await merge.op_merge(fs.kv, source, "main", strategy=strategy)  # refused: FsError
        await fs.views.refresh()
    elif op < 0.93:
        snaps = await trees.list_names(fs.kv, "snapshot")
        if snaps:
            await br.op_snapshot_delete(fs.kv, rng.choice(snaps))
            await fs.views.refresh()
            await fs.volume_gc()
    elif op < 0.95:
        await fs.kv.sync()


# a longer hunt: BMFS_ORACLE_SEEDS=40 pytest tests/test_t3_oracle.py
@pytest.mark.parametrize("seed", range(int(os.environ.get("BMFS_ORACLE_SEEDS", "4"))))
def test_random_operations_read_back_exactly(tmp_path, checked, seed):
    rng = random.Random(seed)

    async def main():
        async with open_fs(tmp_path / "vol") as fs:
            views, counter = [0], [0]
            for step in range(400):
                try:
                    await _step(fs, rng, views, step, counter)
                except FsError:
                    pass  # a refused operation (EEXIST, ENOTEMPTY, a merge conflict...)
    trio.run(main)
    assert checked["complete"] > 0  # the answers from memory were exercised
