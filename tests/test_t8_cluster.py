"""Level 6: a 6-node 4+2 cluster of real node processes on loopback; failures."""
import base64
import hashlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bmfs.cluster.etcd import ETCD
from bmfs.proc import alive
from fragments import flip, intact, intact_keys, lose, on_device
from mountutil import Mounted, assert_fsck_clean, bmfs

TOTAL = int(os.environ.get("BMFS_CLUSTER_TEST_BYTES", 1 << 30))


class Cluster:
    def __init__(self, path, *up_args, nodes=6):
        self.dir, self.up_args, self.nodes = str(path), up_args, nodes

    def __enter__(self):
        bmfs("cluster", "up", self.dir, "--nodes", self.nodes, "--ec", "4+2", *self.up_args,
             timeout=120)
        return self

    @property
    def info(self):
        with open(os.path.join(self.dir, "cluster.json")) as f:
            return json.load(f)

    def kill(self, *indexes):
        for i in indexes:
            os.kill(self.info["nodes"][i]["pid"], signal.SIGKILL)

    def start(self, *extra):
        return bmfs("cluster", "start", self.dir, *extra, timeout=120)

    def down(self):
        bmfs("cluster", "down", self.dir, timeout=60)

    def __exit__(self, *exc):
        if os.path.exists(os.path.join(self.dir, "cluster.json")):
            bmfs("cluster", "down", self.dir, check=False, timeout=60)


@pytest.fixture
def cluster(tmp_path):
    with Cluster(tmp_path / "cluster") as c:
        yield c


def _write_varied(root, total, seed=1):
    """Files from 0 bytes to 40 MiB, totalling ``total``; returns {name: sha256}."""
    rng = random.Random(seed)
    sizes = [0, 1, 4096, 17_000, (1 << 20) + 1]
    while sum(sizes) < total:
        sizes.append(min(rng.choice([rng.randrange(1, 64 << 10), rng.randrange(1, 8 << 20),
                                     rng.randrange(8 << 20, 40 << 20)]), total - sum(sizes)))
    block = os.urandom(1 << 20)
    digests = {}
    os.makedirs(f"{root}/data", exist_ok=True)
    for i, size in enumerate(sizes):
        h = hashlib.sha256()
        with open(f"{root}/data/f{i:04d}", "wb") as f:
            left, rot = size, i % 1000
            while left:
                chunk = (block[rot:] + block[:rot])[:min(left, 1 << 20)]
                f.write(chunk)
                h.update(chunk)
                left -= len(chunk)
        digests[f"data/f{i:04d}"] = h.hexdigest()
    return digests


def _check(root, digests):
    for name, want in digests.items():
        h = hashlib.sha256()
        with open(f"{root}/{name}", "rb") as f:
            while b := f.read(4 << 20):
                h.update(b)
        assert h.hexdigest() == want, f"{name} differs"


def _assert_no_decode(stats):
    """No read needed a device it could not reach, nor a decode for one: a decode
    counted here came from a hedge of a node slow to answer (on a loaded machine)."""
    assert stats.get("missing_fragments", 0) == 0, stats
    assert stats["degraded_reads"] == stats.get("hedged_reads", 0), stats


def _drop_caches():
    subprocess.run(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def _status(mp):
    return json.loads(bmfs("status", mp, "--json").stdout)


def test_two_nodes_killed_then_repaired(cluster, tmp_path):
    mp = tmp_path / "mnt"
    with Mounted(cluster.dir, mp):
        digests = _write_varied(mp, TOTAL)
        cluster.kill(1, 4)
        _drop_caches()
        _check(mp, digests)                      # no error seen by the application
        st = _status(mp)
        assert [d["health"] for d in st["devices"]].count("missing") == 2
        assert st["data"]["degraded_reads"] > 0
        cluster.start()
        time.sleep(2.5)                          # the transport retries down nodes after 2 s
        # the mount's background repair may get there first: `bmfs repair` then waits
        # for it and finds less (or nothing) left to do
        r = json.loads(bmfs("repair", mp, "--json").stdout)
        assert r["stripes_failed"] == 0
        s = json.loads(bmfs("scrub", mp, "--json").stdout)
        assert s["bad_fragments"] == 0 and s["stripes"] == 0  # full redundancy again
        st = _status(mp)
        assert all(d["health"] == "ok" for d in st["devices"])
        assert st["fragments_awaiting_repair"] == 0
        _drop_caches()
        _check(mp, digests)
    assert_fsck_clean(cluster.dir)


def test_nodes_killed_during_writes(cluster, tmp_path):
    mp = tmp_path / "mnt"
    acked = tmp_path / "acked"
    writer = f"""
import os, sys
block = os.urandom(1 << 20)
with open({str(acked)!r}, "w") as log:
    for i in range(60):
        data = block[i:] + block[:i]
        with open(f"{mp}/w{{i:03d}}", "wb") as f:
            for _ in range(3):
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        log.write(f"w{{i:03d}}\\n"); log.flush()
"""
    with Mounted(cluster.dir, mp):
        proc = subprocess.Popen([sys.executable, "-c", writer], stderr=subprocess.PIPE, text=True)
        while not acked.exists() or len(acked.read_text().split()) < 10:
            time.sleep(0.05)
            assert proc.poll() is None, proc.stderr.read()
        cluster.kill(0, 3)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"a write failed: {err}"
        names = acked.read_text().split()
        assert len(names) == 60
        block = None
        for i, name in enumerate(names):
            data = open(f"{mp}/{name}", "rb").read()
            assert len(data) == 3 << 20
            if block is None and i == 0:
                block = data[: 1 << 20]
            assert data[:1 << 20] == block[i:] + block[:i], name
        cluster.start()
        time.sleep(2.5)
        bmfs("repair", mp)
        assert _status(mp)["fragments_awaiting_repair"] == 0
    assert_fsck_clean(cluster.dir)


def test_drain_with_nowhere_to_move_fragments_is_refused(cluster, tmp_path):
    """A 4+2 cluster of 6 devices has no device to take a drained one's fragments
    (each stripe has one on every device): `bmfs node drain` says so and changes
    nothing. It used to mark the device draining and report success, and every
    stripe written after it had a fragment missing for good."""
    mp = tmp_path / "mnt"
    with Mounted(cluster.dir, mp):
        (mp / "f").write_bytes(b"x" * 100_000)
        for op in ("drain", "remove"):
            r = bmfs("node", op, 3, "-m", mp, check=False)
            assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
            assert "cannot drain device 3: 4+2 stripes need 6 devices, and 5 would be " \
                   "left" in r.stderr
        before = _status(mp)["devices"][3]["fragments"]
        data = os.urandom(8 << 20)
        (mp / "g").write_bytes(data)  # new stripes still go to all 6 devices
        assert _status(mp)["devices"][3]["fragments"] > before
        s = json.loads(bmfs("scrub", mp, "--json").stdout)
        assert s["bad_fragments"] == 0 and s["stripes"] == 0  # nothing short
        _drop_caches()
        assert (mp / "g").read_bytes() == data
    assert_fsck_clean(cluster.dir)


def test_drain_and_remove_move_every_fragment_off_a_device(tmp_path):
    """On a 7-node 4+2 cluster (stripes spread over the 7), `bmfs node drain 3` moves
    device 3's fragments to the others: the files stay exact with its node killed,
    and no read needs a decode; `bmfs node remove 3` then forgets it, and new files
    go to the other 6."""
    with Cluster(tmp_path / "c7", nodes=7) as c7:
        mp = tmp_path / "mnt"
        with Mounted(c7.dir, mp):
            digests = _write_varied(mp, 40 << 20)
            counts = [d["fragments"] for d in _status(mp)["devices"]]
            assert len(counts) == 7 and all(counts), counts  # spread over all 7
            r = bmfs("node", "drain", 3, "-m", mp)
            assert "fragments left on device: 0" in r.stdout, r.stdout
            assert _status(mp)["devices"][3]["fragments"] == 0
            c7.kill(3)
            _drop_caches()
            _check(mp, digests)
            _assert_no_decode(_status(mp)["data"])
            r = bmfs("node", "remove", 3, "-m", mp)
            assert "removed: True" in r.stdout, r.stdout
            digests.update({f"more/{k}": v for k, v in
                            _write_varied(mp / "more", 8 << 20, seed=2).items()})
            _drop_caches()
            _check(mp, digests)
            st = _status(mp)
            assert [d["id"] for d in st["devices"]] == [0, 1, 2, 4, 5, 6]
            assert st["removed_devices"] == [3]
        assert_fsck_clean(c7.dir)


def _devices(mp):
    return {d["id"]: d for d in _status(mp)["devices"]}


def test_cluster_add_makes_room_to_drain_and_undrain(cluster, tmp_path):
    """On a mounted 6-node 4+2 cluster, `bmfs cluster add` starts a seventh node and
    adds its device: `bmfs rebalance --limit 2M` moves older fragments onto it (taking
    at least the time its limit allows for the bytes it reports), new stripes use it, and device 3, which could not be drained
    before, now can: with its node killed the files are exact and no read decodes.
    Restarted and undrained, it takes new stripes again."""
    mp = tmp_path / "mnt"
    with Mounted(cluster.dir, mp):
        digests = _write_varied(mp, 24 << 20)
        assert bmfs("node", "drain", 3, "-m", mp, check=False).returncode == 2
        r = bmfs("cluster", "add", cluster.dir)
        assert "node6" in r.stdout and "device 6" in r.stdout, r.stdout
        node6 = cluster.info["nodes"][6]
        assert alive(node6["pid"]) and node6["device"] == 6
        devs = _devices(mp)
        assert sorted(devs) == list(range(7)) and devs[6]["fragments"] == 0
        assert devs[6]["health"] == "ok" and devs[6]["state"] == "in"
        limit = 2 << 20  # bytes a second: each fragment moved is read and written
        t0 = time.monotonic()
        r = json.loads(bmfs("rebalance", mp, "--json", "--limit", "2M").stdout)
        took = time.monotonic() - t0
        moved = _devices(mp)[6]["fragments"]  # ~1/7 of the fragments written before
        assert moved == r["fragments_moved"] > 0 and r["fragments_failed"] == 0, r
        assert r["bytes_moved"] >= moved * 4096
        assert took >= 2 * r["bytes_moved"] / limit, (took, r)
        digests.update({f"b/{k}": v for k, v in
                        _write_varied(mp / "b", 24 << 20, seed=2).items()})
        assert _devices(mp)[6]["fragments"] > moved  # new stripes use it
        r = bmfs("node", "drain", 3, "-m", mp)
        assert "fragments left on device: 0" in r.stdout, r.stdout
        devs = _devices(mp)
        assert devs[3]["fragments"] == 0 and devs[3]["state"] == "drained"
        cluster.kill(3)
        _drop_caches()
        _check(mp, digests)
        _assert_no_decode(_status(mp)["data"])
        cluster.start("--node", 3)
        time.sleep(3)  # the mount skips a node for 2 s after it failed (status's stat)
        r = bmfs("node", "undrain", 3, "-m", mp)
        assert "was draining: True" in r.stdout, r.stdout
        digests.update({f"c/{k}": v for k, v in
                        _write_varied(mp / "c", 24 << 20, seed=3).items()})
        devs = _devices(mp)
        assert devs[3]["fragments"] > 0 and devs[3]["state"] == "in"
        _drop_caches()
        _check(mp, digests)
    assert_fsck_clean(cluster.dir)


def test_a_device_added_through_one_mount_is_used_by_another(tmp_path):
    """Two mounts of an etcd cluster volume: a device added through the first is taken
    up by the second within a few seconds (its upkeep loop reads the device records):
    the second reads what the first wrote there, and places its own stripes on it."""
    if not os.access(ETCD, os.X_OK):
        pytest.skip(f"etcd not installed ({ETCD})")
    with Cluster(tmp_path / "cluster", "--meta", "etcd") as c:
        a, b = tmp_path / "a", tmp_path / "b"
        with Mounted(c.dir, a), Mounted(c.dir, b):
            bmfs("cluster", "add", c.dir)
            # cluster add went through one mount; the other learns it from the records
            deadline = time.monotonic() + 15
            while 6 not in _devices(b) or 6 not in _devices(a):
                assert time.monotonic() < deadline, "device 6 not taken up by both mounts"
                time.sleep(0.5)
            data = {m: os.urandom(12 << 20) for m in (a, b)}
            for m in (a, b):
                (m / f"from-{m.name}").write_bytes(data[m])
            subprocess.run(["sync"])
            frags = lambda: _devices(a)[6]["fragments"]  # noqa: E731
            before = frags()
            assert before > 0
            (b / "more").write_bytes(os.urandom(24 << 20))  # 6 stripes
            subprocess.run(["sync"])
            assert frags() > before  # the second mount places stripes on it
            _drop_caches()
            for m in (a, b):
                for other in (a, b):
                    assert (other / f"from-{m.name}").read_bytes() == data[m]
            _assert_no_decode(_status(b)["data"])
        assert_fsck_clean(c.dir)


def _etcd_watchers(cluster) -> int:
    """Watchers open on the cluster's etcd members (etcd's own gauge, over TLS with
    the cluster's client certificate)."""
    import ssl
    import urllib.request
    pki = os.path.join(cluster.dir, "etcd", "pki")
    ctx = ssl.create_default_context(cafile=os.path.join(pki, "ca.crt"))
    ctx.load_cert_chain(os.path.join(pki, "client.crt"), os.path.join(pki, "client.key"))
    total = 0
    for member in cluster.info["etcd"]:
        with urllib.request.urlopen(f"https://{member['client']}/metrics", context=ctx,
                                    timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("etcd_debugging_mvcc_watcher_total "):
                    total += int(float(line.split()[1]))
    return total


def _settle_watchers(cluster, want, seconds=15.0) -> int:
    """The watcher count once it is ``want`` (or after ``seconds``: a client that
    went away leaves its stream open on the member for a moment)."""
    deadline = time.monotonic() + seconds
    while (n := _etcd_watchers(cluster)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return n


def test_storage_nodes_keep_no_watch_on_etcd(tmp_path):
    """The storage nodes of an etcd cluster keep their membership records there but
    watch nothing: every metadata change (a small file's content included) goes to
    the mounts' watches only, not to each node as well. A mount's own watches come
    and go with it."""
    if not os.access(ETCD, os.X_OK):
        pytest.skip(f"etcd not installed ({ETCD})")
    with Cluster(tmp_path / "cluster", "--meta", "etcd") as c:
        deadline = time.monotonic() + 30
        while len(json.loads(bmfs("status", c.dir, "--json").stdout)["nodes"]) < 6:
            assert time.monotonic() < deadline, "the nodes did not register in etcd"
            time.sleep(0.5)
        assert _settle_watchers(c, 0) == 0
        mp = tmp_path / "mnt"
        with Mounted(c.dir, mp):
            assert _etcd_watchers(c) > 0  # (the mount's: the gauge counts them)
            for i in range(20):
                (mp / f"f{i}").write_bytes(os.urandom(4096))
            assert [(mp / f"f{i}").stat().st_size for i in range(20)] == [4096] * 20
        assert _settle_watchers(c, 0) == 0
        assert len(json.loads(bmfs("status", c.dir, "--json").stdout)["nodes"]) == 6
        assert_fsck_clean(c.dir)


def test_remove_while_another_mount_writes(tmp_path):
    """A 7-node etcd cluster volume mounted twice. While a process writes files through
    the second mount, `bmfs node remove 2` runs through the first: it waits until both
    mounts confirm the draining mark (each commits the stripes it placed before), so
    one pass moves everything and the device is forgotten. Every file written reads
    back exact through the first mount with node 2 killed, and fsck (which reads
    every fragment's header where its stripe says it is) finds none on device 2."""
    if not os.access(ETCD, os.X_OK):
        pytest.skip(f"etcd not installed ({ETCD})")
    with Cluster(tmp_path / "cluster", "--meta", "etcd", nodes=7) as c:
        a, b = tmp_path / "a", tmp_path / "b"
        with Mounted(c.dir, a), Mounted(c.dir, b):
            stop = tmp_path / "stop"
            writer = subprocess.Popen([sys.executable, "-c", f"""
import os, sys
i = 0
while not os.path.exists({str(stop)!r}):
    with open({str(b)!r} + f"/w{{i:03d}}", "wb") as f:
        f.write(bytes([i % 251]) * ((3 << 20) + i))
    i += 1
print(i)
"""], stdout=subprocess.PIPE, text=True)
            try:
                time.sleep(2)  # stripes being written through b when the mark comes
                r = bmfs("node", "remove", 2, "-m", a, timeout=120)
                time.sleep(1)
            finally:
                stop.touch()
                out, _ = writer.communicate(timeout=60)
            assert writer.returncode == 0
            n = int(out)
            assert n > 2
            assert "mounts confirmed: 2" in r.stdout and "mounts unconfirmed: 0" in r.stdout, \
                r.stdout
            assert "removed: True" in r.stdout, r.stdout
            subprocess.run(["sync"])
            assert 2 not in _devices(a) and 2 not in _devices(b)
            c.kill(2)
            _drop_caches()
            for i in range(n):
                assert (a / f"w{i:03d}").read_bytes() == bytes([i % 251]) * ((3 << 20) + i)
            # (not "no read decodes": right after dropping caches a slow node's read
            # may be hedged, which decodes)
        assert_fsck_clean(c.dir)  # every fragment of every stripe read: none on 2


def test_slow_node_hedged_reads(cluster, tmp_path):
    mp = tmp_path / "mnt"
    with Mounted(cluster.dir, mp):
        with open(f"{mp}/f", "wb") as f:
            f.write(os.urandom(64 << 20))
        delay = 0.4
        cluster.start("--node", "2", "--fault", f"delay={delay}")
        _drop_caches()
        rng = random.Random(3)
        lat = []
        fd = os.open(f"{mp}/f", os.O_RDONLY)
        try:
            for _ in range(200):
                off = rng.randrange(0, (64 << 20) - 4096) // 4096 * 4096
                t0 = time.monotonic()
                os.pread(fd, 4096, off)
                lat.append(time.monotonic() - t0)
        finally:
            os.close(fd)
        lat.sort()
        # a quarter of the reads land on the slow node; hedging keeps them far below it
        assert lat[len(lat) // 2] < delay / 4, lat[len(lat) // 2]
        assert lat[int(len(lat) * 0.9)] < delay * 0.75, lat[int(len(lat) * 0.9)]
        assert _status(mp)["data"].get("hedged_reads", 0) > 0


def test_corrupt_fragments_detected_repaired_never_returned(cluster, tmp_path):
    mp = tmp_path / "mnt"
    with Mounted(cluster.dir, mp):
        data = os.urandom(24 << 20)
        with open(f"{mp}/f", "wb") as f:
            f.write(data)
        # flip bytes in the payload of every fragment on two devices
        flipped = 0
        for n in (1, 5):
            for frag in on_device(f"{cluster.dir}/node{n}/dev"):
                flip(frag, frag.length // 2)
                flipped += 1
        assert flipped >= 2
        _drop_caches()
        assert open(f"{mp}/f", "rb").read() == data
        st = _status(mp)
        assert st["data"]["corrupt_fragments"] > 0
        s = json.loads(bmfs("scrub", mp, "--json").stdout)
        assert s["bad_fragments"] >= flipped - 2 and s["stripes_failed"] == 0
        s = json.loads(bmfs("scrub", mp, "--json").stdout)
        assert s["bad_fragments"] == 0
    r = bmfs("fsck", cluster.dir, "--full", check=False)
    assert r.returncode == 0, r.stdout


def _node_addr(cluster, i=0):
    host, port = cluster.info["nodes"][i]["address"].rsplit(":", 1)
    return host, int(port)


def _frame(header: bytes, payload: bytes = b"") -> bytes:
    return struct.pack("<II", len(header), len(payload)) + header + payload


def test_protocol_robustness(cluster, tmp_path):
    mp = tmp_path / "mnt"
    with Mounted(cluster.dir, mp):
        data = os.urandom(9 << 20)
        with open(f"{mp}/f", "wb") as f:
            f.write(data)
        addr = _node_addr(cluster)
        before = on_device(f"{cluster.dir}/node0/dev")
        assert before and all(intact(f) for f in before)

        # a client without the secret is refused
        from bmfs.node.protocol import Connection  # noqa: F401 (protocol under test)
        from bmfs.wire import node_pb2 as pb
        s = socket.create_connection(addr, timeout=5)
        hello = s.recv(1 << 16)
        assert hello
        s.sendall(_frame(pb.Auth(proof=b"x" * 32, challenge=b"y" * 32).SerializeToString()))
        assert s.recv(1 << 16) == b""   # closed without a word
        s.close()

        @settings(max_examples=60, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.one_of(
            st.binary(max_size=200),
            st.builds(lambda h, p: _frame(h, p), st.binary(max_size=100), st.binary(max_size=100)),
            st.builds(lambda n: struct.pack("<II", n, n), st.integers(0, 2**32 - 1)),
            st.builds(lambda h: _frame(h)[:len(h) // 2], st.binary(min_size=4, max_size=50)),
        ))
        def fuzz(blob):
            c = socket.create_connection(addr, timeout=5)
            try:
                c.recv(1 << 16)  # Hello
                c.sendall(blob)
                c.shutdown(socket.SHUT_WR)
                c.settimeout(6)
                while c.recv(1 << 16):
                    pass
            except OSError:  # reset, broken pipe, not connected: the node hung up
                pass
            finally:
                c.close()
        fuzz()
        # the node still serves, and nothing was damaged
        _drop_caches()
        assert open(f"{mp}/f", "rb").read() == data
        assert on_device(f"{cluster.dir}/node0/dev") == before
        assert all(intact(f) for f in before)
        st_ = _status(mp)
        # (a hedged read may still race the cold node: that is not damage)
        assert st_["data"]["missing_fragments"] == 0 and st_["data"]["corrupt_fragments"] == 0
    assert_fsck_clean(cluster.dir)


def test_authenticated_garbage_gets_an_error_and_a_close(cluster):
    """After a correct handshake, an unknown op or an oversized frame: error, close."""
    import trio
    from bmfs.node.protocol import Connection, client_handshake, read_secret
    from bmfs.wire import node_pb2 as pb
    secret = read_secret(f"{cluster.dir}/secret")
    addr = _node_addr(cluster)

    async def main():
        sock = trio.socket.socket()
        await sock.connect(addr)
        conn = Connection(sock)
        await client_handshake(conn, secret, 0)  # (node 0 serves device 0)
        await conn.send(pb.Request(id=1, op=99, device=0))
        resp, _ = await conn.recv(pb.Response)
        assert resp.errno and "unknown operation" in resp.error
        await conn.send(pb.Request(id=2, op=pb.Request.READ, device=0, name="../../etc/passwd"))
        resp, _ = await conn.recv(pb.Response)
        assert resp.errno and "invalid fragment name" in resp.error
        await conn._sendall(struct.pack("<II", 10, 1 << 30))
        resp, _ = await conn.recv(pb.Response)
        assert "oversized" in resp.error
        with pytest.raises(EOFError):
            await conn.recv(pb.Response)
        conn.close()
    trio.run(main)


@pytest.mark.parametrize("meta", ["sqlite", "etcd"])
def test_down_then_start_brings_the_cluster_back(tmp_path, meta):
    """`cluster down` then `cluster start`: every node (and etcd member) runs again on
    its data, with its new pid in cluster.json, and what was written reads back."""
    if meta == "etcd" and not os.access(ETCD, os.X_OK):
        pytest.skip(f"etcd not installed ({ETCD})")
    mp = tmp_path / "mnt"
    data = os.urandom((9 << 20) + 5)
    with Cluster(tmp_path / "cluster", "--meta", meta) as cluster:
        with Mounted(cluster.dir, mp):
            with open(f"{mp}/f", "wb") as f:
                f.write(data)
        before = cluster.info
        cluster.down()
        # one node of a stopped cluster: a clear error, not a start
        res = bmfs("cluster", "start", cluster.dir, "--node", 1, check=False)
        assert res.returncode == 2 and "is down" in res.stderr, res.stderr
        out = cluster.start().stdout
        info = cluster.info
        procs = info["nodes"] + info.get("etcd", [])
        assert len(procs) == 6 + 3 * (meta == "etcd") and all(alive(p["pid"]) for p in procs)
        assert "node5" in out and ("etcd m2" in out) == (meta == "etcd")
        assert [n["address"] for n in info["nodes"]] == [n["address"] for n in before["nodes"]]
        with Mounted(cluster.dir, mp):
            assert open(f"{mp}/f", "rb").read() == data
        assert_fsck_clean(cluster.dir)
    assert not any(alive(p["pid"]) for p in procs)


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_an_etcd_cluster_lets_in_only_its_credentials(tmp_path):
    """`cluster up --meta etcd` turns etcd's authentication on: the mount works, while
    a local user (nobody) gets nothing from any member, over http or https, reads no
    credential file, and finds the password in no file or argv it can read."""
    if not os.access(ETCD, os.X_OK):
        pytest.skip(f"etcd not installed ({ETCD})")
    mp = tmp_path / "mnt"
    secret = b"root's secret, inline in the metadata"
    with Cluster(tmp_path / "cluster", "--meta", "etcd") as c:
        with Mounted(c.dir, mp):
            (mp / "f").write_bytes(secret)
            os.chmod(mp / "f", 0o600)
            info = c.info
            etcd_dir = os.path.join(c.dir, "etcd")
            password = open(os.path.join(etcd_dir, "root.password")).read().strip()
            assert oct(os.stat(etcd_dir).st_mode & 0o777) == "0o700"
            for f in ["root.password", "pki/client.key", "pki/ca.key", "pki/m0.key"]:
                assert oct(os.stat(os.path.join(etcd_dir, f)).st_mode & 0o777) == "0o600", f
                r = subprocess.run([*NOBODY, "cat", os.path.join(etcd_dir, f)],
                                   capture_output=True)
                assert r.returncode != 0
            every = json.dumps({"key": "AA==", "range_end": "AA=="})
            put = json.dumps({"key": base64.b64encode(b"b/main").decode(), "value": "eA=="})
            for member in info["etcd"]:
                for scheme, extra in [("http", []), ("https", ["-k"])]:
                    for path, body in [("/v3/kv/range", every), ("/v3/kv/put", put),
                                       ("/v3/kv/deleterange", every)]:
                        r = subprocess.run([*NOBODY, "curl", "-s", "-m", "5", *extra,
                                            f"{scheme}://{member['client']}{path}", "-d", body],
                                           capture_output=True)
                        out = r.stdout.decode(errors="replace")
                        assert '"header"' not in out and base64.b64encode(secret).decode() \
                            not in out, (member, scheme, path, out)
            # the password is in no file of the volume but its own, nor in any argv
            for name in ["volume.json", "cluster.json"]:
                assert password not in open(os.path.join(c.dir, name)).read()
            pids = [n["pid"] for n in info["nodes"]] + [m["pid"] for m in info["etcd"]]
            pids.append(int(open(os.path.join(c.dir, "mount.pid")).read().split()[0]))
            for pid in pids:
                assert password.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
            assert (mp / "f").read_bytes() == secret  # nothing was changed either
        with Mounted(c.dir, mp):
            assert (mp / "f").read_bytes() == secret
        assert_fsck_clean(c.dir)


def test_start_without_a_cluster_is_one_line(tmp_path):
    res = bmfs("cluster", "start", tmp_path / "none", check=False)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "no cluster.json" in res.stderr


def test_node_serve_format_then_node_add_by_address(cluster, tmp_path):
    """Adding a storage node's device by hand: `bmfs node serve --format --device
    6=PATH` formats the new directory for the volume and serves it; `bmfs node add
    PATH --address HOST:PORT --id 6` adds it once the node answers for that id (a
    wrong id is refused in one line). With two of the first nodes killed, what was
    written since reads back exact, decoded with the new device's fragments."""
    from bmfs.cluster.local import free_ports
    port = free_ports(1)[0]
    path = tmp_path / "n6"
    log = open(tmp_path / "n6.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bmfs.cli.main", "node", "serve", "--format",
         "--listen", f"127.0.0.1:{port}", "--device", f"6={path}",
         "--secret-file", f"{cluster.dir}/secret", "--volume-uuid", cluster.info["uuid"]],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "node did not start"
                time.sleep(0.05)
        assert os.path.exists(path / "DEVICE")
        mp = tmp_path / "mnt"
        with Mounted(cluster.dir, mp):
            add = ("node", "add", path, "--address", f"127.0.0.1:{port}", "-m", mp)
            r = bmfs(*add, "--id", 7, check=False)
            assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
            assert "does not serve device 7" in r.stderr
            assert 7 not in _devices(mp)
            bmfs(*add, "--id", 6)
            data = os.urandom(24 << 20)  # 6 stripes: some on device 6
            (mp / "f").write_bytes(data)
            devs = _devices(mp)
            assert devs[6]["fragments"] > 0 and devs[6]["node"] == f"127.0.0.1:{port}"
            cluster.kill(0, 1)
            _drop_caches()
            assert (mp / "f").read_bytes() == data
            cluster.start()
    finally:
        proc.kill()
        proc.wait()
        log.close()


def test_background_repair_of_a_shared_volume_by_one_mount(tmp_path, monkeypatch):
    """Two mounts of an etcd cluster volume: fragments lost on a live node are rebuilt
    in the background, without `bmfs repair`, by one mount only (the oldest: its pid
    is on every background repair line of the log), though the other found the
    damage; with that mount killed -9, the other takes over once its lease is gone."""
    if not os.access(ETCD, os.X_OK):
        pytest.skip(f"etcd not installed ({ETCD})")
    monkeypatch.setenv("BMFS_REPAIR_ROUNDS", "1")  # repair every upkeep round (5 s)
    with Cluster(tmp_path / "cluster", "--meta", "etcd") as c:
        a, b = tmp_path / "a", tmp_path / "b"
        log = f"{c.dir}/mount.log"

        def repairers(since):
            with open(log, errors="replace") as f:
                lines = f.read()[since:].splitlines()
            return {int(line.split("[")[1].split("]")[0]) for line in lines
                    if "background repair:" in line}

        def sids():
            return {f.sid for i in range(6) for f in on_device(f"{c.dir}/node{i}/dev")}

        def lose_read_and_wait(node, files, old=()):
            # data fragments of the stripes written since ``old`` (a fragment of an
            # older stripe may be cached decoded by b, so its loss would go unseen)
            lost = [f for f in on_device(f"{c.dir}/node{node}/dev")
                    if f.idx < 4 and f.sid not in old]
            assert lost
            for f in lost:
                lose(f)
            _drop_caches()
            for name, want in files.items():  # b decodes, and queues the damage
                assert (b / name).read_bytes() == want
            want = {(f.sid, f.idx) for f in lost}
            deadline = time.monotonic() + 60
            while not want <= set().union(*(intact_keys(f"{c.dir}/node{i}/dev")
                                            for i in range(6))):
                assert time.monotonic() < deadline, "lost fragments not rebuilt"
                time.sleep(1)
            assert _status(b)["fragments_awaiting_repair"] == 0
        with Mounted(c.dir, a) as ma, Mounted(c.dir, b) as mb:
            data = {n: os.urandom(16 << 20) for n in ("f", "g")}
            (a / "f").write_bytes(data["f"])
            subprocess.run(["sync"])
            start = os.path.getsize(log)
            lose_read_and_wait(2, {"f": data["f"]})
            assert repairers(start) == {ma.pid}
            ma.kill9()
            old = sids()
            (b / "g").write_bytes(data["g"])
            subprocess.run(["sync"])
            start = os.path.getsize(log)
            lose_read_and_wait(4, data, old)
            assert repairers(start) == {mb.pid}
        assert_fsck_clean(c.dir)


def test_repair_keeps_the_fragments_of_a_node_that_came_back(cluster, tmp_path, monkeypatch):
    """Reads while node 2 was dead queue its fragments for repair (unreachable). Once
    it is back with them intact, repair reads them, finds them intact and rebuilds
    none: they stay on node 2 and the queue empties. It used to rebuild each of them
    on another device."""
    monkeypatch.setenv("BMFS_REPAIR_ROUNDS", "100000")  # no background repair here
    mp = tmp_path / "mnt"
    node2 = f"{cluster.dir}/node2/dev"
    with Mounted(cluster.dir, mp):
        data = os.urandom(24 << 20)
        (mp / "f").write_bytes(data)
        subprocess.run(["sync"])
        held = intact_keys(node2)
        assert held
        cluster.kill(2)
        _drop_caches()
        assert (mp / "f").read_bytes() == data  # decodes; queues node 2's fragments
        cluster.start("--node", 2)
        time.sleep(3)  # the mount skips a node for 2 s after it failed
        r = json.loads(bmfs("repair", mp, "--json").stdout)
        assert r["fragments_intact_again"] > 0, r
        assert r["fragments_rebuilt"] == 0 and r["stripes_failed"] == 0, r
        assert _status(mp)["fragments_awaiting_repair"] == 0
        assert intact_keys(node2) == held
        _drop_caches()
        assert (mp / "f").read_bytes() == data
    assert_fsck_clean(cluster.dir)


def test_repair_rebuilds_a_dead_nodes_fragments_unread(tmp_path):
    """On a 7-node 4+2 cluster, node 3 dies and nothing reads its fragments: `bmfs
    repair` finds it dead (it asks every device) and rebuilds all of them on the
    other nodes, so the files then survive two more nodes killed."""
    with Cluster(tmp_path / "c7", nodes=7) as c7:
        mp = tmp_path / "mnt"
        with Mounted(c7.dir, mp):
            digests = _write_varied(mp, 24 << 20)
            subprocess.run(["sync"])
            on3 = len(on_device(f"{c7.dir}/node3/dev"))
            assert on3 > 0
            c7.kill(3)
            r = json.loads(bmfs("repair", mp, "--json").stdout)
            assert r["fragments_rebuilt"] == on3 and r["stripes_failed"] == 0, (r, on3)
            c7.kill(1, 5)
            _drop_caches()
            _check(mp, digests)


def test_a_second_node_on_a_served_device_is_refused(cluster, tmp_path):
    """`bmfs node serve` on a device another node process serves already (a node
    started again while the old one still runs) exits with one line, status 2, and
    leaves the device to the first: a mount still reads and writes through it."""
    from bmfs.cluster.local import free_ports
    node0 = cluster.info["nodes"][0]
    port = free_ports(1)[0]
    t0 = time.monotonic()
    r = bmfs("node", "serve", "--listen", f"127.0.0.1:{port}",
             "--device", f"{node0['device']}={node0['path']}",
             "--secret-file", f"{cluster.dir}/secret", "--volume-uuid", cluster.info["uuid"],
             check=False, timeout=60)
    assert r.returncode == 2 and "served by another process" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and time.monotonic() - t0 < 30
    assert alive(node0["pid"])
    mp = tmp_path / "mnt"
    with Mounted(cluster.dir, mp):
        data = os.urandom(12 << 20)
        (mp / "f").write_bytes(data)
        assert _devices(mp)[0]["fragments"] > 0
        _drop_caches()
        assert (mp / "f").read_bytes() == data


def test_tls_cluster_end_to_end(tmp_path):
    """`cluster up --tls`: a mount writes and reads through real node processes over
    TLS (files of every size, read back cold), the certificates and keys are 0600 in
    a 0700 directory, and a plain TCP client of a node is closed without a byte."""
    with Cluster(tmp_path / "cluster", "--tls") as c:
        tls_dir = os.path.join(c.dir, "tls")
        assert os.stat(tls_dir).st_mode & 0o777 == 0o700
        assert all(os.stat(os.path.join(tls_dir, f)).st_mode & 0o777 == 0o600
                   for f in os.listdir(tls_dir))
        with open(os.path.join(c.dir, "volume.json")) as f:
            assert json.load(f)["tls"]["ca"] == "tls/ca.crt"
        mp = tmp_path / "mnt"
        with Mounted(c.dir, mp):
            digests = _write_varied(mp, 24 << 20)
            _drop_caches()
            _check(mp, digests)
            big = max(os.listdir(f"{mp}/data"), key=lambda n: os.path.getsize(f"{mp}/data/{n}"))
            with open(f"{mp}/data/{big}", "rb") as f:  # small reads, at random
                blob = f.read()
            _drop_caches()
            with open(f"{mp}/data/{big}", "rb") as f:
                for off in random.Random(2).sample(range(0, len(blob), 4096), 16):
                    f.seek(off)
                    assert f.read(4096) == blob[off:off + 4096]
            st_ = _status(mp)
            assert all(d["health"] == "ok" for d in st_["devices"])
        s = socket.create_connection(_node_addr(c), timeout=10)
        s.sendall(_frame(b"\x08\x01"))  # a plain client's first frame: no TLS record
        try:
            assert s.recv(1 << 16) == b""
        except ConnectionResetError:
            pass
        s.close()
        assert_fsck_clean(c.dir)


def test_hundreds_of_idle_connections_to_a_node_leave_the_mount_served(cluster, tmp_path):
    """300 idle authenticated connections held open to node 0 (more than the 256 it
    serves at once): a mount started then writes and reads through it cold, and `bmfs
    status` finds every device ok (before, the node stopped answering new connections
    and its device went missing)."""
    import trio
    from bmfs.node.protocol import Connection, client_handshake, read_secret
    secret = read_secret(f"{cluster.dir}/secret")
    addr = _node_addr(cluster)
    mp = tmp_path / "mnt"

    def use_a_mount():
        with Mounted(cluster.dir, mp):
            data = os.urandom(8 << 20)
            with open(f"{mp}/f", "wb") as f:
                f.write(data)
            _drop_caches()
            with open(f"{mp}/f", "rb") as f:
                assert f.read() == data
            return _status(mp)

    async def main():
        conns = []
        try:
            for _ in range(300):
                sock = trio.socket.socket()
                await sock.connect(addr)
                conn = Connection(sock, 4096)
                conns.append(conn)
                await client_handshake(conn, secret, 0)  # (node 0 serves device 0)
            await trio.sleep(1.5)  # all idle: the node may close the idlest now
            return await trio.to_thread.run_sync(use_a_mount)
        finally:
            for c in conns:
                c.close()
    st_ = trio.run(main)
    assert [d["health"] for d in st_["devices"]] == ["ok"] * 6, st_["devices"]
