"""Level 3: POSIX rules and branches in the vfs, without FUSE; each test ends in fsck.

Every test runs on each metadata engine (``engine``): sqlite, memory and a real
3-member etcd cluster (tests/etcd_cluster.py; skipped where etcd is not installed).
On etcd, where every metadata operation is a round trip to the cluster, a
representative subset runs (ETCD_TESTS); SQLITE_ONLY make and reopen a volume of
their own.
"""
import errno
import os
import stat

import pytest
import trio

from bmfs.errors import FsError
from bmfs.meta import branches as br
from bmfs.meta import diff, keys, layer_gc, merge, trees
from bmfs.meta import namespace as ns
from bmfs.format.records import Inode
from bmfs.store.file import FileStore
from bmfs.vfs.fs import FileSystem
from bmfs.volume.fsck import fsck
from bmfs.vfs.views import CTL_BRANCHES, CTL_VIEW, VIEW_SHIFT
from bmfs.volume.volume import Volume, mkfs
from etcd_cluster import etcd_cluster  # noqa: F401  (the fixture)
from vfsutil import META, open_fs, read_file, write_file

ROOT = 1
ETCD_TESTS = {
    "test_create_read_overwrite_truncate", "test_names_dirs_links", "test_rename_rules",
    "test_unlink_open_file_keeps_data", "test_xattrs", "test_branch_isolation_and_gc",
    "test_merge_and_diff", "test_clean_three_way_merge_and_reset",
    "test_deleting_a_snapshot_gives_back_what_only_it_held",
    "test_prune_keeps_an_open_unlinked_file", "test_listings_have_dot_and_dotdot",
    "test_fsck_finds_data_past_a_files_size", "test_times_written_back_to_a_freed_file",
}
SQLITE_ONLY = {"test_files_a_crashed_mount_held_unlinked_are_freed_together"}


def pytest_generate_tests(metafunc):
    name = metafunc.function.__name__
    engines = ["sqlite"] if name in SQLITE_ONLY else \
        ["sqlite", "memory"] + (["etcd"] if name in ETCD_TESTS else [])
    metafunc.parametrize("engine", engines, indirect=True)


@pytest.fixture(autouse=True)
def engine(request, tmp_path):
    """The metadata engine the test's volumes are made on (vfsutil.META)."""
    if request.param == "memory":
        url = f"memory:{tmp_path}"
    elif request.param == "etcd":
        cluster = request.getfixturevalue("etcd_cluster")
        cluster.wipe()
        url = cluster.url
    else:
        url = None
    token = META.set(url)
    try:
        yield request.param
    finally:
        META.reset(token)


def run(fn, tmp_path, **kw):
    async def main():
        async with open_fs(tmp_path / "vol", **kw) as fs:
            await fn(fs)
    trio.run(main)


def raises(code):
    class _Ctx:
        def __enter__(self):
            return self

        def __exit__(self, t, e, tb):
            assert t is not None, f"expected errno {errno.errorcode[code]}"
            assert issubclass(t, FsError) and e.errno == code, f"got {t.__name__}: {e}"
            return True
    return _Ctx()


def test_create_read_overwrite_truncate(tmp_path):
    async def t(fs):
        data = os.urandom(9 << 20)
        ino = await write_file(fs, ROOT, b"f", data)
        assert await read_file(fs, ino) == data
        fh = await fs.open(ino, os.O_RDWR)
        await fs.files.write(fh, 5 << 20, b"X" * 100)
        await fs.files.release(fh)
        want = data[:5 << 20] + b"X" * 100 + data[(5 << 20) + 100:]
        assert await read_file(fs, ino) == want
        await fs.setattr(ino, size=1000)
        await fs.setattr(ino, size=3000)
        assert await read_file(fs, ino) == want[:1000] + bytes(2000)
        assert (await fs.getattr(ino)).size == 3000
    run(t, tmp_path)


def test_sparse_past_4g(tmp_path):
    async def t(fs):
        fh, a = await fs.create_file(ROOT, b"sparse", 0o644, os.O_RDWR, 0, 0)
        await fs.files.write(fh, 5 << 30, b"end")
        await fs.files.write(fh, 10, b"start")
        assert await fs.files.read(fh, 5 << 30, 10) == b"end"
        assert await fs.files.read(fh, (5 << 30) - 4, 8) == bytes(4) + b"end"
        assert await fs.files.read(fh, 0, 20) == bytes(10) + b"start" + bytes(5)
        await fs.files.release(fh)
        assert (await fs.getattr(a.ino)).size == (5 << 30) + 3
    run(t, tmp_path)


def test_names_dirs_links(tmp_path):
    async def t(fs):
        with raises(errno.ENAMETOOLONG):
            await fs.mkdir(ROOT, b"x" * 256, 0o755, 0, 0)
        d = await fs.mkdir(ROOT, b"d" * 255, 0o755, 0, 0)
        f = await write_file(fs, d.ino, b"f", b"hi")
        with raises(errno.ENOTDIR):
            await fs.lookup(f, b"x")
        with raises(errno.EEXIST):
            await fs.mkdir(ROOT, b"d" * 255, 0o755, 0, 0)
        with raises(errno.ENOTEMPTY):
            await fs.rmdir(ROOT, b"d" * 255)
        await fs.link(f, ROOT, b"hard")
        assert (await fs.getattr(f)).nlink == 2
        await fs.unlink(d.ino, b"f")
        assert (await fs.getattr(f)).nlink == 1
        assert await read_file(fs, f) == b"hi"
        await fs.rmdir(ROOT, b"d" * 255)
        s = await fs.symlink(ROOT, b"ln", b"/some/where", 0, 0)
        assert await fs.readlink(s.ino) == b"/some/where"
        assert (await fs.getattr(ROOT)).nlink == 2
    run(t, tmp_path)


def test_rename_rules(tmp_path):
    async def t(fs):
        a = await fs.mkdir(ROOT, b"a", 0o755, 0, 0)
        b = await fs.mkdir(a.ino, b"b", 0o755, 0, 0)
        with raises(errno.EINVAL):
            await fs.rename(ROOT, b"a", b.ino, b"a")
        f1 = await write_file(fs, ROOT, b"f1", b"one")
        await write_file(fs, ROOT, b"f2", b"two")
        with raises(errno.EEXIST):
            await fs.rename(ROOT, b"f1", ROOT, b"f2", 1)  # RENAME_NOREPLACE
        await fs.rename(ROOT, b"f1", ROOT, b"f2", 2)      # RENAME_EXCHANGE
        assert (await fs.lookup(ROOT, b"f2")).ino == f1
        await fs.rename(ROOT, b"f2", a.ino, b"moved")     # across dirs, replacing nothing
        await fs.rename(ROOT, b"f1", a.ino, b"moved")     # replace
        assert await read_file(fs, (await fs.lookup(a.ino, b"moved")).ino) == b"two"
        with raises(errno.EISDIR):
            await write_file(fs, ROOT, b"x", b"")
            await fs.rename(ROOT, b"x", a.ino, b"b")
        await fs.rename(a.ino, b"b", ROOT, b"b2")           # directory across parents
        assert (await fs.getattr(a.ino)).nlink == 2
        assert (await fs.getattr(ROOT)).nlink == 4
    run(t, tmp_path)


def test_unlink_open_file_keeps_data(tmp_path):
    async def t(fs):
        data = os.urandom(100_000)
        ino = await write_file(fs, ROOT, b"f", data)
        fh = await fs.open(ino, os.O_RDONLY)
        await fs.unlink(ROOT, b"f")
        assert await fs.files.read(fh, 0, 200_000) == data
        await fs.files.release(fh)
        with raises(errno.ENOENT):
            await fs.getattr(ino)
    run(t, tmp_path)


def test_times_written_back_to_a_freed_inode(tmp_path):
    """The kernel writes the times it caches back to inodes it still holds, freed or
    not: accepted (nothing to keep) for a freed one, whether freed at unlink or at its
    last close; any other change of a freed inode is ENOENT, as is looking at it."""
    async def t(fs):
        gone = await write_file(fs, ROOT, b"a", b"x" * 5000, mode=0o640)
        await fs.unlink(ROOT, b"a")
        held = await write_file(fs, ROOT, b"b", b"y")
        fh = await fs.open(held, os.O_RDONLY)
        await fs.unlink(ROOT, b"b")
        await fs.files.release(fh)
        for ino in (gone, held):
            a = await fs.setattr(ino, mtime_ns=5, ctime_ns=6)
            assert (a.ino, a.nlink) == (ino, 0)
            with raises(errno.ENOENT):
                await fs.setattr(ino, mode=0o600)
            with raises(errno.ENOENT):
                await fs.getattr(ino)
        assert stat.S_IMODE((await fs.setattr(gone, atime_ns=1)).mode) == 0o640
        kept = await write_file(fs, ROOT, b"c", b"z")
        assert (await fs.setattr(kept, mtime_ns=7)).mtime_ns == 7
        assert (await fs.getattr(kept)).mtime_ns == 7
    run(t, tmp_path)


def test_many_small_writes_scattered_over_a_chunk(tmp_path):
    """Thousands of small writes scattered over one chunk of a sparse file (a
    database's or a torrent's file; stress-ng --fpunch), each stored as a slice of its
    own: every one lands, the file reads back exact, and the mount keeps answering.
    Compacting the chunk's slice list was quadratic in its length (the holes between
    the writes split what was left to paint), at every write: 500 writes took 6 s,
    1,000 took 42 s, and stress-ng hung the mount."""
    import random
    n, size = 1500, 4 << 20

    async def t(fs):
        rng = random.Random(7)
        model = bytearray(size)
        fh, a = await fs.create_file(ROOT, b"f", 0o644, os.O_RDWR, 0, 0)
        await fs.files.write(fh, size - 1, b"\0")  # sparse: holes between the writes
        with trio.fail_after(120):  # (hours before the fix; seconds after)
            for k in range(n):
                off = rng.randrange(size - 64) if k % 2 else rng.randrange(size // 4096) * 4096
                data = rng.randbytes(rng.randrange(1, 64))
                await fs.files.write(fh, off, data)
                model[off:off + len(data)] = data
                if k % 300 == 299:
                    await fs.files.flush(fh)
                    assert await fs.files.read(fh, 0, size) == model
            await fs.files.release(fh)
        assert await read_file(fs, a.ino) == model
    run(t, tmp_path)


def test_xattrs(tmp_path):
    async def t(fs):
        ino = await write_file(fs, ROOT, b"f", b"")
        await fs.setxattr(ino, b"user.bm.type", b"npy")
        assert await fs.getxattr(ino, b"user.bm.type") == b"npy"
        with raises(errno.EEXIST):
            await fs.setxattr(ino, b"user.bm.type", b"x", 1)   # XATTR_CREATE
        with raises(errno.ENODATA):
            await fs.setxattr(ino, b"user.other", b"x", 2)     # XATTR_REPLACE
        with raises(errno.EOPNOTSUPP):
            await fs.setxattr(ino, b"security.capability", b"x")
        assert await fs.listxattr(ino) == [b"user.bm.type"]
        await fs.removexattr(ino, b"user.bm.type")
        with raises(errno.ENODATA):
            await fs.getxattr(ino, b"user.bm.type")
    run(t, tmp_path)


def test_large_directory(tmp_path):
    async def t(fs):
        d = await fs.mkdir(ROOT, b"big", 0o755, 0, 0)
        for i in range(3000):
            await fs.mknod(d.ino, b"f%05d" % i, 0o100644, 0, 0, 0)
        names = [n for n, _ in await fs.readdir(d.ino)]
        assert names == [b"f%05d" % i for i in range(3000)]
    run(t, tmp_path)


async def _bulk_tree(fs, n):
    """n files in one transaction, written through the namespace functions."""
    view = fs.views.get(0)

    async def fn(txn, chain):
        d = await fs._alloc_ino()
        await ns.put_inode(txn, chain, d, Inode(0o40755, nlink=2, parent=ROOT))
        await ns.link_entry(txn, chain, ROOT, b"tree%d" % n, d, 0o40755)
        root = await ns.get_inode(txn, chain, ROOT)
        root.nlink += 1
        await ns.put_inode(txn, chain, ROOT, root)
        for i in range(n):
            ino = await fs._alloc_ino()
            await ns.put_inode(txn, chain, ino, Inode(0o100644))
            await ns.link_entry(txn, chain, d, b"%d" % i, ino, 0o100644)
    await fs.mutate(view, fn)


def test_branch_creation_is_o1(tmp_path):
    async def t(fs):
        work = {}
        for n in (10, 100_000):
            await _bulk_tree(fs, n)
            r0, w0 = fs.kv.keys_read, fs.kv.keys_written
            await br.op_branch_create(fs.kv, f"b{n}")
            await br.op_snapshot_create(fs.kv, f"s{n}")
            work[n] = (fs.kv.keys_read - r0, fs.kv.keys_written - w0)
            await fs.views.refresh()
        assert work[10] == work[100_000], work
        assert work[10][1] <= 10
    run(t, tmp_path)


def test_branch_isolation_and_gc(tmp_path):
    async def t(fs):
        data = os.urandom(5 << 20)
        ino = await write_file(fs, ROOT, b"f", data)
        await br.op_branch_create(fs.kv, "exp")
        await fs.views.refresh()
        exp = await fs.views.add("branch", "exp")
        eroot = exp.id << 48 | ROOT
        einode = (await fs.lookup(eroot, b"f")).ino
        fh = await fs.open(einode, os.O_RDWR)
        await fs.files.write(fh, 0, b"branch!")
        await fs.files.release(fh)
        assert await read_file(fs, ino) == data
        assert (await read_file(fs, einode))[:7] == b"branch!"
        await write_file(fs, eroot, b"only-in-exp", b"x")
        with raises(errno.ENOENT):
            await fs.lookup(ROOT, b"only-in-exp")
        with raises(errno.EXDEV):
            await fs.rename(eroot, b"only-in-exp", ROOT, b"moved")
        await br.op_snapshot_create(fs.kv, "snap")
        await fs.views.refresh()
        snap = await fs.views.add("snapshot", "snap")
        with raises(errno.EROFS):
            await fs.mkdir(snap.id << 48 | ROOT, b"d", 0o755, 0, 0)
        stripes_before = len(await fs.kv.range(b"t/", b"t0"))
        await br.op_branch_delete(fs.kv, "exp")
        await fs.views.refresh()
        await fs.volume_gc()
        assert len(await fs.kv.range(b"t/", b"t0")) < stripes_before
        assert await read_file(fs, ino) == data
    run(t, tmp_path)


def test_merge_and_diff(tmp_path):
    async def t(fs):
        await write_file(fs, ROOT, b"a", b"base")
        await write_file(fs, ROOT, b"b", b"base")
        await br.op_branch_create(fs.kv, "x")
        await fs.views.refresh()
        x = await fs.views.add("branch", "x")
        xr = x.id << 48 | ROOT
        fh = await fs.open((await fs.lookup(xr, b"a")).ino, os.O_RDWR | os.O_TRUNC)
        await fs.files.write(fh, 0, b"from x")
        await fs.files.release(fh)
        await write_file(fs, xr, b"new", b"n")
        d = await diff.op_diff(fs.kv, "main", "x")
        assert d == {"added": ["/new"], "removed": [], "changed": ["/a"]}
        # main changes b and a: a conflicts, new and b merge cleanly
        fh = await fs.open((await fs.lookup(ROOT, b"b")).ino, os.O_RDWR | os.O_TRUNC)
        await fs.files.write(fh, 0, b"main b")
        await fs.files.release(fh)
        fh = await fs.open((await fs.lookup(ROOT, b"a")).ino, os.O_RDWR | os.O_TRUNC)
        await fs.files.write(fh, 0, b"main a")
        await fs.files.release(fh)
        with pytest.raises(merge.MergeConflict) as e:
            await merge.op_merge(fs.kv, "x", "main")
        assert e.value.paths == ["/a"]
        with raises(errno.ENOENT):
            await fs.lookup(ROOT, b"new")  # nothing changed
        r = await merge.op_merge(fs.kv, "x", "main", strategy="theirs")
        assert r["result"] == "merged"
        assert await read_file(fs, (await fs.lookup(ROOT, b"a")).ino) == b"from x"
        assert await read_file(fs, (await fs.lookup(ROOT, b"b")).ino) == b"main b"
        assert await read_file(fs, (await fs.lookup(ROOT, b"new")).ino) == b"n"
    run(t, tmp_path)


def test_bad_branch_names(tmp_path):
    async def t(fs):
        for bad in ("", "a/b", "..", "x..y", "-x", "a" * 200, "sp ace"):
            with raises(errno.EINVAL):
                await br.op_branch_create(fs.kv, bad)
        with raises(errno.EPERM):
            await br.op_branch_delete(fs.kv, "main")
        with raises(errno.ENOENT):
            await br.op_branch_create(fs.kv, "ok", source="nope")
    run(t, tmp_path)


def test_clean_three_way_merge_and_reset(tmp_path):
    async def t(fs):
        a = await write_file(fs, ROOT, b"a", b"base a")
        await write_file(fs, ROOT, b"b", b"base b")
        d = await fs.mkdir(ROOT, b"dir", 0o755, 0, 0)
        await br.op_snapshot_create(fs.kv, "before")
        await br.op_branch_create(fs.kv, "x")
        await fs.views.refresh()
        x = await fs.views.add("branch", "x")
        xr = x.id << 48 | ROOT
        fh = await fs.open((await fs.lookup(xr, b"a")).ino, os.O_RDWR | os.O_TRUNC)
        await fs.files.write(fh, 0, b"x changed a")
        await fs.files.release(fh)
        xd = (await fs.lookup(xr, b"dir")).ino
        await write_file(fs, xd, b"from-x", b"1")
        # main changes other things, including the same directory
        fh = await fs.open((await fs.lookup(ROOT, b"b")).ino, os.O_RDWR | os.O_TRUNC)
        await fs.files.write(fh, 0, b"main changed b")
        await fs.files.release(fh)
        await write_file(fs, d.ino, b"from-main", b"2")
        r = await merge.op_merge(fs.kv, "x", "main")
        assert r["result"] == "merged" and r.get("conflicts_resolved") == 0
        assert await read_file(fs, a) == b"x changed a"
        assert await read_file(fs, (await fs.lookup(ROOT, b"b")).ino) == b"main changed b"
        assert sorted(n for n, _ in await fs.readdir(d.ino)) == [b"from-main", b"from-x"]
        assert (await fs.getattr(d.ino)).nlink == 2
        # reset main to the snapshot: everything since is gone from main
        await br.op_branch_reset(fs.kv, "main", "before")
        await fs.views.refresh()
        assert await read_file(fs, (await fs.lookup(ROOT, b"a")).ino) == b"base a"
        assert await fs.readdir((await fs.lookup(ROOT, b"dir")).ino) == []
    run(t, tmp_path)


def test_times_written_back_to_a_freed_file(tmp_path):
    """The kernel writes back the times it keeps of a file right after unlinking it:
    for a file this mount freed, the answer is its last attributes (no link left)
    and nothing is stored; the same inode brought back by a reset of the branch to
    a snapshot that has it takes the times as any file does."""
    async def t(fs):
        ino = await write_file(fs, ROOT, b"f", b"data")
        before = await fs.getattr(ino)
        await br.op_snapshot_create(fs.kv, "had-f")
        await fs.views.refresh()
        await fs.unlink(ROOT, b"f")
        a = await fs.setattr(ino, mtime_ns=5 * 10**9, ctime_ns=6 * 10**9)
        assert a.nlink == 0 and a.mtime_ns == before.mtime_ns
        with raises(errno.ENOENT):
            await fs.getattr(ino)
        await br.op_branch_reset(fs.kv, "main", "had-f")
        await fs.views.refresh()
        assert (await fs.lookup(ROOT, b"f")).ino == ino
        a = await fs.setattr(ino, mtime_ns=5 * 10**9, ctime_ns=6 * 10**9)
        assert a.nlink == 1 and a.mtime_ns == 5 * 10**9
        assert (await fs.getattr(ino)).mtime_ns == 5 * 10**9
        assert await read_file(fs, ino) == b"data"
    run(t, tmp_path)


def test_reads_see_data_still_being_stored_in_the_background(tmp_path):
    """With the write pipeline on, a read of a range whose stripe is queued or being
    stored must wait for it, never return what was there before (found by stress-ng:
    the third stripe left the buffer while its writer waited for a pipeline slot)."""
    async def t(fs):
        stripe = fs.volume.settings.stripe_size
        real = fs.volume.data.write_stripe

        async def slow_write_stripe(sid, data):
            await trio.sleep(0.2)  # a slow device: stripes pile up in the pipeline
            return await real(sid, data)
        fs.volume.data.write_stripe = slow_write_stripe
        blocks = [bytes([i + 1]) * stripe for i in range(3)]
        seen = []
        async with trio.open_nursery() as nursery:
            fs.files.nursery = nursery
            fh, a = await fs.create_file(ROOT, b"f", 0o644, os.O_RDWR, 0, 0)

            async def writer():
                for i, b in enumerate(blocks):
                    await fs.files.write(fh, i * stripe, b)

            async def reader():
                await trio.sleep(0.1)  # two stripes in flight, the third waiting a slot
                seen.append(await fs.files.read(fh, 2 * stripe + 100, 10))
            nursery.start_soon(writer)
            nursery.start_soon(reader)
        fs.files.nursery = None
        assert seen == [bytes([3]) * 10]
        await fs.files.release(fh)
        assert await read_file(fs, a.ino) == b"".join(blocks)
    run(t, tmp_path)


# -- merges that must leave a tree fsck accepts (found by a randomized review test) -------
async def _branch(fs, name):
    """Branch ``name`` of main; returns its root as seen through this mount."""
    await br.op_branch_create(fs.kv, name)
    await fs.views.refresh()
    return (await fs.views.add("branch", name)).id << 48 | ROOT


async def _names(fs, d):
    return sorted(n for n, _ in await fs.readdir(d))


def test_merge_counts_links_from_the_merged_entries(tmp_path):
    """Link counts follow the merged entries: hard links added on both sides merge (was a
    conflict, and with --theirs nlink 2 for 3 names), and subdirectories removed on both
    sides leave nlink 2 (was 2 + (2 - 5) = -1: struct.error inside the merge)."""
    async def t(fs):
        f = await write_file(fs, ROOT, b"f", b"data")
        d = await fs.mkdir(ROOT, b"d", 0o755, 0, 0)
        for n in (b"a", b"b", b"c"):
            await fs.mkdir(d.ino, n, 0o755, 0, 0)
        xr = await _branch(fs, "x")
        xd = (await fs.lookup(xr, b"d")).ino
        await fs.link((await fs.lookup(xr, b"f")).ino, xr, b"g")
        await fs.link(f, ROOT, b"h")
        for n in (b"a", b"b", b"c"):
            await fs.rmdir(xd, n)
            await fs.rmdir(d.ino, n)
        await write_file(fs, d.ino, b"new", b"")
        r = await merge.op_merge(fs.kv, "x", "main")
        assert r["result"] == "merged" and r["conflicts_resolved"] == 0
        await fs.views.refresh()
        assert await _names(fs, ROOT) == [b"d", b"f", b"g", b"h"]
        assert (await fs.getattr(f)).nlink == 3
        assert (await fs.getattr(d.ino)).nlink == 2
        assert await _names(fs, d.ino) == [b"new"]
    run(t, tmp_path)


def test_merge_removes_a_file_both_sides_unlinked(tmp_path):
    """Each side removes one of a file's two names: the file goes (was a conflict, and
    with --theirs an inode with nlink 1 and no name)."""
    async def t(fs):
        f = await write_file(fs, ROOT, b"f", b"data")
        await fs.link(f, ROOT, b"g")
        xr = await _branch(fs, "x")
        await fs.unlink(xr, b"f")
        await fs.unlink(ROOT, b"g")
        r = await merge.op_merge(fs.kv, "x", "main")
        assert r["result"] == "merged"
        await fs.views.refresh()
        assert await _names(fs, ROOT) == []
    run(t, tmp_path)


def test_merge_additions_keep_what_the_other_side_deleted(tmp_path):
    """A directory deleted on one side and filled on the other, or a file deleted on one
    side and given a new name on the other, is a conflict; either strategy keeps it, with
    what was added (was: entries in a missing directory, entries to a missing inode)."""
    async def t(fs):
        d = await fs.mkdir(ROOT, b"d", 0o755, 0, 0)
        await write_file(fs, d.ino, b"old", b"o")
        f = await write_file(fs, ROOT, b"f", b"data")
        xr = await _branch(fs, "x")
        await fs.unlink((await fs.lookup(xr, b"d")).ino, b"old")
        await fs.rmdir(xr, b"d")
        await fs.unlink(xr, b"f")
        await write_file(fs, d.ino, b"new", b"n")
        await fs.link(f, d.ino, b"g")
        with pytest.raises(merge.MergeConflict) as e:
            await merge.op_merge(fs.kv, "x", "main")
        assert "/d" in e.value.paths
        await br.op_snapshot_create(fs.kv, "before")
        for strategy in ("theirs", "ours"):
            r = await merge.op_merge(fs.kv, "x", "main", strategy=strategy)
            assert r["result"] == "merged"
            await fs.views.refresh()
            assert await _names(fs, ROOT) == [b"d"]
            d2 = (await fs.lookup(ROOT, b"d")).ino
            assert await _names(fs, d2) == [b"g", b"new"]
            assert await read_file(fs, (await fs.lookup(d2, b"g")).ino) == b"data"
            assert (await fs.getattr(d2)).nlink == 2
            await br.op_branch_reset(fs.kv, "main", "before")
            await fs.views.refresh()
    run(t, tmp_path)


def test_merge_directory_moved_apart_on_both_sides(tmp_path):
    """A directory moved to two places, or two moves that put directories inside each
    other, is a conflict; a strategy takes the winning side's place (was: a directory
    with two names and a wrong parent, or a cycle cut off from the root)."""
    async def t(fs):
        for n in (b"a", b"b", b"p", b"q"):
            await fs.mkdir(ROOT, n, 0o755, 0, 0)
        xr = await _branch(fs, "x")
        await fs.rename(xr, b"a", (await fs.lookup(xr, b"p")).ino, b"a")
        await fs.rename(ROOT, b"a", (await fs.lookup(ROOT, b"q")).ino, b"a")
        with pytest.raises(merge.MergeConflict) as e:
            await merge.op_merge(fs.kv, "x", "main")
        assert e.value.paths == ["/p/a", "/q/a"]
        await merge.op_merge(fs.kv, "x", "main", strategy="theirs")
        await fs.views.refresh()
        p, q = (await fs.lookup(ROOT, b"p")).ino, (await fs.lookup(ROOT, b"q")).ino
        assert (await _names(fs, p), await _names(fs, q)) == ([b"a"], [])
        assert (await fs.getattr(q)).nlink == 2 and (await fs.getattr(p)).nlink == 3
        # a cycle: x moves b into p/a, main moves a into b
        xa = (await fs.lookup((await fs.lookup(xr, b"p")).ino, b"a")).ino
        await fs.rename(xr, b"b", xa, b"b")
        await fs.rename(p, b"a", (await fs.lookup(ROOT, b"b")).ino, b"a")
        with pytest.raises(merge.MergeConflict):
            await merge.op_merge(fs.kv, "x", "main")
        await merge.op_merge(fs.kv, "x", "main", strategy="ours")
        await fs.views.refresh()
        b = (await fs.lookup(ROOT, b"b")).ino
        assert await _names(fs, ROOT) == [b"b", b"p", b"q"] and await _names(fs, b) == [b"a"]
    run(t, tmp_path)


def test_random_merges_leave_trees_fsck_accepts(tmp_path):
    """Seeded random namespace changes on main and a branch (files, directories, hard
    links, renames, removals), merged each round with a random strategy: every merge
    either succeeds or refuses with MergeConflict; fsck ends the test."""
    import random
    rng = random.Random(7)

    async def step(fs, root):
        dirs = [root] + [a.ino for _, a in await fs.readdir(root) if a.mode & 0o40000]
        d = rng.choice(dirs)
        ents = await fs.readdir(d)
        name, op = b"n%d" % rng.randrange(8), rng.random()
        try:
            if op < 0.25:
                await write_file(fs, d, name, b"x" * rng.randrange(50))
            elif op < 0.4:
                await fs.mkdir(d, name, 0o755, 0, 0)
            elif ents and op < 0.55:
                await fs.link(rng.choice(ents)[1].ino, rng.choice(dirs), name)
            elif ents and op < 0.8:
                await fs.rename(d, rng.choice(ents)[0], rng.choice(dirs), name)
            elif ents:
                n, a = rng.choice(ents)
                await (fs.rmdir if a.mode & 0o40000 else fs.unlink)(d, n)
        except FsError:
            pass

    async def t(fs):
        for r in range(30):
            xr = await _branch(fs, "x%d" % r)
            for _ in range(rng.randrange(4, 12)):
                await step(fs, rng.choice([ROOT, xr]))
            try:
                await merge.op_merge(fs.kv, "x%d" % r, "main",
                                  strategy=rng.choice([None, "theirs", "ours"]))
            except merge.MergeConflict:
                pass
            await fs.views.refresh()
    run(t, tmp_path)


def test_unlinked_while_open_then_snapshot(tmp_path):
    """A file unlinked while open, a snapshot taken, then the file closed: the mounted
    tree frees it, and the snapshot's layer keeps the nameless inode with its orphan
    record (fsck at the end checks both trees: before, the record went with the
    free, and fsck named the snapshot's inode). The next mount leaves it so."""
    async def t(fs):
        data = os.urandom(300_000)
        fh, a = await fs.create_file(ROOT, b"f", 0o644, os.O_RDWR, 0, 0)
        await fs.files.write(fh, 0, data)
        await fs.files.flush(fh)
        await fs.unlink(ROOT, b"f")
        await br.op_snapshot_create(fs.kv, "snap")
        await fs.views.refresh()
        assert await fs.files.read(fh, 0, len(data)) == data
        await fs.files.release(fh)
        with raises(errno.ENOENT):  # freed in the mounted tree
            await fs.getattr(a.ino)
        assert len(await fs.kv.range(b"o/", b"o0")) == 1
    run(t, tmp_path)

    async def again(fs):  # the next mount's start sweep
        assert len(await fs.kv.range(b"o/", b"o0")) == 1
    run(again, tmp_path)


def test_deleting_a_snapshot_gives_back_what_only_it_held(tmp_path):
    """A snapshot pins the data of files changed or deleted in main after it. Deleting
    the snapshot gives that data back: its layer stays under main's, but the versions
    main's next layer hides are deleted (prune_shadowed). What main still shows
    (a file untouched since, a file rewritten since) reads the same. Before, the
    stripes stayed until main itself was deleted."""
    async def t(fs):
        kept = os.urandom(5 << 20)
        await write_file(fs, ROOT, b"kept", kept)
        await write_file(fs, ROOT, b"deleted", os.urandom(8 << 20))
        rewritten = await write_file(fs, ROOT, b"rewritten", os.urandom(8 << 20))
        await br.op_snapshot_create(fs.kv, "s")
        await fs.views.refresh()
        await fs.unlink(ROOT, b"deleted")
        new = os.urandom(8 << 20)
        fh = await fs.open(rewritten, os.O_RDWR | os.O_TRUNC)
        await fs.files.write(fh, 0, new)
        await fs.files.release(fh)
        await fs.volume_gc()
        pinned = len(await fs.kv.range(b"t/", b"t0"))
        await br.op_snapshot_delete(fs.kv, "s")
        await fs.views.refresh()
        await fs.volume_gc()
        left = len(await fs.kv.range(b"t/", b"t0"))
        # the deleted file's and the rewritten file's old stripes: 4 MiB each, 4 of them
        assert pinned - left == 4, (pinned, left)
        assert await read_file(fs, (await fs.lookup(ROOT, b"kept")).ino) == kept
        assert await read_file(fs, rewritten) == new
        with raises(errno.ENOENT):
            await fs.lookup(ROOT, b"deleted")
    run(t, tmp_path)


def test_collecting_deleted_trees_later_keeps_the_mark_of_a_newer_delete(tmp_path):
    """Deletes left to collect_pending (a mount's background upkeep) free what deletes
    that collect at once free. A delete that comes while a collection runs keeps the
    mark, even after another pass cleared the mark the first one read (each delete
    marks with a number of its own), so the next collection sees it."""
    async def t(fs):
        await write_file(fs, ROOT, b"f", os.urandom(8 << 20))
        await br.op_snapshot_create(fs.kv, "s")
        await br.op_branch_create(fs.kv, "b", "s")
        await fs.views.refresh()
        await fs.unlink(ROOT, b"f")  # only the snapshot and the branch have it now
        stripes = len(await fs.kv.range(b"t/", b"t0"))
        assert stripes == 2
        assert await br.collect_pending(fs.kv) is None  # nothing pending
        assert (await br.op_snapshot_delete(fs.kv, "s", collect=False)) == \
            {"freed_layers": None}
        mark = await fs.kv.get(keys.COLLECT_LAYERS)
        assert mark is not None

        real = layer_gc.collect_layers

        async def another_pass_and_a_delete_meanwhile(kv, **kw):
            layer_gc.collect_layers = real
            assert await br.collect_pending(kv) == 0  # another mount's pass ends first
            assert await kv.get(keys.COLLECT_LAYERS) is None
            await br.op_branch_delete(kv, "b", collect=False)  # then a delete marks again
            return await real(kv, **kw)
        layer_gc.collect_layers = another_pass_and_a_delete_meanwhile
        try:
            assert await br.collect_pending(fs.kv) == 1  # the branch's own layer
        finally:
            layer_gc.collect_layers = real
        assert await fs.kv.get(keys.COLLECT_LAYERS) not in (None, mark)
        problems, notes = await fsck(fs.volume)  # still to collect: not a problem
        assert problems == [] and any("still to collect" in n for n in notes), notes
        problems, notes = await fsck(fs.volume, repair=True)  # collects it
        assert problems == [] and "collected 0 layers of deleted branches and " \
            "snapshots" in notes, notes
        assert await fs.kv.get(keys.COLLECT_LAYERS) is None
        assert await br.collect_pending(fs.kv) is None
        await fs.views.refresh()
        await fs.volume_gc()
        assert await fs.kv.range(b"t/", b"t0") == []  # the file's stripes are freed
        assert await br.op_snapshot_list(fs.kv) == []
        assert [b["name"] for b in await br.op_branch_list(fs.kv)] == ["main"]
    run(t, tmp_path)


def test_collection_in_pages_of_a_few_keys(tmp_path, monkeypatch):
    """The collection reads the layered keys a page at a time (layer_gc.GC_PAGE, and
    yields between pages): with pages of 3 keys, a key's versions split over pages, it
    frees the same as in one page: the deleted branch's layer and what the deleted
    snapshot alone held."""
    monkeypatch.setattr(layer_gc, "GC_PAGE", 3)

    async def t(fs):
        for i in range(5):
            await write_file(fs, ROOT, b"f%d" % i, os.urandom(64 << 10))  # a stripe each
        await br.op_snapshot_create(fs.kv, "s")
        await br.op_branch_create(fs.kv, "b", "s")
        await fs.views.refresh()
        for i in range(3):
            await fs.unlink(ROOT, b"f%d" % i)
        await br.op_snapshot_delete(fs.kv, "s", collect=False)
        await br.op_branch_delete(fs.kv, "b", collect=False)
        assert await br.collect_pending(fs.kv) == 1
        await fs.views.refresh()
        await fs.volume_gc()
        assert len(await fs.kv.range(b"t/", b"t0")) == 2  # f3's and f4's
        problems, _ = await fsck(fs.volume)
        assert problems == []
    run(t, tmp_path)


def test_data_hidden_several_layers_up_is_freed(tmp_path):
    """A snapshot, then a branch made from main (which froze main's top again: an
    empty layer between the snapshot's and main's), then a file deleted in main: once
    the snapshot is deleted the branch still shows the file, and once the branch is
    deleted too the file's data is freed (its only version is hidden two layers up,
    by main's tombstone). Before, it stayed taken for good."""
    async def t(fs):
        data = os.urandom(8 << 20)
        await write_file(fs, ROOT, b"f", data)
        await br.op_snapshot_create(fs.kv, "s")
        await br.op_branch_create(fs.kv, "b")  # from main
        await fs.views.refresh()
        await fs.unlink(ROOT, b"f")
        await br.op_snapshot_delete(fs.kv, "s")
        await fs.views.refresh()
        await fs.volume_gc()
        assert len(await fs.kv.range(b"t/", b"t0")) == 2  # the branch still has it
        root = (await fs.views.add("branch", "b")).id << VIEW_SHIFT | 1
        assert await read_file(fs, (await fs.lookup(root, b"f")).ino) == data
        await br.op_branch_delete(fs.kv, "b")
        await fs.views.refresh()
        await fs.volume_gc()
        assert await fs.kv.range(b"t/", b"t0") == []
        problems, _ = await fsck(fs.volume)
        assert problems == []
    run(t, tmp_path)


def test_prune_transactions_do_not_grow_with_the_chain(tmp_path):
    """Files that lived across 60 snapshots, deleted, then every snapshot deleted: each
    transaction of the prune reads a hidden version's SUB once, whatever the number of
    layers between it and what hides it (etcd bounds a transaction's operations:
    --max-txn-ops; a transaction over it fails, and the prune with it)."""
    async def t(fs):
        for i in range(40):
            await write_file(fs, ROOT, b"f%d" % i, os.urandom(64 << 10))
        for i in range(60):
            await br.op_snapshot_create(fs.kv, "s%d" % i)
        await fs.views.refresh()
        for i in range(40):
            await fs.unlink(ROOT, b"f%d" % i)
        sizes = []
        commit = fs.kv.commit

        async def counted(txn):
            sizes.append(len(txn.reads) + len(txn.writes))
            return await commit(txn)
        fs.kv.commit = counted
        for i in range(60):
            await br.op_snapshot_delete(fs.kv, "s%d" % i)
        fs.kv.commit = commit
        await fs.views.refresh()
        await fs.volume_gc()
        assert await fs.kv.range(b"t/", b"t0") == []  # all 40 files' stripes freed
        assert max(sizes) < 1500, max(sizes)  # 100 versions, a few operations each
    run(t, tmp_path)


def test_trees_made_during_a_collection_are_not_collected(tmp_path):
    """A snapshot and a branch made by another mount while a collection runs, after it
    read which layers the trees use: their new layers (main's new head among them)
    are not taken for dead, and the volume stays whole."""
    async def t(fs):
        await write_file(fs, ROOT, b"f", b"kept")
        await br.op_branch_create(fs.kv, "old")
        await br.op_branch_delete(fs.kv, "old", collect=False)
        real = trees.live_layers

        async def trees_made_meanwhile(kv):
            live = await real(kv)
            await br.op_snapshot_create(kv, "s")
            await br.op_branch_create(kv, "b", "s")
            return live
        trees.live_layers = trees_made_meanwhile
        try:
            assert await br.collect_pending(fs.kv) == 1  # the deleted branch's layer
        finally:
            trees.live_layers = real
        await fs.views.refresh()
        assert await read_file(fs, (await fs.lookup(ROOT, b"f")).ino) == b"kept"
        problems, _ = await fsck(fs.volume)
        assert problems == []
        assert [b["name"] for b in await br.op_branch_list(fs.kv)] == ["b", "main"]
    run(t, tmp_path)


def test_prune_keeps_an_open_unlinked_file(tmp_path):
    """A file unlinked while open, a snapshot taken, the open file written again (a
    new version of its inode above the snapshot's), the snapshot deleted: the prune
    drops the hidden old version but not the orphan record the open file still
    needs (fsck would name the inode, and nothing would free it)."""
    async def t(fs):
        fh, a = await fs.create_file(ROOT, b"f", 0o644, os.O_RDWR, 0, 0)
        await fs.files.write(fh, 0, b"before" * 1000)
        await fs.files.flush(fh)
        await fs.unlink(ROOT, b"f")
        await br.op_snapshot_create(fs.kv, "s")
        await fs.views.refresh()
        await fs.files.write(fh, 0, b"after!")
        await fs.files.flush(fh)
        await br.op_snapshot_delete(fs.kv, "s")
        await fs.views.refresh()
        assert len(await fs.kv.range(b"o/", b"o0")) == 1
        assert (await fs.files.read(fh, 0, 12)) == b"after!before"
        await fs.files.release(fh)
        with raises(errno.ENOENT):
            await fs.getattr(a.ino)
        # and with it freed, no tree has the inode: its record goes too (it stayed for
        # good, and every mount's start sweep tried it again)
        assert await fs.kv.range(b"o/", b"o0") == []
        await fs.volume_gc()
        assert await fs.kv.range(b"t/", b"t0") == []  # (its stripe is freed)
    run(t, tmp_path)


def test_orphan_record_kept_while_a_tree_has_the_inode(tmp_path):
    """A file unlinked while open, then a branch made: the file released in main, the
    branch still has the nameless inode, so its record stays (through a remount);
    freed in the branch too (a mount of it), the record goes."""
    async def t(fs):
        fh, a = await fs.create_file(ROOT, b"f", 0o644, os.O_RDWR, 0, 0)
        await fs.files.write(fh, 0, b"x" * 5000)
        await fs.files.flush(fh)
        await fs.unlink(ROOT, b"f")
        await br.op_branch_create(fs.kv, "b")
        await fs.views.refresh()
        await fs.files.release(fh)
        with raises(errno.ENOENT):
            await fs.getattr(a.ino)
        assert len(await fs.kv.range(b"o/", b"o0")) == 1
        a_ino.append(a.ino)
    a_ino = []
    run(t, tmp_path)

    async def branch_mount(fs):
        assert len(await fs.kv.range(b"o/", b"o0")) == 1  # main's start sweep kept it
        view = await fs.views.add("branch", "b")
        await fs.files.orphans.reap_orphans(view)  # the branch's mount frees its copy
        assert await fs.kv.range(b"o/", b"o0") == []
        with raises(errno.ENOENT):
            await fs.getattr(view.id << VIEW_SHIFT | a_ino[0])
    run(branch_mount, tmp_path)


def test_files_a_crashed_mount_held_unlinked_are_freed_together(tmp_path):
    """A mount dies holding many files unlinked while open: the next mount's start
    sweep frees them several a transaction (files.FREE_FILES), not one each, and a
    file too big to go with others (more than FREE_FILE_CHUNKS chunks) by itself.
    fsck at the end: nothing left without a name or a record."""
    from bmfs.meta.keys import CHUNK_SIZE
    from bmfs.vfs.orphans import FREE_FILE_CHUNKS, FREE_FILES
    n = 3 * FREE_FILES

    async def crash():
        await mkfs(str(tmp_path / "vol"))
        vol = await Volume.open(str(tmp_path / "vol"))
        fs = await FileSystem.create(vol)
        for i in range(n):
            fh, _ = await fs.create_file(ROOT, b"f%d" % i, 0o644, os.O_RDWR, 0, 0)
            await fs.files.write(fh, 0, os.urandom(100 + i))
            await fs.files.flush(fh)
            await fs.unlink(ROOT, b"f%d" % i)
        fh, _ = await fs.create_file(ROOT, b"wide", 0o644, os.O_RDWR, 0, 0)
        for c in range(FREE_FILE_CHUNKS + 1):
            await fs.files.write(fh, c * CHUNK_SIZE, b"w" * 4096)
        await fs.files.flush(fh)
        await fs.unlink(ROOT, b"wide")
        assert len(await fs.kv.range(b"o/", b"o0")) == n + 1
        await vol.aclose()  # the mount dies: its handles are never released
    trio.run(crash)

    async def next_mount():
        vol = await Volume.open(str(tmp_path / "vol"))
        before = vol.kv.commits
        fs = await FileSystem.create(vol)  # (sweeps what a crashed mount left)
        spent = vol.kv.commits - before
        assert await fs.kv.range(b"o/", b"o0") == []
        # 4 groups and the wide file by itself, where one each took n + 1 = 49
        assert spent <= 6, spent
        assert await fs.readdir(ROOT) == []
        await fs.aclose()
        problems, _ = await fsck(vol)
        await vol.aclose()
        assert problems == [], problems
    trio.run(next_mount)


def test_a_removed_directory_the_kernel_holds_still_answers(tmp_path):
    """A directory removed (rmdir, or replaced by a rename) while the kernel holds it
    (a process sits in it, a descriptor is open on it) answers as on a local disk
    until the kernel forgets it: st_nlink 0, `..` the directory it was in, its mode
    can change; nothing is created in it; nothing of it is left in the metadata (the
    fsck at the end)."""
    async def t(fs):
        p = await fs.mkdir(ROOT, b"p", 0o755, 0, 0)
        d = await fs.mkdir(p.ino, b"d", 0o750, 0, 0)
        fs.held.saw(d)  # what the front end does when a reply gives the kernel d
        await fs.rmdir(p.ino, b"d")
        a = await fs.getattr(d.ino)
        assert (a.nlink, stat.S_ISDIR(a.mode), a.mode & 0o777) == (0, True, 0o750)
        assert (await fs.lookup(d.ino, b"..")).ino == p.ino
        assert (await fs.lookup(d.ino, b".")).ino == d.ino
        assert await fs.readdir(d.ino, dots=True) == []  # (as ext4 lists it)
        assert (await fs.setattr(d.ino, mode=0o700)).mode & 0o777 == 0o700
        assert (await fs.getattr(d.ino)).mode & 0o777 == 0o700
        with raises(errno.ENOENT):
            await fs.mkdir(d.ino, b"x", 0o755, 0, 0)
        with raises(errno.ENOENT):
            await fs.lookup(d.ino, b"x")
        fs.held.forgot(d.ino)  # the kernel's forget
        with raises(errno.ENOENT):
            await fs.getattr(d.ino)
        # replaced by a rename while held; the one removed without being held is gone
        a1 = await fs.mkdir(p.ino, b"a", 0o755, 0, 0)
        b1 = await fs.mkdir(p.ino, b"b", 0o755, 0, 0)
        c1 = await fs.mkdir(p.ino, b"c", 0o755, 0, 0)
        fs.held.saw(await fs.getattr(b1.ino))
        await fs.rename(p.ino, b"a", p.ino, b"b")
        assert (await fs.getattr(b1.ino)).nlink == 0
        assert (await fs.lookup(p.ino, b"b")).ino == a1.ino
        await fs.rmdir(p.ino, b"c")
        with raises(errno.ENOENT):
            await fs.getattr(c1.ino)
    run(t, tmp_path)


def test_listings_have_dot_and_dotdot(tmp_path):
    async def t(fs):
        p = await fs.mkdir(ROOT, b"p", 0o755, 0, 0)
        await write_file(fs, p.ino, b"f", b"x")
        ents = await fs.readdir(p.ino, dots=True)
        assert [(n, a.ino) for n, a in ents[:2]] == [(b".", p.ino), (b"..", ROOT)]
        assert [n for n, _ in ents[2:]] == [b"f"]
        root = await fs.readdir(ROOT, dots=True)
        assert [(n, a.ino) for n, a in root[:2]] == [(b".", ROOT), (b"..", ROOT)]
        assert [n for n, _ in await fs.readdir(p.ino)] == [b"f"]  # (the vfs's own callers)
        await fs.control.run("branch_create", {"name": "x"})
        broot = await fs.lookup((await fs.lookup(ROOT, b".bm")).ino, b"branches")
        x = await fs.lookup(broot.ino, b"x")
        assert [(n, a.ino) for n, a in (await fs.readdir(x.ino, dots=True))[:2]] == \
            [(b".", x.ino), (b"..", broot.ino)]
        assert (await fs.lookup(x.ino, b"..")).ino == broot.ino
        f = await fs.lookup(p.ino, b"f")
        for name in (b".", b".."):
            with raises(errno.ENOTDIR):
                await fs.lookup(f.ino, name)
    run(t, tmp_path)


def test_atime_follows_relatime_noatime_strictatime_and_read_only(tmp_path):
    day = 24 * 3600 * 10**9

    async def read(fs, ino):
        await read_file(fs, ino)
        return (await fs.getattr(ino)).atime_ns

    async def t(fs):
        ino = await write_file(fs, ROOT, b"f", b"data")
        a = await fs.getattr(ino)
        await fs.setattr(ino, atime_ns=a.mtime_ns - 10**9)  # read before its last write
        first = await read(fs, ino)
        assert first > a.mtime_ns
        assert await read(fs, ino) == first  # relatime: once per change
        old = (await fs.getattr(ino)).ctime_ns
        await fs.setattr(ino, atime_ns=first - 2 * day, mtime_ns=first - 3 * day)
        # (the ctime moved on with that setattr: the rule compares it too)
        assert await read(fs, ino) > old
        d = await fs.mkdir(ROOT, b"d", 0o755, 0, 0)
        await fs.setattr(d.ino, atime_ns=d.mtime_ns - 10**9)
        await fs.readdir(d.ino, dots=True)  # a listing (opendir)
        assert (await fs.getattr(d.ino)).atime_ns > d.mtime_ns
        fs.atime = "noatime"
        await fs.setattr(ino, atime_ns=1)
        assert await read(fs, ino) == 1
        fs.atime = "strictatime"
        t1 = await read(fs, ino)
        await trio.sleep(0.01)  # (the kernel's coarse clock ticks at least every 4 ms)
        assert await read(fs, ino) > t1 > 1
        fs.atime, fs.read_only = "relatime", True
        await fs.files.truncate(fs.views.get(0), ino, 4)  # (a write: vfs below the check)
        before = (await fs.getattr(ino)).atime_ns
        assert await read(fs, ino) == before
        for op in (fs.mkdir(ROOT, b"e", 0o755, 0, 0), fs.unlink(ROOT, b"f"),
                   fs.setattr(ino, mode=0o600), fs.open(ino, os.O_WRONLY),
                   fs.rename(ROOT, b"f", ROOT, b"g"), fs.setxattr(ino, b"user.a", b"1")):
            with raises(errno.EROFS):
                await op
        fs.read_only = False
        await fs.unlink(ROOT, b"f")
    run(t, tmp_path)


async def _rewrite(fs, ino, data, mode=None):
    fh = await fs.open(ino, os.O_RDWR | os.O_TRUNC)
    await fs.files.write(fh, 0, data)
    await fs.files.release(fh)
    if mode is not None:
        await fs.setattr(ino, mode=mode)


@pytest.mark.parametrize("strategy", ["ours", "theirs"])
def test_merge_takes_the_winning_file_whole(tmp_path, strategy):
    """A file both sides changed comes whole from the winner: its bytes with its size,
    mode and xattrs, none of the loser's (was: the winner's bytes with the size the
    other side alone had changed: ``ours\\n\\0\\0``). Big files too (a chunk list each
    side rewrote), and an inode the loser changed only in an attribute. After the
    merge with --theirs, diff shows no change for them."""
    async def t(fs):
        small = await write_file(fs, ROOT, b"g", b"base\n")
        big = await write_file(fs, ROOT, b"big", os.urandom(100_000))
        await fs.setxattr(small, b"user.bm.type", b"base")
        xr = await _branch(fs, "c2")
        xs = (await fs.lookup(xr, b"g")).ino
        xb = (await fs.lookup(xr, b"big")).ino
        mine = {b"g": b"ours\n", b"big": os.urandom(100_000)}
        theirs = {b"g": b"theirs\n", b"big": os.urandom(150_000)}
        await _rewrite(fs, small, mine[b"g"])
        await _rewrite(fs, big, mine[b"big"], mode=0o600)
        await fs.setxattr(small, b"user.bm.type", b"ours")
        await _rewrite(fs, xs, theirs[b"g"])
        await _rewrite(fs, xb, theirs[b"big"])
        await fs.setxattr(xs, b"user.other", b"theirs")
        r = await merge.op_merge(fs.kv, "c2", "main", strategy=strategy)
        assert r["result"] == "merged" and r["conflicts_resolved"] >= 2
        await fs.views.refresh()
        want = mine if strategy == "ours" else theirs
        for name, ino in ((b"g", small), (b"big", big)):
            assert await read_file(fs, ino) == want[name]
            assert (await fs.getattr(ino)).size == len(want[name])
        modes = {"ours": 0o600, "theirs": 0o644}
        assert (await fs.getattr(big)).mode & 0o777 == modes[strategy]
        xattrs = {"ours": [b"user.bm.type"], "theirs": [b"user.bm.type", b"user.other"]}
        assert sorted(await fs.listxattr(small)) == xattrs[strategy]
        assert await fs.getxattr(small, b"user.bm.type") == \
            (b"ours" if strategy == "ours" else b"base")
        if strategy == "theirs":
            assert await diff.op_diff(fs.kv, "c2", "main") == \
                {"added": [], "removed": [], "changed": []}
    run(t, tmp_path)


def test_fsck_finds_data_past_a_files_size(tmp_path):
    """A file whose slices reach past its size (the state a key-by-key merge could
    leave: one side's data, the other's smaller size) is a problem for fsck."""
    async def t():
        async with open_fs(tmp_path / "vol", check=False) as fs:
            ino = await write_file(fs, ROOT, b"f", b"0123456789")

            async def shrink(txn, chain):
                i = await ns.get_inode(txn, chain, ino)
                i.size = 4
                await ns.put_inode(txn, chain, ino, i)
            await fs.mutate(fs.views.get(0), shrink)
            problems, _ = await fsck(fs.volume)
            assert problems == [f"branch main: inode {ino} has data past its size 4"]
    trio.run(t)


# -- devices that fill up under a write-behind file ---------------------------------------
class SmallFilesystem:
    """Room shared by devices on one small filesystem."""

    def __init__(self, room: int):
        import threading
        self.left = room
        self.lock = threading.Lock()


class FillingStore(FileStore):
    """A device on a SmallFilesystem: a write that does not fit leaves what did (a file
    cut short, as a full disk does) and fails with ENOSPC; a delete gives room back."""

    def __init__(self, path, volume_uuid, dev, space: SmallFilesystem):
        super().__init__(path, volume_uuid, dev)
        self.space = space

    def write(self, name, parts):
        total = sum(len(p) for p in parts)
        with self.space.lock:
            fits = min(total, self.space.left)
            self.space.left -= fits
        if fits < total:
            with open(self._file(name), "wb") as f:
                f.write(b"".join(bytes(p) for p in parts)[:fits])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().write(name, parts)

    def delete(self, name):
        try:
            size = os.path.getsize(self._file(name))
        except FileNotFoundError:
            size = 0
        super().delete(name)
        with self.space.lock:
            self.space.left += size


def fill_up(fs, stripes: float, devices=None) -> SmallFilesystem:
    """Put the devices of ``fs`` (or those listed) on a SmallFilesystem with room for
    about ``stripes`` full stripes."""
    s = fs.volume.settings
    space = SmallFilesystem(int(stripes * s.stripe_size * (s.k + s.m) / s.k))
    for dev, path in fs.volume.device_paths.items():
        if devices is None or dev in devices:
            fs.volume.transport.add_device(dev, FillingStore(path, s.uuid, dev, space))
    return space


async def write_behind(fs, fh, data: bytes, at: int = 0, piece: int = 64 << 10) -> None:
    """``data`` written at ``at`` as the kernel writes back its pages (64 KiB writes,
    each one whatever the others' errors), the write pipeline on: full stripes are
    stored in the background."""
    async with trio.open_nursery() as nursery:
        fs.files.nursery = nursery
        for off in range(0, len(data), piece):
            try:
                await fs.files.write(fh, at + off, data[off:off + piece])
            except FsError as e:  # (may be said here, or by fsync and close)
                assert e.errno == errno.ENOSPC, e
    fs.files.nursery = None  # (the stores behind have ended with the nursery)


def test_a_failed_store_is_an_error_never_zeros(tmp_path):
    """Devices fill up while a file is stored behind its writes: fsync says ENOSPC, and
    again at every fsync and at close; meanwhile the file is what is stored (its size,
    its bytes) and the bytes not stored read as EIO, never zeros; the fragments of the
    stripes that failed are deleted at once (fsck finds no leak); a remount shows the
    same file."""
    data = os.urandom(24 << 18)  # 24 stripes of 256 KiB

    async def t(fs):
        fill_up(fs, 2.5)
        fh, a = await fs.create_file(ROOT, b"f", 0o644, os.O_RDWR, 0, 0)
        await write_behind(fs, fh, data)
        for _ in range(3):
            with raises(errno.ENOSPC):
                await fs.files.fsync(fh)
        size = (await fs.getattr(a.ino)).size
        assert 0 < size < len(data)
        assert await fs.files.read(fh, 0, size) == data[:size]
        with raises(errno.EIO):
            await fs.files.read(fh, size, 4096)
        with raises(errno.EIO):
            await fs.files.read(fh, len(data) - 4096, 4096)  # past the stored size too
        with raises(errno.ENOSPC):
            await fs.files.release(fh)
        assert (await fs.getattr(a.ino)).size == size
        assert await read_file(fs, a.ino) == data[:size]
        return size
    sizes = []

    async def main():
        async with open_fs(tmp_path / "vol", fragment_size=64 << 10, layout="files") as fs:
            sizes.append(await t(fs))
        async with open_fs(tmp_path / "vol") as fs:  # (fsck at each close)
            ino = (await fs.lookup(ROOT, b"f")).ino
            assert (await fs.getattr(ino)).size == sizes[0]
            assert await read_file(fs, ino) == data[:sizes[0]]
    trio.run(main)


def test_a_writer_that_tries_again_after_a_failed_store(tmp_path):
    """After a failed store the writer may start over where the stored bytes end (once
    there is room again): the file then reads back whole, fsync and close succeed.
    Bytes written past the lost range meanwhile are dropped with it (they would follow
    a hole of zeros), and a cut that would leave the lost bytes a hole is refused."""
    data = os.urandom(16 << 18)

    async def t(fs):
        space = fill_up(fs, 2.5)
        fh, a = await fs.create_file(ROOT, b"f", 0o644, os.O_RDWR, 0, 0)
        await write_behind(fs, fh, data)
        with raises(errno.ENOSPC):
            await fs.files.fsync(fh)
        size = (await fs.getattr(a.ino)).size
        with raises(errno.ENOSPC):
            await fs.files.truncate(fs.views.get(0), a.ino, size + 1)
        with space.lock:
            space.left += 64 << 20
        await write_behind(fs, fh, data[size + 4096:], at=size + 4096)  # past it: dropped
        with raises(errno.ENOSPC):
            await fs.files.fsync(fh)
        await write_behind(fs, fh, data[size:], at=size)  # from its start: taken back
        await fs.files.fsync(fh)
        await fs.files.release(fh)
        assert await read_file(fs, a.ino) == data
    run(t, tmp_path, fragment_size=64 << 10, layout="files")


def test_a_failed_overwrite_keeps_the_stored_bytes(tmp_path):
    """An overwrite inside a file whose stripes cannot be stored: fsync and close say
    ENOSPC; the range reads as EIO while the file is open, then as what is stored (the
    bytes from before, as a remount shows); a cut that keeps the file's stored bytes
    over the range is allowed."""
    stripe = 256 << 10
    old, new = os.urandom(6 * stripe), os.urandom(3 * stripe)

    async def t(fs):
        ino = await write_file(fs, ROOT, b"f", old)
        fill_up(fs, 0.5)
        fh = await fs.open(ino, os.O_RDWR)
        await write_behind(fs, fh, new, at=stripe)
        with raises(errno.ENOSPC):
            await fs.files.fsync(fh)
        assert (await fs.getattr(ino)).size == len(old)
        assert await fs.files.read(fh, 0, stripe) == old[:stripe]
        with raises(errno.EIO):
            await fs.files.read(fh, 2 * stripe, 4096)
        await fs.files.truncate(fs.views.get(0), ino, 5 * stripe)
        with raises(errno.ENOSPC):
            await fs.files.release(fh)
        assert await read_file(fs, ino) == old[:5 * stripe]
    run(t, tmp_path, fragment_size=64 << 10, layout="files")


def test_a_full_device_keeps_no_cut_short_fragment(tmp_path):
    """One device full: the fragments meant for it go to others and the file is
    stored; what each failed PUT left on the full device (a fragment file cut short)
    is deleted at once, not left for fsck to find as no stripe's."""
    data = os.urandom(4 << 18)

    async def t(fs):
        fill_up(fs, 0, devices=[0])
        ino = await write_file(fs, ROOT, b"f", data)
        assert await read_file(fs, ino) == data
        assert not any(files for _, _, files in os.walk(fs.volume.device_paths[0] + "/frags"))
    run(t, tmp_path, fragment_size=64 << 10, layout="files")


def test_the_mounted_branch_under_bm_is_a_view_of_its_own(tmp_path):
    """/.bm/branches/main is not the root's inode (the kernel refuses the root inode
    number anywhere else: EIO), shows the same tree, and a file open through one path
    and unlinked through the other stays readable until closed, then is freed."""
    async def t(fs):
        data = os.urandom(200_000)
        await write_file(fs, ROOT, b"f", data)
        own = (await fs.control.lookup(CTL_BRANCHES, b"main")).ino
        assert own >> VIEW_SHIFT not in (0, CTL_VIEW) and own & ((1 << VIEW_SHIFT) - 1) == ROOT
        assert [(n, a.ino) for n, a in await fs.control.readdir(CTL_BRANCHES)] == [(b"main", own)]
        assert await _names(fs, own) == [b"f"]
        for opened_in, unlinked_in in ((ROOT, own), (own, ROOT)):
            opened = (await fs.lookup(opened_in, b"f")).ino
            fh = await fs.open(opened, os.O_RDONLY)
            await fs.unlink(unlinked_in, b"f")
            assert await fs.files.read(fh, 0, len(data)) == data
            await fs.files.release(fh)
            with raises(errno.ENOENT):
                await fs.getattr(opened)
            assert await fs.kv.range(b"o/", b"o0") == []
            await write_file(fs, ROOT, b"f", data)
    run(t, tmp_path)
