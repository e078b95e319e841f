"""Level 1: the SQLite engine's redo log (bmfs/kv/sqlite.py).

Commits are appended to a redo log and applied to SQLite in batches: what a commit
returned must survive the process dying before any batch was applied, a log torn by
a power loss must give a prefix of the commits, and reads must see pending commits
exactly as if they were in SQLite. The last test does it on a real mount, killed -9.
"""
import os
import subprocess
import sys
import textwrap

import trio

from bmfs.config import SqliteLimits
from bmfs.kv import open_kv
from bmfs.kv import sqlite as engine
from bmfs.kv.seal import seal
import pytest

from bmfs.errors import VolumeError
from mountutil import Mounted, assert_fsck_clean, bmfs

CRASHER = textwrap.dedent("""
    import os, sys, trio
    from bmfs.kv import open_kv

    async def main():
        kv = await open_kv(sys.argv[1])
        for i in range(300):
            t = kv.begin()
            t.put(b"k%04d" % i, b"v%d" % i)
            if i % 3 == 0 and i:
                t.delete(b"k%04d" % (i - 1))
            await kv.commit(t)
        os._exit(0)  # dies like kill -9: no close, nothing flushed by us
    trio.run(main)
""")


def _expected():
    want = {}
    for i in range(300):
        want[b"k%04d" % i] = b"v%d" % i
        if i % 3 == 0 and i:
            want.pop(b"k%04d" % (i - 1))
    return want


def test_commits_survive_the_process_dying(tmp_path):
    url = f"sqlite:{tmp_path}/meta.db"
    subprocess.run([sys.executable, "-c", CRASHER, url], check=True)
    assert os.path.getsize(f"{tmp_path}/meta.db-redo") > 0  # they were only in the log

    async def main():
        kv = await open_kv(url)
        assert dict(await kv.range(b"k", b"l")) == _expected()
        await kv.aclose()
        assert os.path.getsize(f"{tmp_path}/meta.db-redo") == 0  # replayed, then cut
        kv = await open_kv(url)
        assert dict(await kv.range(b"k", b"l")) == _expected()
        await kv.aclose()
    trio.run(main)


def test_torn_log_gives_a_prefix_and_stale_records_are_not_replayed(tmp_path):
    url = f"sqlite:{tmp_path}/meta.db"
    subprocess.run([sys.executable, "-c", CRASHER, url], check=True)
    log = f"{tmp_path}/meta.db-redo"
    buf = open(log, "rb").read()
    records = engine._records(buf)[0]
    assert len(records) == 300
    # a power loss: the tail half written, and records of before a cut behind new ones
    # (the engine stores values sealed: bmfs/kv/seal.py)
    first_two = engine._record(1, {b"a": seal(b"a", b"1")}) + \
        engine._record(2, {b"a": seal(b"a", b"2")})
    stale = engine._record(1, {b"a": seal(b"a", b"old")})
    with open(log, "wb") as f:
        f.write(first_two + stale + buf[:len(buf) // 2])

    async def main():
        kv = await open_kv(url)
        assert await kv.get(b"a") == b"2"
        assert await kv.range(b"k", b"l") == []
        await kv.aclose()
    trio.run(main)


def _crashed_log(tmp_path) -> tuple[str, bytes, list[int]]:
    """The CRASHER's volume: its URL, its redo log and the offset of each record."""
    url = f"sqlite:{tmp_path}/meta.db"
    subprocess.run([sys.executable, "-c", CRASHER, url], check=True)
    buf = open(f"{tmp_path}/meta.db-redo", "rb").read()
    offsets, pos = [], 0
    while pos < len(buf):
        offsets.append(pos)
        pos += engine._REC.size + engine._REC.unpack_from(buf, pos)[0]
    assert len(offsets) == 300
    return url, buf, offsets


def _open_and_read(url):
    async def main():
        kv = await open_kv(url)
        try:
            return dict(await kv.range(b"k", b"l"))
        finally:
            await kv.aclose()
    return trio.run(main)


def test_a_torn_tail_is_dropped_quietly(tmp_path, caplog):
    """A crash mid-write leaves the last record short: replay drops it, no warning."""
    url, buf, offsets = _crashed_log(tmp_path)
    with open(f"{tmp_path}/meta.db-redo", "wb") as f:
        f.write(buf[:len(buf) - 3])
    got = _open_and_read(url)
    assert got[b"k0298"] == b"v298" and b"k0299" not in got
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_damaged_last_record_is_dropped_with_a_warning(tmp_path, caplog):
    """A whole last record that fails its checksum: the volume opens without it, and
    the log says where and how much was dropped."""
    url, buf, offsets = _crashed_log(tmp_path)
    bad = bytearray(buf)
    bad[offsets[-1] + engine._REC.size + engine._BODY.size + 2] ^= 0x10
    with open(f"{tmp_path}/meta.db-redo", "wb") as f:
        f.write(bad)
    got = _open_and_read(url)
    assert got[b"k0298"] == b"v298" and b"k0299" not in got
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1, warned
    assert f"offset {offsets[-1]}" in warned[0]
    assert f"last {len(buf) - offsets[-1]} bytes" in warned[0]


@pytest.mark.parametrize("where", ["body", "length"])
def test_a_damaged_record_before_valid_ones_refuses_to_open(tmp_path, where):
    """A damaged record in the middle of the log: replaying up to it would drop the
    commits after it, which were acknowledged. Opening is refused, naming the offset;
    the log and the database are left as they were."""
    url, buf, offsets = _crashed_log(tmp_path)
    bad = bytearray(buf)
    at = offsets[150]
    bad[at + (engine._REC.size + engine._BODY.size + 1 if where == "body" else 1)] ^= 0x40
    with open(f"{tmp_path}/meta.db-redo", "wb") as f:
        f.write(bad)
    with pytest.raises(VolumeError) as e:
        _open_and_read(url)
    assert f"record at offset {at} is damaged" in str(e.value)
    assert open(f"{tmp_path}/meta.db-redo", "rb").read() == bad  # not cut
    # cutting the log where the message says opens the commits before the damage
    os.truncate(f"{tmp_path}/meta.db-redo", at)
    got = _open_and_read(url)
    assert got[b"k0148"] == b"v148" and b"k0150" not in got


def test_mount_and_fsck_refuse_a_log_damaged_in_the_middle(volume, tmp_path):
    """On a volume: `bmfs mount` and `bmfs fsck` say it in one line, exit 2."""
    mp = tmp_path / "mnt"
    with Mounted(volume, mp) as m:
        for i in range(50):
            os.mkdir(os.path.join(m.mp, f"d{i}"))
        m.kill9()
    log = os.path.join(volume, "meta.db-redo")
    buf = open(log, "rb").read()
    records = engine._records(buf)[0]
    assert len(records) >= 40
    bad = bytearray(buf)
    at = len(buf) // 2
    bad[at] ^= 0xFF  # inside some record in the middle
    with open(log, "wb") as f:
        f.write(bad)
    for cmd in (["fsck", volume], ["mount", mp, "--volume", volume]):
        res = bmfs(*cmd, check=False)
        assert res.returncode == 2, (cmd, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "is damaged and valid records follow it" in lines[0] \
            and "meta.db-redo" in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert open(log, "rb").read() == bad


def test_reads_merge_pending_commits(tmp_path):
    """Pending puts and deletes over rows already in SQLite, through get, range and
    range with a limit (a limit must not stop short because of pending deletes)."""
    async def main():
        kv = await open_kv(f"sqlite:{tmp_path}/meta.db")
        t = kv.begin()
        for i in range(20):
            t.put(b"r%02d" % i, b"old%d" % i)
        await kv.commit(t)
        await kv.sync()  # now in SQLite itself
        assert not kv._pending
        model = {b"r%02d" % i: b"old%d" % i for i in range(20)}
        t = kv.begin()
        for i in range(0, 12):  # the first 12 rows deleted, pending
            t.delete(b"r%02d" % i)
            model.pop(b"r%02d" % i)
        t.put(b"r05x", b"new")  # a pending row between deleted ones
        t.put(b"r15", b"changed")
        model[b"r05x"] = b"new"
        model[b"r15"] = b"changed"
        await kv.commit(t)
        assert kv._pending
        want = sorted(model.items())
        assert await kv.range(b"r", b"s") == want
        for limit in (1, 2, 3, 5, 30):
            assert await kv.range(b"r", b"s", limit) == want[:limit]
        assert await kv.range(b"r", b"", 2) == want[:2]
        assert await kv.get(b"r03") is None and await kv.get(b"r15") == b"changed"
        # a transaction that read a pending key conflicts like any other
        t1, t2 = kv.begin(), kv.begin()
        await t1.get(b"r15")
        await t2.get(b"r15")
        t2.put(b"r15", b"t2")
        await kv.commit(t2)
        t1.put(b"r15", b"t1")
        from bmfs.errors import Conflict
        try:
            await kv._commit(t1.reads, t1.writes)
            raise AssertionError("a stale read of a pending key did not conflict")
        except Conflict:
            pass
        await kv.aclose()
    trio.run(main)


def test_batches_are_applied_as_commits_go_on(tmp_path, use_config):
    use_config(sqlite=SqliteLimits(apply_keys=64))

    async def main():
        kv = await open_kv(f"sqlite:{tmp_path}/meta.db")
        for i in range(500):
            t = kv.begin()
            t.put(b"b%04d" % i, b"x" * 100)
            await kv.commit(t)
        assert len(kv._pending) < 64
        assert kv._db.execute("SELECT count(*) FROM kv").fetchone()[0] > 400
        assert len(await kv.range(b"b", b"c")) == 500
        await kv.aclose()
    trio.run(main)


async def _commit_random(kv, rng, model, chosen, step, big):
    """One commit putting or (30%) deleting each key of ``chosen``, in ``model`` too;
    a share ``big`` of the values are too large to be cached (inline file data)."""
    t = kv.begin()
    for k in chosen:
        if rng.random() < 0.3:
            t.delete(k)
            model.pop(k, None)
        else:
            v = b"%d" % step * (300 if rng.random() < big else 1)
            t.put(k, v)
            model[k] = v
    await kv.commit(t)


def test_read_cache_follows_commits_and_batches(tmp_path, use_config):
    """Single-key reads come from a cache of what SQLite holds (read or applied
    lately, values up to CACHE_VALUE_MAX bytes, CACHE_BYTES in all): every get must
    still equal a model through puts, deletes, values growing past the limit,
    batches applied, absent keys read before they exist, the cache trimmed (by keys
    and by bytes), and a reopen; a transaction's compare sees the same revisions as
    SQLite's rows; no large value is kept, and the bytes kept are counted right."""
    import random
    use_config(sqlite=SqliteLimits(apply_keys=16, cache_keys=40, cache_value_max=600,
                                   cache_bytes=3000))
    rng = random.Random(5)
    keys = [b"c%03d" % i for i in range(120)]
    model: dict = {}

    async def check(kv):
        for k in rng.sample(keys, 60):
            assert await kv.get(k) == model.get(k), k
        for k in rng.sample(keys, 10):  # the revision compared is SQLite's own
            t = kv.begin()
            await t.get(k)
            if k in kv._pending:
                v, rev = kv._pending[k]
                want = rev if v is not None else 0
            else:
                row = kv._db.execute("SELECT rev FROM kv WHERE k=?", (k,)).fetchone()
                want = row[0] if row else 0
            assert t.reads[k] == want, k

    async def main():
        kv = await open_kv(f"sqlite:{tmp_path}/meta.db")
        for step in range(300):
            await _commit_random(kv, rng, model, rng.sample(keys, 3), step, 0.2)
            if step % 25 == 0:
                await check(kv)
        assert 0 < len(kv._cache) <= 40
        assert all(v is None or len(v) <= 600 for v, _ in kv._cache.values())
        assert kv._cache_bytes == sum(len(v) for v, _ in kv._cache.values() if v) <= 3000
        await check(kv)
        await kv.sync()
        await check(kv)
        for v in (b"small", b"L" * 5000, b"small again"):  # grows past the limit and back
            t = kv.begin()
            t.put(b"grow", v)
            await kv.commit(t)
            await kv.sync()
            assert await kv.get(b"grow") == v
            model[b"grow"] = v
        await kv.aclose()
        kv = await open_kv(f"sqlite:{tmp_path}/meta.db")
        assert {k: v for k, v in await kv.range(b"c", b"d")} == \
            {k: v for k, v in model.items() if k.startswith(b"c")}
        await check(kv)
        await kv.aclose()
    trio.run(main)


def test_metadata_operations_survive_kill9_of_the_mount(volume, tmp_path):
    """Completed creates, renames and unlinks, with no fsync, are there after kill -9."""
    mp = tmp_path / "mnt"
    with Mounted(volume, mp) as m:
        d = os.path.join(m.mp, "d")
        os.mkdir(d)
        for i in range(200):
            with open(os.path.join(d, f"f{i}"), "wb") as f:
                f.write(b"%d" % i * 100)
        for i in range(0, 200, 2):
            os.unlink(os.path.join(d, f"f{i}"))
        os.rename(os.path.join(d, "f1"), os.path.join(m.mp, "moved"))
        m.kill9()
    with Mounted(volume, mp) as m:
        d = os.path.join(m.mp, "d")
        assert sorted(os.listdir(d)) == sorted(f"f{i}" for i in range(3, 200, 2))
        with open(os.path.join(d, "f99"), "rb") as f:
            assert f.read() == b"99" * 100
        with open(os.path.join(m.mp, "moved"), "rb") as f:
            assert f.read() == b"1" * 100
    assert_fsck_clean(volume)


def test_a_failed_batch_does_not_fail_the_commit(tmp_path, use_config):
    """A batch that cannot be applied (disk full, I/O error) leaves the commit that
    triggered it done: reported as failed, the operation would be retried and run
    twice. The batch stays pending and the next sync applies it."""
    import sqlite3
    use_config(sqlite=SqliteLimits(apply_keys=4))

    async def main():
        kv = await open_kv(f"sqlite:{tmp_path}/meta.db")
        real, failures = kv._apply, []

        def failing():
            failures.append(1)
            raise sqlite3.OperationalError("database or disk is full")
        kv._apply = failing
        for i in range(6):
            t = kv.begin()
            t.put(b"f%d" % i, b"v")
            await kv.commit(t)  # does not raise
        assert failures and await kv.get(b"f5") == b"v"
        kv._apply = real
        await kv.sync()
        assert kv._db.execute("SELECT count(*) FROM kv").fetchone()[0] == 6
        await kv.aclose()
    trio.run(main)


def test_complete_prefixes_follow_commits_and_answer_from_memory(tmp_path, use_config):
    """Prefixes declared empty (``known_empty``, as for a new inode's keys) are
    answered from memory afterwards, gets and whole-prefix ranges alike: they must
    equal a model through puts, deletes, large values (not cached: read from SQLite
    instead), batches applied, the cache and the prefix set trimmed, and a reopen;
    and a whole-prefix range of a new prefix runs no SQL at all."""
    import random
    use_config(sqlite=SqliteLimits(apply_keys=16, cache_keys=60, complete_prefixes=12,
                                   complete_keys=30, complete_prefix_keys=3))
    rng = random.Random(11)
    model: dict = {}
    prefixes: list[bytes] = []

    def under(p):
        return {k: v for k, v in model.items() if k.startswith(p)}

    async def check(kv):
        for p in rng.sample(prefixes, min(len(prefixes), 8)):
            want = sorted(under(p).items())
            assert await kv.range(p, p + b"\xff") == want, p  # (not the prefix's end)
            from bmfs.kv import prefix_end
            assert await kv.range(p, prefix_end(p)) == want, p
            assert await kv.range(p, prefix_end(p), limit=2) == want[:2], p
            for k in [p + b"%d" % i for i in range(4)]:
                assert await kv.get(k) == model.get(k), k

    async def main():
        kv = await open_kv(f"sqlite:{tmp_path}/meta.db")
        statements = []
        kv._db.set_trace_callback(statements.append)
        for step in range(400):
            if step % 10 == 0:  # a new inode: its prefixes are empty (nested ones too)
                p = b"n/%04d/" % step
                prefixes.extend([p, p + b"1"])
                kv.known_empty([p, p + b"1"])
                if step == 0:
                    statements.clear()
                    assert await kv.range(p, p[:-1] + b"0") == []
                    assert await kv.get(p + b"0") is None
                    assert statements == [], statements
            chosen = [rng.choice(prefixes) + b"%d" % rng.randrange(4) for _ in range(3)]
            await _commit_random(kv, rng, model, chosen, step, 0.1)
            if step % 20 == 0:
                await check(kv)
        assert len(kv._complete) <= 12
        assert kv._complete_count == sum(map(len, kv._complete.values())) <= 30
        assert all(len(keys) <= 3 for keys in kv._complete.values())
        await kv.sync()
        await check(kv)
        await kv.aclose()
        kv = await open_kv(f"sqlite:{tmp_path}/meta.db")  # nothing known: all from SQLite
        assert not kv._complete
        await check(kv)
        await kv.aclose()
    trio.run(main)


def test_shared_readers_see_the_log_and_keep_owners_out(tmp_path):
    """open_shared (a direct client): readers beside each other read what a crashed
    owner left in the redo log without applying it, refuse commits (EROFS), and keep
    an owner from opening the database meanwhile; an owner keeps them out."""
    import errno
    import pytest
    from bmfs.errors import ReadOnly, VolumeError
    url = f"sqlite:{tmp_path}/meta.db"
    subprocess.run([sys.executable, "-c", CRASHER, url], check=True)
    log_size = os.path.getsize(f"{tmp_path}/meta.db-redo")

    async def main():
        a = await open_kv(url, shared=True)
        b = await open_kv(url, shared=True)
        for kv in (a, b):
            assert dict(await kv.range(b"k", b"l")) == _expected()
            assert await kv.get(b"k0001") == b"v1"
        t = a.begin()
        t.put(b"x", b"y")
        with pytest.raises(ReadOnly) as e:
            await a.commit(t)
        assert e.value.errno == errno.EROFS
        with pytest.raises(VolumeError, match="in use"):
            await open_kv(url)
        await a.aclose()
        await b.aclose()
        assert os.path.getsize(f"{tmp_path}/meta.db-redo") == log_size  # not applied
        owner = await open_kv(url)
        with pytest.raises(VolumeError, match="in use"):
            await open_kv(url, shared=True)
        assert dict(await owner.range(b"k", b"l")) == _expected()
        await owner.aclose()
    trio.run(main)
