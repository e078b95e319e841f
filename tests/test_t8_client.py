"""The direct client and fsspec ``bm`` against a 6-node 4+2 cluster of real node
processes with etcd metadata: beside a mount, pandas and pyarrow, batched reads
across nodes, nodes down, a wrong secret."""
from __future__ import annotations

import errno
import os
import threading

import pytest

import bmfs
from bmfs.cluster.etcd import ETCD
from bmfs.transport import tcp
from mountutil import Mounted, assert_fsck_clean
from test_t8_cluster import Cluster

pytestmark = pytest.mark.skipif(not os.access(ETCD, os.X_OK), reason=f"etcd not installed ({ETCD})")


@pytest.fixture
def etcd_cluster(tmp_path):
    with Cluster(tmp_path / "cluster", "--meta", "etcd") as c:
        yield c


def test_client_beside_a_mount(etcd_cluster, tmp_path, monkeypatch):
    """Close-to-open both ways: what the mount closed, the client reads; what the
    client wrote and closed, the mount reads; batches across every node (a fresh
    client's first batch opens a few connections per node, not one per request)."""
    data = os.urandom((13 << 20) + 77)
    with Mounted(etcd_cluster.dir, tmp_path / "mnt") as m:
        with open(os.path.join(m.mp, "f"), "wb") as f:
            f.write(data)
        with bmfs.connect(etcd_cluster.dir, writable=True) as c:
            assert c.read_file("/f") == data
            rng = __import__("random").Random(3)
            items = [("/f", rng.randrange(len(data)), 4096) for _ in range(300)]
            for (_, off, n), b in zip(items, c.read_many(items)):
                assert bytes(b) == data[off:off + n]
            c.write_file("/from-client", b"client bytes" * 1000)
            c.mkdir("/dir")
            with open(os.path.join(m.mp, "f"), "r+b") as f:  # the mount changes it ...
                f.write(b"CHANGED")
            assert c.read_file("/f")[:7] == b"CHANGED"  # ... seen at the next open
        with open(os.path.join(m.mp, "from-client"), "rb") as f:
            assert f.read() == b"client bytes" * 1000
        connects, real = [], tcp.TcpTransport._connect

        async def counted(self, node, *args):
            connects.append(node.address)
            return await real(self, node, *args)
        monkeypatch.setattr(tcp.TcpTransport, "_connect", counted)
        with bmfs.connect(etcd_cluster.dir) as c:
            items = [("/f", rng.randrange(7, len(data)), 4096) for _ in range(300)]
            for (_, off, n), b in zip(items, c.read_many(items)):
                assert bytes(b) == data[off:off + n]  # (past the mount's CHANGED)
        nodes = len(etcd_cluster.info["nodes"])
        limit = nodes * tcp.BATCH_CONNS if tcp.CLIENT is not None else len(items)
        assert 0 < len(connects) <= limit
        assert os.path.isdir(os.path.join(m.mp, "dir"))
    assert_fsck_clean(etcd_cluster.dir)


def test_pandas_pyarrow_and_workers_on_a_cluster(etcd_cluster):
    fsspec = pytest.importorskip("fsspec")
    pd = pytest.importorskip("pandas")
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    if "bm" not in fsspec.available_protocols():
        fsspec.register_implementation("bm", "bmfs.client.fsspec_fs.BmFileSystem")
    fs = fsspec.filesystem("bm", volume=etcd_cluster.dir, writable=True,
                           skip_instance_cache=True)
    df = pd.DataFrame({"x": range(50_000), "y": [i * 0.5 for i in range(50_000)]})
    fs.mkdir("main/ds")
    with fs.open("main/ds/a.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pandas(df), f)
    with fs.open("bm://main/ds/a.csv", "wb") as f:
        df.to_csv(f, index=False)
    # readers beside the writer (etcd: any number of clients)
    assert pd.read_parquet("bm://main/ds/a.parquet",
                           storage_options={"volume": etcd_cluster.dir}).equals(df)
    with fs.open("main/ds/a.csv", "rb") as f:
        assert pd.read_csv(f).equals(df)
    assert len(fs.cat_ranges(["main/ds/a.csv"] * 64, list(range(0, 6400, 100)),
                             list(range(10, 6410, 100)))) == 64
    c = bmfs.connect(etcd_cluster.dir)
    raw = c.read_file("/ds/a.csv")
    pids = []
    for w in range(2):  # forked workers, each its own connections
        pid = os.fork()
        if pid == 0:
            got = c.read_many([("/ds/a.csv", w * 1000, 500)])
            os._exit(0 if bytes(got[0]) == raw[w * 1000:w * 1000 + 500] else 1)
        pids.append(pid)
    assert all(os.waitpid(p, 0)[1] == 0 for p in pids)
    errors = []

    def reader():
        try:
            for off in range(0, len(raw) - 100, len(raw) // 20):
                assert bytes(c.read_many([("/ds/a.csv", off, 100)])[0]) == raw[off:off + 100]
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    c.close()
    fs.close()


def test_nodes_down_and_a_wrong_secret(etcd_cluster, tmp_path):
    data = os.urandom(8 << 20)
    with bmfs.connect(etcd_cluster.dir, writable=True) as c:
        c.write_file("/f", data)
    etcd_cluster.kill(0, 3)  # m nodes down: every byte still reads right (decoded)
    with bmfs.connect(etcd_cluster.dir) as c:
        items = [("/f", off, 4096) for off in range(0, len(data), 250_007)]
        for (_, off, n), b in zip(items, c.read_many(items)):
            assert bytes(b) == data[off:off + n]
        assert c.read_file("/f") == data
    etcd_cluster.kill(1)  # one more: no wrong byte, an error
    with bmfs.connect(etcd_cluster.dir) as c:
        with pytest.raises(OSError) as e:
            c.read_file("/f")
        assert e.value.errno == errno.EIO
    with open(os.path.join(etcd_cluster.dir, "secret"), "rb") as f:
        good = f.read()
    try:
        with open(os.path.join(etcd_cluster.dir, "secret"), "wb") as f:
            f.write(os.urandom(len(good)))
        with bmfs.connect(etcd_cluster.dir) as c:
            with pytest.raises(OSError) as e:
                c.read_file("/f")
            assert e.value.errno == errno.EIO
    finally:
        with open(os.path.join(etcd_cluster.dir, "secret"), "wb") as f:
            f.write(good)


def test_aligned_reads_into_buffers_across_nodes(etcd_cluster):
    """A sequential reader's 1 MiB ranges are received straight into its buffers from
    the nodes: every byte right with a node down and a corrupt block in one data
    fragment of each stripe (decoded over what was received), and past the end."""
    from fragments import flip, on_device, payload_area
    MiB = 1 << 20
    data = os.urandom(10 * MiB + 12345)
    with bmfs.connect(etcd_cluster.dir, writable=True) as c:
        c.write_file("/f", data)
    for n in range(6):
        for f in on_device(f"{etcd_cluster.dir}/node{n}/dev"):
            if f.idx == 1:
                flip(f, payload_area(f)[0] + (300 << 10))
    etcd_cluster.kill(0)
    items = [("/f", off, MiB) for off in range(0, len(data) + MiB, MiB)]
    with bmfs.connect(etcd_cluster.dir) as c:
        for _ in range(2):
            bufs = [bytearray(b"\xee" * (MiB + 10)) for _ in items]
            counts = c.read_many(items, out=bufs)
            for (_, off, n), b, k in zip(items, bufs, counts):
                assert k == len(data[off:off + n])
                assert b[:k] == data[off:off + n] and b[k:] == b"\xee" * (len(b) - k)
        with c.open("/f", buffering=0) as f:
            buf, got = bytearray(MiB), bytearray()
            while n := f.readinto(buf):
                got += buf[:n]
            assert got == data
