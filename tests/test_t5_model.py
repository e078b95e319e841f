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
source's.
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
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

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


class FsModel(RuleBasedStateMachine):
    """File operations on the example's directory in main (and, in the subclass, in
    branches of the example)."""

    env: Env = None  # set by the test function

    def __init__(self):
        super().__init__()
        env = self.env
        env.examples += 1
        self.ex = f"ex{env.examples}"
        self.mp = env.mnt.mp
        self.base = os.path.join(env.model_root, self.ex)
        os.makedirs(os.path.join(self.base, "trees", "main"))
        os.makedirs(os.path.join(self.base, "snaps"))
        os.mkdir(os.path.join(self.mp, self.ex))
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
