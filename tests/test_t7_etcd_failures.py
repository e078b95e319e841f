"""Level 7: mounts of one etcd volume while etcd fails (a real 3-member cluster).

- the leader is SIGKILLed under a metadata-heavy load from two mounts: operations stall
  briefly (printed), then continue; nothing acknowledged is lost; fsck is clean;
- etcd unreachable at mount time: `bmfs mount` exits 2 with one line, quickly;
- etcd without a quorum while mounted: operations fail with EIO after the engine's
  timeout (no hang), and work again once the quorum is back;
- a transaction over etcd's limits fails at once with an error naming the flag.
"""
import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import trio

from bmfs.errors import IOFailure
from bmfs.kv import open_kv
from etcd_cluster import etcd_cluster  # noqa: F401  (the fixture)
from mountutil import Mounted, assert_fsck_clean, bmfs, is_mounted
from multimount import etcd_volume, run_worker


def test_leader_kill_under_metadata_load(etcd_cluster, tmp_path):
    stop = str(tmp_path / "stop")
    leader = None
    try:
        with etcd_volume(etcd_cluster, tmp_path, 2) as mounts:
            workers = [run_worker("metaload", m.mp, f"w{i}", 60, stop_file=stop)
                       for i, m in enumerate(mounts)]
            try:
                time.sleep(2)
                leader = etcd_cluster.leader_index()
                killed_at = time.time()
                etcd_cluster.kill(leader)
                time.sleep(5)
                open(stop, "w").close()
                results = [w.result(timeout=60) for w in workers]
            finally:
                for w in workers:
                    w.stop()
            stalls = []
            for i, r in enumerate(results):
                times = [t for _, t in r["acks"]]
                before = [t for t in times if t <= killed_at]
                after = [t for t in times if t > killed_at]
                assert before and len(after) > 10, f"worker {i}: {len(before)} before, " \
                                                   f"{len(after)} after the kill"
                # the longest time without an acknowledgement, across the kill
                stalls.append(max(b - a for a, b in zip([before[-1]] + after,
                                                        after)))
                assert after[-1] - killed_at > 3  # and it kept going
            print(f"\netcd leader (member {leader}) SIGKILLed under 2 mounts' metadata load: "
                  f"operations stalled {max(stalls):.2f} s "
                  f"(per mount: {', '.join(f'{s:.2f}' for s in stalls)}); "
                  f"{sum(len(r['acks']) for r in results)} operations acknowledged")
            assert max(stalls) < 10
            for i, r in enumerate(results):  # nothing acknowledged is lost, on either mount
                for m in mounts:
                    names = set(os.listdir(f"{m.mp}/w{i}"))
                    missing = [n for n, _ in r["acks"] if n not in names]
                    assert not missing, f"{m.mp}/w{i}: lost {missing[:5]}"
                for n, _ in r["acks"][:: max(1, len(r["acks"]) // 50)]:
                    with open(f"{mounts[1 - i].mp}/w{i}/{n}", "rb") as f:
                        assert f.read() == f"w{i}:{int(n[1:])}".encode()
        # etcd_volume unmounted both and ran fsck: clean
    finally:
        if leader is not None:
            etcd_cluster.restart(leader)


def _unreachable_url() -> tuple[str, list]:
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)                # accepts into the backlog, never answers
    hosts = [f"127.0.0.1:{s.getsockname()[1]}" for s in (refused, silent)]
    return "etcd://" + ",".join(hosts), [refused, silent]


def test_etcd_unreachable_at_mount(etcd_cluster, tmp_path):
    etcd_cluster.wipe()
    bmfs("mkfs", tmp_path / "vol", "--meta", etcd_cluster.url)
    info = json.load(open(tmp_path / "vol" / "volume.json"))
    url, socks = _unreachable_url()
    try:
        info["meta"] = url
        os.makedirs(tmp_path / "elsewhere")
        json.dump(info, open(tmp_path / "elsewhere" / "volume.json", "w"))
        os.makedirs(tmp_path / "mnt")
        t0 = time.monotonic()
        res = bmfs("mount", tmp_path / "mnt", "--volume", tmp_path / "elsewhere", check=False,
                   timeout=60)
        took = time.monotonic() - t0
    finally:
        for s in socks:
            s.close()
    print(f"\nbmfs mount with etcd unreachable: exit {res.returncode} after {took:.1f} s: "
          f"{res.stderr.strip()}")
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "etcd cluster unavailable" in res.stderr
    assert took < 12
    assert not is_mounted(tmp_path / "mnt")


def test_wrong_etcd_credentials_at_mount(etcd_cluster, tmp_path):
    """A volume whose etcd password file no longer holds the password, or whose URL
    names a client key that is gone: `bmfs mount` exits 2 with one line saying so."""
    etcd_cluster.wipe()
    creds = etcd_cluster.creds
    pw, key = tmp_path / "password", tmp_path / "client.key"
    pw.write_bytes(open(creds.password_file, "rb").read())
    key.write_bytes(open(creds.key, "rb").read())
    url = etcd_cluster.url.replace(creds.password_file, str(pw)).replace(creds.key, str(key))
    bmfs("mkfs", tmp_path / "vol", "--meta", url)
    os.makedirs(tmp_path / "mnt")
    pw.write_text("an old password\n")
    res = bmfs("mount", tmp_path / "mnt", "--volume", tmp_path / "vol", check=False, timeout=60)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "authentication failed" in res.stderr and str(pw) in res.stderr
    pw.write_bytes(open(creds.password_file, "rb").read())
    key.unlink()
    res = bmfs("mount", tmp_path / "mnt", "--volume", tmp_path / "vol", check=False, timeout=60)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "cannot use the client certificate" in res.stderr and str(key) in res.stderr
    assert not is_mounted(tmp_path / "mnt")


def _timed(cmd: list[str], timeout: float = 60) -> tuple[int, str, float]:
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stderr.strip(), time.monotonic() - t0


def test_etcd_quorum_lost_while_mounted(etcd_cluster, tmp_path):
    """Without a quorum, operations fail with EIO after the engine's timeout (10 s), a
    new mount fails at once; when the quorum is back, the mount works again and what
    it had acknowledged is there."""
    down = []
    try:
        with etcd_volume(etcd_cluster, tmp_path, 1) as (m,):
            with open(f"{m.mp}/before", "wb") as f:
                f.write(b"kept")
            for i in (0, 1):
                etcd_cluster.kill(i)
                down.append(i)
            # the mount commits behind (docs/etcd.md, write-behind): a mkdir may be
            # queued, but fsync of its directory cannot succeed, and once the queue is
            # known stuck, every change fails with EIO
            probe = ("import os, sys\ntry:\n    os.mkdir(sys.argv[1])\n"
                     "    os.fsync(os.open(os.path.dirname(sys.argv[1]), os.O_RDONLY))\n"
                     "except OSError as e:\n    sys.exit(e.errno)\n")
            code, _, took = _timed([sys.executable, "-c", probe, f"{m.mp}/during"])
            print(f"\nmkdir + fsync without an etcd quorum: errno {code} after {took:.1f} s")
            assert code == errno.EIO and took < 25
            code, _, took = _timed([sys.executable, "-c", probe, f"{m.mp}/during2"])
            print(f"mkdir without an etcd quorum, queue stuck: errno {code} after {took:.1f} s")
            assert code == errno.EIO and took < 25
            os.makedirs(tmp_path / "m2")
            code, err, took = _timed([sys.executable, "-m", "bmfs.cli.main", "mount",
                                      str(tmp_path / "m2"), "--volume", str(tmp_path / "vol")])
            print(f"bmfs mount without an etcd quorum: exit {code} after {took:.1f} s: {err}")
            assert code == 2 and len(err.splitlines()) == 1 and took < 12
            for i in down:
                etcd_cluster.restart(i)
            down.clear()
            t0 = time.monotonic()
            while True:  # the engine backs off; the next operation goes through
                try:
                    os.mkdir(f"{m.mp}/after")
                    break
                except OSError as e:
                    assert e.errno == errno.EIO and time.monotonic() - t0 < 30
            with open(f"{m.mp}/before", "rb") as f:
                assert f.read() == b"kept"
            # the queued mkdir was acknowledged: committed once etcd answered again
            assert sorted(os.listdir(m.mp)) == ["after", "before", "during"]
    finally:
        for i in down:
            etcd_cluster.restart(i)


def test_write_behind_holder_killed(etcd_cluster, tmp_path):
    """The mount committing behind (it holds the write-behind token) is killed -9: what
    it fsync'ed is kept, what it had not is a prefix of its operations (as ordered
    metadata journaling gives after a crash), the other mount takes over within the
    token's lease time and fsck is clean."""
    from bmfs.kv.etcd_writeback import LEASE_TTL
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        d = f"{a.mp}/d"
        os.mkdir(d)

        def content(i):
            return b"%d." % i * (i % 50 + 1)
        for i in range(400):
            with open(f"{d}/f{i}", "wb") as f:
                f.write(content(i))
            if i == 199:
                fd = os.open(d, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        assert a.ctl("status")["result"]["meta_engine"]["write_behind"]["holding"]
        a.kill9()
        t0 = time.monotonic()
        with open(f"{b.mp}/d/after", "wb") as f:  # waits for a's token to lapse
            f.write(b"b")
        took = time.monotonic() - t0
        names = set(os.listdir(f"{b.mp}/d")) - {"after"}
        n = len(names)
        print(f"\nwrite-behind holder killed -9: {n - 200} of 200 unsynced files kept; "
              f"the other mount's first create took {took:.1f} s")
        assert names == {f"f{i}" for i in range(n)}, "not a prefix of the operations"
        assert n >= 200 and took < LEASE_TTL + 5
        for i in range(n):
            with open(f"{b.mp}/d/f{i}", "rb") as f:
                got = f.read()
            # the last file may have been created but not yet written
            assert got == content(i) or (i == n - 1 and got == b""), f"f{i}: {got[:20]!r}"


def test_write_behind_holder_paused(etcd_cluster, tmp_path):
    """The holder's daemon is stopped (SIGSTOP) past its token's lease: the other mount
    goes on after the lease lapses; once resumed, the holder notices it may no longer
    decide alone, and its next operations commit as usual: nothing either mount
    acknowledged is lost, both see everything, no error logged, fsck clean."""
    import signal
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        for i in range(20):
            with open(f"{a.mp}/a{i}", "wb") as f:
                f.write(b"a%d" % i)
        assert a.ctl("status")["result"]["meta_engine"]["write_behind"]["holding"]
        os.kill(a.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with open(f"{b.mp}/b0", "wb") as f:
                f.write(b"b0")
            took = time.monotonic() - t0
            time.sleep(2)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        for i in range(1, 20):
            with open(f"{b.mp}/b{i}", "wb") as f:
                f.write(b"b%d" % i)
            with open(f"{a.mp}/a{20 + i}", "wb") as f:
                f.write(b"a%d" % (20 + i))
        want = {f"a{i}" for i in range(40) if i != 20} | {f"b{i}" for i in range(20)}
        print(f"\nholder stopped: the other mount's first create took {took:.1f} s")
        for m in (a, b):
            assert set(os.listdir(m.mp)) == want
            for name in want:
                with open(f"{m.mp}/{name}", "rb") as f:
                    assert f.read() == name.encode()


def test_transaction_over_etcd_limits_fails_at_once(etcd_cluster):
    etcd_cluster.wipe()

    async def main():
        kv = await open_kv(etcd_cluster.url)
        try:
            for n, size, flag in ((etcd_cluster.max_txn_ops + 1, 1, "--max-txn-ops"),
                                  (1, etcd_cluster.max_request_bytes + (1 << 20),
                                   "--max-request-bytes")):
                txn = kv.begin()
                for i in range(n):
                    txn.put(b"big/%d" % i, b"x" * size)
                t0 = trio.current_time()
                with pytest.raises(IOFailure, match=flag):
                    await kv.commit(txn)
                assert trio.current_time() - t0 < 3
        finally:
            await kv.aclose()
    trio.run(main)


def test_mount_records_and_orphans_of_dead_mounts(etcd_cluster, tmp_path):
    """A mount holds a leased m/ record; a file it holds unlinked-but-open is left alone
    by other mounts while it lives, and freed by them once it has died."""
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        async def keys(prefix):
            kv = await open_kv(etcd_cluster.url)
            try:
                return dict(await kv.range(prefix, prefix[:-1] + b"0"))
            finally:
                await kv.aclose()
        records = trio.run(keys, b"m/")
        assert sorted(json.loads(v)["pid"] for v in records.values()) == sorted([a.pid, b.pid])
        with open(f"{a.mp}/held", "wb") as f:
            f.write(b"x" * 100)
        fd = os.open(f"{a.mp}/held", os.O_RDONLY)
        os.unlink(f"{a.mp}/held")
        assert len(trio.run(keys, b"o/")) == 1
        # b sweeps orphans every few seconds: a's stays while a lives
        c = Mounted(tmp_path / "vol", tmp_path / "c")  # a new mount reaps at start too
        with c:
            time.sleep(6)
            assert os.pread(fd, 100, 0) == b"x" * 100
            a.kill9()  # dies holding it: its record expires (10 s lease), then b frees it
            t0 = time.monotonic()
            while trio.run(keys, b"o/"):
                assert time.monotonic() - t0 < 30, "the dead mount's orphan was not freed"
                time.sleep(0.5)
            print(f"\norphan of a SIGKILLed mount freed {time.monotonic() - t0:.1f} s later")
        try:
            os.close(fd)
        except OSError:
            pass


def test_big_file_freed_in_batches(tmp_path, monkeypatch):
    """Deleting or cutting short a file with more chunks than one etcd transaction may
    touch goes a batch of chunks per transaction (here: etcd's default of 128
    operations per transaction, and 16 chunks per batch)."""
    from bmfs.cluster.etcd import EtcdCluster
    from bmfs.vfs import orphans
    from bmfs.meta.keys import CHUNK_SIZE
    from vfsutil import open_fs
    monkeypatch.setattr(orphans, "FREE_BATCH", 16)
    cluster = EtcdCluster(max_txn_ops=128)
    try:
        async def main():
            from bmfs.volume.volume import mkfs
            await mkfs(str(tmp_path / "vol"), meta=cluster.url)
            async with open_fs(tmp_path / "vol") as fs:
                made = []
                for name in (b"unlinked", b"truncated"):
                    fh, a = await fs.create_file(1, name, 0o644, os.O_RDWR, 0, 0)
                    for c in range(100):  # a byte in each of 100 chunks: 100 stripes
                        await fs.files.write(fh, c * CHUNK_SIZE, b"x")
                        await fs.files.flush(fh)
                    await fs.files.release(fh)
                    made.append(a.ino)
                commits = fs.kv.commits
                await fs.unlink(1, b"unlinked")
                await fs.setattr(made[1], size=1)
                assert fs.kv.commits - commits >= 2 * 100 // 16
                assert (await fs.getattr(made[1])).size == 1
                assert [n for n, _ in await fs.readdir(1)] == [b"truncated"]
                assert not await fs.kv.range(b"o/", b"o0")
            # open_fs ends with fsck: reference counts and entries agree
        trio.run(main)
    finally:
        cluster.stop()


# -- etcd's history under churn (bmfs/kv/etcd_compact.py) ----------------------------------
QUOTA = 4 << 20  # etcd's --quota-backend-bytes for these tests: the churn below writes
#                  about 2.5 times as much history (8 KiB files live inline in etcd)
PACE = 0.5  # seconds a round of the churn takes at least: the compaction interval set


def _churn(mp, rounds: int, sizes: list, cluster, held: list | None = None) -> None:
    """``rounds`` times: create 20 files of 8 KiB, fsync the directory (their keys are
    committed), unlink them, fsync again; note etcd's database size every 5 rounds.
    With ``held``, an fsync that fails with EIO (writes held for longer than the
    engine's timeout) is noted there and done again."""
    os.makedirs(f"{mp}/d", exist_ok=True)
    data = os.urandom(8192)
    fd = os.open(f"{mp}/d", os.O_RDONLY)

    def fsync():
        for _ in range(20):
            try:
                return os.fsync(fd)
            except OSError as e:
                if held is None or e.errno != errno.EIO:
                    raise
                held.append(e)
                time.sleep(0.5)  # (the upkeep clears the alarm in its next round)
        os.fsync(fd)
    try:
        for r in range(rounds):
            # a steady churn, not a burst: a round takes no less than the compaction
            # interval (on an idle machine it takes a tenth of it, and the window's
            # history alone would then reach the quota)
            began = time.monotonic()
            for i in range(20):
                with open(f"{mp}/d/f{i}", "wb") as f:
                    f.write(data)
            fsync()
            for i in range(20):
                os.unlink(f"{mp}/d/f{i}")
            fsync()
            if r % 5 == 4:
                sizes.append(int(cluster.status(0)["dbSize"]))
            time.sleep(max(0.0, PACE - (time.monotonic() - began)))
    finally:
        os.close(fd)


def _churn_cluster(tmp_path, monkeypatch, window: float):
    from bmfs.cluster.etcd import EtcdCluster
    monkeypatch.setenv("BMFS_ETCD_COMPACT_INTERVAL", "0.5")  # (the mount's environment)
    monkeypatch.setenv("BMFS_ETCD_COMPACT_WINDOW", str(window))
    monkeypatch.setenv("BMFS_ETCD_DEFRAG_MIN", str(1 << 20))
    cluster = EtcdCluster(size=1, flags=("--quota-backend-bytes", str(QUOTA)))
    bmfs("mkfs", tmp_path / "vol", "--meta", cluster.url)
    return cluster


def test_long_churn_keeps_etcds_database_bounded(tmp_path, monkeypatch):
    """Files created and unlinked over and over, 2.5 times etcd's quota of history:
    the mount that leads the upkeep compacts etcd's history (here every 0.5 s, keeping
    1 s), so every operation succeeds and the database stays well under the quota.
    Without compaction, etcd refuses writes (NOSPACE) after a third of the rounds."""
    cluster = _churn_cluster(tmp_path, monkeypatch, window=1)
    sizes: list[int] = []
    try:
        with Mounted(tmp_path / "vol", tmp_path / "mnt"):
            _churn(tmp_path / "mnt", 30, sizes, cluster)
        print(f"\netcd database size every 5 rounds of 20 create/unlink pairs of 8 KiB "
              f"files (quota {QUOTA}): {sizes}")
        assert max(sizes) < QUOTA * 3 // 4
        assert not cluster.post(0, "/v3/maintenance/alarm", {"action": "GET"}).get("alarms")
        log = (tmp_path / "vol" / "mount.log").read_text(errors="replace")
        assert " ERROR " not in log and "alarm" not in log, log[-2000:]
    finally:
        cluster.stop()


def test_etcds_nospace_alarm_is_cleared_by_the_upkeep(tmp_path, monkeypatch):
    """When etcd's database reaches its quota all the same (here the history kept is
    an hour: nothing is compacted by age), the mount that leads the upkeep compacts
    the history, defragments the member and disarms the NOSPACE alarm: writes held
    meanwhile go through, nothing acknowledged is lost, fsck is clean."""
    cluster = _churn_cluster(tmp_path, monkeypatch, window=3600)
    sizes: list[int] = []
    held: list[OSError] = []
    try:
        with Mounted(tmp_path / "vol", tmp_path / "mnt"):
            # (an fsync waits for the alarm to be cleared; on a loaded machine that
            # can outlast the engine's timeout: it then fails with EIO, is noted and
            # done again, as a program would)
            _churn(tmp_path / "mnt", 25, sizes, cluster, held)
            print(f"\nfsyncs held past the engine's timeout by the NOSPACE alarm: {len(held)}")
            (tmp_path / "mnt" / "kept").write_bytes(b"written after the alarm")
        log = (tmp_path / "vol" / "mount.log").read_text(errors="replace")
        assert "NOSPACE alarm was raised" in log and " ERROR " not in log, log[-2000:]
        assert "lost" not in log
        assert not cluster.post(0, "/v3/maintenance/alarm", {"action": "GET"}).get("alarms")
        with Mounted(tmp_path / "vol", tmp_path / "mnt"):
            assert sorted(os.listdir(tmp_path / "mnt")) == ["d", "kept"]
            assert not os.listdir(tmp_path / "mnt" / "d")
            assert (tmp_path / "mnt" / "kept").read_bytes() == b"written after the alarm"
        assert_fsck_clean(tmp_path / "vol")
    finally:
        cluster.stop()
