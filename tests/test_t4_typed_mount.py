"""Typed views through a real bmfs mount: every format round-trips on the mount."""
import os
import random
import subprocess

import numpy as np

import bmfs
from bmfs.wire.examples_pb2 import Sample
from typed_checks import check_roundtrips


def test_typed_roundtrips_on_mount(mnt):
    d = os.path.join(mnt.mp, "typed")
    os.mkdir(d)
    check_roundtrips(d)


def test_numpy_view_shares_the_mapping_on_mount(mnt):
    path = os.path.join(mnt.mp, "a.npy")
    want = np.arange(3 << 20, dtype=np.float32)  # 12 MiB: several stripes
    np.save(path, want)
    a = bmfs.mmap(path)
    assert np.shares_memory(a, np.frombuffer(a.mapping, np.uint8))  # a view, not a copy
    assert np.array_equal(a, want)
    bmfs.set_type(path, "npy")
    assert bmfs.get_type(path) == "npy"  # recorded in the metadata as user.bm.type


def _cached(path):
    """Bytes of ``path`` in the page cache (fincore, util-linux)."""
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", path], check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def test_random_access_reads_pages_not_megabytes_on_mount(mnt):
    """On the mount (read_ahead_kb 4096), a page fault of a mapping reads about 1 MiB
    around the page; with access="random" it reads the page. 40 records taken at random
    from a 16 MiB record file: what the file's page cache gained, both ways, and the
    records are the same."""
    dev = os.stat(mnt.mp).st_dev
    with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
        assert int(f.read()) == 4096  # what `bmfs mount` sets (as root)
    path = os.path.join(mnt.mp, "train.rec")
    with bmfs.typed.records.writer(path, Sample) as w:
        for i in range(8000):
            w.append(Sample(id=i, payload=i.to_bytes(4, "little") * 500))
    picks = random.Random(4).sample(range(8000), 40)
    read = {}
    for access in ("normal", "random"):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold again
        os.close(fd)
        before = _cached(path)
        recs = bmfs.typed.mmap(path, Sample, access=access)
        got = [recs[i] for i in picks]
        assert [(m.id, m.payload) for m in got] == \
            [(i, i.to_bytes(4, "little") * 500) for i in picks]
        read[access] = _cached(path) - before
        recs.close()
        del got
    assert read["normal"] > 8 << 20, read   # read around: half the file or more
    assert read["random"] < 2 << 20, read   # 40 records' pages, the index, the header
