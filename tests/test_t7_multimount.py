"""Level 7: several mounts of one etcd volume (a real 3-member etcd cluster).

The mounts use 30 s kernel cache timeouts, so anything another mount sees within a
second came through the watch-driven invalidation, not through a timeout. Every test
ends with `bmfs fsck` of the volume (etcd_volume does it after unmounting).
"""
import base64
import errno
import json
import os
import shutil
import threading
import time

import pytest

from bmfs.cluster.etcd import ETCD
from bmfs.volume.upkeep import GC_INTERVAL
from bmfs.proc import alive

from etcd_cluster import etcd_cluster  # noqa: F401  (the fixture)
from mountutil import Mounted, bmfs, mkfs, sit_in
from multimount import etcd_volume, run_worker, wait_until


def _write(path, data: bytes, mode="wb"):
    with open(path, mode) as f:
        f.write(data)


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_mkfs_and_mount_etcd_volume(etcd_cluster, tmp_path):
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        info = open(tmp_path / "vol" / "volume.json").read()
        assert etcd_cluster.url in info
        assert a.pid != b.pid and a.pid and b.pid
        _write(f"{a.mp}/hello", b"from a")
        assert _read(f"{b.mp}/hello") == b"from a"
        # mkfs on metadata that already holds a volume: one-line error, exit 2
        res = bmfs("mkfs", tmp_path / "vol2", "--meta", etcd_cluster.url, check=False)
        assert res.returncode == 2 and "already holds a volume" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_close_to_open(etcd_cluster, tmp_path):
    """A file closed on one mount is seen complete by an open on another, whatever the
    other mount had cached (its pages, its kernel's file size), growing or shrinking."""
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        pa, pb = f"{a.mp}/f", f"{b.mp}/f"
        bad = []
        for i in range(60):
            size = [10, 5000, 3, 70000, 4096, 0, 12345][i % 7] + i
            data = os.urandom(size)
            _write(pa, data)  # truncate + write, close
            got = _read(pb)   # open right after the close, no wait
            if got != data:
                bad.append((i, size, len(got)))
            assert os.stat(pb).st_size == size or bad
        assert not bad, f"stale reads on the other mount (round, size, got): {bad}"
        # appends by b while a reads: the other direction, and growth only
        for i in range(20):
            _write(pb, b"x" * (100 + i), "ab")
            assert _read(pa) == _read(pb)
        # b keeps the file open: a's growth still shows in b's next open
        with open(pb, "rb") as held:
            before = held.read()
            _write(pa, b"y" * 9000, "ab")
            assert _read(pb) == before + b"y" * 9000


def test_changes_visible_within_a_second(etcd_cluster, tmp_path):
    with etcd_volume(etcd_cluster, tmp_path, 3) as mounts:
        a, others = mounts[0], mounts[1:]
        os.mkdir(f"{a.mp}/d")
        delays = {}

        def seen(what, fn):
            for m in others:
                fn.__doc__ = f"{what} on {m.mp}"
                delays.setdefault(what, []).append(wait_until(lambda: fn(m.mp), 5))

        seen("mkdir", lambda mp: os.path.isdir(f"{mp}/d"))
        for m in others:  # every mount caches the directory, names and attributes
            assert os.listdir(f"{m.mp}/d") == []
            assert not os.path.exists(f"{m.mp}/d/x")
        _write(f"{a.mp}/d/x", b"1234")
        # (the name and the data are two operations: the writer's commits go behind
        # it, so another mount can see the name a moment before the size)
        seen("create", lambda mp: os.path.exists(f"{mp}/d/x") and os.stat(f"{mp}/d/x").st_size == 4)
        for m in others:
            assert os.stat(f"{m.mp}/d/x").st_size == 4
        os.rename(f"{a.mp}/d/x", f"{a.mp}/d/y")
        seen("rename", lambda mp: not os.path.exists(f"{mp}/d/x") and os.path.exists(f"{mp}/d/y"))
        _write(f"{a.mp}/d/y", b"123456789", "ab")
        seen("size", lambda mp: os.stat(f"{mp}/d/y").st_size == 13)
        os.chmod(f"{a.mp}/d/y", 0o600)
        seen("chmod", lambda mp: os.stat(f"{mp}/d/y").st_mode & 0o777 == 0o600)
        os.unlink(f"{a.mp}/d/y")
        seen("unlink", lambda mp: not os.path.exists(f"{mp}/d/y"))
        os.rmdir(f"{a.mp}/d")
        seen("rmdir", lambda mp: not os.path.exists(f"{mp}/d"))
        # a snapshot taken on one mount: the branch head moves under the others
        assert a.ctl("snapshot_create", name="s1")["ok"]
        _write(f"{a.mp}/after-snapshot", b"new layer")
        seen("create after snapshot", lambda mp: os.path.exists(f"{mp}/after-snapshot"))
        for m in others:
            assert _read(f"{m.mp}/after-snapshot") == b"new layer"
            assert os.listdir(f"{m.mp}/.bm/snapshots") == ["s1"]
        print("\nseconds until the other mounts saw it (worst of 2): " +
              ", ".join(f"{k} {max(v):.3f}" for k, v in delays.items()))
        assert max(max(v) for v in delays.values()) < 1.0


def test_same_name_create_race(etcd_cluster, tmp_path):
    """Both mounts create each name at the same moment: exactly one wins, one EEXIST."""
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        rounds = 40
        barrier = threading.Barrier(2)
        results = {a.mp: [], b.mp: []}

        def racer(mp):
            for i in range(rounds):
                barrier.wait()
                try:
                    fd = os.open(f"{mp}/r{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    os.write(fd, mp.encode())
                    os.close(fd)
                    results[mp].append("won")
                except OSError as e:
                    results[mp].append(errno.errorcode[e.errno])
        threads = [threading.Thread(target=racer, args=(m.mp,)) for m in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i in range(rounds):
            outcome = sorted((results[a.mp][i], results[b.mp][i]))
            assert outcome == ["EEXIST", "won"], f"round {i}: {outcome}"
            winner = a.mp if results[a.mp][i] == "won" else b.mp
            for m in (a, b):
                assert _read(f"{m.mp}/r{i}") == winner.encode()
        wins = results[a.mp].count("won")
        print(f"\nsame-name create race: mount a won {wins}, mount b {rounds - wins}")


def test_two_mounts_hammer_one_directory(etcd_cluster, tmp_path):
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        os.mkdir(f"{a.mp}/h")
        workers = [run_worker("hammer", f"{m.mp}/h", f"w{i}", 6, seed=i)
                   for i, m in enumerate((a, b))]
        try:
            results = [w.result() for w in workers]
        finally:
            for w in workers:
                w.stop()
        done = sum(len(r["done"]) for r in results)
        created = {op[2] for r in results for op in r["done"] if op[0] == "create"}
        print(f"\nhammer: {done} operations succeeded, "
              f"{sum(r['failed'] for r in results)} got EEXIST/ENOENT")
        assert done > 100
        names_a = sorted(os.listdir(f"{a.mp}/h"))
        wait_until(lambda: sorted(os.listdir(f"{b.mp}/h")) == names_a, 2)
        tokens = []
        for name in names_a:
            for m in (a, b):
                st = os.stat(f"{m.mp}/h/{name}")
                assert st.st_nlink == 1
            content = _read(f"{a.mp}/h/{name}")
            assert _read(f"{b.mp}/h/{name}") == content
            assert content.decode() in created, f"{name}: {content!r} was never written"
            tokens.append(content)
        assert len(tokens) == len(set(tokens)), "one file's content under two names"
        for m in (a, b):
            assert os.stat(f"{m.mp}/h").st_nlink == 2
    # (etcd_volume ends with fsck: entries, inodes, link counts and stripes agree)


def test_sqlite_volume_stays_single_owner(tmp_path):
    mkfs(tmp_path / "vol")
    os.makedirs(tmp_path / "m2")
    with Mounted(tmp_path / "vol", tmp_path / "m1"):
        res = bmfs("mount", tmp_path / "m2", "--volume", tmp_path / "vol", check=False)
        assert res.returncode == 2 and "in use" in res.stderr, res.stderr


def test_cluster_up_with_etcd(tmp_path):
    """`bmfs cluster up DIR --meta etcd`: 3 etcd members beside the nodes, listed with
    their pids in DIR/cluster.json; two mounts share the volume; `cluster down` stops
    every member."""
    if not os.access(ETCD, os.X_OK):
        pytest.skip("etcd not installed")
    d = tmp_path / "cl"
    bmfs("cluster", "up", d, "--meta", "etcd", "--nodes", "6", timeout=120)
    try:
        info = json.load(open(d / "cluster.json"))
        assert info["meta"].startswith("etcd://") and len(info["etcd"]) == 3
        assert all(alive(m["pid"]) for m in info["etcd"])
        with Mounted(d, tmp_path / "a") as a, Mounted(d, tmp_path / "b") as b:
            _write(f"{a.mp}/x", b"shared")
            assert _read(f"{b.mp}/x") == b"shared"
        assert bmfs("fsck", d, check=False).returncode == 0
    finally:
        bmfs("cluster", "down", d, check=False, timeout=60)
    assert not any(alive(m["pid"]) for m in info["etcd"])


def test_drain_waits_for_a_stripe_another_mount_placed_before_the_mark(
        etcd_cluster, tmp_path, monkeypatch):
    """Two in-process mounts of an etcd volume of 7 device directories (each with its
    presence record, its device-record watch and its confirmations, as a mount daemon
    runs them). Mount B has stripes under way whose fragments to device 3 are held
    back, placed before A marks device 3 draining. A's drain waits until B confirms the
    mark, which B does only once those stripes are committed; so the drain moves their
    fragments too, and in the end no stripe is on device 3 and B's file reads back.
    The fixed wait drain used before (7 s, here 1 s) moved what was committed by then
    and missed B's stripes."""
    import trio
    from bmfs.meta import keys
    from bmfs.format.records import Stripe
    from bmfs.volume import devices, session
    from bmfs.vfs.fs import FileSystem
    from bmfs.volume.volume import Volume
    from bmfs.volume.volume import mkfs as make
    from bmfs.vfs.watch import watch_devices
    from vfsutil import read_file, write_file

    monkeypatch.setattr(devices, "OTHER_MOUNTS_SETTLE", 1.0)
    etcd_cluster.wipe()
    vol = str(tmp_path / "vol")
    data = os.urandom(5 * (4 << 20))  # 5 stripes: each skips one of the 7 devices

    async def stripes_on(v, dev):
        return [k for k, raw in await v.kv.range(b"t/", b"t0")
                if dev in Stripe.unpack(raw).devices]

    async def main():
        await make(vol, 4, 2, devices=[str(tmp_path / f"d{i}") for i in range(7)],
                   meta=etcd_cluster.url)
        va, vb = await Volume.open(vol), await Volume.open(vol)
        fa, fb = await FileSystem.create(va), await FileSystem.create(vb)
        held, release = trio.Event(), trio.Event()
        real_put = vb.transport.put

        async def put(dev, name, parts):
            if dev == 3:
                held.set()
                await release.wait()
            return await real_put(dev, name, parts)
        vb.transport.put = put
        try:
            async with trio.open_nursery() as nursery:
                for fs, name in ((fa, "a"), (fb, "b")):
                    await nursery.start(session.keep_alive, fs, str(tmp_path / name))
                    nursery.start_soon(watch_devices, fs)
                    nursery.start_soon(session.confirm_devices, fs)
                written = {}

                async def write():
                    written["ino"] = await write_file(fb, 1, b"f", data)
                nursery.start_soon(write)
                await held.wait()  # B placed a stripe on device 3, not committed yet
                drained = {}

                async def drain():
                    drained.update(await devices.drain(va, 3))
                nursery.start_soon(drain)
                await trio.sleep(2.5)  # more than the old fixed wait, here 1 s
                assert not drained, "the drain went ahead before mount B confirmed"
                assert 3 not in vb.data.devices  # B took the mark up (its watch)
                release.set()
                with trio.fail_after(60):
                    while not drained or "ino" not in written:
                        await trio.sleep(0.1)
                assert drained["mounts_confirmed"] == 2, drained
                assert drained["mounts_unconfirmed"] == 0, drained
                assert drained["fragments_left_on_device"] == 0, drained
                assert await stripes_on(va, 3) == []
                vb.data._tables.clear()
                assert await read_file(fb, written["ino"]) == data
                rec = json.loads(await va.kv.get(keys.mount(fb.mount_id)))
                assert rec["devices"] == vb.devices_seq >= 1
                nursery.cancel_scope.cancel()
        finally:
            for fs, v in ((fa, va), (fb, vb)):
                await fs.aclose()
                await v.aclose()
    trio.run(main)


def test_no_fragment_moves_onto_a_device_marked_draining_meanwhile(etcd_cluster, tmp_path):
    """A process that does not know of a draining mark (an offline `bmfs rebalance`,
    which drains do not wait for) must not move fragments onto the marked device: two
    in-process openings of an etcd volume; B takes up an added device 7, then A marks
    it draining, and B's rebalance, which places ~1/8 of the fragments on it, commits
    none of those moves: no stripe is on device 7 and the files read back."""
    import trio
    from bmfs.format.records import Stripe
    from bmfs.volume import devices, repair
    from bmfs.vfs.fs import FileSystem
    from bmfs.volume.volume import Volume
    from bmfs.volume.volume import mkfs as make
    from vfsutil import read_file, write_file

    etcd_cluster.wipe()
    vol = str(tmp_path / "vol")
    files = {b"f%d" % i: os.urandom((6 << 20) + i) for i in range(4)}

    async def main():
        await make(vol, 4, 2, devices=[str(tmp_path / f"d{i}") for i in range(7)],
                   meta=etcd_cluster.url)
        va, vb = await Volume.open(vol), await Volume.open(vol)
        fa = await FileSystem.create(va)
        try:
            inos = {n: await write_file(fa, 1, n, d) for n, d in files.items()}
            await devices.add_device(va, str(tmp_path / "d7"))
            await vb.refresh_devices()
            assert 7 in vb.data.devices
            await devices.set_device(va, 7, draining=True)  # B does not look again
            assert 7 in vb.data.devices
            result = await repair.rebalance(vb)
            on7 = [k for k, raw in await va.kv.range(b"t/", b"t0")
                   if 7 in Stripe.unpack(raw).devices]
            assert on7 == [], (on7, result)
            assert result["fragments_moved"] == 0, result
            va.data._tables.clear()
            for n, ino in inos.items():
                assert await read_file(fa, ino) == files[n]
        finally:
            await fa.aclose()
            await va.aclose()
            await vb.aclose()
    trio.run(main)


def _orphan_records(cluster) -> dict:
    """The volume's orphan records (o/LAYER/INO -> value), read from etcd directly."""
    b64 = base64.b64encode
    body = {"key": b64(b"o/").decode(), "range_end": b64(b"o0").decode()}
    kvs = cluster.post(0, "/v3/kv/range", body).get("kvs", [])
    return {base64.b64decode(kv["key"]): base64.b64decode(kv.get("value", "")) for kv in kvs}


def test_a_file_unlinked_by_another_mount_stays_open_here(etcd_cluster, tmp_path, monkeypatch):
    """A file one mount holds open and another mount unlinks stays readable and
    writable through the open handles, as it does when the same mount unlinks it
    (POSIX; CephFS and Lustre do the same across clients). It is freed once the last
    handle anywhere closes, after the grace period (BMFS_ORPHAN_GRACE, 3 s here)
    that unclaimed files wait for a holder to claim them; so is a file nobody had
    open. Opt-in (setting BMFS_ORPHAN_GRACE turns it on); without it the holder's
    reads and writes fail with ENOENT at once."""
    monkeypatch.setenv("BMFS_ORPHAN_GRACE", "3")
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        data = os.urandom(9 << 20)  # stripes on the devices, and an inline tail
        _write(f"{a.mp}/held", data)
        _write(f"{a.mp}/loose", b"nobody holds this")
        reader = open(f"{a.mp}/held", "rb")
        writer = open(f"{a.mp}/held", "ab", buffering=0)
        assert reader.read(4096) == data[:4096]
        os.unlink(f"{b.mp}/held")
        os.unlink(f"{b.mp}/loose")
        wait_until(lambda: not os.path.exists(f"{a.mp}/held"), 5)
        # claimed at once through the watch: the record names mount a only
        wait_until(lambda: any(v and not v.startswith(b"?")
                               for v in _orphan_records(etcd_cluster).values()), 5, step=0.05)
        # (both records are there: the unlinks commit behind, in order)
        wait_until(lambda: len(_orphan_records(etcd_cluster)) == 2, 5, step=0.05)
        # the loose one goes once a sweep has seen it unclaimed for the grace period
        wait_until(lambda: len(_orphan_records(etcd_cluster)) == 1,
                   3 + 2 * GC_INTERVAL + 5, step=0.2)
        time.sleep(GC_INTERVAL)  # and the held one stays, sweep after sweep
        assert len(_orphan_records(etcd_cluster)) == 1
        assert reader.read() == data[4096:]
        writer.write(b"appended after the unlink")
        writer.close()
        reader.seek(0)
        assert reader.read() == data + b"appended after the unlink"
        assert os.fstat(reader.fileno()).st_nlink == 0
        reader.close()
        # the last handle closed: unclaimed, then freed by a sweep after the grace
        wait_until(lambda: not _orphan_records(etcd_cluster), 3 + 2 * GC_INTERVAL + 5,
                   step=0.2)
        assert os.listdir(a.mp) == [] and os.listdir(b.mp) == []
    # (etcd_volume's fsck: no inode left without a name or an orphan record)


def test_deferred_frees_of_a_lone_mount_and_under_a_snapshot(etcd_cluster, tmp_path,
                                                             monkeypatch):
    """With deferred frees on (BMFS_ORPHAN_GRACE, a long 300 s here), a mount with no
    other mount alive frees the files unlinked on it at its next sweep, and at
    unmount, without the grace: nobody else can hold them. A snapshot taken right
    after an unlink keeps the nameless inode in its layer: the orphan record stays
    for it once the mounted tree's copy is freed (fsck, at the end, checks both
    trees; before, the record went and fsck named the snapshot's inode)."""
    monkeypatch.setenv("BMFS_ORPHAN_GRACE", "300")
    with etcd_volume(etcd_cluster, tmp_path, 1) as (a,):
        _write(f"{a.mp}/f", os.urandom(9 << 20))
        os.unlink(f"{a.mp}/f")
        # (the unlink commits behind, so its record may not be there yet: wait for two
        # sweeps rather than for the record to go)
        time.sleep(2 * GC_INTERVAL + 2)
        assert not _orphan_records(etcd_cluster)
        _write(f"{a.mp}/h", os.urandom(9 << 20))
        os.unlink(f"{a.mp}/h")
        bmfs("snapshot", "create", "s", "-m", a.mp)
        assert os.listdir(f"{a.mp}/.bm/snapshots/s") == []
        time.sleep(2 * GC_INTERVAL)  # swept: freed in the mounted tree
        assert len(_orphan_records(etcd_cluster)) == 1  # kept for the snapshot
        _write(f"{a.mp}/k", b"unlinked just before the unmount")
        os.unlink(f"{a.mp}/k")
    assert len(_orphan_records(etcd_cluster)) == 1  # k's went at the unmount


def _revision(cluster) -> int:
    """etcd's revision now: every committed transaction that writes adds one."""
    body = {"key": base64.b64encode(b"v/").decode(), "count_only": True}
    return int(cluster.post(0, "/v3/kv/range", body)["header"]["revision"])


def test_deferred_frees_of_many_small_files_go_together(etcd_cluster, tmp_path, monkeypatch):
    """`rm -rf` of many small files with deferred frees on: the sweep that frees them
    once the grace is over does so several files a transaction (files.FREE_FILES),
    not one each (which doubled the transactions `rm -rf` costs etcd)."""
    from bmfs.meta.keys import CHUNK_SIZE
    from bmfs.vfs.orphans import FREE_FILE_CHUNKS, FREE_FILES
    monkeypatch.setenv("BMFS_ORPHAN_GRACE", "3")
    n = 3 * FREE_FILES
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        os.mkdir(f"{a.mp}/d")
        for i in range(n):
            _write(f"{a.mp}/d/f{i}", os.urandom(100 + i))
        _write(f"{a.mp}/d/big", os.urandom(9 << 20))  # stripes on the devices
        with open(f"{a.mp}/d/wide", "wb") as f:  # 5 chunks: too many to go with others
            for c in range(FREE_FILE_CHUNKS + 1):
                f.seek(c * CHUNK_SIZE)
                f.write(b"w" * 4096)
        wait_until(lambda: len(os.listdir(f"{b.mp}/d")) == n + 2, 10)
        shutil.rmtree(f"{b.mp}/d")
        wait_until(lambda: len(_orphan_records(etcd_cluster)) == n + 2, 10, step=0.05)
        before = _revision(etcd_cluster)
        wait_until(lambda: not _orphan_records(etcd_cluster), 3 + 2 * GC_INTERVAL + 10,
                   step=0.2)
        spent = _revision(etcd_cluster) - before
        # 4 groups and the wide file by itself: 5 transactions, where one a file took
        # n + 2 = 50. Room for other writes meanwhile (the write-behind token changing
        # hands) and for the records falling due over two sweeps
        assert spent <= 20, spent
        assert os.listdir(a.mp) == [] and os.listdir(b.mp) == []


def _ino_or_none(path):
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def test_a_directory_removed_through_another_mount_while_in_use_here(etcd_cluster,
                                                                      tmp_path):
    """A process sits in a directory of mount b; mount a removes it (rmdir, or a rename
    over it): the process's stat(".") and fstat give st_nlink 0 and chdir("..") takes
    it to the directory it was in, as on a local disk (not ENOENT)."""
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        for i, remove in enumerate((lambda: os.rmdir(f"{a.mp}/p1/d"),
                                    lambda: os.rename(f"{a.mp}/p2/new", f"{a.mp}/p2/d"))):
            p = f"p{i + 1}"
            os.makedirs(f"{a.mp}/{p}/d")
            if i:
                os.mkdir(f"{a.mp}/{p}/new")
            wait_until(lambda: os.path.isdir(f"{b.mp}/{p}/d"), 10)
            up = os.stat(f"{b.mp}/{p}").st_ino
            proc = sit_in(f"{b.mp}/{p}/d")
            old = os.stat(f"{b.mp}/{p}/d").st_ino
            remove()
            # b's kernel drops what it cached of d when b's watch sees the change
            # (one stat: the name may go between an exists() and a stat())
            wait_until(lambda: _ino_or_none(f"{b.mp}/{p}/d") != old, 10)
            out, err = proc.communicate("go\n", timeout=60)
            assert proc.returncode == 0, err
            assert json.loads(out) == {"nlink": 0, "fnlink": 0, "up": up}
