"""Level 7: a trial SQLite volume moved to etcd with `bmfs dump` / `bmfs load`, then
mounted and compared file by file (bytes, modes, xattrs, symlinks, every branch and
snapshot); and the dumps that must be refused, each in one line with nothing written."""
import contextlib
import json
import os
import stat
import subprocess
import sys

import numpy as np

from etcd_cluster import etcd_cluster  # noqa: F401 (a fixture)
from bmfs.cluster.directory import free_ports
from mountutil import Mounted, assert_fsck_clean, bmfs, mkfs, wait_listening


@contextlib.contextmanager
def _node(port, devices, secret, uuid, log_path):
    """A storage node serving ``devices`` (ID=DIR) on 127.0.0.1:``port``, stopped by pid."""
    log = open(log_path, "wb")
    cmd = [sys.executable, "-m", "bmfs.cli.main", "node", "serve", "--listen",
           f"127.0.0.1:{port}", "--secret-file", secret, "--volume-uuid", uuid]
    for d in devices:
        cmd += ["--device", d]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        wait_listening(port, proc, f"the node (log: {log_path})")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _tree(root: str) -> dict:
    """path -> (type and mode, bytes or link target, xattrs) of everything under root."""
    out = {}
    for top, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            p = os.path.join(top, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                body = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    body = f.read()
            else:
                body = None
            xattrs = {} if stat.S_ISLNK(st.st_mode) else \
                {a: os.getxattr(p, a) for a in sorted(os.listxattr(p))}
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_mtime_ns, body,
                                             xattrs)
    return out


def _everything(mp: str) -> dict:
    """The mounted branch and every branch and snapshot under .bm."""
    trees = {"/": _tree(mp)}
    for kind in ("branches", "snapshots"):
        for name in sorted(os.listdir(f"{mp}/.bm/{kind}")):
            trees[f"{kind}/{name}"] = _tree(f"{mp}/.bm/{kind}/{name}")
    return trees


def _fill(mp: str) -> None:
    rng = np.random.default_rng(7)
    os.makedirs(f"{mp}/data/deep")
    with open(f"{mp}/data/small.txt", "w") as f:
        f.write("a small file, kept inline\n")
    with open(f"{mp}/data/deep/big.bin", "wb") as f:
        f.write(rng.bytes(5 << 20))  # several stripes on the devices
    np.save(f"{mp}/data/x.npy", np.arange(1000, dtype=np.float32))
    bmfs("type", f"{mp}/data/x.npy", "npy")
    os.setxattr(f"{mp}/data/small.txt", "user.note", b"kept")
    os.symlink("deep/big.bin", f"{mp}/data/link")
    os.chmod(f"{mp}/data/small.txt", 0o640)
    bmfs("branch", "create", "exp", "-m", mp)
    with open(f"{mp}/.bm/branches/exp/data/exp-only", "w") as f:
        f.write("only in exp\n")
    bmfs("snapshot", "create", "before", "-m", mp)
    with open(f"{mp}/data/small.txt", "a") as f:
        f.write("changed after the snapshot\n")
    os.unlink(f"{mp}/data/link")


def test_a_sqlite_volume_moves_to_etcd(etcd_cluster, tmp_path):  # noqa: F811
    src = tmp_path / "trial"
    mkfs(src)
    with Mounted(src, tmp_path / "m1") as m:
        _fill(m.mp)
    with Mounted(src, tmp_path / "m1") as m:
        before = _everything(m.mp)
    assert set(before) == {"/", "branches/exp", "branches/main", "snapshots/before"}
    assert before["/"]["data/x.npy"][4] == {"user.bm.type": b"npy"}
    dump = tmp_path / "trial.dump"
    r = bmfs("dump", src, dump)
    assert "dumped volume" in r.stdout and stat.S_IMODE(os.stat(dump).st_mode) == 0o600
    etcd_cluster.wipe()
    dst = tmp_path / "onetcd"
    # the trial's six device directories, served now by a storage node
    port = free_ports(1)[0]
    r = bmfs("load", dump, dst, "--meta", etcd_cluster.url,
             *[f"--node={i}=127.0.0.1:{port}" for i in range(6)])
    assert "loaded volume" in r.stdout and os.path.exists(dst / "secret")
    uuid = r.stdout.split()[2]
    with _node(port, [f"{i}={src}/dev{i}" for i in range(6)], dst / "secret", uuid,
               tmp_path / "node.log"):
        with Mounted(dst, tmp_path / "m2") as m:
            after = _everything(m.mp)
            import bmfs as bm
            assert bm.get_type(f"{m.mp}/data/x.npy") == "npy"
            arr = bm.mmap(f"{m.mp}/data/x.npy")
            assert arr[999] == 999
            del arr
            status = json.loads(bmfs("status", m.mp, "--json").stdout)
            assert {(d["node"], d["health"]) for d in status["devices"]} == \
                {(f"127.0.0.1:{port}", "ok")}
        assert after == before
        assert_fsck_clean(dst)
        # a second load into the same (now full) etcd: refused, nothing changed
        r = bmfs("load", dump, tmp_path / "again", "--meta", etcd_cluster.url, check=False)
        assert r.returncode == 2 and "is not empty" in r.stderr, r
        assert len(r.stderr.strip().splitlines()) == 1
        assert not os.path.exists(tmp_path / "again")
        with Mounted(dst, tmp_path / "m2") as m:
            assert _everything(m.mp) == before
        # and back: the etcd volume dumped (a backup) and loaded into SQLite, reading
        # the same node with the secret it holds
        bmfs("dump", dst, tmp_path / "etcd.dump")
        back = tmp_path / "back"
        bmfs("load", tmp_path / "etcd.dump", back, "--secret-file", dst / "secret")
        assert (back / "secret").read_bytes() == (dst / "secret").read_bytes()
        with Mounted(back, tmp_path / "m3") as m:
            assert _everything(m.mp) == before


def test_bad_dumps_are_refused_whole(tmp_path):
    """Truncated, damaged, another version, another format revision, not a dump, into
    a directory that holds a volume, or a dump of a mounted volume: one line, exit 2,
    and nothing written."""
    src = tmp_path / "vol"
    mkfs(src)
    with Mounted(src, tmp_path / "m") as m:
        with open(f"{m.mp}/f", "w") as f:
            f.write("x" * 100)
        r = bmfs("dump", src, tmp_path / "while-mounted", check=False)
        assert r.returncode == 2 and not os.path.exists(tmp_path / "while-mounted"), r
    good = tmp_path / "good"
    bmfs("dump", src, good)
    r = bmfs("dump", src, good, check=False)
    assert r.returncode == 2 and "exists" in r.stderr
    data = good.read_bytes()
    import hashlib
    import json
    import struct
    hlen = struct.unpack(">I", data[14:18])[0]
    header = json.loads(data[18:18 + hlen])

    def resealed(body: bytes) -> bytes:  # a well-formed file with other contents
        return body + hashlib.sha256(body).digest()
    other_rev = json.dumps({**header, "format_revision": 99}).encode()
    cases = {
        "truncated": (data[:len(data) // 2], "truncated dump"),
        "cut-checksum": (data[:-5], "truncated dump (its checksum is cut off)"),
        "appended": (data + b"more", "damaged dump (bytes after its checksum)"),
        "flipped": (data[:40] + bytes([data[40] ^ 1]) + data[41:], "damaged dump"),
        "version": (data[:10] + struct.pack(">I", 2) + data[14:],
                    "a dump of version 2; this bmfs reads version 1"),
        "revision": (resealed(data[:14] + struct.pack(">I", len(other_rev)) + other_rev
                              + data[18 + hlen:-32]), "volume format revision 99"),
        "foreign": (b"PK\x03\x04 a zip file", "is not a bmfs dump"),
    }
    for name, (body, msg) in cases.items():
        p = tmp_path / name
        p.write_bytes(body)
        r = bmfs("load", p, tmp_path / f"v-{name}", check=False)
        assert r.returncode == 2 and msg in r.stderr, (name, r)
        assert len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)
        assert not os.path.exists(tmp_path / f"v-{name}"), name
    r = bmfs("load", good, src, check=False)
    assert r.returncode == 2 and "already holds a volume" in r.stderr
    with Mounted(src, tmp_path / "m") as m:  # the volume loaded over is untouched
        with open(f"{m.mp}/f") as f:
            assert f.read() == "x" * 100
    for nodes, msg in ((["--node", "0=127.0.0.1:9"], "devices 1, 2, 3, 4, 5 stay on this "
                        "machine"),
                       (["--node", "9=127.0.0.1:9"], "the dump has no device 9"),
                       (["--node", "zero"], "give ID=HOST:PORT")):
        r = bmfs("load", good, tmp_path / "v-nodes", *nodes, check=False)
        assert r.returncode == 2 and msg in r.stderr, r
        assert not os.path.exists(tmp_path / "v-nodes")
    bmfs("load", good, tmp_path / "copy")  # and the good dump loads
    assert_fsck_clean(tmp_path / "copy")
