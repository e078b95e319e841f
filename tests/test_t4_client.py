"""The direct client (bmfs.connect): a volume opened in the test's process, beside
real mounts; reads and writes compared with what the mount shows, batched reads,
threads and forked workers, and bad input."""
from __future__ import annotations

import errno
import os
import threading

import pytest

import bmfs
from mountutil import Mounted, assert_fsck_clean


def _fill(volume, files: dict[str, bytes]):
    with bmfs.connect(volume, writable=True) as c:
        for path, data in files.items():
            c.makedirs(os.path.dirname(path), exist_ok=True)
            c.write_file(path, data)


def test_write_then_read_through_client_and_mount(volume, tmp_path):
    big = os.urandom((9 << 20) + 123)  # three stripes, the last one short
    _fill(volume, {"/d/big": big, "/d/small": b"tiny", "/e/empty": b""})
    with bmfs.connect(volume) as c:
        assert sorted(c.listdir("/")) == ["d", "e"]
        assert c.stat("/d/big").st_size == len(big)
        assert c.read_file("/d/big") == big
        assert c.read_file("/e/empty") == b""
        with c.open("/d/big", buffering=0) as f:
            f.seek(len(big) - 5)
            assert f.read(100) == big[-5:]
            assert f.read(100) == b""  # past the end: nothing, no error
    with Mounted(volume, tmp_path / "mnt") as m:
        with open(os.path.join(m.mp, "d/big"), "rb") as f:
            assert f.read() == big
        with open(os.path.join(m.mp, "d/small"), "rb") as f:
            assert f.read() == b"tiny"
    assert_fsck_clean(volume)


@pytest.mark.parametrize("native", [True, False])
def test_read_many_and_readinto(volume, monkeypatch, native):
    """Batches (read in C by pread_batch, or by the worker threads where the helper
    is missing) give every byte right: unaligned, across stripes, past the end."""
    from bmfs.transport import local
    if not native:
        monkeypatch.setattr(local, "NATIVE", None)
    elif local.NATIVE is None:
        pytest.skip("the C helper is not built (BMFS_NATIVE=0)")
    data = os.urandom(6 << 20)
    _fill(volume, {"/f": data, "/g": b"x" * 100})
    rng = __import__("random").Random(5)
    items = [("/f", rng.randrange(len(data) - 5000), rng.choice([1, 4096, 5000]))
             for _ in range(200)]
    items += [("/f", (4 << 20) - 7, 20), ("/f", len(data) - 3, 10), ("/g", 90, 50),
              ("/f", len(data) + 5, 10)]
    with bmfs.connect(volume) as c:
        got = c.read_many(items)
        for (p, off, n), b in zip(items, got):
            src = data if p == "/f" else b"x" * 100
            assert bytes(b) == src[off:off + n]
        bufs = [bytearray(n) for _, _, n in items]
        counts = c.read_many(items, out=bufs)
        for (p, off, n), b, k in zip(items, bufs, counts):
            src = data if p == "/f" else b"x" * 100
            assert bytes(b[:k]) == src[off:off + n]
        with c.open("/f", buffering=0) as f:
            buf = bytearray(10000)
            f.seek(12345)
            assert f.readinto(buf) == 10000 and buf == data[12345:22345]
            assert c.read_many([(f, 7, 3)])[0] == data[7:10]


@pytest.mark.parametrize("layout", ["files", "pool"])
def test_aligned_reads_into_callers_buffers(tmp_path, layout):
    """A sequential reader's block-aligned ranges are read into its own buffers (the
    payload straight from the devices): every byte right, including where blocks
    are corrupt (their ranges decoded over what was read), past the end, and into
    buffers larger than asked for, whose bytes beyond the read stay as they were."""
    from fragments import flip, on_volume, payload_area
    from mountutil import mkfs
    vol = tmp_path / "vol"
    mkfs(vol, "--layout", layout)
    MiB = 1 << 20
    data = os.urandom(10 * MiB + 12345)  # three stripes, the last one short
    _fill(vol, {"/f": data})
    frags = [f for f in on_volume(vol) if f.idx in (1, 3) and f.sid == min(
        g.sid for g in on_volume(vol))]
    for f in frags:  # two data fragments of the first stripe, one block each
        start, _ = payload_area(f)
        flip(f, start + (200 << 10))
    items = [("/f", off, MiB) for off in range(0, len(data) + MiB, MiB)]
    items += [("/f", 4096, 64 << 10), ("/f", 3 * MiB + 100, MiB)]
    with bmfs.connect(vol) as c:
        for _ in range(2):  # (the second time with the fragments' tables cached)
            bufs = [bytearray(b"\xee" * (n + 10)) for _, _, n in items]
            counts = c.read_many(items, out=bufs)
            for (_, off, n), b, k in zip(items, bufs, counts):
                assert k == len(data[off:off + n])
                assert b[:k] == data[off:off + n]
                assert b[k:] == b"\xee" * (len(b) - k)
        with c.open("/f", buffering=0) as f:
            buf, got = bytearray(MiB), bytearray()
            while n := f.readinto(buf):
                got += buf[:n]
            assert got == data
        with pytest.raises(ValueError):
            c.read_many([("/f", 0, MiB)], out=[bytearray(10)])


def test_sequential_reader_reads_ahead(volume):
    """readinto in a loop (fetched ahead in the background) gives every byte right,
    whatever the reader does between reads: seeks back and forward, changes its
    length, closes with fetches under way, reads on in a forked child."""
    MiB = 1 << 20
    data = os.urandom(21 * MiB + 777)
    _fill(volume, {"/f": data})
    with bmfs.connect(volume) as c:
        with c.open("/f", buffering=0) as f:
            buf, got = bytearray(2 * MiB), bytearray()
            while n := f.readinto(buf):
                got += buf[:n]
            assert got == data
        with c.open("/f", buffering=0) as f:
            buf = bytearray(MiB)
            for i in range(4):
                assert f.readinto(buf) == MiB and buf == data[i * MiB:(i + 1) * MiB]
            f.seek(MiB)  # back, over ranges fetched already
            assert f.readinto(buf) == MiB and buf == data[MiB:2 * MiB]
            f.seek(15 * MiB + 3)  # forward, unaligned
            for _ in range(3):
                pos = f.tell()
                assert f.readinto(buf) == MiB and buf == data[pos:pos + MiB]
            small = bytearray(300 << 10)  # another length
            pos = f.tell()
            assert f.readinto(small) == len(small) and small == data[pos:pos + len(small)]
            f.seek(20 * MiB)
            assert f.readinto(buf) == MiB and buf == data[20 * MiB:21 * MiB]
            assert f.readinto(buf) == 777 and buf[:777] == data[-777:]
            assert f.readinto(buf) == 0
        with c.open("/f", buffering=0) as f:  # closed with fetches under way
            f.readinto(bytearray(4 * MiB))
            f.readinto(bytearray(4 * MiB))
        with c.open("/f") as f:  # buffered: io.BufferedReader reads through readinto
            assert f.read() == data
        f = c.open("/f", buffering=0)
        buf = bytearray(MiB)
        f.readinto(buf), f.readinto(buf)  # (two read: the next ones are being fetched)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the parent's fetches are not the child's
            ok = all(f.readinto(buf) == MiB and buf == data[i * MiB:(i + 1) * MiB]
                     for i in range(2, 8))
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"1"
        os.waitpid(pid, 0)
        assert f.readinto(buf) == MiB and buf == data[2 * MiB:3 * MiB]
        f.close()


def test_degraded_batch_decodes(volume):
    """Two devices gone (m=2): a batch still reads every byte right, decoded."""
    data = os.urandom(4 << 20)
    _fill(volume, {"/f": data})
    import shutil
    for d in ("dev0", "dev3"):
        shutil.rmtree(os.path.join(volume, d))
        os.makedirs(os.path.join(volume, d))
    with bmfs.connect(volume) as c:
        items = [("/f", off, 4096) for off in range(0, len(data), 100_003)]
        for (_, off, n), b in zip(items, c.read_many(items)):
            assert bytes(b) == data[off:off + n]


@pytest.mark.parametrize("native", [True, False])
def test_corrupt_blocks_in_a_batch_are_decoded_around(volume, monkeypatch, native):
    """Two data fragments (m=2) get a flipped byte in their payload: the batch's reads
    of those blocks fail their checksums and are decoded from the other fragments."""
    from bmfs.transport import local
    from fragments import flip, on_volume, payload_area
    if not native:
        monkeypatch.setattr(local, "NATIVE", None)
    data = os.urandom(4 << 20)
    _fill(volume, {"/f": data})
    frags = [f for f in on_volume(volume) if f.idx in (0, 2)]
    assert len(frags) == 2
    for f in frags:
        start, length = payload_area(f)
        flip(f, start + 100)
    with bmfs.connect(volume) as c:
        items = [("/f", i * (1 << 20) + 50, 4096) for i in range(4)] * 5
        for (_, off, n), b in zip(items, c.read_many(items)):
            assert bytes(b) == data[off:off + n]


def test_threads_and_forked_workers(volume):
    data = os.urandom(2 << 20)
    _fill(volume, {"/f": data})
    with bmfs.connect(volume) as c:
        f = c.open("/f", buffering=0)
        errors = []

        def reader(seed):
            try:
                for i in range(30):
                    off = (seed * 7919 + i * 104729) % (len(data) - 4096)
                    assert bytes(f.pread(4096, off)) == data[off:off + 4096]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        pids = []
        for w in range(3):  # DataLoader workers: forked with the client and file open
            pid = os.fork()
            if pid == 0:
                ok = bytes(f.pread(1000, w * 1000)) == data[w * 1000:(w + 1) * 1000] and \
                    bytes(c.read_many([("/f", 5, 5)])[0]) == data[5:10]
                os._exit(0 if ok else 1)
            pids.append(pid)
        assert all(os.waitpid(p, 0)[1] == 0 for p in pids)
        assert bytes(f.pread(10, 0)) == data[:10]  # the parent's connections still work
        f.close()


def test_bad_input(volume, tmp_path):
    _fill(volume, {"/f": b"data"})
    with pytest.raises(FileNotFoundError):
        bmfs.connect(tmp_path / "nowhere")
    (tmp_path / "foreign").mkdir()
    with pytest.raises(FileNotFoundError):
        bmfs.connect(tmp_path / "foreign")
    with pytest.raises(FileNotFoundError, match="no branch named 'nope'"):
        bmfs.connect(volume, branch="nope")
    with pytest.raises(FileNotFoundError):
        bmfs.connect(volume, snapshot="nope")
    with bmfs.connect(volume) as c:
        with pytest.raises(FileNotFoundError):
            c.read_file("/missing")
        with pytest.raises(FileNotFoundError):
            c.read_many([("/f", 0, 1), ("/missing", 0, 1)])
        with pytest.raises(IsADirectoryError):
            c.open("/")
        with pytest.raises(PermissionError) as e:
            c.write_file("/new", b"x")
        assert e.value.errno == errno.EROFS
        with pytest.raises(ValueError):
            c.read_many([("/f", -1, 1)])


def test_mounted_one_machine_volume(volume, tmp_path):
    """A mount owns a one-machine volume: the client reads through it (what the mount
    committed last, still in its redo log, too), branches and snapshots by name, and
    is refused writes naming the mount point; once it is unmounted, a read-only
    client keeps a mount from starting until it closes."""
    old = os.urandom(300_000)
    _fill(volume, {"/f": b"before", "/d/old": old})
    with Mounted(volume, tmp_path / "mnt") as m:
        m.ctl("snapshot_create", name="s1")
        m.ctl("branch_create", name="dev")
        big = os.urandom((5 << 20) + 77)
        with open(os.path.join(m.mp, "d/big"), "wb") as f:
            f.write(big)
        with open(os.path.join(m.mp, "f"), "wb") as f:
            f.write(b"after")
        # (closed just now: the commits are in the mount's redo log, not the database)
        assert os.path.getsize(os.path.join(volume, "meta.db-redo")) > 0
        with bmfs.connect(volume) as c:
            assert c.read_file("/d/big") == big
            assert c.read_file("/f") == b"after"
            assert c.read_file("/d/old") == old
            assert sorted(c.listdir("/d")) == ["big", "old"]
            with pytest.raises(PermissionError) as e:
                c.write_file("/new", b"x")
            assert e.value.errno == errno.EROFS and f"the mount at {m.mp}" in str(e.value)
            with open(os.path.join(m.mp, "f"), "wb") as f:  # close-to-open
                f.write(b"again")
            assert c.read_file("/f") == b"again"
            pid = os.fork()  # a DataLoader worker: its own connections to the mount
            if pid == 0:
                os._exit(0 if c.read_many([("/d/big", 1000, 5)])[0] == big[1000:1005]
                         else 1)
            assert os.waitpid(pid, 0)[1] == 0
            assert c.read_file("/f") == b"again"
        with bmfs.connect(volume, snapshot="s1") as c:
            assert c.read_file("/f") == b"before" and not c.exists("/d/big")
        with bmfs.connect(volume, branch="dev") as c:
            assert c.read_file("/f") == b"before"
        with pytest.raises(PermissionError) as e:
            bmfs.connect(volume, writable=True)
        assert e.value.errno == errno.EROFS and f"the mount at {m.mp}" in str(e.value)
        with pytest.raises(FileNotFoundError, match="no branch named 'nope'"):
            bmfs.connect(volume, branch="nope")
    assert not os.path.exists(os.path.join(volume, "meta.sock"))
    with bmfs.connect(volume) as c:
        from mountutil import bmfs as run
        res = run("mount", tmp_path / "mnt", "--volume", volume, check=False)
        assert res.returncode != 0 and "in use" in res.stderr
        assert c.read_file("/f") == b"again"


def test_mount_outlives_bad_socket_clients(volume, tmp_path):
    """Garbage, oversized frames and clients that go away mid-request on the metadata
    socket cost only their own connections; the mount and its clients go on."""
    import socket
    import struct
    _fill(volume, {"/f": b"kept"})
    with Mounted(volume, tmp_path / "mnt") as m, bmfs.connect(volume) as c:
        path = os.path.join(volume, "meta.sock")
        assert os.stat(path).st_mode & 0o777 == 0o600
        hello = struct.pack("<IBH", 3, 1, 1)
        for junk in (b"\xff" * 100,                              # an oversized frame
                     struct.pack("<I", 1000) + b"\x02abc",       # gone mid-frame
                     struct.pack("<IB", 1, 2),                    # a request before HELLO
                     hello + struct.pack("<IB", 3, 9) + b"xy",    # an unknown request
                     hello + struct.pack("<IBII", 9, 3, 50, 0)):  # a short RANGE
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            try:
                while s.recv(65536):  # (the HELLO's answer; then the mount closes it)
                    pass
            except ConnectionResetError:  # (closed with the rest of the junk unread)
                pass
            s.close()
        held = [socket.socket(socket.AF_UNIX) for _ in range(5)]  # idle connections
        for s in held:
            s.connect(path)
        with open(os.path.join(m.mp, "f"), "rb") as f:
            assert f.read() == b"kept"
        assert c.read_file("/f") == b"kept"
        with bmfs.connect(volume) as c2:
            assert c2.read_file("/f") == b"kept"
        for s in held:
            s.close()
        with open(os.path.join(volume, "mount.log")) as f:
            assert "a frame of 4294967295 bytes" in f.read()


def test_snapshots_and_branches_by_name(volume, tmp_path):
    _fill(volume, {"/f": b"one"})
    with Mounted(volume, tmp_path / "mnt") as m:
        m.ctl("snapshot_create", name="s1")
        m.ctl("branch_create", name="dev")
        with open(os.path.join(m.mp, "f"), "wb") as f:
            f.write(b"two")
    with bmfs.connect(volume, snapshot="s1", writable=True) as c:
        assert c.read_file("/f") == b"one"
        with pytest.raises(OSError) as e:
            c.write_file("/f", b"x")
        assert e.value.errno == errno.EROFS
    with bmfs.connect(volume, branch="dev", writable=True) as c:
        assert c.read_file("/f") == b"one"
        c.write_file("/g", b"in dev")
    with bmfs.connect(volume) as c:
        assert c.read_file("/f") == b"two" and not c.exists("/g")
    assert_fsck_clean(volume)


def test_typed_views_without_a_mount(volume, tmp_path):
    """Record files and .npy arrays written through a mount, read through the client."""
    import numpy as np
    from bmfs.typed import records
    from bmfs.typed.registry import proto_class
    Sample = proto_class("bmfs.examples.Sample")
    arr = np.arange(3000 * 7, dtype="<f4").reshape(3000, 7)
    with Mounted(volume, tmp_path / "mnt") as m:
        with records.writer(os.path.join(m.mp, "train.rec"), Sample) as w:
            for i in range(5000):
                w.append(Sample(id=i, label=f"sample {i}" * (i % 5)))
        np.save(os.path.join(m.mp, "a.npy"), arr)
        with open(os.path.join(m.mp, "junk.rec"), "wb") as f:
            f.write(b"BMRECS\r\n" + b"\0" * 100)
    with bmfs.connect(volume) as c:
        recs = c.records("/train.rec")
        assert len(recs) == 5000 and recs.message_class is Sample
        assert recs[4999].id == 4999 and recs[-1].id == 4999
        picked = [17, 4000, 3, 17, 2500]
        assert [s.id for s in recs.get_many(picked)] == picked
        assert [s.label for s in recs.get_many(picked)] == \
            [f"sample {i}" * (i % 5) for i in picked]
        assert [s.id for s in recs] == list(range(5000))
        with pytest.raises(IndexError):
            recs[5000]
        recs.close()
        from bmfs.typed.errors import NotSupportedHere, TypeMismatch
        with pytest.raises(NotSupportedHere, match="version 0"):
            c.records("/junk.rec")
        a = c.array("/a.npy")
        assert a.shape == (3000, 7) and a.dtype == np.dtype("<f4")
        assert np.array_equal(a.read(), arr) and np.array_equal(a[5], arr[5])
        assert np.array_equal(a[10:20], arr[10:20])
        assert np.array_equal(a.take([2999, 0, 1234]), arr[[2999, 0, 1234]])
        with pytest.raises(TypeMismatch):
            c.array("/train.rec")


def test_a_second_client_in_the_same_process_is_told_why(volume):
    """A one-machine volume has one owner: a second client of it in the process that
    holds it (a writable fsspec instance asked for a second branch, a reader beside a
    writer) is refused (EBUSY) saying that this process holds it and what to do, not
    that another process does; once the first is closed it opens."""
    w = bmfs.connect(volume, writable=True)
    try:
        for kw in ({"writable": True, "branch": "main"}, {}):
            with pytest.raises(PermissionError) as e:
                bmfs.connect(volume, **kw)
            assert e.value.errno == errno.EBUSY, e.value
            assert "in use by this process already" in str(e.value), e.value
            assert "another bmfs process" not in str(e.value), e.value
    finally:
        w.close()
    with bmfs.connect(volume, writable=True) as c:
        c.write_file("/f", b"x")
