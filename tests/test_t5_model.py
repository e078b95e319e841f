"""Model-based tests: random operations on a real bmfs mount and on a plain local
directory (the model), compared after every step.

Each hypothesis example works in a fresh subdirectory ``exN`` of one mount (made once
per test function) and a fresh local directory; branch and snapshot names carry the
example number. A step compares the listing, file types, modes, sizes and link counts
of every tree the example uses, and the contents of the files the step changed (read
with the page cache dropped, so the bytes come from bmfs, not the kernel). Failing
operations must fail with the same errno on both sides.

At the end of a test the volume is unmounted and checked with fsck, mounted again,
and every tree of every example (main, branches, snapshots) is compared byte for
byte with its model: what was written reached the devices and the metadata.

The model of a branch or snapshot is a ``cp -a`` copy (hard links kept) of the model
directory it was made from; a fast-forward merge replaces the target's model with the
source's. Three-way merges have a model of their own (``MergeModel``): a few names, each
a file or symlink changed on both sides, and what a merge must make of each.
"""
from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import stat
import subprocess

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from mountutil import Mounted, assert_fsck_clean

MiB = 1 << 20
STRIPE = 4 * MiB
NAMES = ["a", "b", "c", "d"]
SYMLINK_TARGETS = ["a", "b", "d", "d/a", "nowhere", "l", "a/b"]

# Some errnos are interchangeable by POSIX (rename over a non-empty directory may give
# either); everything else must match exactly.
ERRNO_CLASS = {errno.EEXIST: errno.ENOTEMPTY}

SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)
# a longer hunt: BMFS_MODEL_EXAMPLES=500 pytest tests/test_t5_model.py
EXAMPLES = int(os.environ.get("BMFS_MODEL_EXAMPLES", "40"))
MERGE_EXAMPLES = int(os.environ.get("BMFS_MERGE_EXAMPLES", "20"))

offsets = st.one_of(st.integers(0, 20000), st.integers(0, 20000),
                    st.integers(STRIPE - 6000, STRIPE + 6000), st.integers(0, 9 * MiB))
small_lengths = st.one_of(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 70000))
big_lengths = st.integers(MiB, 6 * MiB)
sizes = st.one_of(st.integers(0, 20000), st.integers(STRIPE - 5000, STRIPE + 5000),
                  st.integers(0, 10 * MiB))
modes = st.sampled_from([0o644, 0o600, 0o755, 0o700, 0o444, 0o640, 0o000, 0o1777])


def payload(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def eclass(e: int) -> int:
    return ERRNO_CLASS.get(e, e)


# -- operations, applied the same way to a tree in the mount and to its model ----------
def op_write(root, path, offset, data, trunc):
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if trunc else 0)
    fd = os.open(os.path.join(root, path), flags, 0o644)
    try:
        return os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def op_append(root, path, data):
    fd = os.open(os.path.join(root, path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return os.write(fd, data)
    finally:
        os.close(fd)


def op_read(root, path, offset, length, uncached):
    fd = os.open(os.path.join(root, path), os.O_RDONLY)
    try:
        if uncached:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return hashlib.sha256(os.pread(fd, length, offset)).hexdigest()
    finally:
        os.close(fd)


def read_all(path) -> bytes:
    """The whole file, read past the kernel's page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while True:
            b = os.read(fd, 4 * MiB)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def attempt(fn, *args):
    """('ok', result) or ('err', errno class)."""
    try:
        return ("ok", fn(*args))
    except OSError as e:
        return ("err", eclass(e.errno))


def snapshot_tree(root, readonly=False) -> dict:
    """Path -> (type, mode, nlink, size or symlink target) for everything under root.

    ``readonly``: as a snapshot shows it (no write bits, except on symlinks)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            s = os.lstat(p)
            fmt = stat.S_IFMT(s.st_mode)
            if fmt == stat.S_IFLNK:
                extra = os.readlink(p)
            elif fmt == stat.S_IFDIR:
                extra = None  # directory sizes differ between filesystems
            else:
                extra = s.st_size
            mode = s.st_mode & ~0o222 if readonly and fmt != stat.S_IFLNK else s.st_mode
            out[rel] = (stat.filemode(mode), s.st_nlink, extra)
    return out


def compare_trees(real, model, contents=True, what="", readonly=False):
    a, b = snapshot_tree(real), snapshot_tree(model, readonly)
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()))
        raise AssertionError(f"{what}: trees differ (bmfs vs model):\n" + "\n".join(
            f"  {'bmfs ' if item in a.items() else 'model'} {item}" for item in diff[:40]))
    if contents:
        for rel, (mode, _, _) in b.items():
            if mode.startswith("-"):
                compare_file(os.path.join(real, rel), os.path.join(model, rel), f"{what}/{rel}")


def compare_file(real, model, what):
    with open(model, "rb") as f:
        want = f.read()
    got = read_all(real)
    if got != want:
        first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                     min(len(got), len(want)))
        raise AssertionError(f"{what}: contents differ: bmfs {len(got)} bytes, model "
                             f"{len(want)} bytes, first difference at offset {first}")


def cp_a(src, dst):
    if os.path.exists(dst):
        shutil.rmtree(dst)
    subprocess.run(["cp", "-a", src, dst], check=True)


class Env:
    """What lives for one test function: the mount, the model root, every tree to check
    after remount (mount path -> model path)."""

    def __init__(self, mnt, model_root):
        self.mnt = mnt
        self.model_root = model_root
        self.examples = 0
        self.final: dict[str, tuple[str, bool]] = {}

    def new_example(self, prefix: str) -> str:
        """The name of the next example's directory in main, made."""
        self.examples += 1
        ex = f"{prefix}{self.examples}"
        os.mkdir(os.path.join(self.mnt.mp, ex))
        return ex


class FsModel(RuleBasedStateMachine):
    """File operations on the example's directory in main (and, in the subclass, in
    branches of the example)."""

    env: Env = None  # set by the test function

    def __init__(self):
        super().__init__()
        env = self.env
        self.ex = env.new_example("ex")
        self.mp = env.mnt.mp
        self.base = os.path.join(env.model_root, self.ex)
        os.makedirs(os.path.join(self.base, "trees", "main"))
        os.makedirs(os.path.join(self.base, "snaps"))
        # tree name -> (directory in the mount, directory of the model)
        self.trees = {"main": (os.path.join(self.mp, self.ex),
                               os.path.join(self.base, "trees", "main"))}
        self.snaps: dict[str, tuple[str, str]] = {}
        self.dirty: set[tuple[str, str]] = set()   # (tree, path) whose contents changed

    # -- choosing paths ---------------------------------------------------------------
    def entries(self, tree, kind=None) -> list[str]:
        model = self.trees[tree][1]
        out = []
        for dirpath, dirnames, filenames in os.walk(model):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                m = os.lstat(p).st_mode
                if kind is None or (kind == "dir" and stat.S_ISDIR(m)) or \
                        (kind == "file" and stat.S_ISREG(m)):
                    out.append(os.path.relpath(p, model))
        return sorted(out)

    def pick(self, data, tree, kind=None, new=True, under_file=False) -> str:
        """An existing path (of ``kind``) or, if ``new``, a name in an existing directory
        (``under_file``: or under a file, for ENOTDIR)."""
        cands = set(self.entries(tree, kind))
        if new or not cands:
            for d in [""] + self.entries(tree, "dir"):
                cands.update(os.path.join(d, n) for n in NAMES)
            if under_file:
                cands.update(os.path.join(f, "x") for f in self.entries(tree, "file")[:1])
        return data.draw(st.sampled_from(sorted(cands)), label="path")

    def pick_tree(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.trees)), label="tree")

    # -- applying ----------------------------------------------------------------------
    def both(self, tree, fn, *args, mutates=True):
        real, model = self.trees[tree]
        want = attempt(fn, model, *args)
        got = attempt(fn, real, *args)
        if got != want:
            shown = ", ".join(f"<{len(a)} bytes>" if isinstance(a, bytes) else repr(a)
                              for a in args)
            raise AssertionError(f"{fn.__name__}({shown}) in {tree}: bmfs {got}, model {want}")
        if mutates and want[0] == "ok":
            self.on_change(tree)
        return want

    def on_change(self, tree):
        """A tree changed (subclasses track what that means for merges)."""

    def mark_dirty(self, tree, path):
        model = self.trees[tree][1]
        p = os.path.join(model, path)
        try:
            ino = os.stat(p).st_ino
        except OSError:
            return
        # every name of the same file changed too (hard links)
        for rel in self.entries(tree, "file"):
            if os.stat(os.path.join(model, rel)).st_ino == ino:
                self.dirty.add((tree, rel))

    # -- rules -------------------------------------------------------------------------
    @rule(data=st.data(), offset=offsets, length=small_lengths, seed=st.integers(0, 2**32),
          trunc=st.booleans())
    def write(self, data, offset, length, seed, trunc):
        tree = self.pick_tree(data)
        path = self.pick(data, tree, under_file=True)
        self.both(tree, op_write, path, offset, payload(seed, length), trunc)
        self.mark_dirty(tree, path)

    @rule(data=st.data(), offset=offsets, length=big_lengths, seed=st.integers(0, 2**32))
    def write_big(self, data, offset, length, seed):
        tree = self.pick_tree(data)
        path = self.pick(data, tree, "file")
        self.both(tree, op_write, path, offset, payload(seed, length), False)
        self.mark_dirty(tree, path)

    @rule(data=st.data(), length=small_lengths, seed=st.integers(0, 2**32))
    def append(self, data, length, seed):
        tree = self.pick_tree(data)
        path = self.pick(data, tree)
        self.both(tree, op_append, path, payload(seed, length))
        self.mark_dirty(tree, path)

    @rule(data=st.data(), size=sizes)
    def truncate(self, data, size):
        tree = self.pick_tree(data)
        path = self.pick(data, tree, "file", new=False)
        self.both(tree, lambda r, p, s: os.truncate(os.path.join(r, p), s), path, size)
        self.mark_dirty(tree, path)

    @rule(data=st.data(), offset=offsets, length=st.integers(0, 6 * MiB),
          uncached=st.booleans())
    def read(self, data, offset, length, uncached):
        tree = self.pick_tree(data)
        path = self.pick(data, tree, new=False)
        self.both(tree, op_read, path, offset, length, uncached, mutates=False)

    @rule(data=st.data())
    def rename(self, data):
        tree = self.pick_tree(data)
        src = self.pick(data, tree, new=False)
        dst = self.pick(data, tree)
        self.both(tree, lambda r, a, b: os.rename(os.path.join(r, a), os.path.join(r, b)),
                  src, dst)

    @rule(data=st.data())
    def unlink(self, data):
        tree = self.pick_tree(data)
        path = self.pick(data, tree, new=False)
        self.both(tree, lambda r, p: os.unlink(os.path.join(r, p)), path)

    @rule(data=st.data())
    def mkdir(self, data):
        tree = self.pick_tree(data)
        path = self.pick(data, tree, under_file=True)
        self.both(tree, lambda r, p: os.mkdir(os.path.join(r, p), 0o755), path)

    @rule(data=st.data())
    def rmdir(self, data):
        tree = self.pick_tree(data)
        path = self.pick(data, tree, "dir", new=False)
        self.both(tree, lambda r, p: os.rmdir(os.path.join(r, p)), path)

    @rule(data=st.data())
    def link(self, data):
        tree = self.pick_tree(data)
        src = self.pick(data, tree, new=False)
        dst = self.pick(data, tree)
        self.both(tree, lambda r, a, b: os.link(os.path.join(r, a), os.path.join(r, b),
                                                follow_symlinks=False), src, dst)

    @rule(data=st.data(), dest=st.sampled_from(SYMLINK_TARGETS))
    def symlink(self, data, dest):
        tree = self.pick_tree(data)
        path = self.pick(data, tree)
        self.both(tree, lambda r, t, p: os.symlink(t, os.path.join(r, p)), dest, path)

    @rule(data=st.data(), mode=modes)
    def chmod(self, data, mode):
        tree = self.pick_tree(data)
        path = self.pick(data, tree, new=False)
        self.both(tree, lambda r, p, m: os.chmod(os.path.join(r, p), m), path, mode)

    @rule()
    def verify_everything(self):
        """Every byte of every tree and snapshot of this example, read from bmfs."""
        for name, (real, model) in sorted(self.trees.items()):
            compare_trees(real, model, what=f"{self.ex} {name}")
        for name, (real, model) in sorted(self.snaps.items()):
            compare_trees(real, model, what=f"{self.ex} snapshot {name}", readonly=True)

    # -- checks after every step -------------------------------------------------------
    @invariant()
    def same_trees(self):
        for name, (real, model) in sorted(self.trees.items()):
            compare_trees(real, model, contents=False, what=f"{self.ex} {name}")
        for tree, path in sorted(self.dirty):
            real, model = self.trees[tree]
            if os.path.isfile(os.path.join(model, path)) and \
                    not os.path.islink(os.path.join(model, path)):
                compare_file(os.path.join(real, path), os.path.join(model, path),
                             f"{self.ex} {tree}/{path}")
        self.dirty.clear()

    def teardown(self):
        # checked again, byte for byte, after the test remounts the volume
        for name, (real, model) in self.trees.items():
            self.env.final[real] = (model, False)
        for name, (real, model) in self.snaps.items():
            self.env.final[real] = (model, True)


class BranchModel(FsModel):
    """File operations in main and in branches, mixed with snapshot create and
    delete, branch create, reset, delete and fast-forward merge."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.ff_ok: set[str] = set()       # branches main has not changed since
        self.untouched: set[str] = set()   # branches from main with no change of their own

    def new_name(self, kind):
        self.n += 1
        return f"{kind}{self.ex[2:]}_{self.n}"

    def ctl(self, op, **args):
        reply = self.env.mnt.ctl(op, **args)
        assert reply["ok"], f"{op}({args}) failed: {reply}"
        return reply["result"]

    def on_change(self, tree):
        if tree == "main":
            self.ff_ok.clear()
        else:
            self.ff_ok.discard(tree)
            self.untouched.discard(tree)

    def branch_dirs(self, name):
        return (os.path.join(self.mp, ".bm", "branches", name, self.ex),
                os.path.join(self.base, "trees", name))

    def snap_dirs(self, name):
        return (os.path.join(self.mp, ".bm", "snapshots", name, self.ex),
                os.path.join(self.base, "snaps", name))

    @precondition(lambda self: len(self.snaps) < 4)
    @rule(data=st.data())
    def snapshot(self, data):
        tree = self.pick_tree(data)
        name = self.new_name("s")
        self.ctl("snapshot_create", name=name, branch=tree)
        real, model = self.snap_dirs(name)
        cp_a(self.trees[tree][1], model)
        self.snaps[name] = (real, model)
        compare_trees(real, model, what=f"new snapshot {name}", readonly=True)

    @precondition(lambda self: len(self.trees) < 4)
    @rule(data=st.data())
    def branch_create(self, data):
        sources = sorted(self.trees) + sorted(self.snaps)
        source = data.draw(st.sampled_from(sources), label="source")
        name = self.new_name("b")
        self.ctl("branch_create", name=name, source=source)
        real, model = self.branch_dirs(name)
        cp_a((self.trees.get(source) or self.snaps[source])[1], model)
        self.trees[name] = (real, model)
        if source == "main":
            self.ff_ok.add(name)
            self.untouched.add(name)
        compare_trees(real, model, what=f"new branch {name}")

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def branch_reset(self, data):
        """Reset a branch (main too: rolling back a bad update) to a snapshot."""
        name = data.draw(st.sampled_from(sorted(self.trees)), label="branch")
        to = data.draw(st.sampled_from(sorted(self.snaps)), label="snapshot")
        self.ctl("branch_reset", name=name, to=to)
        cp_a(self.snaps[to][1], self.trees[name][1])
        self.on_change(name)
        if name == "main":
            # main may now be older than a branch's fork point: merging an unchanged
            # branch would bring main forward again
            self.untouched.clear()
        self.dirty.update((name, p) for p in self.entries(name, "file"))

    @precondition(lambda self: self.ff_ok)
    @rule(data=st.data())
    def merge_fast_forward(self, data):
        name = data.draw(st.sampled_from(sorted(self.ff_ok)), label="branch")
        res = self.ctl("merge", source=name, into="main")
        assert res["result"] in ("fast-forward", "up to date"), res
        assert not res.get("conflicts"), res
        cp_a(self.trees[name][1], self.trees["main"][1])
        self.on_change("main")
        self.ff_ok.add(name)  # main now sits on the branch's state
        self.dirty.update(("main", p) for p in self.entries("main", "file"))

    @precondition(lambda self: self.untouched - self.ff_ok)
    @rule(data=st.data())
    def merge_unchanged_branch(self, data):
        """A branch with no change of its own merged into a changed main changes nothing."""
        name = data.draw(st.sampled_from(sorted(self.untouched - self.ff_ok)), label="branch")
        res = self.ctl("merge", source=name, into="main")
        assert not res.get("conflicts"), res
        self.dirty.update(("main", p) for p in self.entries("main", "file"))

    @precondition(lambda self: len(self.trees) > 1)
    @rule(data=st.data())
    def branch_delete(self, data):
        name = data.draw(st.sampled_from(sorted(set(self.trees) - {"main"})), label="branch")
        self.ctl("branch_delete", name=name)
        real, model = self.trees.pop(name)
        self.ff_ok.discard(name)
        self.untouched.discard(name)
        self.dirty = {(t, p) for t, p in self.dirty if t != name}
        shutil.rmtree(model)
        assert not os.path.exists(os.path.dirname(real)), f"deleted branch {name} still shows"

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def snapshot_delete(self, data):
        """What the other trees show stays (the mount frees in the background what
        only the snapshot held: prune_shadowed, while the next rules run)."""
        name = data.draw(st.sampled_from(sorted(self.snaps)), label="snapshot")
        self.ctl("snapshot_delete", name=name)
        real, model = self.snaps.pop(name)
        shutil.rmtree(model)
        assert not os.path.exists(os.path.dirname(real)), f"deleted snapshot {name} still shows"

    @precondition(lambda self: self.snaps)
    @rule(data=st.data(), which=st.integers(0, 4))
    def snapshot_is_read_only(self, data, which):
        """A change that would succeed on the model fails with EROFS; one that would
        fail anyway fails with the model's errno or EROFS; nothing changes."""
        name = data.draw(st.sampled_from(sorted(self.snaps)), label="snapshot")
        real, model = self.snaps[name]
        path = self.pick(data, "main")
        fn = [lambda r: op_write(r, path, 0, b"x", False),
              lambda r: os.truncate(os.path.join(r, path), 0),
              lambda r: os.mkdir(os.path.join(r, path)),
              lambda r: os.unlink(os.path.join(r, path)),
              lambda r: os.chmod(os.path.join(r, path), 0o700)][which]
        scratch = os.path.join(self.base, "scratch")
        cp_a(model, scratch)
        want = attempt(fn, scratch)
        shutil.rmtree(scratch)
        got = attempt(fn, real)
        if want[0] == "ok":
            assert got == ("err", errno.EROFS), (which, path, got)
        else:
            assert got in (want, ("err", errno.EROFS)), (which, path, got, want)
        compare_trees(real, model, what=f"snapshot {name}", readonly=True)

    @precondition(lambda self: len(self.trees) > 1)
    @rule(data=st.data())
    def cross_branch_rename_is_exdev(self, data):
        name = data.draw(st.sampled_from(sorted(set(self.trees) - {"main"})), label="branch")
        files = self.entries("main", "file")
        if not files:
            return
        src = os.path.join(self.trees["main"][0], files[0])
        for fn in (os.rename, os.link):
            with pytest.raises(OSError) as e:
                fn(src, os.path.join(self.trees[name][0], "moved"))
            assert e.value.errno == errno.EXDEV, (fn.__name__, e.value)

    @invariant()
    def snapshots_unchanged(self):
        for name, (real, model) in sorted(self.snaps.items()):
            compare_trees(real, model, contents=False, what=f"snapshot {name}",
                          readonly=True)


def run_model(machine, mnt, tmp_path, **kw):
    env = Env(mnt, str(tmp_path / "model"))
    os.makedirs(env.model_root)
    cls = type(machine.__name__, (machine,), {"env": env})
    run_state_machine_as_test(cls, settings=settings(**SETTINGS, **kw))
    # what every example left behind must have reached the devices and the metadata
    mnt.umount()
    assert_fsck_clean(mnt.volume)
    with Mounted(mnt.volume, mnt.mp):
        for real, (model, readonly) in sorted(env.final.items()):
            compare_trees(real, model, what=f"after remount: {real}", readonly=readonly)
    assert_fsck_clean(mnt.volume)


def test_posix_model(mnt, tmp_path):
    run_model(FsModel, mnt, tmp_path, max_examples=EXAMPLES, stateful_step_count=40)


def test_branch_model(mnt, tmp_path):
    run_model(BranchModel, mnt, tmp_path, max_examples=EXAMPLES, stateful_step_count=40)


# -- three-way merges: a file at a time, compared with what a merge must make of it --------
MERGE_NAMES = ["a", "b"]  # few: both sides often change the same one
XATTR_NAMES = ["user.bm.type", "user.x"]
XATTR_VALUES = [b"npy", b"proto:bmfs.examples.Sample", b"1", b"22"]
merge_offsets = st.one_of(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 70000),
                          st.integers(STRIPE - 3000, STRIPE + 3000))
merge_lengths = st.one_of(st.integers(1, 3000), st.integers(1, 70000))
merge_sizes = st.one_of(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 70000),
                        st.integers(STRIPE - 3000, STRIPE + 3000))
seeds = st.integers(0, 2**32)
strategies = st.sampled_from([None, "ours", "theirs"])
# MergeModel's changes: method -> its arguments
CHANGES = {
    "write": dict(offset=merge_offsets, length=merge_lengths, seed=seeds, inside=st.booleans()),
    "truncate": dict(size=merge_sizes),
    "chmod": dict(mode=st.sampled_from([0o644, 0o600, 0o755, 0o640])),
    "xattr": dict(key=st.sampled_from(XATTR_NAMES), value=st.sampled_from(XATTR_VALUES),
                  remove=st.booleans()),
    "replace": dict(size=merge_sizes, seed=seeds, dest=st.sampled_from(["a", "nowhere", "d/x"]),
                    link=st.booleans()),
    "remove": {},
}


class Obj:
    """The model of one name: a regular file (``data``, ``mode``, ``xattrs``) or a
    symlink (``target``); ``id`` tells inodes apart (a name given a new file or symlink
    changes its entry, not the old inode)."""

    def __init__(self, id, data=b"", target=None, mode=0o644, xattrs=None):
        self.id, self.data, self.target, self.mode = id, data, target, mode
        self.xattrs = dict(xattrs or {})

    def copy(self):
        return Obj(self.id, self.data, self.target, self.mode, self.xattrs)

    def shown(self):
        """What a user sees (not the id)."""
        if self.target is not None:
            return ("link", self.target)
        return ("file", len(self.data), hashlib.sha256(self.data).hexdigest(), self.mode,
                tuple(sorted(self.xattrs.items())))


def shown_in(real_dir) -> dict:
    """name -> what bmfs shows of it (as Obj.shown), read past the page cache."""
    out = {}
    for name in sorted(os.listdir(real_dir)):
        p = os.path.join(real_dir, name)
        s = os.lstat(p)
        if stat.S_ISLNK(s.st_mode):
            out[name] = ("link", os.readlink(p))
            continue
        data = read_all(p)
        assert len(data) == s.st_size, f"{p}: {len(data)} bytes read, stat says {s.st_size}"
        xattrs = tuple(sorted((k, os.getxattr(p, k)) for k in os.listxattr(p)))
        out[name] = ("file", len(data), hashlib.sha256(data).hexdigest(),
                     stat.S_IMODE(s.st_mode), xattrs)
    return out


def merged_name(b, s, t, fs, ft, strategy):
    """What a three-way merge makes of one name: ``("ok", Obj or None, the side it comes
    from whole: "s", "t" or None)``, or ``("refused",)``. ``b``, ``s``, ``t``: base, source, target (Obj or
    None); ``fs``, ``ft``: what each side did to the base's inode ({"data", "meta"})."""
    bid = b.id if b else None
    ds, dt = (s.id if s else None) != bid, (t.id if t else None) != bid
    win = {"theirs": s, "ours": t}.get(strategy)
    whole = {"theirs": "s", "ours": "t"}.get(strategy)
    if ds and dt:  # both gave the name something new (or both removed it)
        if (s is None) and (t is None):
            return ("ok", None, None)
        return ("refused",) if strategy is None else ("ok", win, whole)
    if ds or dt:
        other_changed = ft if ds else fs
        if not other_changed:
            return ("ok", s if ds else t, "s" if ds else "t")
        # one side took the name away from the inode the other side changed
        if strategy is None:
            return ("refused",)
        renamer_wins = (strategy == "theirs") == ds
        if renamer_wins:
            return ("ok", win, whole)
        if (s if ds else t) is not None:  # the name now holds another inode there
            return ("refused",)
        return ("ok", win, whole)
    if b is None:
        return ("ok", None, None)
    conflict = "data" in fs and "data" in ft
    if s.mode != b.mode and t.mode != b.mode and s.mode != t.mode:
        conflict = True
    keys_ = set(b.xattrs) | set(s.xattrs) | set(t.xattrs)
    for k in keys_:
        sv, bv, tv = s.xattrs.get(k), b.xattrs.get(k), t.xattrs.get(k)
        if sv != bv and tv != bv and sv != tv:
            conflict = True
    if conflict:
        return ("refused",) if strategy is None else ("ok", win, whole)
    out = t.copy()
    if "data" in fs:
        out.data = s.data
    if s.mode != b.mode:
        out.mode = s.mode
    for k in keys_:
        if s.xattrs.get(k) != b.xattrs.get(k):
            if k in s.xattrs:
                out.xattrs[k] = s.xattrs[k]
            else:
                out.xattrs.pop(k, None)
    return ("ok", out, "s" if fs and not ft else "t" if not fs else None)


class MergeModel(RuleBasedStateMachine):
    """Rounds of: a branch of main; files and symlinks changed on either side (their
    sizes, kinds, contents, modes and xattrs made to differ); a merge of the branch into
    main with --ours, --theirs or no strategy, compared name by name with
    ``merged_name``: every byte, the size, mode and xattrs of each file. With no
    strategy a conflict must change nothing; ``bmfs diff`` must not list a file that
    came whole from one side against that side (the branch, or a snapshot of main
    taken before the merge)."""

    env: Env = None

    def __init__(self):
        super().__init__()
        self.ex = self.env.new_example("mx")
        self.mp = self.env.mnt.mp
        self.model_dir = os.path.join(self.env.model_root, self.ex)
        self.side = {"main": {}}       # side -> name -> Obj
        self.did = {"main": {}}        # side -> name -> what was done to the base's inode
        self.base: dict | None = None  # main at the fork, while a round's branch lives
        self.branch = None
        self.n = 0
        self.ids = 0
        self.changes = 0

    def ctl(self, op, **args):
        return self.env.mnt.ctl(op, **args)

    def dir_of(self, side):
        if side == "main":
            return os.path.join(self.mp, self.ex)
        return os.path.join(self.mp, ".bm", "branches", self.branch, self.ex)

    def new_id(self):
        self.ids += 1
        return self.ids

    def pick(self, data, kinds=("file", "none")):
        sides = sorted(self.side)
        side = data.draw(st.sampled_from(sides), label="side")
        objs = self.side[side]

        def kind(n):
            o = objs.get(n)
            return "none" if o is None else ("link" if o.target is not None else "file")
        names = [n for n in MERGE_NAMES if kind(n) in kinds]
        if not names:
            return side, None
        return side, data.draw(st.sampled_from(names), label="name")

    def changed(self, side, name, what):
        """``what`` ("data", "meta") was done to ``name`` on ``side``: noted, checked."""
        self.touched(side, name, what)
        self.check(side, name)

    def touched(self, side, name, what):
        o = self.side[side].get(name)
        b = (self.base or {}).get(name)
        if o is not None and b is not None and o.id == b.id:
            self.did[side].setdefault(name, set()).add(what)

    def check(self, side, name=None):
        """bmfs shows what the model has: of ``name`` (after a change to it), or all."""
        if name is not None:
            self.changes += 1
        got = shown_in(self.dir_of(side))
        want = {n: o.shown() for n, o in self.side[side].items() if o is not None}
        if name is not None:
            got, want = got.get(name), want.get(name)
        assert got == want, f"{self.ex} {side} {name or ''}: bmfs {got}, model {want}"

    # -- changes on either side -----------------------------------------------------------
    @rule(data=st.data(), **CHANGES["write"])
    def write(self, data, offset, length, seed, inside):
        """A write (``inside``: within the file, keeping its size, which the other side
        may change)."""
        side, name = self.pick(data)
        if name is None:
            return
        p = os.path.join(self.dir_of(side), name)
        o = self.side[side].get(name)
        if inside and o is not None and o.data:
            offset %= len(o.data)
            length = min(length, len(o.data) - offset)
        payload_ = payload(seed, length)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if o is None:
                os.fchmod(fd, 0o644)
                o = self.side[side][name] = Obj(self.new_id())
            os.pwrite(fd, payload_, offset)
        finally:
            os.close(fd)
        old = o.data.ljust(offset, b"\0")
        o.data = old[:offset] + payload_ + old[offset + length:]
        self.changed(side, name, "data")

    @rule(data=st.data(), **CHANGES["truncate"])
    def truncate(self, data, size):
        side, name = self.pick(data, ("file",))
        if name is None:
            return
        o = self.side[side][name]
        if size == len(o.data):
            size += 1  # (a truncate to the same size need not change the file)
        os.truncate(os.path.join(self.dir_of(side), name), size)
        o.data = o.data[:size].ljust(size, b"\0")
        self.changed(side, name, "data")

    @rule(data=st.data(), **CHANGES["chmod"])
    def chmod(self, data, mode):
        side, name = self.pick(data, ("file",))
        if name is None:
            return
        os.chmod(os.path.join(self.dir_of(side), name), mode)
        self.side[side][name].mode = mode
        self.changed(side, name, "meta")

    @rule(data=st.data(), **CHANGES["xattr"])
    def xattr(self, data, key, value, remove):
        side, name = self.pick(data, ("file",))
        if name is None:
            return
        o, p = self.side[side][name], os.path.join(self.dir_of(side), name)
        if remove:
            if key not in o.xattrs:
                return
            os.removexattr(p, key)
            del o.xattrs[key]
        else:
            os.setxattr(p, key, value)
            o.xattrs[key] = value
        self.changed(side, name, "meta")

    @rule(data=st.data(), **CHANGES["replace"])
    def replace(self, data, size, seed, dest, link):
        """The name gets a new file or a symlink (its old inode goes)."""
        side, name = self.pick(data, ("file", "link", "none"))
        p = os.path.join(self.dir_of(side), name)
        if self.side[side].get(name) is not None:
            os.unlink(p)
        if link:
            os.symlink(dest, p)
            self.side[side][name] = Obj(self.new_id(), target=dest)
        else:
            body = payload(seed, size)
            with open(p, "wb") as f:
                f.write(body)
            os.chmod(p, 0o644)
            self.side[side][name] = Obj(self.new_id(), data=body)
        self.check(side, name)

    @rule(data=st.data())
    def remove(self, data):
        side, name = self.pick(data, ("file", "link"))
        if name is None:
            return
        os.unlink(os.path.join(self.dir_of(side), name))
        self.side[side][name] = None
        self.check(side, name)

    # -- the rounds -----------------------------------------------------------------------
    @initialize(sizes=st.lists(merge_sizes, min_size=len(MERGE_NAMES),
                               max_size=len(MERGE_NAMES)), seed=st.integers(0, 2**32))
    def start(self, sizes, seed):
        """Main starts with a file of each name, and the first round's branch."""
        for i, (name, size) in enumerate(zip(MERGE_NAMES, sizes)):
            body = payload(seed + i, size)
            with open(os.path.join(self.dir_of("main"), name), "wb") as f:
                f.write(body)
            self.side["main"][name] = Obj(self.new_id(), data=body)
        self.fork()

    def fork(self):
        self.n += 1
        self.branch = f"m{self.ex[2:]}_{self.n}"
        reply = self.ctl("branch_create", name=self.branch, source="main")
        assert reply["ok"], reply
        main = self.side["main"]
        self.base = {n: o.copy() for n, o in main.items() if o is not None}
        self.side["br"] = {n: o.copy() for n, o in self.base.items()}
        self.did = {"main": {}, "br": {}}
        self.changes = 0  # in this round (a merge waits for a few)
        self.check("br")

    @rule(data=st.data(), n=st.integers(2, 8), strategy=strategies)
    def changes_then_merge(self, data, n, strategy):
        """A round in one step (hypothesis makes many short examples)."""
        for _ in range(n):
            change = data.draw(st.sampled_from(sorted(CHANGES)), label="change")
            getattr(self, change)(data, **{k: data.draw(v, label=k)
                                           for k, v in CHANGES[change].items()})
        self.merge(strategy)

    @precondition(lambda self: self.changes >= 3)
    @rule(strategy=strategies)
    def merge(self, strategy):
        b, s, t = self.base, self.side["br"], self.side["main"]
        want, whole, refused = {}, {"s": [], "t": []}, False
        for name in MERGE_NAMES:
            r = merged_name(b.get(name), s.get(name), t.get(name), self.did["br"].get(name, set()),
                            self.did["main"].get(name, set()), strategy)
            if r[0] == "refused":
                refused = True
                continue
            want[name] = r[1]
            if r[1] is not None and r[2]:
                whole[r[2]].append(name)
        before = f"pre{self.branch}"  # main as it was: what the merge changed in it
        assert self.ctl("snapshot_create", name=before, branch="main")["ok"]
        args = {"source": self.branch, "into": "main"}
        if strategy:
            args["strategy"] = strategy
        reply = self.ctl("merge", **args)
        if refused:
            assert not reply["ok"] and reply["errno"] == errno.EEXIST, \
                f"{self.ex}: merge {strategy} should be refused: {reply}"
            self.check("main")
            assert self.ctl("snapshot_delete", name=before)["ok"]
            return
        assert reply["ok"], f"{self.ex}: merge {strategy}: {reply}"
        self.side["main"] = {n: o.copy() for n, o in want.items() if o is not None}
        self.check("main")
        self.check("br")
        # a file that comes whole from one side is that side's, times included
        for side, tree in (("s", self.branch), ("t", before)):
            d = self.ctl("diff", a=tree, b="main")["result"]
            listed = set(d["added"]) | set(d["removed"]) | set(d["changed"])
            shown = sorted(n for n in whole[side] if f"/{self.ex}/{n}" in listed)
            assert not shown, f"{self.ex}: diff {tree} main lists files taken whole: {shown}"
        assert self.ctl("snapshot_delete", name=before)["ok"]
        assert self.ctl("branch_delete", name=self.branch)["ok"]
        self.fork()  # the next round

    def teardown(self):
        # main's files, checked again after the test remounts the volume
        os.makedirs(self.model_dir)
        for name, o in self.side["main"].items():
            if o is None:
                continue
            p = os.path.join(self.model_dir, name)
            if o.target is not None:
                os.symlink(o.target, p)
            else:
                with open(p, "wb") as f:
                    f.write(o.data)
                os.chmod(p, o.mode)
        self.env.final[os.path.join(self.mp, self.ex)] = (self.model_dir, False)


def test_merge_model(mnt, tmp_path):
    # the same examples every run (BMFS_MERGE_RANDOM=1 hunts with fresh ones, and
    # BMFS_MERGE_EXAMPLES=N more of them): a suite that fails at random would hide every
    # other regression. Cases hunts found are tests of their own below.
    run_model(MergeModel, mnt, tmp_path, max_examples=MERGE_EXAMPLES, stateful_step_count=50,
              derandomize=not os.environ.get("BMFS_MERGE_RANDOM"))


@pytest.mark.parametrize("main_first", [False, True])
def test_merge_of_truncate_and_chmod_against_an_xattr(mnt, main_first):
    """A case the merge model found (seed 101018762108104551887558650124540225537): the
    branch truncates a file and chmods it, main gives it an xattr; each side read after
    each change, as the model does. The kernel (writeback cache) hands main's inode the
    mtime it kept for the first write after the branch was made: main's mtime moved
    without a content change, which is no conflict with the branch's rewrite (the
    content changer's mtime wins, docs/branches.md). The branch first or main first:
    a clean merge either way, with the branch's bytes and main's xattr."""
    main, br = mnt.mp, os.path.join(mnt.mp, ".bm", "branches", "tx")
    with open(os.path.join(main, "a"), "wb") as f:
        f.write(payload(7, 793))
    assert mnt.ctl("branch_create", name="tx", source="main")["ok"]
    shown_in(br)

    def branch_side():
        os.truncate(os.path.join(br, "a"), 0)
        shown_in(br)
        os.truncate(os.path.join(br, "a"), 1)
        shown_in(br)
        os.chmod(os.path.join(br, "a"), 0o644)
        shown_in(br)

    def main_side():
        os.setxattr(os.path.join(main, "a"), "user.bm.type", b"npy")
        shown_in(main)
    for side in ((main_side, branch_side) if main_first else (branch_side, main_side)):
        side()
    reply = mnt.ctl("merge", source="tx", into="main")
    assert reply["ok"], reply
    want = Obj(0, data=b"\0", xattrs={"user.bm.type": b"npy"}).shown()
    assert shown_in(main)["a"] == want
    assert mnt.ctl("branch_delete", name="tx")["ok"]


def test_merge_theirs_of_a_grown_file_against_a_write(mnt):
    """A case the merge model found (seed 47422216340379121273903198223896379734) once
    mtimes no longer decided conflicts: the branch grows a file past a stripe, main
    writes inside it. Both wrote the file, a conflict whatever the mtimes say (main's
    write may carry the mtime the kernel kept from before the branch, the base's), so
    --theirs gives the branch's file whole, not main's chunk under the branch's size."""
    main, br = mnt.mp, os.path.join(mnt.mp, ".bm", "branches", "gx")
    a = os.path.join(main, "a")
    body = payload(3, 65536)
    with open(a, "wb") as f:
        f.write(body)
    assert mnt.ctl("branch_create", name="gx", source="main")["ok"]
    os.truncate(os.path.join(br, "a"), STRIPE + 51)
    fd = os.open(a, os.O_WRONLY)
    try:
        os.pwrite(fd, payload(4, 736), 0)
    finally:
        os.close(fd)
    reply = mnt.ctl("merge", source="gx", into="main", strategy="theirs")
    assert reply["ok"], reply
    want = body + b"\0" * (STRIPE + 51 - len(body))
    assert read_all(a) == want
    assert mnt.ctl("branch_delete", name="gx")["ok"]
