"""Level 4: a real FUSE mount used with ordinary tools; fsck after unmount."""
import errno
import fcntl
import hashlib
import functools
import json
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest

from fragments import on_device
from mountutil import (Mounted, assert_fsck_clean, bmfs, delete_snapshot_left_to_collect,
                       fragment_count, sit_in, wait_collected, write_stored)


def sh(cmd, **kw):
    return subprocess.run(cmd, shell=True, check=True, capture_output=True, text=True, **kw)


def make_tree(root):
    """A real tree: nested dirs, odd names, symlinks, hard links, modes, a sparse file."""
    os.makedirs(f"{root}/a/b/c")
    for i in range(50):
        with open(f"{root}/a/f{i}", "wb") as f:
            f.write(os.urandom(i * 997))
    with open(f"{root}/a/b/big", "wb") as f:
        f.write(os.urandom(5 << 20))
    with open(f"{root}/a/b/c/sp ace \u00e9", "w") as f:
        f.write("unicode")
    os.symlink("../f1", f"{root}/a/b/link")
    os.link(f"{root}/a/f2", f"{root}/a/b/hard")
    os.chmod(f"{root}/a/f3", 0o600)
    with open(f"{root}/sparse", "wb") as f:
        f.seek(40 << 20)  # holes read back as zeros (pyfuse3 has no SEEK_HOLE)
        f.write(b"tail")


def tree_digest(root):
    out = []
    for dp, dns, fns in os.walk(root):
        dns.sort()
        for n in sorted(fns + dns):
            p = os.path.join(dp, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out.append((rel, "l", os.readlink(p)))
            elif os.path.isdir(p):
                out.append((rel, "d", oct(st.st_mode)))
            else:
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    while b := f.read(1 << 20):
                        h.update(b)
                out.append((rel, "f", oct(st.st_mode), st.st_size, h.hexdigest(), st.st_nlink))
    return out


def test_tools_roundtrip(mnt, tmp_path):
    src = tmp_path / "src"
    make_tree(src)
    want = tree_digest(src)
    sh(f"cp -a {src} {mnt.mp}/cp")
    assert tree_digest(f"{mnt.mp}/cp") == want
    sh(f"rsync -aH {src}/ {mnt.mp}/rsync/")
    assert tree_digest(f"{mnt.mp}/rsync") == want
    sh(f"tar -C {src} -cSf {tmp_path}/t.tar . && mkdir {mnt.mp}/tar && "
       f"tar -C {mnt.mp}/tar -xSf {tmp_path}/t.tar")
    assert tree_digest(f"{mnt.mp}/tar") == want
    # back out again, byte for byte
    sh(f"cp -a {mnt.mp}/cp {tmp_path}/back")
    assert tree_digest(f"{tmp_path}/back") == want
    mnt.umount()
    assert_fsck_clean(mnt.volume)


def test_git_clone_and_fsck(mnt, tmp_path):
    repo = tmp_path / "repo"
    sh(f"git init -q {repo} && cd {repo} && for i in 1 2 3; do echo $i > f$i; "
       f"git add .; git -c user.email=a@b -c user.name=t commit -qm c$i; done")
    sh(f"git clone -q {repo} {mnt.mp}/clone")
    r = sh(f"cd {mnt.mp}/clone && git fsck --full && git log --oneline | wc -l && git status --porcelain")
    assert r.stdout.split()[-1] == "3"
    mnt.umount()
    assert_fsck_clean(mnt.volume)


def test_posix_semantics(mnt):
    m = mnt.mp
    # O_EXCL, O_TRUNC, O_APPEND
    fd = os.open(f"{m}/x", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.write(fd, b"hello world")
    os.close(fd)
    with pytest.raises(FileExistsError):
        os.open(f"{m}/x", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    fd = os.open(f"{m}/x", os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert os.path.getsize(f"{m}/x") == 0
    for part in (b"a", b"b", b"c"):
        fd = os.open(f"{m}/x", os.O_WRONLY | os.O_APPEND)
        os.write(fd, part)
        os.close(fd)
    assert open(f"{m}/x", "rb").read() == b"abc"
    # names
    with pytest.raises(OSError) as e:
        open(f"{m}/{'n' * 256}", "w")
    assert e.value.errno == errno.ENAMETOOLONG
    open(f"{m}/{'n' * 255}", "w").close()
    with pytest.raises(NotADirectoryError):
        open(f"{m}/x/y", "w")
    # unlink while open: data stays readable until close
    with open(f"{m}/open", "wb") as f:
        f.write(b"still here" * 1000)
    fd = os.open(f"{m}/open", os.O_RDONLY)
    os.unlink(f"{m}/open")
    assert not os.path.exists(f"{m}/open")
    assert os.pread(fd, 10, 0) == b"still here"
    os.close(fd)
    # hard links share one inode
    os.link(f"{m}/x", f"{m}/x2")
    a, b = os.stat(f"{m}/x"), os.stat(f"{m}/x2")
    assert a.st_ino == b.st_ino and a.st_nlink == 2
    # renames: replace, exchange-free, directories
    os.makedirs(f"{m}/d1/sub")
    os.rename(f"{m}/d1", f"{m}/d2")
    assert os.path.isdir(f"{m}/d2/sub")
    with pytest.raises(OSError) as e:
        os.rename(f"{m}/d2", f"{m}/d2/sub/inside")
    assert e.value.errno == errno.EINVAL
    os.rename(f"{m}/x2", f"{m}/x")  # same inode: no-op
    assert os.path.exists(f"{m}/x2")
    with pytest.raises(OSError) as e:
        os.rmdir(f"{m}/d2")
    assert e.value.errno == errno.ENOTEMPTY
    # chmod / chown / utimes
    os.chmod(f"{m}/x", 0o640)
    os.chown(f"{m}/x", 1234, 5678)
    os.utime(f"{m}/x", ns=(1_000_000_000, 2_000_000_000))
    st = os.stat(f"{m}/x")
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_mtime_ns) == (0o640, 1234, 5678, 2_000_000_000)
    # xattrs
    os.setxattr(f"{m}/x", "user.bm.type", b"npy")
    assert os.getxattr(f"{m}/x", "user.bm.type") == b"npy"
    assert "user.bm.type" in os.listxattr(f"{m}/x")
    os.removexattr(f"{m}/x", "user.bm.type")
    # symlinks
    os.symlink("x", f"{m}/sl")
    assert os.readlink(f"{m}/sl") == "x" and open(f"{m}/sl", "rb").read() == b"abc"
    # statfs
    s = os.statvfs(m)
    assert s.f_namemax == 255 and s.f_blocks > 0
    # the control dir is hidden but enterable
    assert ".bm" not in os.listdir(m)
    assert sorted(os.listdir(f"{m}/.bm")) == ["branches", "ctl", "progress", "snapshots"]
    # locks are kept by the kernel for this mount
    with open(f"{m}/x", "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f, fcntl.LOCK_UN)
    # truncate up and down, and a sparse file past 4 GiB
    with open(f"{m}/t", "wb") as f:
        f.write(b"0123456789")
    os.truncate(f"{m}/t", 4)
    os.truncate(f"{m}/t", 8)
    assert open(f"{m}/t", "rb").read() == b"0123\0\0\0\0"
    with open(f"{m}/sp", "wb") as f:
        f.seek(5 << 30)
        f.write(b"z")
    assert os.path.getsize(f"{m}/sp") == (5 << 30) + 1
    with open(f"{m}/sp", "rb") as f:
        f.seek((5 << 30) - 2)
        assert f.read() == b"\0\0z"
    with pytest.raises(OSError) as e:
        fd = os.open(f"{m}/t", os.O_WRONLY)
        try:
            os.pwrite(fd, b"x", (1 << 63) - 1)
        finally:
            os.close(fd)
    assert e.value.errno in (errno.EFBIG, errno.EINVAL)
    mnt.umount()
    assert_fsck_clean(mnt.volume)


@pytest.fixture
def public_mnt(volume):
    """A mount whose path other users can reach (pytest's tmp dirs are private)."""
    import tempfile
    top = tempfile.mkdtemp(dir="/var/tmp", prefix="bmfs-perm-")
    os.chmod(top, 0o755)
    try:
        with Mounted(volume, f"{top}/mnt") as m:
            yield m
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_permissions_enforced(public_mnt):
    m = public_mnt.mp
    os.makedirs(f"{m}/private")
    os.chmod(f"{m}/private", 0o700)
    open(f"{m}/private/secret", "w").close()
    os.chmod(m, 0o755)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "cat", f"{m}/private/secret"], capture_output=True, text=True)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "ls", m], capture_output=True, text=True)
    assert r.returncode == 0 and "private" in r.stdout  # allow_other: others can use it


def test_large_directory_listing(mnt):
    d = f"{mnt.mp}/many"
    os.mkdir(d)
    n = 100_000
    # one process creating files keeps the test about metadata, not process start-up
    subprocess.run(["python3", "-c", f"""
import os
for i in range({n}):
    os.mknod('{d}/f%06d' % i, 0o100644)
"""], check=True)
    names = os.listdir(d)
    assert len(names) == n and sorted(names)[0] == "f000000" and sorted(names)[-1] == f"f{n - 1:06d}"


def test_persistence_across_remount_and_kill9(volume, tmp_path):
    mp = tmp_path / "m"
    data = os.urandom(6 << 20)
    with Mounted(volume, mp) as m:
        with open(f"{mp}/synced", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.mkdir(f"{mp}/dir")
        with open(f"{mp}/dir/closed", "wb") as f:
            f.write(b"closed file")
        os.rename(f"{mp}/dir/closed", f"{mp}/dir/renamed")
        m.kill9()
    with Mounted(volume, mp) as m:
        assert open(f"{mp}/synced", "rb").read() == data
        assert open(f"{mp}/dir/renamed", "rb").read() == b"closed file"
    assert_fsck_clean(volume)


def test_mount_errors_are_one_line(tmp_path):
    os.makedirs(tmp_path / "mp")
    for vol in (tmp_path / "missing", tmp_path):
        r = bmfs("mount", tmp_path / "mp", "--volume", vol, check=False)
        assert r.returncode == 2, r
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = bmfs("fsck", tmp_path / "missing", check=False)
    assert r.returncode == 2 and "no such volume" in r.stderr


def test_mkfs_device_count_and_reuse(tmp_path):
    r = bmfs("mkfs", tmp_path / "v", "--ec", "4+2", "--device", tmp_path / "d1", check=False)
    assert r.returncode == 2 and "needs at least 6 devices, 1 given" in r.stderr
    devs = [f"--device={tmp_path}/dev{i}" for i in range(3)]
    bmfs("mkfs", tmp_path / "v", "--ec", "2+1", *devs)
    r = bmfs("mkfs", tmp_path / "v2", "--ec", "2+1", *devs, check=False)
    assert r.returncode == 2 and "already" in r.stderr
    r = bmfs("mkfs", tmp_path / "v3", "--on-nodes", *devs, check=False)
    assert r.returncode == 2 and "starts with no devices" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "v3" / "volume.json")
    with Mounted(tmp_path / "v", tmp_path / "m") as m:
        with open(f"{m.mp}/f", "wb") as f:
            f.write(os.urandom(300_000))
    assert len(on_device(f"{tmp_path}/dev0")) >= 1
    assert_fsck_clean(tmp_path / "v")


def test_stress_ng_and_fio_verify(mnt):
    if shutil.which("fio"):
        r = subprocess.run(["fio", "--name=v", f"--directory={mnt.mp}", "--rw=randwrite",
                            "--bs=4k", "--size=16m", "--verify=crc32c", "--do_verify=1",
                            "--ioengine=psync", "--output-format=terse",
                            "--verify_state_save=0"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    else:
        pytest.skip("fio not installed")
    if shutil.which("stress-ng"):
        # the mixed run that once found reads of data still queued in the write pipeline;
        # --fpunch (small writes scattered over sparse files) once hung the mount
        r = subprocess.run(["stress-ng", "--hdd", "2", "--hdd-bytes", "32M", "--rename", "1",
                            "--dir", "1", "--link", "1", "--fpunch", "1", "--timeout", "15s",
                            "--verify",
                            "--temp-path", mnt.mp], capture_output=True, text=True, timeout=300,
                           cwd=mnt.mp)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "fail:" not in out, out
        # no writeback error left behind (files renamed and removed by the hundred)
        r = subprocess.run(["sync", "-f", mnt.mp], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    mnt.umount()
    assert_fsck_clean(mnt.volume)


def test_syncfs_after_files_are_gone(mnt):
    """`sync -f` (syncfs(2)) on the mount succeeds after files were created, renamed,
    written and removed. The kernel writes the times it caches back to inodes it still
    holds; for one already freed bmfs answered ENOENT, which the kernel kept as a
    writeback error of the filesystem and handed to the next syncfs."""
    d = os.path.join(mnt.mp, "gone")
    os.mkdir(d)
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    kept = os.path.join(d, "kept")
    with open(kept, "wb") as f:
        f.write(b"k" * 5000)
    for step in ("create-rename-unlink", "write-close-unlink", "rename-over", "link-unlink"):
        if step == "create-rename-unlink":
            open(a, "wb").close()
            os.rename(a, b)
            os.unlink(b)
        elif step == "write-close-unlink":
            with open(a, "wb") as f:
                f.write(b"x" * 10000)
            os.unlink(a)
        elif step == "rename-over":
            with open(a, "wb") as f:
                f.write(b"x" * 10000)
            with open(b, "wb") as f:
                f.write(b"y")
            os.rename(b, a)
            os.unlink(a)
        else:
            open(a, "wb").close()
            os.link(a, b)
            os.unlink(a)
            os.unlink(b)
        r = subprocess.run(["sync", "-f", mnt.mp], capture_output=True, text=True)
        assert r.returncode == 0, (step, r.stderr)
    # the times of a file that is still there are still written
    os.utime(kept, ns=(1_000_000_000, 2_000_000_000))
    assert os.stat(kept).st_mtime_ns == 2_000_000_000
    with open(kept, "rb") as f:
        assert f.read() == b"k" * 5000
    mnt.umount()
    assert_fsck_clean(mnt.volume)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_mount_left_idle_after_a_burst_uses_no_cpu(volume, tmp_path, monkeypatch):
    """With BMFS_IDLE_SPIN_US the daemon keeps its event loop awake for a moment between
    back-to-back requests (fuse/idle.py); once they stop, it must sleep again, not
    burn a CPU for nothing. Lookups of a missing name are requests every time
    (nothing caches them)."""
    import time
    monkeypatch.setenv("BMFS_IDLE_SPIN_US", "300")
    with Mounted(volume, tmp_path / "mnt") as mnt:
        with open(f"/proc/{mnt.pid}/environ", "rb") as f:  # (the daemon spins)
            assert b"BMFS_IDLE_SPIN_US=300" in f.read().split(b"\0")
        missing = os.path.join(mnt.mp, "not-there")
        for _ in range(3000):
            assert not os.path.exists(missing)
        before = _cpu_seconds(mnt.pid)
        time.sleep(1.0)
        assert _cpu_seconds(mnt.pid) - before < 0.2
        assert os.listdir(mnt.mp) == []


def test_mount_t_fuse_bmfs_and_fstab(volume, tmp_path):
    """`mount -t fuse.bmfs VOLUME DIR` and an fstab line (mount.fuse.bmfs helper)."""
    if not os.path.exists("/sbin/mount.fuse.bmfs"):
        pytest.skip("tools/setup.sh installs /sbin/mount.fuse.bmfs")
    mp = tmp_path / "m"
    mp.mkdir()
    helper = os.path.dirname(os.path.abspath(__file__)) + "/../mount/mount.fuse.bmfs"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + ":" + os.environ["PATH"])
    assert os.path.samefile(os.path.realpath("/sbin/mount.fuse.bmfs"), helper)
    subprocess.run(["mount", "-t", "fuse.bmfs", str(volume), str(mp)], check=True, env=env)
    try:
        (mp / "f").write_text("via mount -t")
    finally:
        bmfs("umount", mp)
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{volume} {mp} fuse.bmfs defaults 0 0\n")
    subprocess.run(["mount", "-T", str(fstab), str(mp)], check=True, env=env)
    try:
        assert (mp / "f").read_text() == "via mount -t"
    finally:
        bmfs("umount", mp)
    assert_fsck_clean(volume)


def test_branch_commands_find_the_mount(mnt, tmp_path):
    """From inside the mount, with -m, or (one mount up) from anywhere."""
    sub = os.path.join(mnt.mp, "d")
    os.mkdir(sub)
    r = subprocess.run([sys.executable, "-m", "bmfs.cli.main", "branch", "create", "a"],
                       cwd=sub, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    bmfs("branch", "create", "b", "-m", mnt.mp)
    r = subprocess.run([sys.executable, "-m", "bmfs.cli.main", "branch", "create", "c"],
                       cwd="/", capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(f"{mnt.mp}/.bm/branches")) == ["a", "b", "c", "main"]
    r = bmfs("branch", "create", "bad name", "-m", mnt.mp, check=False)
    assert r.returncode == 2 and "invalid branch name" in r.stderr and "Traceback" not in r.stderr


def test_node_add_remove_and_add_again_through_the_cli(mnt, tmp_path):
    """`bmfs node add` of a relative path (resolved where the command runs, not in the
    mount's working directory), a directory with other files refused in one line, and
    a removed device's directory added again as a new device: the files stay exact,
    and the volume mounts again with its new device list."""
    mp = mnt.mp
    files = {"a": os.urandom(9 << 20)}
    with open(f"{mp}/a", "wb") as f:
        f.write(files["a"])
    r = bmfs("node", "add", "d6", "-m", mp, cwd=tmp_path)
    assert "device: 6" in r.stdout, r.stdout
    st = json.loads(bmfs("status", mp, "--json").stdout)
    assert {d["id"]: d["path"] for d in st["devices"]}[6] == str(tmp_path / "d6")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    r = bmfs("node", "add", tmp_path / "busy", "-m", mp, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not empty" in r.stderr, r.stderr
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    r = bmfs("node", "remove", 0, "-m", mp)
    assert "removed: True" in r.stdout, r.stdout
    dev0 = f"{mnt.volume}/dev0"
    r = bmfs("node", "add", dev0, "-m", mp)  # emptied and formatted as device 7
    assert "device: 7" in r.stdout, r.stdout
    files["b"] = os.urandom(24 << 20)
    with open(f"{mp}/b", "wb") as f:
        f.write(files["b"])
    st = json.loads(bmfs("status", mp, "--json").stdout)
    devs = {d["id"]: d for d in st["devices"]}
    assert sorted(devs) == [1, 2, 3, 4, 5, 6, 7] and st["removed_devices"] == [0]
    assert devs[7]["path"] == dev0 and devs[7]["fragments"] > 0
    held = len(on_device(dev0))
    # repair sweeps fragment files no record owns: device 0's old store must not
    # list device 7's (the same directory) as such
    bmfs("repair", mp)
    assert len(on_device(dev0)) == held
    mnt.umount()
    assert_fsck_clean(mnt.volume)
    with Mounted(mnt.volume, tmp_path / "again") as m2:
        for name, data in files.items():
            with open(f"{m2.mp}/{name}", "rb") as f:
                assert f.read() == data


def test_repair_that_cannot_rebuild_a_stripe_exits_1(mnt):
    """A stripe with 3 of its 6 fragments lost (4+2 needs 4) cannot be rebuilt: its
    file reads as an I/O error (which queues the stripe for repair), `bmfs repair`
    says so in one line and exits 1 (scripts see it failed), and the other file is
    untouched."""
    from fragments import lose, on_volume
    mp = mnt.mp
    keep = os.urandom(5 << 20)
    with open(f"{mp}/keep", "wb") as f:
        f.write(keep)
    with open(f"{mp}/doomed", "wb") as f:
        f.write(os.urandom(4 << 20))
    os.sync()
    frags = on_volume(mnt.volume)
    last = max(f.sid for f in frags)  # doomed's stripe, written last
    for f in [f for f in frags if f.sid == last][:3]:
        lose(f)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    with pytest.raises(OSError) as e:  # the read finds them gone: queued for repair
        with open(f"{mp}/doomed", "rb") as f:
            f.read()
    assert e.value.errno == errno.EIO
    r = bmfs("repair", mp, check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    assert "repair: 1 stripes failed" in r.stderr
    with open(f"{mp}/keep", "rb") as f:
        assert f.read() == keep


def test_deleted_trees_are_freed_in_the_background(volume, tmp_path):
    """`bmfs branch delete` and `bmfs snapshot delete` return once the tree is gone; the
    mount then frees in the background what only it used (its layers, their stripes,
    their fragments on the devices), and `bmfs status` says while that is under way.
    A delete whose mount went away before freeing leaves a mark in the metadata: the
    next mount frees it."""
    mp = tmp_path / "mnt"
    with Mounted(volume, mp):
        before = fragment_count(volume)
        bmfs("branch", "create", "exp", "-m", mp)
        write_stored(f"{mp}/.bm/branches/exp/big", 9 << 20)  # 3 stripes, 18 fragments
        assert fragment_count(volume) == before + 18
        r = bmfs("branch", "delete", "exp", "-m", mp)
        assert "freed in the background" in r.stdout
        assert not os.path.exists(f"{mp}/.bm/branches/exp")
        wait_collected(mp, volume, before)

        write_stored(f"{mp}/kept", 9 << 20)  # in main, then in a snapshot only
        bmfs("snapshot", "create", "s", "-m", mp)
        os.unlink(f"{mp}/kept")
        with_snapshot = fragment_count(volume)
        assert with_snapshot == before + 18
    # the snapshot deleted by a mount that went away before it freed anything
    out = delete_snapshot_left_to_collect(volume, "s")
    assert "'freed_layers': None" in out
    st = json.loads(bmfs("status", "--json", volume).stdout)
    assert st["collecting_deleted_trees"] and st["snapshots"] == []
    assert fragment_count(volume) == with_snapshot  # nothing freed yet
    r = bmfs("fsck", volume)  # not a problem: the next mount finishes it
    assert "still to collect" in r.stdout
    with Mounted(volume, mp):
        wait_collected(mp, volume, before)
    assert_fsck_clean(volume)


@pytest.fixture
def mnt_uncached(volume, tmp_path):
    """A mount whose kernel caches nothing (--timeout 0): every stat reaches the daemon."""
    with Mounted(volume, tmp_path / "mnt", "--timeout", "0") as m:
        yield m


def test_a_removed_directory_still_in_use_answers(mnt_uncached, tmp_path):
    """A process whose working directory another removes keeps stat(".") (st_nlink 0)
    and chdir(".."), as on ext4; so does a descriptor of a directory replaced by a
    rename. A crash while one is in use leaves fsck nothing to find."""
    m = mnt_uncached.mp
    os.makedirs(f"{m}/p/d")
    up = os.stat(f"{m}/p").st_ino
    p = sit_in(f"{m}/p/d")
    os.rmdir(f"{m}/p/d")
    out, _ = p.communicate("go\n", timeout=60)
    assert p.returncode == 0
    assert json.loads(out) == {"nlink": 0, "fnlink": 0, "up": up}
    os.mkdir(f"{m}/p/a")
    os.mkdir(f"{m}/p/b")
    fd = os.open(f"{m}/p/b", os.O_RDONLY)
    try:
        os.rename(f"{m}/p/a", f"{m}/p/b")
        st = os.fstat(fd)
        assert (st.st_nlink, stat.S_ISDIR(st.st_mode)) == (0, True)
    finally:
        os.close(fd)
    os.makedirs(f"{m}/q/d")
    p = sit_in(f"{m}/q/d")
    try:
        os.rmdir(f"{m}/q/d")
        mnt_uncached.kill9()
    finally:
        p.kill()
        p.wait()
    assert_fsck_clean(mnt_uncached.volume)


def _getdents(path) -> list[tuple[bytes, int]]:
    """(name, inode number) of every entry getdents64(2) gives, dots included."""
    import ctypes
    import struct
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    buf = ctypes.create_string_buffer(1 << 16)
    out = []
    try:
        while (n := libc.syscall(217, fd, buf, len(buf))) > 0:  # SYS_getdents64
            raw, pos = buf.raw[:n], 0
            while pos < n:
                ino, _, reclen = struct.unpack_from("<QqH", raw, pos)
                out.append((raw[pos + 19:pos + reclen].split(b"\0")[0], ino))
                pos += reclen
        assert n == 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    return out


def test_listings_have_dot_and_dotdot(mnt):
    m = mnt.mp
    os.makedirs(f"{m}/p/q")
    open(f"{m}/p/f", "w").close()
    ents = _getdents(f"{m}/p")
    assert ents[:2] == [(b".", os.stat(f"{m}/p").st_ino), (b"..", os.stat(m).st_ino)]
    assert sorted(n for n, _ in ents[2:]) == [b"f", b"q"]
    assert _getdents(m)[:2] == [(b".", 1), (b"..", 1)]
    assert sh(f"ls -a {m}/p").stdout.split() == [".", "..", "f", "q"]
    mnt.umount()
    assert_fsck_clean(mnt.volume)


def _atime_after_read(path) -> int:
    with open(path, "rb") as f:
        f.read()
    return os.stat(path).st_atime_ns


def test_atime_relatime_by_default_noatime_and_strictatime(volume, tmp_path):
    mp = tmp_path / "m"
    with Mounted(volume, mp) as mnt:
        f = f"{mnt.mp}/f"
        with open(f, "wb") as fh:
            fh.write(b"data")
        st = os.stat(f)
        first = _atime_after_read(f)  # served from the page cache the write filled
        assert first > st.st_mtime_ns and first >= st.st_atime_ns
        assert _atime_after_read(f) == first  # relatime: once per change
        day = 24 * 3600 * 10**9
        os.utime(f, ns=(first - 2 * day, first - 3 * day))
        assert _atime_after_read(f) > first - day  # a day old: updated
        before = os.stat(mnt.mp).st_atime_ns
        os.utime(mnt.mp, ns=(before - 2 * day, before - 3 * day))
        os.listdir(mnt.mp)
        assert os.stat(mnt.mp).st_atime_ns > before - day  # a directory listed
        os.utime(f, ns=(1, 10**9))
    with Mounted(volume, mp, "-o", "noatime") as mnt:
        assert _atime_after_read(f"{mnt.mp}/f") == 1
    with Mounted(volume, mp, "-o", "strictatime") as mnt:
        a1 = _atime_after_read(f"{mnt.mp}/f")
        time.sleep(0.01)  # (the kernel's coarse clock ticks at least every 4 ms)
        assert _atime_after_read(f"{mnt.mp}/f") > a1 > 1
    assert_fsck_clean(volume)


def test_first_reads_while_the_kernel_evicts_inodes(volume, tmp_path):
    """Files read for the first time (relatime moves their atime at open, and the
    open drops the kernel's cached attributes of the file) by 4 threads at once,
    while the kernel keeps evicting unused inodes (drop_caches, which makes it write
    their times back to the daemon): every read gets its file's bytes, none hangs,
    and stat then shows each file's moved atime."""
    import threading
    with Mounted(volume, tmp_path / "m") as mnt:
        d = os.path.join(mnt.mp, "d")
        os.mkdir(d)
        n = 400
        for i in range(n):
            with open(f"{d}/f{i}", "wb") as fh:
                fh.write(b"%d" % i * 100)
        written = {i: os.stat(f"{d}/f{i}").st_mtime_ns for i in range(n)}
        errors, done = [], threading.Event()

        def reader(part):
            try:
                for i in range(part, n, 4):
                    with open(f"{d}/f{i}", "rb") as fh:
                        if fh.read() != b"%d" % i * 100:
                            errors.append(f"f{i}: wrong bytes")
            except OSError as e:
                errors.append(f"{e}")

        def evictor():
            while not done.is_set():
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("2")  # dentries and unused inodes
                time.sleep(0.005)

        ev = threading.Thread(target=evictor, daemon=True)
        ev.start()
        readers = [threading.Thread(target=reader, args=(p,), daemon=True) for p in range(4)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(timeout=300)
        done.set()
        ev.join(timeout=60)
        assert not any(t.is_alive() for t in readers), "a read hangs"
        assert errors == []
        assert [i for i in range(n) if os.stat(f"{d}/f{i}").st_atime_ns <= written[i]] == []
    assert_fsck_clean(volume)


def _mount_options(mp) -> set[str]:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(mp):
                return set(fields[5].split(","))
    raise AssertionError(f"{mp} is not mounted")


def _helper_env():
    if not os.path.exists("/sbin/mount.fuse.bmfs"):
        pytest.skip("tools/setup.sh installs /sbin/mount.fuse.bmfs")
    return dict(os.environ, PATH=os.path.dirname(sys.executable) + ":" + os.environ["PATH"])


def test_remount_ro_and_rw_through_mount(volume, tmp_path):
    """`mount -o remount,ro` and back to rw on a live mount: the kernel's flag and the
    daemon's (no atime written while read-only); bad options are one-line errors."""
    env = _helper_env()
    mp = tmp_path / "m"
    mp.mkdir()
    run = functools.partial(subprocess.run, capture_output=True, text=True, env=env)
    # (mount(8) itself resolves ro,rw to rw, the last, as for any filesystem)
    r = bmfs("mount", mp, "--volume", volume, "-o", "ro,rw", check=False)
    assert r.returncode == 2 and "contradictory mount options: ro and rw" in r.stderr
    r = run(["mount", "-t", "fuse.bmfs", "-o", "bogus", str(volume), str(mp)])
    assert r.returncode != 0 and "unknown mount option 'bogus'" in r.stderr
    assert "Traceback" not in r.stderr
    r = run(["mount", "-t", "fuse.bmfs", "-o", "remount,ro", str(volume), str(tmp_path)])
    assert r.returncode != 0 and "is not a bmfs mount" in r.stderr, r
    subprocess.run(["mount", "-t", "fuse.bmfs", str(volume), str(mp)], check=True, env=env)
    try:
        (mp / "f").write_bytes(b"written")
        os.utime(mp / "f", ns=(1, 10**9))
        r = run(["mount", "-o", "remount,ro", str(mp)])
        assert r.returncode == 0, r.stderr
        assert "ro" in _mount_options(mp)
        with pytest.raises(OSError) as e:
            (mp / "g").write_bytes(b"no")
        assert e.value.errno == errno.EROFS
        assert (mp / "f").read_bytes() == b"written"
        assert os.stat(mp / "f").st_atime_ns == 1  # (read-only: the atime stays)
        r = run(["mount", "-o", "remount,rw", str(mp)])
        assert r.returncode == 0, r.stderr
        assert "rw" in _mount_options(mp)
        (mp / "g").write_bytes(b"yes")
        assert _atime_after_read(mp / "f") > 1
    finally:
        bmfs("umount", mp)
    assert_fsck_clean(volume)


def test_mount_table_names_the_volume(mnt):
    """The mount's source is the volume's path, its type fuse.bmfs: `findmnt VOLUME`
    finds it, and the commands that look a mount up by its volume too."""
    with open("/proc/self/mountinfo") as f:
        line = next(ln for ln in f if ln.split()[4] == mnt.mp)
    assert line.split(" - ")[1].split()[:2] == ["fuse.bmfs", mnt.volume]
    r = sh(f"findmnt -n -o TARGET {mnt.volume}")
    assert r.stdout.strip() == mnt.mp
    st = json.loads(bmfs("status", "--json", mnt.volume).stdout)
    assert st["mountpoint"] == mnt.mp  # asked through the mount, found by its volume


def test_device_files_follow_nodev(volume, tmp_path):
    """A root mount takes dev by default (device nodes work, as on a local disk);
    -o nodev refuses to open them."""
    mp = tmp_path / "m"
    with Mounted(volume, mp) as mnt:
        assert "nodev" not in _mount_options(mnt.mp)
        node = f"{mnt.mp}/null"
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        with open(node, "wb") as f:
            assert f.write(b"into the void") == 13
        with open(node, "rb") as f:
            assert f.read() == b""
    with Mounted(volume, mp, "-o", "nodev") as mnt:
        assert "nodev" in _mount_options(mnt.mp)
        with pytest.raises(PermissionError):
            open(f"{mnt.mp}/null", "rb")
    assert_fsck_clean(volume)

def test_merge_ours_and_theirs_take_the_winning_file_whole(mnt):
    """The reported case through the CLI: each side rewrote g, one of them to another
    size. --ours leaves ours (was ``ours\\n\\0\\0``), --theirs leaves theirs, and diff
    then shows g unchanged; fsck is clean."""
    mp = mnt.mp

    def sh_in(cmd):
        return sh(cmd, cwd=mp, env={**os.environ, "PATH": os.environ["PATH"]})
    sh_in("echo base > g; echo base > h")
    bmfs("branch", "create", "c2", "-m", mp)
    sh_in("echo ours > g; echo theirs > .bm/branches/c2/g")
    bmfs("merge", "c2", "--into", "main", "--ours", "-m", mp)
    with open(f"{mp}/g", "rb") as f:
        assert f.read() == b"ours\n"
    bmfs("branch", "create", "c3", "-m", mp)
    sh_in("echo ours > h; echo theirs > .bm/branches/c3/h")
    bmfs("merge", "c3", "--into", "main", "--theirs", "-m", mp)
    with open(f"{mp}/h", "rb") as f:
        assert f.read() == b"theirs\n"
    assert "/h" not in bmfs("diff", "c3", "main", "-m", mp).stdout
    mnt.umount()
    assert_fsck_clean(mnt.volume)


@pytest.mark.parametrize("branch", ["main", "exp"])
def test_the_mounted_branch_under_bm_branches(volume, tmp_path, branch):
    """/.bm/branches/<the mounted branch> is a directory like any other branch's (it was
    d????????? and EIO: the lookup handed the kernel the root inode number): listed,
    stat'ed, read and written, the change seen at the root; after a remount too."""
    mp = str(tmp_path / "mnt")
    if branch != "main":
        with Mounted(volume, mp):
            bmfs("branch", "create", branch, "-m", mp)
    with Mounted(volume, mp, "--branch", branch):
        with open(f"{mp}/f", "w") as f:
            f.write("one")
        os.mkdir(f"{mp}/d")
    for round_ in range(2):
        with Mounted(volume, mp, "--branch", branch):
            own = f"{mp}/.bm/branches/{branch}"
            listing = sh(f"ls -la {mp}/.bm/branches").stdout
            assert "?" not in listing and branch in listing, listing
            assert os.path.isdir(own) and os.stat(own).st_ino != os.stat(mp).st_ino
            assert sorted(os.listdir(own)) == ["d", "f"]
            with open(f"{own}/f") as f:
                assert f.read() == ("one" if round_ == 0 else "two, via .bm")
            with open(f"{own}/f", "w") as f:
                f.write("two, via .bm")
            with open(f"{own}/d/new{round_}", "w") as f:
                f.write("x")
            with open(f"{mp}/f") as f:
                assert f.read() == "two, via .bm"
            assert sorted(os.listdir(f"{mp}/d")) == [f"new{i}" for i in range(round_ + 1)]
            assert os.stat(f"{own}/d/..").st_ino == os.stat(own).st_ino
    assert_fsck_clean(volume)
