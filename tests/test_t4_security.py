"""Level 4: who may do what (docs/operations.md, "Threat model"), tried as an
unprivileged user (`setpriv` to nobody) against real mounts: control requests are
authorised, the volume's files are private, the stores write through no link."""
import glob
import grp
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from mountutil import BMFS, Mounted, bmfs, mkfs

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def as_nobody(*cmd, groups: str | None = None,
              pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """``cmd`` run as nobody (with the supplementary ``groups``, if given)."""
    who = NOBODY if groups is None else NOBODY[:2] + [f"--groups={groups}"]
    path = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    return subprocess.run(who + [str(c) for c in cmd], capture_output=True, text=True,
                          errors="replace", env={**os.environ, "PYTHONPATH": path})


_NOBODYS_BMFS: list = []  # [(command, PYTHONPATH)] once made


def _nobodys_bmfs() -> tuple[list[str], str]:
    """How nobody runs the `bmfs` of this checkout. A checkout in a private directory
    (a clone in /root, as on a fresh machine) is out of nobody's reach, and so is its
    virtualenv: then the package and the virtualenv's site-packages are copied once
    to a directory nobody can read, and run by the interpreter the virtualenv is of."""
    if _NOBODYS_BMFS:
        return _NOBODYS_BMFS[0]
    if as_nobody(*BMFS, "--version").returncode == 0:
        _NOBODYS_BMFS.append((BMFS, os.environ.get("PYTHONPATH", "")))
        return _NOBODYS_BMFS[0]
    import atexit
    import site
    import bmfs as package
    top = tempfile.mkdtemp(dir="/var/tmp", prefix="bmfs-nobody-")
    atexit.register(shutil.rmtree, top, True)
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.dirname(package.__file__), f"{top}/code/bmfs", ignore=skip)
    shutil.copytree(next(p for p in site.getsitepackages() if p.startswith(sys.prefix)),
                    f"{top}/site", ignore=skip, symlinks=True)
    for root, dirs, files in os.walk(top):
        os.chmod(root, 0o755)
        for f in files:
            if not os.path.islink(os.path.join(root, f)):
                os.chmod(os.path.join(root, f), 0o644)
    _NOBODYS_BMFS.append(([sys._base_executable, "-m", "bmfs.cli.main"],
                          f"{top}/code:{top}/site"))
    return _NOBODYS_BMFS[0]


def bmfs_as_nobody(*args, groups: str | None = None) -> subprocess.CompletedProcess:
    cmd, path = _nobodys_bmfs()
    return as_nobody(*cmd, *args, groups=groups, pythonpath=path)


@pytest.fixture
def public():
    """A directory other users can reach (pytest's tmp dirs are private)."""
    top = tempfile.mkdtemp(dir="/var/tmp", prefix="bmfs-sec-")
    os.chmod(top, 0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def pub_mnt(public):
    mkfs(f"{public}/vol")
    with Mounted(f"{public}/vol", f"{public}/mnt") as m:
        os.chmod(m.mp, 0o755)
        yield m


def ctl_raw(mp: str, data: bytes, who=None) -> tuple[str | None, dict]:
    """Write ``data`` to the control file (as nobody if ``who``): (the write's error
    name or None, the reply read back on the same handle)."""
    code = f"""
import json, os, sys
fd = os.open({mp + '/.bm/ctl'!r}, os.O_RDWR)
err = None
try:
    os.write(fd, {data!r})
except OSError as e:
    err = e.errno
print(json.dumps([err, os.pread(fd, 1 << 20, 0).decode()]))
"""
    cmd = [sys.executable, "-c", code]
    r = as_nobody(*cmd) if who else subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    err, reply = json.loads(r.stdout)
    return err, json.loads(reply)


def tree_state(m) -> dict:
    """What a refused request must not change: branches, snapshots, devices, a file."""
    with open(f"{m.mp}/f") as f:
        content = f.read()
    return {"branches": m.ctl("branch_list"), "snapshots": m.ctl("snapshot_list"),
            "devices": m.ctl("devices"), "f": content}


def test_control_requests_refused_to_others(pub_mnt, public):
    m = pub_mnt
    with open(f"{m.mp}/f", "w") as f:
        f.write("main's")
    bmfs("snapshot", "create", "s1", "-m", m.mp)
    bmfs("branch", "create", "b1", "-m", m.mp)
    with open(f"{m.mp}/.bm/branches/b1/g", "w") as f:
        f.write("b1's")
    os.mkdir(f"{public}/mine")
    os.chown(f"{public}/mine", 65534, 65534)
    before = tree_state(m)
    mp = m.mp
    for args in (["branch", "reset", "main", "--to", "s1"], ["branch", "delete", "b1"],
                 ["branch", "create", "x"], ["snapshot", "delete", "s1"],
                 ["snapshot", "create", "s2"], ["merge", "b1", "--into", "main"],
                 ["node", "add", f"{public}/mine"], ["node", "drain", "0"],
                 ["node", "undrain", "0"], ["node", "remove", "0"],
                 ["admin-group", "nogroup"]):
        r = bmfs_as_nobody(*args, "-m", mp)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr.startswith("bmfs: permission denied: ") and \
            r.stderr.count("\n") == 1, (args, r.stderr)
    for op in ("repair", "scrub", "rebalance"):
        r = bmfs_as_nobody(op, mp)
        assert r.returncode == 2 and "permission denied" in r.stderr, (op, r.stderr)
    # a raw request fails its write with EACCES; the reply says who may send it
    err, reply = ctl_raw(mp, b'{"op": "add_device", "path": "%s/mine"}'
                         % public.encode(), who="nobody")
    assert err == 13 and reply["errno"] == 13 and "root only" in reply["error"]
    assert tree_state(m) == before
    assert os.listdir(f"{public}/mine") == []
    # read-only requests stay open to all
    for args in (["status", mp], ["branch", "list", "-m", mp],
                 ["snapshot", "list", "-m", mp], ["diff", "s1", "b1", "-m", mp],
                 ["admin-group", "-m", mp]):
        r = bmfs_as_nobody(*args)
        assert r.returncode == 0, (args, r.stderr)
    assert "A\t/g" in bmfs_as_nobody("diff", "s1", "b1", "-m", mp).stdout
    # root still may
    bmfs("branch", "delete", "b1", "-m", mp)


def _group_other_than_nobodys() -> grp.struct_group:
    for name in ("users", "staff", "adm"):
        try:
            g = grp.getgrnam(name)
        except KeyError:
            continue
        if g.gr_gid != 65534:
            return g
    pytest.skip("no group to name as the admin group")


def test_admin_group_manages_branches_not_devices(public):
    g = _group_other_than_nobodys()
    mkfs(f"{public}/vol", "--admin-group", g.gr_name)
    with Mounted(f"{public}/vol", f"{public}/mnt") as m:
        os.chmod(m.mp, 0o755)
        mp = m.mp
        st = os.stat(f"{mp}/.bm/ctl")
        assert st.st_gid == g.gr_gid and stat.S_IMODE(st.st_mode) == 0o666
        member = str(g.gr_gid)
        for args in (["branch", "create", "b2"], ["snapshot", "create", "s2", "--branch", "b2"],
                     ["snapshot", "delete", "s2"], ["branch", "delete", "b2"]):
            r = bmfs_as_nobody(*args, "-m", mp, groups=member)
            assert r.returncode == 0, (args, r.stderr)
        devices = m.ctl("devices")
        os.mkdir(f"{public}/new")
        for args in (["node", "add", f"{public}/new"], ["node", "drain", "0"],
                     ["admin-group", "--none"]):
            r = bmfs_as_nobody(*args, "-m", mp, groups=member)
            assert r.returncode == 2 and "permission denied" in r.stderr, (args, r.stderr)
        assert m.ctl("devices") == devices and os.listdir(f"{public}/new") == []
        # not a member: refused
        r = bmfs_as_nobody("branch", "create", "b3", "-m", mp)
        assert r.returncode == 2 and "admin group" in r.stderr
        # root takes the group's right away
        assert "none" in bmfs("admin-group", "--none", "-m", mp).stdout
        r = bmfs_as_nobody("branch", "create", "b4", "-m", mp, groups=member)
        assert r.returncode == 2 and "permission denied" in r.stderr
        assert [b["name"] for b in m.ctl("branch_list")["result"]] == ["main"]


def test_control_answers_are_per_handle(pub_mnt):
    mp = pub_mnt.mp
    bmfs("snapshot", "create", "root-only-name", "-m", mp)
    fd = os.open(f"{mp}/.bm/ctl", os.O_RDWR)
    try:
        os.write(fd, b'{"op": "snapshot_list"}')
        # another user's handle never shows root's answer
        code = f"""
import os
fd = os.open({mp + '/.bm/ctl'!r}, os.O_RDWR)
print(repr(os.pread(fd, 1 << 20, 0)))
os.write(fd, b'{{"op": "branch_list"}}')
print(repr(os.pread(fd, 1 << 20, 0)))
"""
        r = as_nobody(sys.executable, "-c", code)
        first, second = r.stdout.splitlines()
        assert first == "b''" and "root-only-name" not in r.stdout and '"main"' in second
        assert b"root-only-name" in os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)


def test_control_bad_requests(pub_mnt):
    mp = pub_mnt.mp
    before = pub_mnt.ctl("branch_list")
    for data, says in ((b'{"op": "branch_create"}', "branch_create needs the field 'name'"),
                       (b'{"op": "branch_create", "name": "x", "colour": 1}',
                        "branch_create takes no field 'colour'"),
                       (b'{"op": "branch_create", "name": 7}',
                        "'name' of branch_create is a string, not 7"),
                       (b'{"op": "drain", "device": true}',
                        "'device' of drain is an integer, not true"),
                       (b'{"op": "repair", "limit": "fast"}', "'limit' of repair is"),
                       (b'{"op": "merge", "source": "main"}', "merge needs the field 'into'"),
                       (b'{"op": 3}', 'a JSON object with an "op" string'),
                       (b'["status"]', 'a JSON object with an "op" string'),
                       (b'{"op": "format_disk"}', "unknown control operation 'format_disk'"),
                       (b'\xff\xfe', "not JSON")):
        err, reply = ctl_raw(mp, data)
        assert err is None and reply["errno"] == 22 and says in reply["error"], (data, reply)
    assert pub_mnt.ctl("branch_list") == before


# -- the volume's files --------------------------------------------------------------------
def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _loose_umask():
    os.umask(0)


def test_volume_files_are_private(public):
    vol, mp = f"{public}/vol", f"{public}/mnt"
    subprocess.run(BMFS + ["mkfs", vol], check=True, capture_output=True,
                   preexec_fn=_loose_umask)
    os.makedirs(mp)
    subprocess.run(BMFS + ["mount", mp, "--volume", vol], check=True, capture_output=True,
                   preexec_fn=_loose_umask)
    m = Mounted(vol, mp)
    from mountutil import daemon_pid
    m.pid = daemon_pid(vol)
    try:
        with open(f"{mp}/small", "w") as f:  # lives inline in meta.db
            f.write("TOPSECRET small file")
        os.chmod(f"{mp}/small", 0o600)
        with open(f"{mp}/big", "wb") as f:
            f.write(b"TOPSECRET" * (1 << 20))
            os.fsync(f.fileno())
        assert _mode(vol) == 0o700
        files = [f"{vol}/{n}" for n in ("volume.json", "mount.log", "mount.pid")]
        files += glob.glob(f"{vol}/mounts/*") + glob.glob(f"{vol}/meta.db*")
        assert f"{vol}/meta.db-wal" in files
        frag_files = glob.glob(f"{vol}/dev*/frags/*/*")
        assert frag_files
        for p in files + frag_files + glob.glob(f"{vol}/dev*/DEVICE"):
            assert _mode(p) == 0o600, p
        for p in glob.glob(f"{vol}/dev*") + glob.glob(f"{vol}/dev*/frags") + \
                glob.glob(f"{vol}/dev*/frags/*") + [f"{vol}/mounts"]:
            assert _mode(p) == 0o700, p
        for p in (f"{vol}/meta.db", frag_files[0], f"{vol}/mount.log"):
            r = as_nobody("cat", p)
            assert r.returncode != 0 and "Permission denied" in r.stderr, p
        r = as_nobody("grep", "-rl", "TOPSECRET", vol)
        assert "TOPSECRET" not in r.stdout and r.returncode != 0
    finally:
        m.umount()


def test_mkfs_called_in_process_makes_a_private_volume(public):
    """mkfs from a program (not the CLI, whose umask is 077) with umask 0."""
    import trio
    from bmfs.volume.volume import mkfs as mkfs_here
    old = os.umask(0)
    try:
        trio.run(mkfs_here, f"{public}/vol", 2, 1)
    finally:
        os.umask(old)
    for dp, dns, fns in os.walk(f"{public}/vol"):
        assert _mode(dp) == 0o700, dp
        for n in fns:
            assert _mode(os.path.join(dp, n)) == 0o600, n


def test_older_volume_tightened_once(public):
    vol = f"{public}/vol"
    mkfs(vol)
    with Mounted(vol, f"{public}/mnt") as m:
        with open(f"{m.mp}/f", "wb") as f:
            f.write(os.urandom(1 << 20))
    loosened = []  # as an older bmfs left them
    for dp, dns, fns in os.walk(vol):
        for n in dns:
            os.chmod(os.path.join(dp, n), 0o755)
        for n in fns:
            os.chmod(os.path.join(dp, n), 0o644)
            loosened.append(os.path.join(dp, n))
    os.chmod(vol, 0o755)
    r = as_nobody("cat", f"{vol}/meta.db")
    assert r.returncode == 0  # the setup did loosen it
    with Mounted(vol, f"{public}/mnt"):
        assert _mode(vol) == 0o700
        assert all(_mode(p) == 0o600 for p in glob.glob(f"{vol}/meta.db*"))
        assert all(_mode(p) == 0o700 for p in glob.glob(f"{vol}/dev*/frags/*"))
        assert as_nobody("cat", f"{vol}/meta.db").returncode != 0
    with Mounted(vol, f"{public}/mnt"):
        pass
    with open(f"{vol}/mount.log") as f:
        said = [line for line in f if "tightened permissions" in line]
    assert len(said) == 1 and "meta.db" in said[0], said


# -- devices: no link followed ---------------------------------------------------------------
def test_planted_links_are_not_written_through(public, tmp_path):
    """A link to a root-owned 0600 file where the first stripes' fragments go on one
    device: the file stays as it was, the writes land on the other devices, and the
    device counts what it found."""
    vol = f"{public}/vol"
    mkfs(vol)
    target = tmp_path / "precious"
    target.write_bytes(b"root's own\n")
    os.chmod(target, 0o600)
    before = (target.read_bytes(), os.stat(target).st_mtime_ns)
    frags = f"{vol}/dev0/frags"
    links = []
    for sid in range(1, 600):
        for index in range(6):
            name = "%016x.%d" % (sid, index)
            links.append(f"{frags}/{name[14:16]}/{name}")
            os.symlink(target, links[-1])
    data = os.urandom(9 << 20)
    with Mounted(vol, f"{public}/mnt") as m:
        with open(f"{m.mp}/file", "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        st = json.loads(bmfs("status", m.mp, "--json").stdout)
    with Mounted(vol, f"{public}/mnt") as m:  # read back from the devices
        with open(f"{m.mp}/file", "rb") as f:
            assert f.read() == data
    assert (target.read_bytes(), os.stat(target).st_mtime_ns) == before
    # each link is still there, or was removed (unlink takes the link, not its target:
    # a failed stripe's fragments are deleted on every device) and made afresh
    for p in links:
        assert os.path.islink(p) or not os.path.exists(p) or os.stat(p).st_nlink == 1
    dev0 = [d for d in st["devices"] if d.get("id", d.get("device")) == 0]
    assert dev0 and dev0[0].get("unexpected_entries", 0) >= 1, st["devices"]
    with open(f"{vol}/mount.log") as f:
        assert "not made by bmfs: left alone, not written" in f.read()


def test_device_paths_refused(public, tmp_path):
    vol = f"{public}/vol"
    mkfs(vol)
    other = tmp_path / "other"
    mkfs(other)
    os.mkdir(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    (tmp_path / "plain").write_text("a file")
    with Mounted(vol, f"{public}/mnt") as m:
        os.mkdir(f"{m.mp}/inside")
        before = m.ctl("devices")
        for path, says in ((tmp_path / "link", "is a symbolic link"),
                           (tmp_path / "plain", "is not a directory"),
                           (other, "the directory of a bmfs volume"),
                           (f"{m.mp}/inside", "inside the bmfs mount"),
                           (f"{m.mp}/inside/new", "inside the bmfs mount")):
            r = bmfs("node", "add", path, "-m", m.mp, check=False)
            assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, \
                (path, r.stderr)
        assert m.ctl("devices") == before
        assert os.listdir(tmp_path / "real") == []
        args = ["--ec", "1+1", "--device"]
        r = bmfs("mkfs", tmp_path / "v2", *args, tmp_path / "link", "--device",
                 tmp_path / "d2", check=False)
        assert r.returncode == 2 and "is a symbolic link" in r.stderr
        r = bmfs("mkfs", tmp_path / "v3", *args, f"{m.mp}/inside", "--device",
                 tmp_path / "d3", check=False)
        assert r.returncode == 2 and "inside the bmfs mount" in r.stderr


def test_admin_group_setting_offline(public):
    vol = f"{public}/vol"
    r = bmfs("mkfs", vol, "--admin-group", "no-such-group-here", check=False)
    assert r.returncode == 2 and "no group 'no-such-group-here'" in r.stderr
    assert not os.path.exists(f"{vol}/volume.json")
    mkfs(vol)
    g = _group_other_than_nobodys()
    assert bmfs("admin-group", "--volume", vol).stdout == "admin group: none (root alone)\n"
    assert bmfs("admin-group", g.gr_name, "--volume", vol).stdout == \
        f"admin group: {g.gr_name}\n"
    r = bmfs("admin-group", "no-such-group-here", "--volume", vol, check=False)
    assert r.returncode == 2 and "no group" in r.stderr
    r = bmfs_as_nobody("admin-group", "--none", "--volume", vol)  # the volume is root's
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    with Mounted(vol, f"{public}/mnt") as m:
        assert bmfs("admin-group", "-m", m.mp).stdout == f"admin group: {g.gr_name}\n"
        assert os.stat(f"{m.mp}/.bm/ctl").st_gid == g.gr_gid


def test_devices_of_another_user_are_refused(public):
    """A device directory another user owns is theirs to rearrange: refused when added,
    and a pool file they put in place of the volume's is never opened (it would take
    the volume's data, root's 0600 files included, where they read it)."""
    theirs = f"{public}/theirs"
    os.mkdir(theirs)
    os.chown(theirs, 65534, 65534)
    r = bmfs("mkfs", f"{public}/v1", "--ec", "1+1", "--device", theirs, "--device",
             f"{public}/d1", check=False)
    assert r.returncode == 2 and "belongs to uid 65534" in r.stderr and \
        r.stderr.count("\n") == 1, r.stderr
    assert os.listdir(theirs) == []
    vol = f"{public}/vol"
    devs = [f"{public}/e{i}" for i in range(4)]
    mkfs(vol, "--ec", "2+1", "--layout", "pool", *[a for d in devs for a in ("--device", d)])
    with Mounted(vol, f"{public}/mnt") as m:
        r = bmfs("node", "add", theirs, "-m", m.mp, check=False)
        assert r.returncode == 2 and "belongs to uid 65534" in r.stderr, r.stderr
        assert os.listdir(theirs) == []
    # device 0's directory is given away (an older bmfs let it be added); its new owner
    # swaps the pool files for files of their own
    os.chown(devs[0], 65534, 65534)
    r = as_nobody("sh", "-c", "cd $0 && for f in pool parity; do mv $f $f.old && : > $f "
                  "&& chmod 666 $f; done", devs[0])
    assert r.returncode == 0, r.stderr
    with Mounted(vol, f"{public}/mnt") as m:
        with open(f"{m.mp}/secret", "wb") as f:
            f.write(b"ROOTSECRET" * (1 << 18))
            os.fsync(f.fileno())
        os.chmod(f"{m.mp}/secret", 0o600)
        st = json.loads(bmfs("status", m.mp, "--json").stdout)
        dev0 = [d for d in st["devices"] if d.get("id", d.get("device")) == 0][0]
        assert dev0.get("health") != "ok", dev0
    for f in ("pool", "parity"):
        r = as_nobody("grep", "-c", "ROOTSECRET", f"{devs[0]}/{f}")
        assert r.stdout.strip() == "0", (f, r.stdout)
    with open(f"{vol}/mount.log") as f:
        assert "is not a file of bmfs's (owner uid 65534" in f.read()


_SWAPPER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
d, link = sys.argv[1].encode(), sys.argv[2].encode()
fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:  # the directory loose again, then swapped with the link
    os.fchmod(fd, 0o755)
    libc.renameat2(-100, d, -100, link, 2)  # (AT_FDCWD, RENAME_EXCHANGE)
"""


@pytest.mark.parametrize("how", ["tighten", "format"])
def test_tightening_changes_no_file_through_a_swapped_link(public, how):
    """Tightening a device another user can replace (its directory is theirs: a device
    of an older volume, say), or making a device directory (or a volume's) where they
    may write, never chmods what a link put in its place names: nobody swaps the
    directory with a link to a root file as fast as it can while it is tightened (or
    made) again and again."""
    from bmfs.errors import VolumeError
    from bmfs.store.file import make_private_dir
    from bmfs.store.pmem import tighten_device
    theirs = f"{public}/theirs"
    os.mkdir(theirs)
    os.chown(theirs, 65534, 65534)
    victim = f"{public}/victim"
    with open(victim, "w") as f:
        f.write("root's, 0644\n")
    os.chmod(victim, 0o644)
    dev, alt = f"{theirs}/dev", f"{theirs}/alt"
    assert as_nobody("sh", "-c", f"mkdir -m 755 {dev} && ln -s {victim} {alt}").returncode == 0
    swapper = subprocess.Popen(NOBODY + [sys.executable, "-c", _SWAPPER, dev, alt, "60"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert swapper.stdout.readline() == "ready\n"
        tightened = 0
        for _ in range(20000):
            changed = []
            if how == "tighten":
                tighten_device(dev, changed)
            else:
                try:
                    make_private_dir(dev)
                    changed.append(dev)
                except (VolumeError, FileExistsError):  # (the link's turn)
                    pass
            tightened += bool(changed)
            assert _mode(victim) == 0o644
        assert tightened  # (the directory itself was tightened whenever it was there)
    finally:
        swapper.kill()
        swapper.wait()


def test_volume_dirs_planted_by_others_are_refused(public):
    """In a directory everyone may write (a sticky /var/tmp), nobody plants a link
    where root is about to make a volume or a cluster (or makes the directory first):
    mkfs and cluster up refuse in one line and make nothing, here or where the link
    points (its owner could point it at a volume of their own later)."""
    os.chmod(public, 0o1777)
    os.mkdir(f"{public}/roots")
    assert as_nobody("ln", "-s", f"{public}/roots", f"{public}/planted").returncode == 0
    assert as_nobody("mkdir", f"{public}/theirs").returncode == 0
    for args, says in ((["mkfs", f"{public}/planted"], "is a symbolic link"),
                       (["mkfs", f"{public}/theirs"], "belongs to uid 65534"),
                       (["cluster", "up", f"{public}/planted", "--meta", "etcd"],
                        "is a symbolic link"),
                       (["cluster", "up", f"{public}/theirs"], "belongs to uid 65534")):
        r = bmfs(*args, check=False)
        assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, \
            (args, r.stderr)
    assert os.listdir(f"{public}/roots") == [] and os.listdir(f"{public}/theirs") == []


@pytest.mark.parametrize("name", ["m.db", "m.db-wal", "m.db-redo", "m.db.lock"])
def test_metadata_files_planted_as_links_are_refused(public, name):
    """A SQLite metadata database in a directory others write (`--meta
    sqlite:/shared/m.db`): a link nobody planted where one of its files goes is
    refused in one line; the file it names is neither written nor emptied."""
    os.chmod(public, 0o1777)
    victim = f"{public}/victim"
    with open(victim, "w") as f:
        f.write("root's own\n")
    assert as_nobody("ln", "-s", victim, f"{public}/{name}").returncode == 0
    r = bmfs("mkfs", f"{public}/vol", "--meta", f"sqlite:{public}/m.db", check=False)
    assert r.returncode == 2 and "is a symbolic link" in r.stderr and \
        r.stderr.count("\n") == 1, r.stderr
    with open(victim) as f:
        assert f.read() == "root's own\n"


def test_metadata_socket_serves_the_mounts_user_only(pub_mnt, public):
    """A direct client of a mounted one-machine volume reads the mount's metadata over
    VOLUME/meta.sock: nobody gets PermissionError; with the volume directory and the
    socket opened up by mistake, the mount still closes nobody's connection unanswered
    (its peer credentials are not the mount's uid)."""
    vol, sock = f"{public}/vol", f"{public}/vol/meta.sock"
    cmd, path = _nobodys_bmfs()
    code = f"""
import bmfs
try:
    bmfs.connect({vol!r})
except OSError as e:
    print(type(e).__name__)
"""
    r = as_nobody(cmd[0], "-c", code, pythonpath=path)
    assert r.stdout.strip() == "PermissionError", r.stdout + r.stderr
    raw = f"""
import socket, struct
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({sock!r})
except PermissionError:
    print("refused"); raise SystemExit
try:
    s.sendall(struct.pack("<IBH", 3, 1, 1))  # HELLO
    print("answered" if s.recv(100) else "closed")
except (BrokenPipeError, ConnectionResetError):
    print("closed")
"""
    r = as_nobody(sys.executable, "-c", raw)
    assert r.stdout.strip() == "refused", r.stdout + r.stderr
    os.chmod(vol, 0o755)
    os.chmod(sock, 0o666)
    try:
        r = as_nobody(sys.executable, "-c", raw)
        assert r.stdout.strip() == "closed", r.stdout + r.stderr
    finally:
        os.chmod(sock, 0o600)
        os.chmod(vol, 0o700)
    with open(f"{vol}/mount.log") as f:
        assert "a connection of uid 65534 refused" in f.read()
    import bmfs
    with bmfs.connect(vol) as c:  # root, the mount's user, reads on
        assert c.listdir("/") == sorted(os.listdir(pub_mnt.mp))
