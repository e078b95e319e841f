"""Level 1: one conformance suite for every fragment store (a directory of fragment
files, a directory holding a pool, a pmem pool file)."""
import os
import threading

import pytest

from bmfs.errors import VolumeError
from bmfs.store.pmem import format_store, open_store


@pytest.fixture(params=["dir", "pool", "pmem"])
def spec(request, tmp_path):
    if request.param in ("dir", "pool"):
        return (str(tmp_path / "dev"), "files" if request.param == "dir" else "pool")
    return f"pmem:{tmp_path}/pool:64"


def make(spec):
    path, layout = spec if isinstance(spec, tuple) else (spec, "files")
    format_store(path, "vol-uuid", 3, layout)
    return open_store(path, "vol-uuid", 3)


def _path(spec):
    return spec[0] if isinstance(spec, tuple) else spec


def test_write_read_delete(spec):
    s = make(spec)
    a, b = os.urandom(10_000), os.urandom(300_000)
    s.write("0000000000000001.0", [a[:10], a[10:]])
    s.write("0000000000000002.5", [b])
    assert s.read_parts("0000000000000001.0", [(0, 10), (9990, 100)]) == [a[:10], a[9990:]]
    assert sorted(s.names()) == ["0000000000000001.0", "0000000000000002.5"]
    s.write("0000000000000001.0", [b"replaced"])
    assert s.read_parts("0000000000000001.0", [(0, 100)]) == [b"replaced"]
    s.delete("0000000000000001.0")
    s.delete("0000000000000001.0")  # deleting twice is fine
    with pytest.raises(FileNotFoundError):
        s.read_parts("0000000000000001.0", [(0, 1)])
    s.sync()
    u = s.usage()
    assert 0 < u["free"] <= u["total"]


def test_read_parts_into_a_callers_buffer(spec):
    """read_parts' last range read into the caller's buffer: the part is that buffer
    (or its first bytes where the fragment ends sooner), the same bytes as without."""
    s = make(spec)
    b = os.urandom(300_000)
    s.write("0000000000000002.5", [b])
    for ranges in ([(0, 4096)], [(100, 10), (4096, 200_000)], [(299_000, 5000)]):
        into = memoryview(bytearray(ranges[-1][1]))
        parts = s.read_parts("0000000000000002.5", ranges, into)
        assert [bytes(p) for p in parts] == [b[o:o + n] for o, n in ranges]
        assert parts[-1].obj is into.obj
        assert into[:len(parts[-1])] == b[ranges[-1][0]:ranges[-1][0] + ranges[-1][1]]


def test_survives_reopen_and_rejects_foreign(spec):
    s = make(spec)
    data = os.urandom(123_457)
    s.write("00000000000000aa.1", [data])
    s.sync()
    del s
    again = open_store(_path(spec), "vol-uuid", 3)
    assert again.read_parts("00000000000000aa.1", [(0, 1 << 20)]) == [data]
    with pytest.raises(VolumeError):
        open_store(_path(spec), "other-volume", 3)
    with pytest.raises(VolumeError, match="already belongs"):
        make(spec)


def test_concurrent_writers_and_space_reuse(spec):
    s = make(spec)
    blobs = {f"{i:016x}.0": os.urandom(200_000 + i) for i in range(40)}

    def put(items):
        for name, data in items:
            s.write(name, [data])
    items = list(blobs.items())
    threads = [threading.Thread(target=put, args=(items[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, data in blobs.items():
        assert s.read_parts(name, [(0, 1 << 20)]) == [data]
    free = s.usage()["free"]
    for name in list(blobs)[:20]:
        s.delete(name)
    assert s.usage()["free"] > free
    for name, data in list(blobs.items())[:20]:  # freed space is used again
        s.write(name, [data])
        assert s.read_parts(name, [(0, 1 << 20)]) == [data]


def test_pool_full_is_an_error_not_corruption(tmp_path):
    spec = f"pmem:{tmp_path}/small:8"
    s = make(spec)
    written = []
    with pytest.raises(OSError, match="full|slot"):
        for i in range(100):
            s.write(f"{i:016x}.0", [bytes([i]) * 300_000])
            written.append(i)
    for i in written:
        assert s.read_parts(f"{i:016x}.0", [(0, 10)]) == [bytes([i]) * 10]


def test_a_sync_waits_for_the_sync_already_running(spec, monkeypatch):
    """Two fsyncs at once: the second finds nothing left to do (the first took this
    store's pending writes), but it must not return before the first has made them
    durable, or its caller is told so too early."""
    if not isinstance(spec, tuple):
        pytest.skip("a pmem pool flushes every write before it returns")
    s = make(spec)
    s.write("0000000000000001.0", [os.urandom(300_000)])
    entered, release = threading.Event(), threading.Event()
    real = {name: getattr(os, name) for name in ("fsync", "fdatasync")}

    def slow(name):
        def call(fd):
            entered.set()
            release.wait(10)
            return real[name](fd)
        return call
    for name in real:
        monkeypatch.setattr(os, name, slow(name))
    first = threading.Thread(target=s.sync)
    first.start()
    assert entered.wait(10)
    second_done = threading.Event()
    second = threading.Thread(target=lambda: (s.sync(), second_done.set()))
    second.start()
    assert not second_done.wait(0.3), "a second sync returned while the first was running"
    release.set()
    first.join(10)
    second.join(10)
    assert second_done.is_set()


# -- nothing written through a link or into a file the store did not make -----------------
@pytest.fixture
def precious(tmp_path):
    """A root-owned 0600 file a planted link points at: (path, its bytes, its mtime)."""
    p = tmp_path / "precious"
    p.write_bytes(b"not a fragment\n")
    os.chmod(p, 0o600)
    return p, p.read_bytes(), os.stat(p).st_mtime_ns


def _unchanged(precious) -> bool:
    p, data, mtime = precious
    return p.read_bytes() == data and os.stat(p).st_mtime_ns == mtime


@pytest.mark.parametrize("size", [1000, 1 << 20])  # buffered, and O_DIRECT where it works
def test_file_store_writes_through_no_link(tmp_path, precious, size):
    from bmfs.store.file import UnexpectedEntry
    s = make((str(tmp_path / "dev"), "files"))
    frags = tmp_path / "dev" / "frags"
    name = "00000000000000a1.2"
    os.symlink(precious[0], frags / "a1" / name)
    hard = "00000000000000a2.0"
    os.link(precious[0], frags / "a2" / hard)  # another name of a file: not ours alone
    os.mkdir(frags / "a3" / "00000000000000a3.1")
    other = tmp_path / "elsewhere"
    other.mkdir()
    os.rmdir(frags / "a4")
    os.symlink(other, frags / "a4")  # the fan-out folder itself a link
    data = os.urandom(size)
    for n in (name, hard, "00000000000000a3.1", "00000000000000a4.0"):
        with pytest.raises(UnexpectedEntry):
            s.write(n, [data])
    assert _unchanged(precious) and os.path.islink(frags / "a1" / name)
    assert os.listdir(other) == [] and (frags / "a3" / "00000000000000a3.1").is_dir()
    assert s.unexpected == 4 and s.usage()["unexpected_entries"] == 4
    with pytest.raises(OSError):  # a read does not follow it either (ELOOP)
        s.read_parts(name, [(0, 10)])
    s.delete(name)  # removes the link, never what it names
    assert _unchanged(precious) and not os.path.lexists(frags / "a1" / name)
    s.write(name, [data])  # and the fragment goes where the link was
    assert s.read_parts(name, [(0, size)]) == [data]
    assert os.stat(frags / "a1" / name).st_mode & 0o777 == 0o600


def test_file_store_rewrites_its_own_fragment_afresh(tmp_path):
    s = make((str(tmp_path / "dev"), "files"))
    name = "00000000000000b1.0"
    s.write(name, [b"first"])
    path = tmp_path / "dev" / "frags" / "b1" / name
    ino = os.stat(path).st_ino
    with open(path, "rb") as keep:  # a reader of the old copy keeps the old bytes
        s.write(name, [b"second"])
        assert keep.read() == b"first"
    assert s.read_parts(name, [(0, 10)]) == [b"second"] and os.stat(path).st_ino != ino
    assert s.unexpected == 0


def test_formats_refuse_planted_links(tmp_path, precious):
    dev = tmp_path / "pooldev"
    dev.mkdir()
    os.symlink(precious[0], dev / "index")
    with pytest.raises(VolumeError, match="is there already"):
        format_store(str(dev), "vol-uuid", 1, "pool")
    os.symlink(precious[0], tmp_path / "pmemfile")
    with pytest.raises(VolumeError, match="symbolic link"):
        from bmfs.store.pmem import format_if_new
        format_if_new(f"pmem:{tmp_path}/pmemfile:8", "vol-uuid", 2)
    with pytest.raises(VolumeError, match="not a file bmfs may use"):
        format_store(f"pmem:{tmp_path}/pmemfile:8", "vol-uuid", 2)
    with pytest.raises(VolumeError, match="holds other data"):
        format_store(f"pmem:{precious[0]}:8", "vol-uuid", 2)
    assert _unchanged(precious)


def test_new_devices_are_private_whatever_the_umask(tmp_path, spec):
    old = os.umask(0)
    try:
        s = make(spec)
        s.write("00000000000000c1.0", [b"x" * 5000])
    finally:
        os.umask(old)
    path = _path(spec)
    if path.startswith("pmem:"):
        assert os.stat(path[5:].partition(":")[0]).st_mode & 0o777 == 0o600
        return
    assert os.stat(path).st_mode & 0o777 == 0o700
    for dp, dns, fns in os.walk(path):
        for n in dns:
            assert os.stat(os.path.join(dp, n)).st_mode & 0o777 == 0o700, n
        for n in fns:
            assert os.stat(os.path.join(dp, n)).st_mode & 0o777 == 0o600, n
