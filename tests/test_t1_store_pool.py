"""Level 1: the pool layout of a device directory (bmfs/store/pool.py) beyond the
conformance suite: space used again instead of growing the file, exact bytes from
O_DIRECT writes, a read racing a delete, slots left by a crash, a pool that cannot
grow, a kill -9 in the middle of writes."""
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from bmfs.format import fragment as fr
from bmfs.errors import VolumeError
from bmfs.store import pool as poolmod
from bmfs.store.pmem import format_store, open_store
from bmfs.store.slot import SLOT_SIZE, pack_slot
from bmfs.store.pool import PoolStore

UUID = "vol-uuid"


def make(path, dev=0):
    format_store(str(path), UUID, dev, "pool")
    return open_store(str(path), UUID, dev)


def fragment(sid, idx, size, seed=None):
    """A real fragment (header + payload), as the data path writes it."""
    payload = random.Random(seed if seed is not None else sid * 10 + idx).randbytes(size)
    return fr.fragment_name(sid, idx), fr.build_header(sid, idx, 4, 2, payload) + payload


def test_opened_as_a_pool_and_files_layout_refused_as_pool(tmp_path):
    s = make(tmp_path / "p")
    assert isinstance(s, PoolStore)
    format_store(str(tmp_path / "f"), UUID, 0, "files")
    with pytest.raises(VolumeError, match="unknown format"):
        PoolStore(str(tmp_path / "f"), UUID, 0)
    with pytest.raises(VolumeError, match="unknown device layout"):
        format_store(str(tmp_path / "x"), UUID, 0, "blocks")


def test_freed_space_is_used_again_and_the_file_does_not_grow(tmp_path, monkeypatch):
    monkeypatch.setattr(poolmod, "GROW", 8 << 20)
    s = make(tmp_path / "p")
    blobs = dict(fragment(sid, 0, (1 << 20) + sid * 4000) for sid in range(1, 21))
    for name, data in blobs.items():
        s.write(name, [data])
    size = os.path.getsize(tmp_path / "p" / "pool")
    for _ in range(3):  # delete and rewrite every fragment, in another order
        for name in blobs:
            s.delete(name)
        for name, data in sorted(blobs.items(), reverse=True):
            s.write(name, [data])
    assert os.path.getsize(tmp_path / "p" / "pool") == size
    s.sync()
    again = open_store(str(tmp_path / "p"), UUID, 0)
    for name, data in blobs.items():
        assert again.read(name, 0, 1 << 30) == data
    # free space rebuilt from the slots: new writes do not land on live fragments
    extra = dict(fragment(sid, 1, 300_000) for sid in range(100, 110))
    for name in list(blobs)[::2]:
        again.delete(name)
    for name, data in extra.items():
        again.write(name, [data])
    for name, data in {**blobs, **extra}.items():
        if name in again.names():
            assert again.read(name, 0, 1 << 30) == data
    assert sorted(again.names()) == sorted(list(blobs)[1::2] + list(extra))


@pytest.mark.parametrize("total", [4096, 300_000, (1 << 20) + 1140, (1 << 20) + 4096])
def test_writes_hold_exactly_the_bytes(tmp_path, total):
    import mmap
    s = make(tmp_path / "p")
    data = random.Random(total).randbytes(total)
    s.write("0000000000000001.0", [data[:1000], data[1000:]])
    buf = mmap.mmap(-1, total + 8192)  # page-aligned, like a node's receive buffer
    buf[:total] = data[::-1]
    buf[total:total + 100] = b"\xee" * 100  # past the payload: not written
    view = memoryview(buf)[:total]
    s.write_aligned("0000000000000002.0", view)
    view.release()
    assert s.read("0000000000000001.0", 0, 1 << 30) == data
    assert s.read("0000000000000002.0", 0, 1 << 30) == data[::-1]
    assert s.read_parts("0000000000000002.0", [(total - 10, 100)]) == [data[::-1][-10:]]
    fd, off, length, release = s.extent("0000000000000002.0")
    try:
        assert length == total and os.pread(fd, total, off) == data[::-1]
    finally:
        release()


def test_a_read_in_flight_never_sees_another_fragments_bytes(tmp_path):
    s = make(tmp_path / "p")
    name, data = fragment(1, 0, 200_000)
    s.write(name, [data])
    stop, bad = threading.Event(), []

    def reader():
        while not stop.is_set():
            try:
                got = s.read(name, 0, 1 << 30)
            except FileNotFoundError:
                continue
            if got != data:
                bad.append(len(got))

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        rng = random.Random(5)
        for i in range(100):  # delete it, fill its space with others, put it back
            s.delete(name)
            others = [fragment(1000 + i, j, 200_000, seed=rng.random()) for j in range(2)]
            for n, d in others:
                s.write(n, [d])
            s.write(name, [data])
            for n, _ in others:
                s.delete(n)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert bad == []
    # and deterministically: an extent looked up by a read in flight is not reused
    # until that read ends
    s = make(tmp_path / "q")
    s.write(name, [data])
    epoch, _, off, _ = s._begin_read(name)
    s.delete(name)
    n2, d2 = fragment(7, 0, 200_000)
    s.write(n2, [d2])
    assert s._index[n2][1] != off
    s._end_read(epoch)
    n3, d3 = fragment(8, 0, 200_000)
    s.write(n3, [d3])
    assert s._index[n3][1] == off  # once it ended, the space is used again
    assert s.read(n2, 0, 1 << 30) == d2 and s.read(n3, 0, 1 << 30) == d3
    # an extent handed out for sendfile is held the same way until released
    fd, off3, _, release = s.extent(n3)
    s.delete(n3)
    n4, d4 = fragment(9, 0, 200_000)
    s.write(n4, [d4])
    assert s._index[n4][1] != off3
    assert os.pread(fd, len(d3), off3) == d3
    release()
    n5, d5 = fragment(10, 0, 200_000)
    s.write(n5, [d5])
    assert s._index[n5][1] == off3


def test_two_slots_on_one_extent_after_a_crash_keep_the_true_one(tmp_path):
    """A fragment deleted just before a crash whose slot's zeroing never reached the
    disk, while its space was already written again: both slots are live at the next
    open. The one the data's header names is kept, the other cleared."""
    s = make(tmp_path / "p")
    live_name, live = fragment(0x10, 2, 100_000)
    s.write(live_name, [live])
    off = s._index[live_name][1]
    other_name, other = fragment(0x11, 0, 50_000)
    s.write(other_name, [other])
    s.sync()
    s.close()
    # the deleted ones' slots: one longer than the live fragment (found after it at
    # that offset), one shorter (found first, so the live one must win it back)
    with open(tmp_path / "p" / "index", "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(pack_slot(fr.fragment_name(0x99, 1), off, 120_000))
        f.write(pack_slot(fr.fragment_name(0x98, 3), off, 30_000))
    again = open_store(str(tmp_path / "p"), UUID, 0)
    assert sorted(again.names()) == sorted([live_name, other_name])
    assert again.read(live_name, 0, 1 << 30) == live
    assert again.read(other_name, 0, 1 << 30) == other
    # the stale slot was cleared: a third open agrees, and new writes avoid live data
    again.sync()
    again.close()
    third = open_store(str(tmp_path / "p"), UUID, 0)
    for sid in range(0x20, 0x28):
        n, d = fragment(sid, 0, 64_000)
        third.write(n, [d])
    assert third.read(live_name, 0, 1 << 30) == live
    assert third.read(other_name, 0, 1 << 30) == other
    # a name with two live slots (a rewrite cut short): the one its data confirms wins
    with open(tmp_path / "p" / "index", "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(pack_slot(live_name, third._index[other_name][1], 50_000))
    third.close()
    fourth = open_store(str(tmp_path / "p"), UUID, 0)
    assert fourth.read(live_name, 0, 1 << 30) == live
    assert fourth.read(other_name, 0, 1 << 30) == other


def test_a_pool_that_cannot_grow_refuses_writes_and_keeps_what_it_has(tmp_path):
    """The filesystem under the device is full (here: RLIMIT_FSIZE): a write fails
    with a clear error, and every fragment already stored reads back."""
    code = textwrap.dedent(f"""
        import os, resource, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from bmfs.store import pool
        from bmfs.store.pmem import format_store, open_store
        pool.GROW = 4 << 20
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        format_store({str(tmp_path / 'p')!r}, "vol-uuid", 0, "pool")
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        s = open_store({str(tmp_path / 'p')!r}, "vol-uuid", 0)
        n = 0
        try:
            for i in range(100):
                s.write("%016x.0" % i, [bytes([i]) * 1_000_000])
                n += 1
        except OSError as e:
            print("ERR", e)
        for i in range(n):
            assert s.read("%016x.0" % i, 0, 1 << 30) == bytes([i]) * 1_000_000, i
        print("STORED", n)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pool cannot grow" in out.stdout, out.stdout
    stored = int(out.stdout.split("STORED")[1])
    assert 10 <= stored <= 16  # 16 extents of 1,003,520 bytes fit in 16 MiB


def test_kill_9_during_writes_keeps_what_sync_promised(tmp_path):
    """A writer killed with SIGKILL: every fragment written before its last completed
    sync reads back byte-exact, later ones read back exact or are absent, and the
    pool takes new writes without touching them."""
    path = str(tmp_path / "p")
    make(path).close()
    code = textwrap.dedent(f"""
        import os, random, sys
        sys.path.insert(0, {os.getcwd()!r})
        from bmfs.store.pmem import open_store
        s = open_store({path!r}, "vol-uuid", 0)
        for i in range(10_000):
            size = random.Random(i).randrange(4096, 1_200_000)
            s.write("%016x.0" % i, [random.Random(i).randbytes(size)])
            if i % 7 == 6:
                s.delete("%016x.0" % (i - 3))
            if i % 5 == 4:
                s.sync()
                print(i, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    synced = -1
    for line in proc.stdout:
        synced = int(line)
        if synced >= 150:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    s = open_store(path, UUID, 0)
    names = set(s.names())
    for i in range(synced + 1):
        name = "%016x.0" % i
        deleted = i % 7 == 3 and i + 3 <= synced
        if deleted:
            assert name not in names, i
            continue
        assert name in names, i
    for name in names:
        i = int(name.split(".")[0], 16)
        want = random.Random(i).randbytes(random.Random(i).randrange(4096, 1_200_000))
        assert s.read(name, 0, 1 << 30) == want, i
    for i in range(20_000, 20_040):
        s.write("%016x.0" % i, [bytes([i % 256]) * 500_000])
    for name in names:
        i = int(name.split(".")[0], 16)
        want = random.Random(i).randbytes(random.Random(i).randrange(4096, 1_200_000))
        assert s.read(name, 0, 1 << 30) == want, i


def test_parity_fragments_live_apart_from_data(tmp_path):
    """A sequential reader reads data fragments only; the kernel's read-ahead past
    one must find the next data fragment, not parity it will never read."""
    from fragments import on_device
    s = make(tmp_path / "p")
    frags = dict(fragment(sid, idx, 300_000) for sid in (1, 2) for idx in range(6))
    for name, data in frags.items():
        s.write(name, [data])
    s.sync()
    where = {(f.sid, f.idx): os.path.basename(f.path) for f in on_device(str(tmp_path / "p"))}
    assert where == {(sid, idx): "pool" if idx < 4 else "parity"
                     for sid in (1, 2) for idx in range(6)}
    data_extents = sorted(f.offset for f in on_device(str(tmp_path / "p"))
                          if f.path.endswith("pool"))
    size = -(-len(frags[fr.fragment_name(1, 0)]) // 4096) * 4096  # whole pages
    assert data_extents == [i * size for i in range(8)]  # back to back, no gaps
    again = open_store(str(tmp_path / "p"), UUID, 0)
    for name, data in frags.items():
        assert again.read(name, 0, 1 << 30) == data
