"""Level 4: the command line as people use it, against real mounts: read-only mounts
and snapshots mounted, mount points made or refused, branch commands defaulting to
the mounted branch, merge conflicts' exit status, what umount waits for, and why a
mount failed (as an unprivileged user, where the rule is the kernel's)."""
import errno
import json
import os
import subprocess
import time

import pytest

from mountutil import Mounted, bmfs, is_mounted
from test_t4_security import bmfs_as_nobody, public  # noqa: F401 (a fixture)


def _write_fails_erofs(path):
    with pytest.raises(OSError) as e:
        with open(path, "w") as f:
            f.write("x")
    assert e.value.errno == errno.EROFS


@pytest.mark.parametrize("how", [["--read-only"], ["-o", "ro"]])
def test_read_only_mounts_refuse_writes(volume, tmp_path, how):
    with Mounted(volume, tmp_path / "w") as m:
        with open(f"{m.mp}/kept", "w") as f:
            f.write("kept\n")
    with Mounted(volume, tmp_path / "mnt", *how) as m:
        assert "ro" in next(x for x in bmfs_mounts() if x[0] == m.mp)[1]
        with open(f"{m.mp}/kept") as f:
            assert f.read() == "kept\n"
        _write_fails_erofs(f"{m.mp}/new")
        _write_fails_erofs(f"{m.mp}/kept")
    r = bmfs("mount", tmp_path / "x", "--volume", volume, "--read-only", "-o", "rw",
             check=False)
    assert r.returncode == 2 and "contradictory" in r.stderr and not is_mounted(tmp_path / "x")


def bmfs_mounts():
    from bmfs.cli.common import mounts
    return [(m["mountpoint"], m["options"]) for m in mounts()]


def test_a_snapshot_mounted_is_read_only(volume, tmp_path):
    """--branch SNAP mounts the snapshot at the root: its files as they were when it
    was taken, and every write fails with EROFS. A name that is neither a branch nor
    a snapshot is a one-line error."""
    with Mounted(volume, tmp_path / "w") as m:
        with open(f"{m.mp}/f", "w") as f:
            f.write("then\n")
        bmfs("snapshot", "create", "s1", "-m", m.mp)
        with open(f"{m.mp}/f", "w") as f:
            f.write("now\n")
    with Mounted(volume, tmp_path / "snap", "--branch", "s1") as m:
        with open(f"{m.mp}/f") as f:
            assert f.read() == "then\n"
        _write_fails_erofs(f"{m.mp}/f")
        _write_fails_erofs(f"{m.mp}/g")
        with pytest.raises(OSError) as e:
            os.mkdir(f"{m.mp}/d")
        assert e.value.errno == errno.EROFS
        # branch create starts from the snapshot mounted; snapshot create needs a branch
        bmfs("branch", "create", "fromsnap", "-m", m.mp)
        with open(f"{m.mp}/.bm/branches/fromsnap/f") as f:
            assert f.read() == "then\n"
        r = bmfs("snapshot", "create", "s2", "-m", m.mp, check=False)
        assert r.returncode == 2 and "shows snapshot 's1', not a branch" in r.stderr, r
    r = bmfs("mount", tmp_path / "n", "--volume", volume, "--branch", "nope", check=False)
    assert not os.path.exists(tmp_path / "n")  # (made for the mount, gone with it)
    assert r.returncode == 2 and "no branch or snapshot named 'nope'" in r.stderr, r
    assert len(r.stderr.strip().splitlines()) == 1 and not is_mounted(tmp_path / "n")


def test_mount_point_is_made_and_a_full_one_refused(volume, tmp_path):
    mp = tmp_path / "a" / "b" / "mnt"
    r = bmfs("mount", mp, "--volume", volume)
    try:
        assert is_mounted(mp) and f"made the mount point {mp}" in r.stderr
    finally:
        bmfs("umount", mp)
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine").write_text("x")
    r = bmfs("mount", full, "--volume", volume, check=False)
    assert r.returncode == 2 and "is not empty (it holds 'mine')" in r.stderr, r
    assert not is_mounted(full) and (full / "mine").read_text() == "x"
    for how in (["--nonempty"], ["-o", "nonempty"]):
        bmfs("mount", full, "--volume", volume, *how)
        try:
            assert is_mounted(full) and not os.path.exists(full / "mine")
        finally:
            bmfs("umount", full)
    assert (full / "mine").read_text() == "x"


def test_branch_commands_default_to_the_mounted_branch(volume, tmp_path):
    """With a branch mounted at the root, snapshot create, branch create and merge act
    on it, not on main; run in a directory under .bm/branches/NAME, on NAME."""
    with Mounted(volume, tmp_path / "m0") as m:
        bmfs("branch", "create", "exp", "-m", m.mp)
    with Mounted(volume, tmp_path / "m1", "--branch", "exp") as m:
        with open(f"{m.mp}/onexp", "w") as f:
            f.write("x")
        bmfs("snapshot", "create", "s", "-m", m.mp)
        bmfs("branch", "create", "child", "-m", m.mp)
        snaps = json.loads(bmfs("snapshot", "list", "--json", "-m", m.mp).stdout)
        assert {"s": "exp"}.items() <= {s["name"]: s["branch"] for s in snaps}.items()
        branches = json.loads(bmfs("branch", "list", "--json", "-m", m.mp).stdout)
        assert {b["name"]: b.get("from") for b in branches}["child"] == "exp"
        assert os.path.exists(f"{m.mp}/.bm/branches/child/onexp")
        # from inside child's directory: a branch of child, and a merge into child
        inside = f"{m.mp}/.bm/branches/child"
        with open(f"{m.mp}/.bm/branches/child/c", "w") as f:
            f.write("c")
        bmfs("branch", "create", "grandchild", cwd=inside)
        assert os.path.exists(f"{m.mp}/.bm/branches/grandchild/c")
        with open(f"{m.mp}/.bm/branches/grandchild/gc", "w") as f:
            f.write("g")
        bmfs("merge", "grandchild", cwd=inside)
        assert os.path.exists(f"{inside}/gc") and not os.path.exists(f"{m.mp}/gc")


def test_merge_conflicts_exit_4_with_json(mnt):
    mp = mnt.mp
    for name in ("a", "b"):
        with open(f"{mp}/{name}", "w") as f:
            f.write("base\n")
    bmfs("branch", "create", "side", "-m", mp)
    for name in ("a", "b"):
        with open(f"{mp}/{name}", "w") as f:
            f.write("main\n")
        with open(f"{mp}/.bm/branches/side/{name}", "w") as f:
            f.write("side\n")
    r = bmfs("merge", "side", "--into", "main", "--json", "-m", mp, check=False)
    assert r.returncode == 4, r
    assert json.loads(r.stdout) == {"result": "conflicts", "conflicts": ["/a", "/b"]}
    assert "merge conflicts in: /a, /b" in r.stderr
    with open(f"{mp}/a") as f:
        assert f.read() == "main\n"  # nothing changed
    r = bmfs("merge", "side", "-m", mp, check=False)  # (into the mounted branch)
    assert r.returncode == 4 and r.stdout == "" and len(r.stderr.splitlines()) == 1
    r = bmfs("merge", "side", "--theirs", "--json", "-m", mp)
    assert json.loads(r.stdout)["result"] == "merged"


def test_umount_names_what_holds_the_mount(mnt):
    """A busy mount: umount says which processes hold files in it (exit 2) and the
    mount stays; once they are gone it unmounts."""
    holder = subprocess.Popen(["sleep", "600"], cwd=mnt.mp)
    try:
        time.sleep(0.2)
        r = bmfs("umount", mnt.mp, check=False)
        assert r.returncode == 2 and f"sleep (pid {holder.pid})" in r.stderr, r
        assert "busy" in r.stderr and is_mounted(mnt.mp)
    finally:
        holder.kill()
        holder.wait()
    bmfs("umount", mnt.mp, "--timeout", "120")
    assert not is_mounted(mnt.mp)


def test_a_failed_mount_says_why(public):
    """Mounted by a user that may not write the mount point: libfuse's own reason
    (fusermount3's; or, where /dev/fuse is root's alone, that it cannot be opened),
    not pyfuse3's "fuse_session_mount failed"."""
    top = f"{public}/nb"
    os.mkdir(top)
    os.chown(top, 65534, 65534)
    r = bmfs_as_nobody("mkfs", f"{top}/vol")
    assert r.returncode == 0, r
    mp = f"{public}/rootsdir"
    os.mkdir(mp)  # root's, 0755
    r = bmfs_as_nobody("mount", mp, "--volume", f"{top}/vol")
    assert r.returncode == 2, r
    why = "no write access to mountpoint" if os.stat("/dev/fuse").st_mode & 0o006 == 0o006 \
        else "failed to open /dev/fuse: Permission denied"
    assert why in r.stderr, r.stderr
    assert "fuse_session_mount" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not is_mounted(mp)


def test_a_users_default_volume_is_in_their_home(public):
    """`bmfs mount DIR` without --volume, as a user other than root: the default volume
    is made in that user's data directory ($XDG_DATA_HOME, else ~/.local/share); with a
    HOME that is not theirs (root's, kept by setpriv) and no home of their own (nobody's
    is /nonexistent), a one-line error that says what to do, not a traceback."""
    from test_t4_security import NOBODY, _nobodys_bmfs
    cmd, path = _nobodys_bmfs()

    def mount_as_nobody(mp, **env):
        return subprocess.run(NOBODY + cmd + ["mount", mp], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": path, **env})
    home = f"{public}/home"
    os.mkdir(home, 0o700)
    os.chown(home, 65534, 65534)
    env = {k: v for k, v in os.environ.items() if k != "XDG_DATA_HOME"}
    r = subprocess.run(NOBODY + cmd + ["mount", f"{home}/mnt"], capture_output=True,
                       text=True, env={**env, "PYTHONPATH": path, "HOME": home})
    try:
        assert os.path.exists(f"{home}/.local/share/bmfs/default/volume.json"), r
        # (mounted where /dev/fuse lets nobody mount; else libfuse's reason, one line)
        assert r.returncode == 0 or (r.returncode == 2 and
                                     len(r.stderr.strip().splitlines()) == 1), r
    finally:
        if is_mounted(f"{home}/mnt"):
            bmfs("umount", f"{home}/mnt")
    r = mount_as_nobody(f"{public}/mnt2", XDG_DATA_HOME=f"{home}/data")
    assert os.path.exists(f"{home}/data/bmfs/default/volume.json"), r
    if is_mounted(f"{public}/mnt2"):
        bmfs("umount", f"{public}/mnt2")
    r = mount_as_nobody(f"{public}/mnt3", HOME="/root", XDG_DATA_HOME="")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r
    assert "cannot make the default volume" in r.stderr and "--volume DIR" in r.stderr, r
    assert "/root" not in r.stderr and not is_mounted(f"{public}/mnt3")


def test_umount_gives_up_waiting_at_its_timeout(volume, tmp_path):
    """A daemon that cannot finish (stopped here with SIGSTOP): umount unmounts, waits
    --timeout seconds, then exits 1 naming the daemon's pid; the daemon, let go,
    stores what was written and exits, and the data is there."""
    import signal
    from bmfs.proc import alive
    with Mounted(volume, tmp_path / "mnt") as m:
        with open(f"{m.mp}/f", "wb") as f:
            f.write(b"x" * (1 << 20))
        os.kill(m.pid, signal.SIGSTOP)
        try:
            r = bmfs("umount", m.mp, "--timeout", "1", check=False)
            assert r.returncode == 1 and f"daemon (pid {m.pid}) is still storing" in r.stderr, r
            assert not is_mounted(m.mp) and alive(m.pid)
        finally:
            os.kill(m.pid, signal.SIGCONT)
    with Mounted(volume, tmp_path / "mnt") as m:
        with open(f"{m.mp}/f", "rb") as f:
            assert f.read() == b"x" * (1 << 20)
