"""Failure tests on real mounts: lost devices, corrupt fragments, a crashed mount
daemon, and bad input.

Each test damages a volume the way the world does (a device directory gone, bytes
flipped on a device, the daemon killed with SIGKILL in the middle of writes, a user's
mistake) and checks what a user would see: every byte that was stored (or fsync'ed)
reads back exactly, the damage is reported (status, mount.log, fsck), and mistakes
get the proper errno or a one-line error with exit status 2.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from fragments import (empty_device, flip, intact, intact_keys, lose, on_device, on_volume,
                       payload_area)
from mountutil import Mounted, assert_fsck_clean, bmfs, daemon_pid, fsck, is_mounted, mkfs

MiB = 1 << 20


# -- helpers ------------------------------------------------------------------------------
@pytest.fixture(params=["files", "pool"])
def volume(request, tmp_path):
    """A fresh 4+2 volume, once in each device layout (docs/formats.md): the damage
    below is done to the bytes on the devices (tests/fragments.py), whatever the
    layout keeps them in."""
    v = tmp_path / "vol"
    mkfs(v, "--layout", request.param)
    return v


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_varied_files(root) -> dict[str, str]:
    """Files of the sizes that take different paths (empty, inline, one block, several
    blocks, a stripe and a bit, several stripes, sparse); returns name -> sha256 of the
    contents a reader must see."""
    rng = random.Random(1234)
    want = {}
    os.makedirs(os.path.join(root, "sub", "deeper"), exist_ok=True)
    for name, size in [("empty", 0), ("one", 1), ("4k", 4096), ("17k", 17 * 1024),
                       ("sub/1m1", MiB + 1), ("sub/deeper/9m", 9 * MiB)]:
        data = rng.randbytes(size)
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
        want[name] = sha(data)
    # sparse: data, a hole across a stripe boundary, data, then a hole to the end
    head, tail = rng.randbytes(1000), rng.randbytes(5000)
    fd = os.open(os.path.join(root, "sparse"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, head, 0)
        os.pwrite(fd, tail, 6 * MiB + 123)
        os.ftruncate(fd, 20 * MiB)
    finally:
        os.close(fd)
    sparse = bytearray(20 * MiB)
    sparse[:1000] = head
    sparse[6 * MiB + 123:6 * MiB + 123 + 5000] = tail
    want["sparse"] = sha(bytes(sparse))
    return want


def read_back(root, want: dict[str, str]) -> None:
    for name, digest in sorted(want.items()):
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        assert sha(data) == digest, f"{name}: {len(data)} bytes read, contents differ"


def status_json(target) -> dict:
    res = bmfs("status", "--json", target)
    return json.loads(res.stdout)


def one_line_error(res: subprocess.CompletedProcess) -> str:
    err = res.stderr.strip()
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr
    assert err and len(err.splitlines()) == 1, f"want one line on stderr, got:\n{res.stderr}"
    return err


# -- lost devices -------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["whole-device", "frags-only"])
def test_two_devices_lost_everything_reads_back(mnt, how):
    want = write_varied_files(mnt.mp)
    mnt.umount()
    lost = [1, 4]
    for n in lost:
        dev = os.path.join(str(mnt.volume), f"dev{n}")
        if how == "whole-device":
            shutil.rmtree(dev)
        else:
            empty_device(dev)
    with Mounted(mnt.volume, mnt.mp):
        read_back(mnt.mp, want)
        st = status_json(mnt.mp)
        health = {d["id"]: d["health"] for d in st["devices"]}
        if how == "whole-device":
            assert {d for d, h in health.items() if h != "ok"} == set(lost), health
            human = bmfs("status", mnt.volume).stdout
            for n in lost:
                line = next(ln for ln in human.splitlines() if f"dev{n}" in ln)
                assert "missing" in line, human
        else:
            assert set(health.values()) == {"ok"}, health
            assert st["data"]["missing_fragments"] > 0, st["data"]
        assert st["data"]["degraded_reads"] > 0, st["data"]
        # a degraded volume still takes new data
        extra = random.Random(5).randbytes(5 * MiB + 7)
        with open(os.path.join(mnt.mp, "written-degraded"), "wb") as f:
            f.write(extra)
            os.fsync(f.fileno())
        want["written-degraded"] = sha(extra)
    with Mounted(mnt.volume, mnt.mp):
        read_back(mnt.mp, want)
    # the damage is not hidden: fsck names what is gone
    res = fsck(mnt.volume)
    assert res.returncode != 0, res.stdout
    if how == "whole-device":
        for n in lost:
            assert f"device {n}" in res.stdout, res.stdout


# -- corrupt fragments --------------------------------------------------------------------
def test_small_reads_with_two_devices_lost_rebuild_their_ranges(mnt):
    """Random small reads of a file whose volume lost 2 of 6 devices: exact bytes at
    every size and alignment, each rebuilt from the same range of 4 other fragments
    (`ranges_rebuilt` in `bmfs status`) rather than by decoding whole stripes."""
    data = random.Random(11).randbytes(13 * MiB + 333)
    with open(os.path.join(mnt.mp, "big"), "wb") as f:
        f.write(data)
    mnt.umount()
    for n in (1, 4):
        empty_device(os.path.join(str(mnt.volume), f"dev{n}"))
    with Mounted(mnt.volume, mnt.mp):
        rng = random.Random(12)
        fd = os.open(os.path.join(mnt.mp, "big"), os.O_RDONLY)
        try:
            for _ in range(300):
                n = rng.choice([1, 512, 4096, 5000, 65536])
                off = rng.randrange(len(data))
                if rng.random() < 0.5:
                    off -= off % 4096
                assert os.pread(fd, n, off) == data[off:off + n], (off, n)
        finally:
            os.close(fd)
        st = status_json(mnt.mp)["data"]
        assert st["ranges_rebuilt"] > 0 and st["degraded_reads"] >= st["ranges_rebuilt"], st


def test_flipped_bytes_are_detected_and_read_around(mnt):
    want = write_varied_files(mnt.mp)
    mnt.umount()
    frags = on_volume(mnt.volume)
    first = min(f.sid for f in frags)
    # two devices: the ones holding data fragments 0 and 1 of the first stripe, so the
    # damage lies on the path of ordinary reads; no stripe loses more than m=2 fragments
    dev_payload = next(f.dev for f in frags if f.sid == first and f.idx == 0)
    dev_header = next(f.dev for f in frags if f.sid == first and f.idx == 1)
    damaged = []
    for f in frags:
        if f.dev == dev_payload:
            start, plen = payload_area(f)
            flip(f, start + plen // 2)
        elif f.dev == dev_header:
            flip(f, 32)  # the first entry of the block checksum table
        else:
            continue
        damaged.append((f.sid, f.idx, f.dev))
    assert len({sid for sid, _, _ in damaged}) >= 3, damaged

    res = fsck(mnt.volume, "--full")
    assert res.returncode != 0, res.stdout
    for sid, idx, dev in damaged:
        assert f"stripe {sid} fragment {idx} on device {dev}" in res.stdout, \
            (sid, idx, dev, res.stdout)

    with Mounted(mnt.volume, mnt.mp):
        read_back(mnt.mp, want)
        st = status_json(mnt.mp)
        assert st["data"]["corrupt_fragments"] > 0, st["data"]
    with open(os.path.join(str(mnt.volume), "mount.log")) as f:
        log = f.read()
    assert "corrupt" in log, log[-2000:]

    # and the volume can be brought back to full health
    bmfs("repair", mnt.volume)
    res = fsck(mnt.volume, "--full")
    assert res.returncode == 0, res.stdout
    with Mounted(mnt.volume, mnt.mp):
        read_back(mnt.mp, want)


# -- kill -9 of the mount daemon during writes -------------------------------------------
WRITER = textwrap.dedent("""
    import hashlib, os, random, sys
    root, log_path = sys.argv[1], sys.argv[2]
    sizes = [0, 1, 5000, 17 * 1024, 300 * 1024, (1 << 20) + 3, 5 << 20]
    log = open(log_path, "a")
    def record(line):
        log.write(line + "\\n")
        log.flush()
        os.fsync(log.fileno())
    try:
        for i in range(100000):
            if i % 10 == 0:
                d = os.path.join(root, "d%d" % (i // 10))
                os.mkdir(d)
                fd = os.open(root, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                record("dir d%d" % (i // 10))
            data = random.Random(i).randbytes(sizes[i % len(sizes)])
            name = "d%d/f%d" % (i // 10, i)
            fd = os.open(os.path.join(root, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.write(fd, data)
            os.fsync(fd)
            record("file %s %s" % (name, hashlib.sha256(data).hexdigest()))
            os.close(fd)
    except OSError as e:
        print("writer stopped:", e, file=sys.stderr)
""")


def test_kill9_during_writes_keeps_what_fsync_promised(mnt, tmp_path):
    root = os.path.join(mnt.mp, "w")
    os.mkdir(root)
    log_path = str(tmp_path / "fsynced.log")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, root, log_path],
                              stderr=subprocess.PIPE, text=True)
    try:
        # kill once 25 files are safe, while the writer is on a 5 MiB file (more than
        # a stripe: fragments are being stored when the daemon dies)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and writer.poll() is None:
            done = [ln for ln in open(log_path)] if os.path.exists(log_path) else []
            files = [ln for ln in done if ln.startswith("file")]
            if len(files) >= 25 and int(files[-1].split()[1].split("/f")[1]) % 7 == 5:
                break
            time.sleep(0.005)
        assert writer.poll() is None, f"the writer stopped early: {writer.stderr.read()}"
        time.sleep(random.Random().uniform(0, 0.1))
        mnt.kill9()
        writer.wait(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    lines = open(log_path).read().splitlines()
    files = [ln.split()[1:] for ln in lines if ln.startswith("file ")]
    dirs = [ln.split()[1] for ln in lines if ln.startswith("dir ")]
    assert len(files) >= 25

    with Mounted(mnt.volume, mnt.mp):
        for d in dirs:
            assert os.path.isdir(os.path.join(root, d)), f"fsync'ed directory {d} is gone"
        for name, digest in files:
            with open(os.path.join(root, name), "rb") as f:
                assert sha(f.read()) == digest, f"fsync'ed file {name} differs after the crash"
        # files the crash interrupted may hold anything, but reading them must not fail
        for d in os.listdir(root):
            for name in os.listdir(os.path.join(root, d)):
                with open(os.path.join(root, d, name), "rb") as f:
                    f.read()
    # the remount saw the crash and deleted the fragments of writes never committed
    assert_fsck_clean(mnt.volume)


# -- bad input ----------------------------------------------------------------------------
def expect_errno(code, fn, *args):
    with pytest.raises(OSError) as e:
        fn(*args)
    assert e.value.errno == code, f"{fn.__name__}{args}: {e.value}, want {errno.errorcode[code]}"


def test_names_over_255_bytes(mnt):
    mp = mnt.mp
    ok255 = "n" * 255
    ok_utf8 = "é" * 127                     # 254 bytes
    long = ["n" * 256, "é" * 128, "n" * 1000]  # 256, 256 and 1000 bytes
    with open(os.path.join(mp, ok255), "w") as f:
        f.write("fine")
    os.mkdir(os.path.join(mp, ok_utf8))
    for name in long:
        p = os.path.join(mp, name)
        expect_errno(errno.ENAMETOOLONG, os.open, p, os.O_WRONLY | os.O_CREAT, 0o644)
        expect_errno(errno.ENAMETOOLONG, os.mkdir, p)
        expect_errno(errno.ENAMETOOLONG, os.symlink, "target", p)
        expect_errno(errno.ENAMETOOLONG, os.rename, os.path.join(mp, ok255), p)
        expect_errno(errno.ENAMETOOLONG, os.link, os.path.join(mp, ok255), p)
        expect_errno(errno.ENAMETOOLONG, os.stat, p)
        expect_errno(errno.ENAMETOOLONG, os.unlink, p)
    assert sorted(os.listdir(mp)) == sorted([ok255, ok_utf8])
    mnt.umount()
    with Mounted(mnt.volume, mnt.mp):
        assert sorted(os.listdir(mp)) == sorted([ok255, ok_utf8])
        with open(os.path.join(mp, ok255)) as f:
            assert f.read() == "fine"
    assert_fsck_clean(mnt.volume)


def test_paths_through_a_file(mnt):
    f = os.path.join(mnt.mp, "plain")
    with open(f, "w") as fh:
        fh.write("x")
    os.symlink("plain", os.path.join(mnt.mp, "link"))
    os.mkdir(os.path.join(mnt.mp, "dir"))
    for base in (f, os.path.join(mnt.mp, "link")):
        p = os.path.join(base, "x")
        expect_errno(errno.ENOTDIR, os.open, p, os.O_WRONLY | os.O_CREAT, 0o644)
        expect_errno(errno.ENOTDIR, os.mkdir, p)
        expect_errno(errno.ENOTDIR, os.stat, p)
        expect_errno(errno.ENOTDIR, os.listdir, base)
        expect_errno(errno.ENOTDIR, os.rename, p, os.path.join(mnt.mp, "y"))
        expect_errno(errno.ENOTDIR, os.rename, os.path.join(mnt.mp, "dir"), p)
    expect_errno(errno.ENOTDIR, os.rmdir, f)
    expect_errno(errno.ENOTDIR, os.rename, os.path.join(mnt.mp, "dir"), f)
    assert sorted(os.listdir(mnt.mp)) == ["dir", "link", "plain"]
    with open(f) as fh:
        assert fh.read() == "x"


def test_mount_of_missing_or_foreign_volume_dir(tmp_path):
    mp = tmp_path / "mp"
    mp.mkdir()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for target, words in ((tmp_path / "missing", "no such"), (foreign, "not a bmfs volume")):
        res = bmfs("mount", mp, "--volume", target, check=False)
        assert res.returncode == 2, (res.returncode, res.stderr)
        assert words in one_line_error(res)
        assert not is_mounted(mp)
    assert not (tmp_path / "missing").exists()
    assert sorted(os.listdir(foreign)) == ["notes.txt"], "bmfs left files in a foreign dir"
    for cmd in (["fsck"], ["status"]):
        res = bmfs(*cmd, tmp_path / "missing", check=False)
        assert res.returncode == 2, (cmd, res.returncode, res.stderr)
        one_line_error(res)


def _volume_format(volume, set_to=None) -> int:
    """The format revision in the volume's settings (after writing ``set_to``, if given:
    a volume made by an older bmfs, in its encoding (tests/oldformat.py), or by a
    newer one)."""
    from oldformat import stored_format, to_previous_format
    if set_to is not None and set_to < 4:
        to_previous_format(volume, set_to)
    elif set_to is not None:
        db = sqlite3.connect(os.path.join(volume, "meta.db"))
        try:
            from bmfs.kv.seal import SEAL_BYTES, seal
            from bmfs.meta import keys
            (v,) = db.execute("SELECT v FROM kv WHERE k=?", (keys.SETTINGS,)).fetchone()
            d = json.loads(v[:-SEAL_BYTES])
            d["format"] = set_to
            db.execute("UPDATE kv SET v=? WHERE k=?",
                       (seal(keys.SETTINGS, json.dumps(d).encode()), keys.SETTINGS))
            db.commit()
        finally:
            db.close()
    return stored_format(volume)[0]


def test_volume_format_revisions(tmp_path):
    """A volume of an earlier format revision is read by status and fsck as it is, and
    upgraded by the first mount (so older bmfs refuses it from then on); one of an
    unknown revision is refused by every command with one line, and nothing in it is
    lost. (tests/test_t6_meta_checksums.py upgrades one with files of every kind.)"""
    from bmfs.meta import keys
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mp.mkdir()
    mkfs(vol)
    assert _volume_format(vol) == keys.FORMAT_REVISION == 4
    with Mounted(vol, mp):
        (mp / "kept").write_bytes(b"x" * 100_000)
    _volume_format(vol, set_to=1)      # as made before fragment revision 2
    assert json.loads(bmfs("status", vol, "--json").stdout)
    assert_fsck_clean(vol)
    assert _volume_format(vol) == 1    # reading it changed nothing
    with Mounted(vol, mp):
        assert (mp / "kept").read_bytes() == b"x" * 100_000
        (mp / "new").write_bytes(b"y" * 100_000)
    assert _volume_format(vol) == 4    # the mount upgraded it
    assert "upgraded to 4" in (vol / "mount.log").read_text()

    _volume_format(vol, set_to=5)      # made by a newer bmfs
    for cmd in (["mount", mp, "--volume", vol], ["fsck", vol], ["fsck", vol, "--repair"],
                ["status", vol], ["repair", vol]):
        res = bmfs(*cmd, check=False)
        assert res.returncode == 2, (cmd, res.returncode, res.stderr)
        assert "format revision 5" in one_line_error(res), cmd
    assert not is_mounted(mp)
    assert _volume_format(vol) == 5
    _volume_format(vol, set_to=4)
    with Mounted(vol, mp):
        assert (mp / "kept").read_bytes() == b"x" * 100_000
        assert (mp / "new").read_bytes() == b"y" * 100_000
    assert_fsck_clean(vol)


def test_write_past_the_maximum_file_size(mnt):
    """Nothing can be written past bmfs.config.MAX_FILE_SIZE; the byte just below it can.

    When the limit is the kernel's own (2**63 - 1) the kernel answers: EFBIG, or EINVAL
    where offset + length overflows."""
    from bmfs.config import MAX_FILE_SIZE
    kernel_limit = MAX_FILE_SIZE >= (1 << 63) - 1
    refused = (errno.EFBIG, errno.EINVAL) if kernel_limit else (errno.EFBIG,)
    p = os.path.join(mnt.mp, "huge")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"start", 0)
        for data, offset in ((b"x", MAX_FILE_SIZE), (b"xy", MAX_FILE_SIZE - 1),
                             (b"x" * 5000, MAX_FILE_SIZE - 100)):
            with pytest.raises(OSError) as e:
                os.pwrite(fd, data, offset)
            assert e.value.errno in refused, (offset, len(data), e.value)
        if not kernel_limit:
            expect_errno(errno.EFBIG, os.ftruncate, fd, MAX_FILE_SIZE + 1)
        os.fsync(fd)
        assert os.fstat(fd).st_size == 5
        # the last byte below the limit is fine (and reads back after a remount)
        assert os.pwrite(fd, b"z", MAX_FILE_SIZE - 1) == 1
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.stat(p).st_size == MAX_FILE_SIZE
    mnt.umount()
    with Mounted(mnt.volume, mnt.mp):
        assert os.stat(p).st_size == MAX_FILE_SIZE
        fd = os.open(p, os.O_RDONLY)
        try:
            assert os.pread(fd, 5, 0) == b"start"
            assert os.pread(fd, 1, MAX_FILE_SIZE - 1) == b"z"
            assert os.pread(fd, 3, MAX_FILE_SIZE - 3) == b"\0\0z"
        finally:
            os.close(fd)
    assert_fsck_clean(mnt.volume)


def test_three_devices_gone_refuses_to_mount_and_loses_nothing(mnt):
    want = write_varied_files(mnt.mp)
    mnt.umount()
    vol = str(mnt.volume)
    gone = [0, 2, 5]
    for n in gone:
        os.rename(os.path.join(vol, f"dev{n}"), os.path.join(vol, f"dev{n}.away"))
    res = bmfs("mount", mnt.mp, "--volume", vol, check=False)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    err = one_line_error(res)
    assert "3 devices" in err and all(f"dev{n}" in err for n in gone), err
    assert not is_mounted(mnt.mp)
    pid = daemon_pid(vol)
    if pid:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for cmd in ("fsck", "status"):
        res = bmfs(cmd, vol, check=False)
        assert res.returncode in (1, 2), (cmd, res.returncode, res.stderr)
        assert "Traceback" not in res.stderr, res.stderr
    for n in gone:
        os.rename(os.path.join(vol, f"dev{n}.away"), os.path.join(vol, f"dev{n}"))
    with Mounted(vol, mnt.mp):
        read_back(mnt.mp, want)
        assert all(d["health"] == "ok" for d in status_json(mnt.mp)["devices"])
    assert_fsck_clean(vol)


def test_background_repair_rebuilds_lost_fragments(volume, tmp_path, monkeypatch):
    """A single-owner mount repairs what reads found missing, without being asked."""
    monkeypatch.setenv("BMFS_REPAIR_ROUNDS", "1")  # every GC round (5 s) instead of 30 s
    data = os.urandom(9 << 20)
    with Mounted(volume, tmp_path / "m") as m:
        with open(f"{m.mp}/f", "wb") as f:
            f.write(data)
        dev2 = os.path.join(str(volume), "dev2")
        lost = {(f.sid, f.idx) for f in on_device(dev2)}
        assert lost
        for f in on_device(dev2):
            lose(f)
        subprocess.run(["sync"])
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")  # read from bmfs, not the kernel's page cache
        assert open(f"{m.mp}/f", "rb").read() == data  # degraded, and the damage is noted
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not lost <= intact_keys(dev2):
            time.sleep(0.5)
        assert lost <= intact_keys(dev2), "the lost fragments were not rebuilt"
    res = fsck(volume, "--full")
    assert res.returncode == 0, res.stdout


# -- bad blocks in several fragments of a stripe; repair that cannot finish --------------
def flip_block(f, row: int) -> None:
    """Invert a byte of payload block ``row`` of the fragment (revision 2: block 0 is
    pyeclib's header, block j >= 1 the 4 KiB from payload offset 80 + 4096 (j - 1))."""
    start, _ = payload_area(f)
    flip(f, start + 80 + 4096 * (row - 1) + 123)


def test_bad_blocks_in_three_fragments_read_and_repair(mnt):
    """One bad 4 KiB block in each of three fragments of a stripe, each at its own
    block row: every read through the mount (4 KiB, whole file) gives the file's
    bytes, `bmfs scrub` and `bmfs repair` bring the volume back (exit 0, fsck --full
    clean). Three bad blocks in one row of a stripe: reads that need them fail with
    EIO (the other 4 KiB reads are right), and repair exits 1 saying why."""
    rng = random.Random(27)
    files = {name: rng.randbytes(4 * MiB) for name in ("read", "scrubbed", "lost")}
    for name, data in files.items():
        with open(os.path.join(mnt.mp, name), "wb") as f:
            f.write(data)
    mnt.umount()
    frags = on_volume(mnt.volume)
    sids = sorted({f.sid for f in frags})
    assert len(sids) == 3
    by = {(f.sid, f.idx): f for f in frags}
    rows = {"read": (3, 100, 200), "scrubbed": (7, 8, 250), "lost": (60, 60, 60)}
    damaged = {}  # stripe of each file, in the order written
    for (name, at), sid in zip(rows.items(), sids):
        for idx, row in enumerate(at):
            flip_block(by[(sid, idx)], row)
        damaged[name] = sid
    with Mounted(mnt.volume, mnt.mp):
        with open(os.path.join(mnt.mp, "read"), "rb") as f:
            assert f.read() == files["read"]  # (which queues the damage it met)
        res = bmfs("repair", mnt.mp, check=False)  # (it said "stripes failed: 1", exit 1)
        assert res.returncode == 0 and "stripes failed: 0" in res.stdout, (res.stdout,
                                                                          res.stderr)
        assert "fragments rebuilt: 3" in res.stdout, res.stdout
        fd = os.open(os.path.join(mnt.mp, "lost"), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # 4 KiB asked, 4 KiB read
        try:
            # row 60 of a fragment holds its bytes [59 x 4 KiB, 60 x 4 KiB); fragment
            # 3's are good
            for off in (0, 58 * 4096, 60 * 4096, MiB + 4096, 3 * MiB + 59 * 4096):
                assert os.pread(fd, 4096, off) == files["lost"][off:off + 4096], off
            for off in (59 * 4096, MiB + 59 * 4096, 2 * MiB + 59 * 4096):
                expect_errno(errno.EIO, os.pread, fd, 4096, off)
        finally:
            os.close(fd)
        expect_errno(errno.EIO, lambda: open(os.path.join(mnt.mp, "lost"), "rb").read())
        res = bmfs("scrub", mnt.mp, "--json", check=False)
        assert res.returncode == 1, (res.stdout, res.stderr)
        report = json.loads(res.stdout)
        assert report["stripes_short"] == 1, report
        assert report["fragments_short"] == {"unreadable": 3}, report
        assert "stripe unreadable" in res.stderr, res.stderr
        # the lost stripe's bytes put back: what was queued reads whole again
        for idx in range(3):
            flip_block(by[(damaged["lost"], idx)], 60)
        res = bmfs("repair", mnt.mp, check=False)
        assert res.returncode == 0, (res.stdout, res.stderr)
        assert "stripes short: 0" in res.stdout, res.stdout
        for name, data in files.items():
            with open(os.path.join(mnt.mp, name), "rb") as f:
                assert f.read() == data, name
    res = fsck(mnt.volume, "--full")
    assert res.returncode == 0, res.stdout
    now = on_volume(mnt.volume)
    assert len(now) == 18 and all(intact(f) for f in now)


def test_repair_that_cannot_restore_redundancy_exits_1_and_says_why(tmp_path):
    """A 4+2 volume of 6 devices that lost one: nowhere to rebuild its fragments, so
    `bmfs repair` exits 1 and says how many stripes are short and why (no device to
    place on); with a seventh device that is full (a tiny tmpfs), the same with
    ENOSPC; --json says it in numbers. (It used to say `stripes failed: 0`, exit 0.)"""
    vol = tmp_path / "vol"
    mkfs(vol)
    data = random.Random(6).randbytes(8 * MiB)
    mp = tmp_path / "mnt"
    with Mounted(vol, mp):
        with open(mp / "f", "wb") as f:
            f.write(data)
    os.rename(vol / "dev3", vol / "dev3.away")
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    with Mounted(vol, mp):
        assert (mp / "f").read_bytes() == data
        res = bmfs("repair", mp, check=False)
        assert res.returncode == 1, (res.stdout, res.stderr)
        err = one_line_error(res)
        assert "2 stripes still short of full redundancy" in err, err
        assert "2 no device to place on" in err, err
        report = json.loads(bmfs("repair", mp, "--json", check=False).stdout)
        assert report["stripes_short"] == 2 and report["fragments_short"] == {"no_device": 2}
        assert status_json(mp)["stripes_short"] == 2  # (bmfs status says so too)
        assert "stripes short of full redundancy: 2" in bmfs("status", mp).stdout
        res = bmfs("scrub", mp, check=False)
        assert res.returncode == 1 and "no device to place on" in res.stderr, res.stderr
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(tiny)],
                       check=True)
        try:
            bmfs("node", "add", tiny / "dev", "-m", mp)
            res = bmfs("repair", mp, "--json", check=False)
            assert res.returncode == 1, (res.stdout, res.stderr)
            report = json.loads(res.stdout)
            assert report["stripes_short"] == 2, report
            assert report["fragments_short"] == {"no_space": 2}, report
            assert "2 ENOSPC" in res.stderr, res.stderr
            assert (mp / "f").read_bytes() == data
        finally:
            mnt_ok = subprocess.run(["umount", str(mp)], capture_output=True)
            subprocess.run(["umount", "-l", str(tiny)], capture_output=True)
            assert mnt_ok.returncode == 0 or not is_mounted(mp)


# -- full devices -------------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    """A small tmpfs (``size=``) for devices that fill up; unmounted afterwards."""
    d = tmp_path / "small"
    d.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_a_failed_store_never_reads_back_as_zeros(small_fs, tmp_path):
    """Devices that fill up under a write-behind file: fsync and close say ENOSPC (every
    fsync, not just the first); on the same mount each read gives the bytes a remount
    shows or EIO, never zeros (nor bytes stored nowhere), before the close and after;
    what the failed stripes stored is deleted at once (the devices hold just the stored
    stripes' fragments), so fsck is clean after a clean unmount (no --repair)."""
    vol, mp = tmp_path / "vol", tmp_path / "mnt"
    # 256 KiB fragments: a stripe is 1 MiB of data, 1.5 MiB on the devices; 4 MiB hold two
    mkfs(vol, "--fragment-size", 256 << 10,
         *[a for i in range(6) for a in ("--device", small_fs / f"d{i}")])
    data = os.urandom(8 * MiB)
    block = 64 << 10
    with Mounted(vol, mp):
        p = mp / "f"
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            for _ in range(3):
                expect_errno(errno.ENOSPC, os.fsync, fd)
            seen = {}  # offset -> the bytes read there, or None for EIO
            for off in range(0, len(data), block):
                try:
                    seen[off] = os.pread(fd, block, off)
                except OSError as e:
                    assert e.errno == errno.EIO, e
                    seen[off] = None
        finally:
            expect_errno(errno.ENOSPC, os.close, fd)
        held = {f.sid for i in range(6) for f in on_device(str(small_fs / f"d{i}"))}
        # (the kernel may keep the size it had until it has dropped the inode: then the
        # bytes past the stored ones read as EIO)
        size_after_close = os.stat(p).st_size
        try:
            after_close = p.read_bytes()
        except OSError as e:
            assert e.errno == errno.EIO, e
            after_close = None
    assert_fsck_clean(vol)
    with Mounted(vol, mp):
        size = os.stat(mp / "f").st_size
        stored = (mp / "f").read_bytes()
    assert 0 < size < len(data) and stored == data[:size]
    assert len(held) == size // MiB  # the devices held only the stored stripes' fragments
    for off, got in seen.items():
        assert got is None or got == stored[off:off + block], f"bytes at {off}"
        assert got is not None or off + block > size, f"EIO at {off}, below {size}"
    assert size_after_close in (size, len(data))
    assert after_close in (stored, None)
    assert_fsck_clean(vol)
