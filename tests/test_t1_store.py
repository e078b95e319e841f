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
