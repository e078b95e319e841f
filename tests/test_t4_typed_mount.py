"""Typed views through a real bmfs mount: every format round-trips on the mount."""
import os

import numpy as np

import bmfs
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
