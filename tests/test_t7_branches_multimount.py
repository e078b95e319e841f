"""Branch isolation across two mounts of one volume (etcd) and across remounts."""
import os

from etcd_cluster import etcd_cluster  # noqa: F401  (the fixture)
from mountutil import (Mounted, assert_fsck_clean, bmfs, delete_snapshot_left_to_collect,
                       fragment_count, wait_collected, write_stored)
from multimount import etcd_volume, wait_until


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_branch_isolation_across_two_mounts(etcd_cluster, tmp_path):
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        os.makedirs(f"{a.mp}/data")
        with open(f"{a.mp}/data/f", "wb") as f:
            f.write(b"main v1")
        bmfs("branch", "create", "exp", "-m", a.mp)
        # the branch made on mount a appears on mount b, with main's content
        wait_until(lambda: os.path.exists(f"{b.mp}/.bm/branches/exp/data/f"), 5)
        assert _read(f"{b.mp}/.bm/branches/exp/data/f") == b"main v1"
        # written in the branch on b: invisible in main on both mounts
        with open(f"{b.mp}/.bm/branches/exp/data/f", "wb") as f:
            f.write(b"branch v2")
        with open(f"{b.mp}/.bm/branches/exp/data/new", "wb") as f:
            f.write(b"only in exp")
        assert _read(f"{a.mp}/data/f") == b"main v1" and _read(f"{b.mp}/data/f") == b"main v1"
        assert not os.path.exists(f"{a.mp}/data/new")
        wait_until(lambda: os.path.exists(f"{a.mp}/.bm/branches/exp/data/new"), 2)
        assert _read(f"{a.mp}/.bm/branches/exp/data/f") == b"branch v2"
        # and the reverse: main changes on a do not reach the branch
        with open(f"{a.mp}/data/f", "wb") as f:
            f.write(b"main v3")
        wait_until(lambda: _read(f"{b.mp}/data/f") == b"main v3", 2)
        assert _read(f"{b.mp}/.bm/branches/exp/data/f") == b"branch v2"
        bmfs("snapshot", "create", "s1", "-m", b.mp)
        with open(f"{a.mp}/data/f", "wb") as f:
            f.write(b"main v4")
        wait_until(lambda: os.path.exists(f"{a.mp}/.bm/snapshots/s1/data/f"), 5)
        assert _read(f"{a.mp}/.bm/snapshots/s1/data/f") == b"main v3"


def test_branch_isolation_across_remount(volume, tmp_path):
    mp = tmp_path / "m"
    with Mounted(volume, mp):
        with open(f"{mp}/f", "wb") as f:
            f.write(b"main")
        bmfs("branch", "create", "exp", "-m", mp)
        with open(f"{mp}/.bm/branches/exp/f", "wb") as f:
            f.write(b"exp")
        bmfs("snapshot", "create", "snap", "-m", mp)
    with Mounted(volume, mp):
        assert _read(f"{mp}/f") == b"main"
        assert _read(f"{mp}/.bm/branches/exp/f") == b"exp"
        assert _read(f"{mp}/.bm/snapshots/snap/f") == b"main"
    # the branch mounted at the root shows its own tree
    with Mounted(volume, mp, "--branch", "exp"):
        assert _read(f"{mp}/f") == b"exp"
        assert sorted(os.listdir(f"{mp}/.bm/branches")) == ["exp", "main"]
    assert_fsck_clean(volume)


def test_a_delete_left_to_collect_is_collected_by_the_leading_mount(etcd_cluster, tmp_path):
    """On a shared volume, a snapshot deleted by a mount that went away before it
    freed anything: the mount that leads the background upkeep (the oldest) frees what
    only the snapshot held, and the mark goes."""
    with etcd_volume(etcd_cluster, tmp_path, 2) as (a, b):
        before = fragment_count(a.volume)
        write_stored(f"{a.mp}/kept", 9 << 20)
        bmfs("snapshot", "create", "s", "-m", a.mp)
        os.unlink(f"{b.mp}/kept")
        # committed once mount a sees it (the snapshot then holds the only version)
        wait_until(lambda: not os.path.exists(f"{a.mp}/kept"), 10, 0.05)
        assert fragment_count(a.volume) == before + 18
        delete_snapshot_left_to_collect(a.volume, "s")
        wait_collected(b.mp, a.volume, before)
