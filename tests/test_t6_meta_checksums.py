"""Level 6: damaged metadata records (bmfs/kv/seal.py) on real mounts.

A byte changed in a stored value, or in a key on disk, is an error for whatever reads
it (EIO, a line in the mount's log, a problem for fsck), never content: not another
file's bytes, not a listing short of names. A metadata database SQLite cannot read
is refused with one line. Volumes of the previous format revision are upgraded by
the first mount, every byte kept.
"""
from __future__ import annotations

import base64
import errno
import json
import os
import shutil
import sqlite3

import pytest

from etcd_cluster import etcd_cluster  # noqa: F401  (the fixture)
from mountutil import Mounted, assert_fsck_clean, bmfs, fsck, is_mounted, mkfs
from oldformat import etcd_to_previous_format, stored_format, to_previous_format

NAMES = [f"f{i:02d}" for i in range(53)]


def _fill(mp) -> None:
    """Small files (their data inline in the metadata) and a directory of 53 names."""
    (mp / "g").write_text("text file\n")
    (mp / "h").write_text("another one\n")
    (mp / "dir").mkdir()
    for n in NAMES:
        (mp / "dir" / n).write_text(n)


def _expect_eio(fn, *args):
    with pytest.raises(OSError) as e:
        fn(*args)
    assert e.value.errno == errno.EIO, e.value


def _check_damage_seen(vol, mp, *, listing: bool) -> None:
    """Mounted: g's content is EIO, h reads back; the listing of dir (if ``listing``
    was damaged) is EIO, not short; the mount's log names the damage."""
    with Mounted(vol, mp):
        _expect_eio((mp / "g").read_bytes)
        assert (mp / "h").read_text() == "another one\n"
        if listing:
            _expect_eio(os.listdir, mp / "dir")
        else:
            assert sorted(os.listdir(mp / "dir")) == NAMES
    log = (vol / "mount.log").read_text()
    assert "damaged metadata record" in log or "is out of order" in log, log[-2000:]


def _fsck_names_damage(vol, words: str) -> None:
    res = fsck(vol, "--full")
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr
    assert words in res.stdout, res.stdout


def _sqlite_rows(vol):
    db = sqlite3.connect(vol / "meta.db")
    try:
        return db.execute("SELECT k, v FROM kv").fetchall()
    finally:
        db.close()


def _sqlite_update(vol, key: bytes, value: bytes) -> None:
    db = sqlite3.connect(vol / "meta.db")
    try:
        db.execute("UPDATE kv SET v=? WHERE k=?", (value, key))
        db.commit()
    finally:
        db.close()


def _sqlite_move(vol, key: bytes, new_key: bytes) -> None:
    """The record of ``key`` now under ``new_key`` (its value unchanged)."""
    db = sqlite3.connect(vol / "meta.db")
    try:
        assert db.execute("UPDATE kv SET k=? WHERE k=?", (new_key, key)).rowcount == 1
        db.commit()
    finally:
        db.close()


def _flip_in(value: bytes, old: bytes, new: bytes) -> bytes:
    assert value.count(old) == 1, value
    return value.replace(old, new)


def test_flipped_value_in_sqlite_is_eio_and_fsck_names_it(tmp_path):
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol)
    with Mounted(vol, mp):
        _fill(mp)
    rows = _sqlite_rows(vol)
    # g's data lives inline in its stripe record: "text file" becomes "text File"
    (key, value), = [(k, v) for k, v in rows if b"text file" in v]
    _sqlite_update(vol, key, _flip_in(value, b"text file", b"text File"))
    # one directory entry's value (the child's inode number) changes by one bit
    (dkey, dvalue), = [(k, v) for k, v in rows if k.startswith(b"d/") and b"/f08@" in k]
    _sqlite_update(vol, dkey, bytes([dvalue[0] ^ 0x01, *dvalue[1:]]))
    _check_damage_seen(vol, mp, listing=True)
    _fsck_names_damage(vol, f"metadata record {key!r} fails its checksum")
    _fsck_names_damage(vol, f"metadata record {dkey!r} fails its checksum")


def test_damaged_inode_in_a_listing_fails_it(tmp_path):
    """An entry whose inode record is damaged: the listing (READDIRPLUS reads every
    entry's attributes) fails, not a listing without that name; stat of it is EIO."""
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol)
    with Mounted(vol, mp):
        _fill(mp)
        ino = os.stat(mp / "dir" / "f20").st_ino
    key = b"i/%016x@00000001" % ino
    value = dict(_sqlite_rows(vol))[key]
    _sqlite_update(vol, key, value[:-1] + bytes([value[-1] ^ 0x80]))
    with Mounted(vol, mp):
        _expect_eio(os.listdir, mp / "dir")
        _expect_eio(os.stat, mp / "dir" / "f20")
        assert (mp / "dir" / "f21").read_text() == "f21"
    _fsck_names_damage(vol, f"metadata record {key!r} fails its checksum")


def test_damaged_records_a_volume_needs_to_open(tmp_path):
    """A damaged device or branch record: mount and status refuse with one line naming
    it; fsck reports it as a problem (exit 1); a damaged root inode mounts, and the
    root is EIO."""
    base, mp = tmp_path / "base", tmp_path / "mp"
    mkfs(base)
    with Mounted(base, mp):
        _fill(mp)
    for key in (b"v/dev/0000", b"b/main", b"i/%016x@00000001" % 1):
        vol = tmp_path / key.decode().replace("/", "_")
        shutil.copytree(base, vol)
        info = json.loads((vol / "volume.json").read_text())
        info["meta"] = f"sqlite:{vol}/meta.db"
        (vol / "volume.json").write_text(json.dumps(info))
        value = dict(_sqlite_rows(vol))[key]
        _sqlite_update(vol, key, value[:-1] + bytes([value[-1] ^ 0x04]))
        _fsck_names_damage(vol, f"metadata record {key!r} fails its checksum")
        if key.startswith(b"i/"):
            with Mounted(vol, mp):
                _expect_eio(os.listdir, mp)
            continue
        for cmd in (["mount", mp, "--volume", vol], ["status", vol]):
            res = bmfs(*cmd, check=False)
            assert res.returncode == 2, (cmd, res.returncode, res.stderr)
            assert res.stderr.strip().splitlines() == [
                f"bmfs: damaged metadata record {key!r}: it fails its checksum"], res.stderr
        assert not is_mounted(mp)


def test_value_moved_under_another_key_is_detected(tmp_path):
    """The checksum covers the key: h's stripe record copied over g's, byte for byte
    a valid record, gives EIO for g instead of h's text."""
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol)
    with Mounted(vol, mp):
        _fill(mp)
    rows = dict(_sqlite_rows(vol))
    g_key = next(k for k, v in rows.items() if b"text file" in v)
    h_val = next(v for k, v in rows.items() if b"another one" in v)
    _sqlite_update(vol, g_key, h_val)
    _check_damage_seen(vol, mp, listing=False)
    _fsck_names_damage(vol, f"metadata record {g_key!r} fails its checksum")


def test_key_changed_on_disk_is_a_listing_error_not_a_short_listing(tmp_path):
    """A byte of a directory entry's key changed in the database file itself (not
    through SQLite): SQLite's scan would stop at it, 8 names of 53; the listing fails
    instead, and fsck names the record and SQLite's own check the damage."""
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol)
    with Mounted(vol, mp):
        _fill(mp)
        dir_ino = os.stat(mp / "dir").st_ino
    key = next(k for k, _ in _sqlite_rows(vol) if k.startswith(b"d/") and b"/f08@" in k)
    parent = key[2:18]
    assert int(parent, 16) == dir_ino or True  # (the FUSE inode may carry a view id)
    bigger = parent[:-1] + bytes([parent[-1] + 1])
    raw = (vol / "meta.db").read_bytes()
    assert raw.count(key) >= 1
    at = raw.index(key) + 2 + 15  # the parent number's last hex digit, in place
    raw = raw[:at] + bigger[-1:] + raw[at + 1:]
    (vol / "meta.db").write_bytes(raw)
    with Mounted(vol, mp):
        _expect_eio(os.listdir, mp / "dir")
        assert (mp / "g").read_text() == "text file\n"
    res = fsck(vol, "--full")
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr
    assert "fails its checksum" in res.stdout, res.stdout


def test_entry_whose_inode_record_is_gone_is_eio_not_a_missing_name(tmp_path):
    """A directory entry whose inode record is not under its key (a changed byte in
    the key's layer number moves the record where no reader looks): the listing fails
    and stat of the name is EIO, not a listing without the name and ENOENT (a name
    removed by another mount since the listing began is still skipped)."""
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol)
    with Mounted(vol, mp):
        _fill(mp)
        ino = os.stat(mp / "dir" / "f08").st_ino
    _sqlite_move(vol, b"i/%016x@00000001" % ino, b"i/%016x@00040001" % ino)
    with Mounted(vol, mp):
        _expect_eio(os.listdir, mp / "dir")
        _expect_eio(os.stat, mp / "dir" / "f08")
        assert (mp / "dir" / "f09").read_text() == "f09"
    assert "damaged" in (vol / "mount.log").read_text()
    res = fsck(vol, "--full")
    assert res.returncode == 1, (res.stdout, res.stderr)


def test_symlink_whose_target_record_is_gone_is_eio(tmp_path):
    """A symlink whose target record is not under its key (a changed byte in the key):
    readlink is EIO and the mount's log says so, not EINVAL ("not a symlink")."""
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol)
    with Mounted(vol, mp):
        os.symlink("g", mp / "ln")
        ino = os.lstat(mp / "ln").st_ino
    _sqlite_move(vol, b"l/%016x@00000001" % ino, b"l/%016x@00000101" % ino)
    with Mounted(vol, mp):
        assert os.path.islink(mp / "ln")
        _expect_eio(os.readlink, mp / "ln")
    assert "has no target record" in (vol / "mount.log").read_text()


def test_file_whose_stripe_record_is_gone_is_eio_without_internal_error(tmp_path):
    """A file whose stripe record is not under its key: reading it and removing it are
    EIO with a line in the mount's log, not an internal error (a traceback)."""
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol)
    with Mounted(vol, mp):
        (mp / "big").write_bytes(os.urandom(300_000))
    (key,) = [k for k, _ in _sqlite_rows(vol) if k.startswith(b"t/")]
    _sqlite_move(vol, key, b"T" + key[1:])
    with Mounted(vol, mp):
        _expect_eio((mp / "big").read_bytes)
        _expect_eio(os.unlink, mp / "big")
    log = (vol / "mount.log").read_text()
    assert "Traceback" not in log and "internal error" not in log, log[-2000:]
    assert "is missing from the metadata" in log, log[-2000:]


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_malformed_database_is_one_line(tmp_path, damage):
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol)
    with Mounted(vol, mp):
        _fill(mp)
    raw = (vol / "meta.db").read_bytes()
    if damage == "header":
        raw = b"\x5a" * 100 + raw[100:]
    else:
        raw = raw[:len(raw) // 2]
    (vol / "meta.db").write_bytes(raw)
    for cmd in (["fsck", vol], ["fsck", vol, "--full"], ["mount", mp, "--volume", vol]):
        res = bmfs(*cmd, check=False)
        assert res.returncode in (1, 2), (cmd, res.returncode, res.stderr)
        out = res.stdout + res.stderr
        assert "Traceback" not in out, out
        assert "meta.db" in out, out
        if res.returncode == 2:
            assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not is_mounted(mp)


def test_flipped_value_in_etcd_is_eio_and_fsck_names_it(etcd_cluster, tmp_path):
    etcd_cluster.wipe()
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol, "--meta", etcd_cluster.url)
    with Mounted(vol, mp):
        _fill(mp)
    every = base64.b64encode(b"\0").decode()
    kvs = etcd_cluster.post(0, "/v3/kv/range", {"key": every, "range_end": every}).get("kvs", [])
    rows = {base64.b64decode(r["key"]): base64.b64decode(r.get("value", "")) for r in kvs}

    def put(k, v):
        etcd_cluster.post(0, "/v3/kv/put", {"key": base64.b64encode(k).decode(),
                                            "value": base64.b64encode(v).decode()})
    key = next(k for k, v in rows.items() if b"text file" in v)
    put(key, _flip_in(rows[key], b"text file", b"text File"))
    dkey = next(k for k in rows if k.startswith(b"d/") and b"/f08@" in k)
    put(dkey, bytes([rows[dkey][0] ^ 0x01, *rows[dkey][1:]]))
    _check_damage_seen(vol, mp, listing=True)
    _fsck_names_damage(vol, f"metadata record {key!r} fails its checksum")
    _fsck_names_damage(vol, f"metadata record {dkey!r} fails its checksum")


def _moved_key(key: bytes, part: str) -> bytes:
    """``key`` (a c/ or x/ key) with one byte changed: in its inode number (the
    record leaves the file's range) or after it (an index or name within the range)."""
    at = 2 if part == "ino" else key.index(b"@") - 1
    return key[:at] + bytes([key[at] ^ 0x01]) + key[at + 1:]


def _fill_counted(mp) -> None:
    _fill(mp)
    os.setxattr(mp / "g", "user.a", b"1")
    os.setxattr(mp / "g", "user.bm.type", b"npy")
    with open(mp / "sparse", "wb") as f:  # chunks 0 and 1 holes, 2 written
        f.truncate(200 << 20)
        f.seek(150 << 20)
        f.write(b"far out")


def _holes_still_read_zeros(mp) -> None:
    with open(mp / "sparse", "rb") as f:
        assert f.read(4096) == b"\0" * 4096
        f.seek(100 << 20)
        assert f.read(4096) == b"\0" * 4096
        f.seek(150 << 20)
        assert f.read(7) == b"far out"


def _sqlite_moved(tmp_path, prefix: bytes, part: str):
    """A volume filled (_fill_counted) whose first record of g under ``prefix`` (``%x``
    for g's inode number) was moved (_moved_key); (vol, mp, g's ino, the new key)."""
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol)
    with Mounted(vol, mp):
        _fill_counted(mp)
        g_ino = os.stat(mp / "g").st_ino
    key = next(k for k, _ in _sqlite_rows(vol) if k.startswith(prefix % g_ino))
    moved = _moved_key(key, part)
    _sqlite_move(vol, key, moved)
    return vol, mp, g_ino, moved


def _damage_said(vol, g_ino, counted: str, part: str, moved: bytes) -> None:
    """The mount's log and fsck --full say it (a record moved within the file's range
    fails its checksum when the count is checked)."""
    log = (vol / "mount.log").read_text()
    said = f"inode {g_ino} counts {counted}" if part == "ino" else \
        f"damaged metadata record {moved!r}"
    assert said in log, log[-2000:]
    res = fsck(vol, "--full")
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr
    assert f"metadata record {moved!r} fails its checksum" in res.stdout, res.stdout


@pytest.mark.parametrize("part", ["ino", "index"])
def test_chunk_key_changed_is_eio_not_zeros(tmp_path, part):
    """A byte changed in the key of a file's chunk record: the record moves where no
    read of the file looks, and the file read zeros. The inode counts its chunk
    records, so the read is EIO (and a line in the log); a sparse file's holes still
    read zeros; fsck --full reports it."""
    vol, mp, g_ino, moved = _sqlite_moved(tmp_path, b"c/%016x/", part)
    with Mounted(vol, mp):
        _expect_eio((mp / "g").read_bytes)
        assert (mp / "h").read_text() == "another one\n"
        _holes_still_read_zeros(mp)
    _damage_said(vol, g_ino, "1 chunk records, 0 found", part, moved)


@pytest.mark.parametrize("part", ["ino", "name"])
def test_xattr_key_changed_is_eio_not_a_missing_attribute(tmp_path, part):
    """The same for an xattr record: getxattr of the name, listxattr and removexattr
    are EIO, not ENODATA or a short list; the other attribute still reads."""
    vol, mp, g_ino, moved = _sqlite_moved(tmp_path, b"x/%016x/user.bm.type", part)
    with Mounted(vol, mp):
        _expect_eio(os.getxattr, mp / "g", "user.bm.type")
        _expect_eio(os.listxattr, mp / "g")
        _expect_eio(os.removexattr, mp / "g", "user.bm.type")
        assert (mp / "g").read_text() == "text file\n"
        if part == "ino":  # (a name changed within the range fails its checksum too)
            assert os.getxattr(mp / "g", "user.a") == b"1"
        with pytest.raises(OSError) as e:  # an attribute never set: still ENODATA
            os.getxattr(mp / "h", "user.none")
        assert e.value.errno == errno.ENODATA
    _damage_said(vol, g_ino, "2 xattr records", part, moved)


def test_chunk_and_xattr_keys_changed_in_etcd_are_eio(etcd_cluster, tmp_path):
    """The same on etcd: g's chunk record and one of its xattrs moved to keys of
    another inode number: reading g and getxattr are EIO, holes still read zeros."""
    etcd_cluster.wipe()
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol, "--meta", etcd_cluster.url)
    with Mounted(vol, mp):
        _fill_counted(mp)
        g_ino = os.stat(mp / "g").st_ino
    every = base64.b64encode(b"\0").decode()
    kvs = etcd_cluster.post(0, "/v3/kv/range", {"key": every, "range_end": every}).get("kvs", [])
    rows = {base64.b64decode(r["key"]): base64.b64decode(r.get("value", "")) for r in kvs}
    for prefix in (b"c/%016x/" % g_ino, b"x/%016x/user.bm.type" % g_ino):
        key = next(k for k in rows if k.startswith(prefix))
        etcd_cluster.post(0, "/v3/kv/deleterange", {"key": base64.b64encode(key).decode()})
        etcd_cluster.post(0, "/v3/kv/put", {
            "key": base64.b64encode(_moved_key(key, "ino")).decode(),
            "value": base64.b64encode(rows[key]).decode()})
    with Mounted(vol, mp):
        _expect_eio((mp / "g").read_bytes)
        _expect_eio(os.getxattr, mp / "g", "user.bm.type")
        assert os.getxattr(mp / "g", "user.a") == b"1"
        assert (mp / "h").read_text() == "another one\n"
        _holes_still_read_zeros(mp)
    log = (vol / "mount.log").read_text()
    assert f"inode {g_ino} counts 1 chunk records, 0 found" in log, log[-2000:]
    assert f"inode {g_ino} counts 2 xattr records, 1 found" in log, log[-2000:]


@pytest.mark.parametrize("fmt", [2, 3])
def test_previous_format_is_upgraded_by_mount(tmp_path, fmt):
    """A volume in the encoding of format revision 2 (no checksums) or 3 (no record
    counts in inodes): status and fsck read it as it is; the first mount seals every
    record (from 2) and raises it to 4; every file reads back byte for byte, and fsck
    --full is clean."""
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol)
    big = os.urandom(300_000)
    with Mounted(vol, mp) as m:
        _fill(mp)
        (mp / "big").write_bytes(big)
        os.symlink("g", mp / "link")
        os.setxattr(mp / "g", "user.note", b"kept")
        assert m.ctl("snapshot_create", name="s1")["ok"]
        (mp / "h").write_text("changed after the snapshot\n")
    n = to_previous_format(vol, fmt)
    assert n > 60 and stored_format(vol) == (fmt, fmt >= 3)
    assert json.loads(bmfs("status", vol, "--json").stdout)
    res = fsck(vol)
    assert res.returncode == 0 and ("carry no checksums" in res.stdout) == (fmt < 3), \
        res.stdout
    assert stored_format(vol) == (fmt, fmt >= 3)  # reading it changed nothing
    with Mounted(vol, mp):
        assert (mp / "g").read_text() == "text file\n"
        assert (mp / "h").read_text() == "changed after the snapshot\n"
        assert (mp / ".bm" / "snapshots" / "s1" / "h").read_text() == "another one\n"
        assert (mp / "big").read_bytes() == big
        assert os.readlink(mp / "link") == "g"
        assert os.getxattr(mp / "g", "user.note") == b"kept"
        assert sorted(os.listdir(mp / "dir")) == NAMES
        assert all((mp / "dir" / n).read_text() == n for n in NAMES)
        (mp / "new").write_text("after the upgrade\n")
    assert stored_format(vol) == (4, True)
    assert "upgraded to 4" in (vol / "mount.log").read_text()
    res = fsck(vol, "--full")
    assert res.returncode == 0 and "carry no checksums" not in res.stdout, res.stdout
    assert_fsck_clean(vol)


def test_previous_format_on_etcd_is_upgraded_by_mount(etcd_cluster, tmp_path):
    """The same on etcd: a volume in the revision 2 encoding is sealed by the first
    mount (in transactions within etcd's default limits), every file byte-exact."""
    etcd_cluster.wipe()
    vol, mp = tmp_path / "vol", tmp_path / "mp"
    mkfs(vol, "--meta", etcd_cluster.url)
    big = os.urandom(200_000)
    with Mounted(vol, mp):
        _fill(mp)
        (mp / "big").write_bytes(big)
    assert etcd_to_previous_format(etcd_cluster, 2) > 60
    res = fsck(vol)
    assert res.returncode == 0 and "carry no checksums" in res.stdout, res.stdout
    with Mounted(vol, mp):
        assert (mp / "g").read_text() == "text file\n"
        assert (mp / "big").read_bytes() == big
        assert sorted(os.listdir(mp / "dir")) == NAMES
        assert all((mp / "dir" / n).read_text() == n for n in NAMES)
    assert "upgraded to 4" in (vol / "mount.log").read_text()
    res = fsck(vol, "--full")
    assert res.returncode == 0 and "carry no checksums" not in res.stdout, res.stdout
