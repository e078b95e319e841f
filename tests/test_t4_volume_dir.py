"""t4: where a volume lives: mkfs's target directory, the mount point, a copied or moved
volume directory. Each mistake is a one-line error (exit 2) that changes nothing."""
import json
import os
import shutil
import subprocess
import sys
import time

from bmfs.proc import alive

from mountutil import Mounted, bmfs, fsck, mkfs


def left_unmounted(mp):
    """Whether ``mp`` is no mount point; one a failing check left is unmounted first."""
    if os.path.ismount(mp):
        bmfs("umount", mp, check=False, timeout=120)
        return False
    return True


def assert_user_error(res, *words):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, \
        res.stderr
    for w in words:
        assert w in res.stderr, res.stderr


def test_mkfs_refuses_a_directory_holding_files(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "thesis.tex").write_text("years of work")
    assert_user_error(bmfs("mkfs", d, check=False), "not empty", "thesis.tex")
    assert sorted(os.listdir(d)) == ["thesis.tex"]
    assert (d / "thesis.tex").read_text() == "years of work"
    e = tmp_path / "empty"
    e.mkdir()
    mkfs(e)  # an empty directory is fine
    assert (e / "volume.json").exists()


def test_mkfs_on_a_file_or_a_pseudo_filesystem_is_a_one_line_error(tmp_path):
    f = tmp_path / "plain"
    f.write_bytes(b"data")
    assert_user_error(bmfs("mkfs", f, check=False), "not a directory")
    assert f.read_bytes() == b"data"
    assert_user_error(bmfs("mkfs", "/proc/bmfs-test-volume", check=False))
    assert_user_error(bmfs("mkfs", "/proc/self", check=False), "not empty")


def test_mount_refuses_a_negative_or_silly_cache_timeout(volume, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    for bad in ("-1", "nan", "inf", "soon"):
        res = bmfs("mount", mp, "--volume", volume, "--timeout", bad, check=False)
        assert left_unmounted(mp), bad
        assert res.returncode == 2 and "--timeout" in res.stderr, (bad, res.stderr)
        assert "Traceback" not in res.stderr


def test_mount_over_a_dead_mount_says_so(volume, tmp_path):
    mp = tmp_path / "mnt"
    m = Mounted(volume, mp).__enter__()
    try:
        os.kill(m.pid, 9)
        for _ in range(100):
            if not alive(m.pid):
                break
            time.sleep(0.05)
        res = bmfs("mount", mp, "--volume", volume, check=False)
        assert_user_error(res, "dead FUSE mount", "umount")
        bmfs("umount", mp)  # what the message says to do works on the dead mount
        with Mounted(volume, mp):
            assert os.listdir(mp) is not None
    finally:
        subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True)


def _meta(volume):
    with open(os.path.join(volume, "volume.json")) as f:
        return json.load(f)["meta"]


def test_a_copied_volume_writes_only_to_itself(volume, tmp_path):
    with Mounted(volume, tmp_path / "mnt") as m:
        with open(os.path.join(m.mp, "f"), "wb") as f:
            f.write(b"original" * 10000)  # on the devices, not inline
    copy = tmp_path / "copy"
    shutil.copytree(volume, copy, symlinks=True)
    # a read-only open cannot make it its own: a clear error, not the original's data
    res = fsck(copy)
    assert_user_error(res, "copy")
    with Mounted(copy, tmp_path / "mnt2") as m:
        with open(os.path.join(m.mp, "f"), "rb") as f:
            assert f.read() == b"original" * 10000
        with open(os.path.join(m.mp, "f"), "wb") as f:
            f.write(b"the copy's" * 10000)
        with open(os.path.join(m.mp, "g"), "wb") as f:
            f.write(b"new")
    assert _meta(copy) == f"sqlite:{os.path.realpath(copy)}/meta.db"
    with Mounted(volume, tmp_path / "mnt") as m:
        with open(os.path.join(m.mp, "f"), "rb") as f:
            assert f.read() == b"original" * 10000
        assert not os.path.exists(os.path.join(m.mp, "g"))
    for v in (volume, copy):
        assert fsck(v, "--full").returncode == 0, v


def test_a_moved_volume_mounts_from_its_new_place(volume, tmp_path):
    with Mounted(volume, tmp_path / "mnt") as m:
        with open(os.path.join(m.mp, "f"), "wb") as f:
            f.write(b"moved" * 100000)
    moved = tmp_path / "moved"
    os.rename(volume, moved)
    with Mounted(moved, tmp_path / "mnt") as m:
        with open(os.path.join(m.mp, "f"), "rb") as f:
            assert f.read() == b"moved" * 100000
    assert fsck(moved, "--full").returncode == 0


def test_a_copy_sharing_outside_devices_with_its_original_is_refused(tmp_path):
    vol = tmp_path / "vol"
    devs = [str(tmp_path / f"nvme{i}") for i in range(6)]
    mkfs(vol, *sum((["--device", d] for d in devs), []))
    copy = tmp_path / "copy"
    shutil.copytree(vol, copy)
    mp = tmp_path / "mnt"
    mp.mkdir()
    res = bmfs("mount", mp, "--volume", copy, check=False)
    assert left_unmounted(mp)
    assert res.returncode == 2 and "outside the volume directory" in res.stderr, res.stderr
    assert _meta(copy) == _meta(vol)  # nothing rewritten


def test_status_without_a_target_uses_the_mount_it_runs_in(mnt):
    sub = os.path.join(mnt.mp, "d")
    os.mkdir(sub)
    res = subprocess.run([sys.executable, "-m", "bmfs.cli.main", "status", "--json"],
                         cwd=sub, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["mountpoint"] == mnt.mp
