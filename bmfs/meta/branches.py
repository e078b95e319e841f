"""Branches and snapshots: O(1) copy-on-write trees over layers (see layers.py).

Creating a branch or snapshot writes four small keys whatever the size of the tree:
the source's head layer becomes frozen (no branch writes to it any more), the source
continues in a new empty layer on top of it, and the new tree gets its own new layer
(a branch) or is that frozen layer (a snapshot). Deleting a tree frees the layers
no other tree uses (their keys, and the references their slice lists held, which
queues stripes nothing else references for garbage collection).

Merges: fast-forward when the target has not changed since the trees forked (the
target moves onto the source's state, O(1)); otherwise three-way over the keys either
side changed since the fork, at file and directory level. A key changed on both sides
to different values is a conflict, except inode attributes changed apart (newest
times; link counts and a directory's parent are recomputed from the merged entries).
The merged namespace is then made whole (``_Merge``). Conflicts are listed by path and
nothing changes unless a strategy (``theirs``/``ours``) says which side wins; an inode
in conflict then comes whole from that side (attributes, data, xattrs, symlink).
"""
from __future__ import annotations

import json
import logging
import re
import stat
import time
from collections import Counter, defaultdict

import trio

from ..errors import Busy, Exists, FsError, Invalid, NotFound, Perm
from ..kv import prefix_end
from . import keys
from .layers import Chain, lget, lput, ldel, lscan
from .namespace import ROOT, adjust_refs, put_chunk, recount
from .records import Inode, unpack_dentry, unpack_slices

log = logging.getLogger(__name__)
# keys a page of the layer collection reads (collect_layers, prune_shadowed). It runs in
# a mount's background beside its requests, and a local engine (SQLite) reads on the
# event loop: it yields after each page, and a request, which waits at each of its
# own steps, waits for a page per step; a page ten times this size makes an open
# during a pass wait visibly (docs/branches.md has the figures)
GC_PAGE = 1000
TOUCHED = "_touched"  # result key: (branch, SUBs whose visible value changed); not sent
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}$")


class MergeConflict(FsError):
    """A three-way merge found paths changed differently on both sides."""
    errno = 17

    def __init__(self, paths, hint: str = "use --theirs or --ours"):
        self.paths = paths
        super().__init__("merge conflicts in: " + ", ".join(paths[:20]) +
                         (f" and {len(paths) - 20} more" if len(paths) > 20 else "") +
                         f"; nothing was changed ({hint})")


def validate_name(kind: str, name) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise Invalid(f"invalid {kind} name {name!r}: use 1-128 characters from A-Z a-z 0-9 "
                      f"and ._+- , starting with a letter, digit or _, without '..'")
    return name


async def list_names(kv, kind: str) -> list[str]:
    prefix = keys.BRANCH_PREFIX if kind == "branch" else keys.SNAPSHOT_PREFIX
    return [keys.tree_name_of(k) for k, _ in await kv.range(prefix, prefix_end(prefix))]


async def _load(txn, key):
    raw = await txn.get(key)
    return json.loads(raw) if raw is not None else None


async def _new_layer(txn, parent: int | None) -> int:
    v = await txn.get(keys.counter("layer"))
    lay = int(v) if v else 2
    txn.put(keys.counter("layer"), b"%d" % (lay + 1))
    txn.put(keys.layer(lay), json.dumps({"parent": parent, "created": time.time()}).encode())
    return lay


async def _source(txn, name: str) -> tuple[str, dict]:
    """A source tree by name: a branch if one has that name, else a snapshot."""
    rec = await _load(txn, keys.branch(name))
    if rec is not None:
        return "branch", rec
    rec = await _load(txn, keys.snapshot(name))
    if rec is not None:
        return "snapshot", rec
    raise NotFound(f"no branch or snapshot named {name!r}")


async def _freeze(txn, branch: str, rec: dict) -> int:
    """Freeze a branch's head: it continues in a new layer. Returns the frozen layer."""
    frozen = rec["head"]
    rec["head"] = await _new_layer(txn, frozen)
    txn.put(keys.branch(branch), json.dumps(rec).encode())
    return frozen


async def _chain(kv, top: int, branch: str | None) -> Chain:
    layers, lay = [], top
    while lay is not None:
        layers.append(lay)
        rec = json.loads(await kv.get(keys.layer(lay)))
        lay = rec["parent"]
    return Chain(tuple(layers), branch)


async def tree_chain(kv, name: str) -> tuple[str, Chain]:
    txn = kv.begin()
    kind, rec = await _source(txn, name)
    if kind == "branch":
        return kind, await _chain(kv, rec["head"], name)
    return kind, await _chain(kv, rec["layer"], None)


# -- operations (called through a mount's control file: op_<name>) ------------------------
async def op_branch_create(kv, name: str, source: str = "main") -> dict:
    validate_name("branch", name)

    async def fn(txn):
        if await txn.get(keys.branch(name)) is not None:
            raise Exists(f"branch {name!r} exists")
        kind, rec = await _source(txn, source)
        base = await _freeze(txn, source, rec) if kind == "branch" else rec["layer"]
        head = await _new_layer(txn, base)
        txn.put(keys.branch(name), json.dumps(
            {"head": head, "created": time.time(), "from": source}).encode())
        return {"name": name, "from": source, "head": head}
    return await kv.transact(fn)


async def op_snapshot_create(kv, name: str, branch: str = "main") -> dict:
    validate_name("snapshot", name)

    async def fn(txn):
        if await txn.get(keys.snapshot(name)) is not None:
            raise Exists(f"snapshot {name!r} exists")
        rec = await _load(txn, keys.branch(branch))
        if rec is None:
            raise NotFound(f"no branch named {branch!r}")
        lay = await _freeze(txn, branch, rec)
        txn.put(keys.snapshot(name), json.dumps(
            {"layer": lay, "created": time.time(), "branch": branch}).encode())
        return {"name": name, "branch": branch, "layer": lay}
    return await kv.transact(fn)


async def _list(kv, prefix: bytes) -> list[dict]:
    return [{"name": keys.tree_name_of(k), **json.loads(v)}
            for k, v in await kv.range(prefix, prefix_end(prefix))]


async def op_branch_list(kv) -> list[dict]:
    return await _list(kv, keys.BRANCH_PREFIX)


async def op_snapshot_list(kv) -> list[dict]:
    return await _list(kv, keys.SNAPSHOT_PREFIX)


async def op_branch_delete(kv, name: str, collect: bool = True) -> dict:
    """Delete branch ``name``; then collect the layers only it used (collect_layers),
    or with ``collect=False`` leave that to collect_pending (a mount's background
    upkeep): {"freed_layers": how many, or None when left}."""
    validate_name("branch", name)
    if name == "main":
        raise Perm("branch main cannot be deleted")
    return await _delete_tree(kv, "branch", keys.branch(name), name, collect)


async def op_snapshot_delete(kv, name: str, collect: bool = True) -> dict:
    """Delete snapshot ``name``; layers as op_branch_delete."""
    validate_name("snapshot", name)
    return await _delete_tree(kv, "snapshot", keys.snapshot(name), name, collect)


async def _delete_tree(kv, kind: str, key: bytes, name: str, collect: bool) -> dict:
    async def fn(txn):
        if await txn.get(key) is None:
            raise NotFound(f"no {kind} named {name!r}")
        txn.delete(key)
        if not collect:  # the mark: a number no delete had before (never reset)
            n = int(await txn.get(keys.counter("collect")) or 0) + 1
            txn.put(keys.counter("collect"), b"%d" % n)
            txn.put(keys.COLLECT_LAYERS, b"%d" % n)
    await kv.transact(fn)
    return {"freed_layers": await collect_layers(kv) if collect else None}


async def collect_pending(kv) -> int | None:
    """Collect the layers of the trees deleted with ``collect=False`` (collect_layers):
    how many were freed, or None if none was pending. The mark is cleared only if no
    other delete came meanwhile (that one's layers may be missed by this pass): each
    delete marks with a number of its own. Safe to run in several mounts at once (see
    collect_layers): they only do the same work."""
    mark = await kv.get(keys.COLLECT_LAYERS)
    if mark is None:
        return None
    freed = await collect_layers(kv)

    async def fn(txn):
        if await txn.get(keys.COLLECT_LAYERS) == mark:
            txn.delete(keys.COLLECT_LAYERS)
    await kv.transact(fn)
    return freed


async def op_branch_reset(kv, name: str, to: str) -> dict:
    """Point branch ``name`` at the state of snapshot ``to`` (its own changes dropped)."""
    validate_name("branch", name)
    _, old = await tree_chain(kv, name)
    _, new = await tree_chain(kv, to)
    _, xo, xn = _fork(old, new)
    touched = await _changed_subs(kv, xo | xn)

    async def fn(txn):
        rec = await _load(txn, keys.branch(name))
        if rec is None:
            raise NotFound(f"no branch named {name!r}")
        snap = await _load(txn, keys.snapshot(to))
        if snap is None:
            raise NotFound(f"no snapshot named {to!r}")
        rec["head"] = await _new_layer(txn, snap["layer"])
        txn.put(keys.branch(name), json.dumps(rec).encode())
    await kv.transact(fn)
    return {"branch": name, "to": to, "freed_layers": await collect_layers(kv),
            TOUCHED: (name, touched)}


# -- layer garbage collection -------------------------------------------------------------
async def _heads(kv) -> set[int]:
    """The layers branches (their heads) and snapshots name."""
    heads = set()
    for prefix, field in ((keys.BRANCH_PREFIX, "head"), (keys.SNAPSHOT_PREFIX, "layer")):
        for _, v in await kv.range(prefix, prefix_end(prefix)):
            heads.add(json.loads(v)[field])
    return heads


async def trees_through(kv, lay: int) -> tuple[bytes | None, list[Chain]]:
    """The layer counter, read first, and the chain of every branch and snapshot that
    has layer ``lay`` in it. A tree made after the counter was read is not among them:
    a caller that acts on the list checks the counter in its transaction."""
    counter = await kv.get(keys.counter("layer"))
    out = []
    for head in await _heads(kv):
        try:
            chain = await _chain(kv, head, None)
        except TypeError:  # (deleted and collected meanwhile: a layer record is gone)
            continue
        if lay in chain.layers:
            out.append(chain)
    return counter, out


async def live_layers(kv) -> set[int]:
    live = set()
    for head in await _heads(kv):
        live.update((await _chain(kv, head, None)).layers)
    return live


async def collect_layers(kv, batch: int = 500) -> int:
    """Delete every layer no branch or snapshot uses, with its keys and references;
    then the versions that layers kept under another hide (prune_shadowed).

    Safe beside other mounts' branch operations: a layer made after the pass read the
    heads (numbered from the layer counter read before them) is never taken for dead;
    a layer a head left meanwhile (a reset) is taken for live, and left to the next
    pass. It yields to the event loop after each page of keys it reads."""
    first_new = int(await kv.get(keys.counter("layer")) or 2)
    live = await live_layers(kv)
    layer_rows = await kv.range(*keys.span(keys.LAYER_PREFIX))
    dead = {lay for lay in (keys.layer_of(k) for k, _ in layer_rows) if lay < first_new} - live
    if not dead:
        await _prune(kv)
        return 0
    for prefix in keys.LAYERED_PREFIXES:
        start = prefix
        while True:
            rows = await kv.range(start, prefix_end(prefix), GC_PAGE)
            doomed = [(k, v) for k, v in rows if k[-9:-8] == b"@" and int(k[-8:], 16) in dead]
            for i in range(0, len(doomed), batch):
                await _drop_keys(kv, doomed[i:i + batch])
            await trio.lowlevel.checkpoint()  # (see GC_PAGE)
            if len(rows) < GC_PAGE:
                break
            start = rows[-1][0] + b"\x00"
    for lay in dead:
        txn = kv.begin()
        txn.delete(keys.layer(lay))
        for k, _ in await kv.range(*keys.span(keys.orphan_prefix(lay))):
            txn.delete(k)
        await kv.commit(txn)
    await _prune(kv)
    return len(dead)


async def _prune(kv) -> None:
    """prune_shadowed after a branch operation that has committed: a failure is
    logged (the next one prunes what this one left), not raised."""
    try:
        await prune_shadowed(kv)
    except FsError as e:
        log.warning("could not prune the versions deleted trees left hidden: %s", e)


async def prune_shadowed(kv, batch: int = 100) -> int:
    """Delete the versions that no tree can see any more: those of a frozen layer
    that no branch or snapshot names and that has one child layer, where a layer on
    its way up has a version of the same key (a value or a tombstone). The way up
    goes from child to child while the layer reached is unnamed with one child too,
    and ends at the first that is not (named, or forked): every tree that goes
    through the layer goes that way first, so the first version on it hides theirs
    (a snapshot's layer under an empty one that a branch made from main froze).

    What this gives back: a snapshot pins the versions of its layer; once it is
    deleted, its layer stays in main's chain (main's layers are stacked on it), and
    without this the data of every file changed or deleted since would stay taken.
    A layer's child only ever keeps hiding what it hides (a key written there is
    replaced or tombstoned, never removed while a lower layer has a version), so
    this is safe while mounts write. Returns the number of versions deleted.
    (``batch`` versions a transaction: a slice list's stripes cost ~2 operations
    each, and etcd's --max-txn-ops bounds a transaction.)"""
    # every new layer (branch, snapshot, reset, merge) bumps this counter: read before
    # the layer graph and again in each deleting transaction, a change stops the prune
    # (the graph it worked from may miss a child or a head; the next one redoes it)
    counter = await kv.get(keys.counter("layer"))
    parents = {}
    for k, v in await kv.range(*keys.span(keys.LAYER_PREFIX)):
        parents[keys.layer_of(k)] = json.loads(v).get("parent")
    heads = await _heads(kv)
    children = defaultdict(list)
    for lay, parent in parents.items():
        if parent is not None:
            children[parent].append(lay)
    child = {lay: kids[0] for lay, kids in children.items()
             if len(kids) == 1 and lay not in heads}
    if not child:
        return 0
    way = _ways_up(child)
    dropped = 0
    for prefix in keys.LAYERED_PREFIXES:
        start = prefix
        while True:
            rows = await kv.range(start, prefix_end(prefix), GC_PAGE)
            versions = defaultdict(list)  # SUB -> the layers of its versions here
            for k, _ in rows:
                if k[-9:-8] == b"@":
                    versions[k[:-9]].append(int(k[-8:], 16))
            doomed = [(k, v) for k, v in rows if k[-9:-8] == b"@"
                      and _hidden(way, int(k[-8:], 16), versions[k[:-9]]) is not None]
            for i in range(0, len(doomed), batch):
                n = await _drop_shadowed(kv, doomed[i:i + batch], way, counter)
                if n is None:
                    return dropped
                dropped += n
            await trio.lowlevel.checkpoint()  # (see GC_PAGE)
            if len(rows) < GC_PAGE:
                break
            # (a key's versions are adjacent: the next page starts at the last key's
            # first version, so no version is judged without those above it)
            last = rows[-1][0]
            start = last[:-8] + b"00000000" if last[-9:-8] == b"@" else last + b"\x00"
            if start <= rows[0][0]:
                start = last + b"\x00"
    return dropped


def _ways_up(child: dict) -> dict[int, tuple[int, int]]:
    """Each layer of ``child`` and each layer its way up ends at -> (that end, its
    distance from it). A version in layer Y lies on the way up from layer X when both
    have the same end and Y is nearer to it; the nearest such hides X's version."""
    way: dict[int, tuple[int, int]] = {}
    for lay in child:
        path = []
        while lay in child and lay not in way:
            path.append(lay)
            lay = child[lay]
        end, dist = way.get(lay, (lay, 0))
        way.setdefault(lay, (end, dist))
        for below in reversed(path):
            dist += 1
            way[below] = (end, dist)
    return way


def _hidden(way: dict, lay: int, layers) -> int | None:
    """The layer, among ``layers`` (those with a version of one SUB), of the version
    that hides the one in layer ``lay`` (the nearest on its way up), or None."""
    mine = way.get(lay)
    if mine is None or mine[1] == 0:  # not prunable (named, forked, or a leaf)
        return None
    best = None
    for other in layers:
        theirs = way.get(other)
        if theirs is not None and theirs[0] == mine[0] and theirs[1] < mine[1] and \
                (best is None or theirs[1] > way[best][1]):
            best = other
    return best


async def _drop_shadowed(kv, rows, way: dict, counter) -> int | None:
    """_drop_keys for versions hidden on their layer's way up (checked again in the
    transaction); None, with nothing deleted, if a layer was made since ``counter``.
    A hidden inode's orphan record goes only if the version hiding it is a tombstone
    (else the tree still has the nameless inode: unlinked, still open)."""
    n = 0

    async def fn(txn):
        nonlocal n
        n = 0
        if await txn.get(keys.counter("layer")) != counter:
            return False
        for k, _ in rows:
            lay, sub = int(k[-8:], 16), k[:-9]
            # (one read of the SUB's versions: each read key costs the commit a compare,
            # and etcd bounds a transaction's operations)
            found = {int(vk[-8:], 16): v for vk, v in await txn.range(sub + b"@", sub + b"A")
                     if len(vk) == len(k)}
            hider = _hidden(way, lay, found)
            cur = found.get(lay)
            if hider is None or cur is None:
                continue
            above = found[hider]
            txn.delete(k)
            n += 1
            if k.startswith(keys.CHUNK_PREFIX) and cur[:1] == keys.LIVE:
                await adjust_refs(txn, {s.sid for s in unpack_slices(cur[1:])}, -1)
            elif k.startswith(keys.INODE_PREFIX) and above[:1] == keys.TOMBSTONE:
                txn.delete(keys.orphan(lay, keys.ino_of(k)))
        return True
    return n if await kv.transact(fn) else None


async def _drop_keys(kv, rows):
    async def fn(txn):
        for k, v in rows:
            cur = await txn.get(k)
            if cur is None:
                continue
            txn.delete(k)
            if k.startswith(keys.CHUNK_PREFIX) and cur[:1] == keys.LIVE:
                await adjust_refs(txn, {s.sid for s in unpack_slices(cur[1:])}, -1)
    await kv.transact(fn)


# -- comparing trees: diff and merge ------------------------------------------------------
async def _changed_subs(kv, layers: set[int]) -> set[bytes]:
    """Every SUB with a version in one of ``layers``."""
    out = set()
    if not layers:
        return out
    for prefix in keys.LAYERED_PREFIXES:
        start = prefix
        while True:
            rows = await kv.range(start, prefix_end(prefix), 10000)
            for k, _ in rows:
                if k[-9:-8] == b"@" and int(k[-8:], 16) in layers:
                    out.add(k[:-9])
            if len(rows) < 10000:
                break
            start = rows[-1][0] + b"\x00"
    return out


def _fork(a: Chain, b: Chain) -> tuple[Chain, set[int], set[int]]:
    """The common base of two chains and the layers each has on top of it."""
    in_a = set(a.layers)
    base_i = next(i for i, lay in enumerate(b.layers) if lay in in_a)
    base = b.layers[base_i]
    a_i = a.layers.index(base)
    return Chain(b.layers[base_i:], None), set(a.layers[:a_i]), set(b.layers[:base_i])


class _Paths:
    """Resolves inode numbers and entry keys to paths within one tree (for reports)."""

    def __init__(self, kv, chain: Chain):
        self.kv, self.chain = kv, chain
        self._names: dict[int, bytes] | None = None

    async def dir_path(self, txn, ino: int) -> bytes:
        parts = []
        seen = 0
        while ino != 1 and seen < 4096:
            i = await lget(txn, self.chain, keys.inode(ino))
            if i is None:
                return b"?"
            parent = Inode.unpack(i).parent
            name = await self._name_in(txn, parent, ino)
            parts.append(name)
            ino = parent
            seen += 1
        return b"/" + b"/".join(reversed(parts))

    async def _name_in(self, txn, parent, ino) -> bytes:
        from .namespace import list_dir
        for name, cino, _ in await list_dir(txn, self.chain, parent):
            if cino == ino:
                return name
        return b"?"

    async def file_path(self, txn, ino: int) -> bytes:
        if self._names is None:
            from .layers import lscan
            self._names = {}
            for sub, v in await lscan(txn, self.chain, keys.DENTRY_PREFIX):
                cino = unpack_dentry(v)[0]
                self._names.setdefault(cino, sub)
        sub = self._names.get(ino)
        if sub is None:
            return b"<inode %d>" % ino
        return await self.entry_path(txn, sub)

    async def entry_path(self, txn, sub: bytes) -> bytes:
        parent, name = keys.dentry_of(sub)
        d = await self.dir_path(txn, parent)
        return (d.rstrip(b"/") + b"/" + name)

    async def of_sub(self, txn, sub: bytes) -> bytes:
        if sub.startswith(keys.DENTRY_PREFIX):
            return await self.entry_path(txn, sub)
        return await self.file_path(txn, keys.ino_of(sub))


def _same_but_read(sub: bytes, a: bytes | None, b: bytes | None) -> bool:
    """Whether two versions of a key are the same, or, for an inode record, differ in
    their atime alone: the file was read (relatime), not changed. Diffs and merges
    take such an inode for unchanged."""
    if a == b:
        return True
    if a is None or b is None or not sub.startswith(keys.INODE_PREFIX):
        return False
    ia, ib = Inode.unpack(a), Inode.unpack(b)
    ib.atime_ns = ia.atime_ns
    return ia == ib


async def op_diff(kv, a: str, b: str) -> dict:
    """Paths added, removed and changed going from tree ``a`` to tree ``b``."""
    _, ca = await tree_chain(kv, a)
    _, cb = await tree_chain(kv, b)
    _, xa, xb = _fork(ca, cb)
    subs = await _changed_subs(kv, xa | xb)
    txn = kv.begin()
    pa, pb = _Paths(kv, ca), _Paths(kv, cb)
    added, removed, changed = set(), set(), set()
    for sub in sorted(subs):
        va, vb = await lget(txn, ca, sub), await lget(txn, cb, sub)
        if _same_but_read(sub, va, vb):
            continue
        if sub.startswith(keys.DENTRY_PREFIX):
            if va is None:
                added.add(await pb.of_sub(txn, sub))
            elif vb is None:
                removed.add(await pa.of_sub(txn, sub))
            else:
                changed.add(await pb.of_sub(txn, sub))
        else:
            ino = keys.ino_of(sub)
            ia = await lget(txn, ca, keys.inode(ino))
            ib = await lget(txn, cb, keys.inode(ino))
            if ia is None or ib is None or Inode.unpack(ib).is_dir():
                continue  # created/removed (seen through entries) or directory times
            changed.add(await pb.of_sub(txn, sub))
    changed -= added | removed
    dec = lambda s: sorted(p.decode(errors="surrogateescape") for p in s)  # noqa: E731
    return {"added": dec(added), "removed": dec(removed), "changed": dec(changed)}


# Inode fields in a three-way merge. nlink and a directory's parent are not merged: they
# follow from the merged entries. A name or xattr change moves ctime, so times take the
# newest (a directory's mtime too: entries added on both sides); any other field
# changed differently on both sides is a conflict. A file whose content (its chunks or
# size) both sides changed is a conflict, whatever the mtimes say; its mtime is the
# content changer's when one side changed the content, the newest when neither did.
# (An mtime moves without a content change, and a content change may keep the base's
# mtime: under the writeback cache the kernel keeps a file's mtime itself and sends it
# to bmfs when it flushes the inode, at any later time, e.g. after a branch was made.)
_OWN_FIELDS = ("mode", "uid", "gid", "size", "rdev", "mtime_ns")
_NEWEST_FIELDS = ("atime_ns", "ctime_ns")


def _merge_inode(s: Inode, b: Inode, t: Inode, s_chunks: bool = False,
                 t_chunks: bool = False) -> tuple[Inode, list[str]]:
    """The target's inode with the source's changes; and the fields both changed.
    ``s_chunks``, ``t_chunks``: whether that side changed a chunk of the file."""
    out, clash = t.copy(), []
    s_data, t_data = s_chunks or s.size != b.size, t_chunks or t.size != b.size
    if s_data and t_data and not t.is_dir():
        # written on both sides, whatever the times say (a write's mtime may be one
        # the kernel kept from before the branch was made: equal to the base's)
        clash.append("data")
    for f in _OWN_FIELDS + _NEWEST_FIELDS:
        sv, bv, tv = getattr(s, f), getattr(b, f), getattr(t, f)
        if sv == bv or sv == tv:
            continue
        if tv == bv:
            setattr(out, f, sv)
        elif f in _NEWEST_FIELDS or (f == "mtime_ns" and (t.is_dir() or not s_data
                                                          and not t_data)):
            setattr(out, f, max(sv, tv))
        elif f == "mtime_ns" and s_data != t_data:
            setattr(out, f, sv if s_data else tv)
        else:
            clash.append(f)
    return out, clash


class _Merge:
    """One three-way merge in one transaction: ``plan`` maps every SUB whose merged value
    differs from the target's to that value (None: deleted).

    Keys are merged one by one (``by_key``), then the namespace is made whole again
    (``settle``), because a key-wise merge of two valid trees need not be one: entries
    and inodes change apart, and link counts and a directory's parent depend on entries
    of both sides. An entry added on one side keeps its inode, and the directory it is
    in, alive even if the other side deleted them (restored from that side whole, data
    included); an inode left without a name is deleted, unless it was in conflict and
    the winning side keeps it (then its names there come back). A directory given two
    places, or moved into itself through moves on both sides, is a conflict: the winning
    side's entries for it are taken, or without a strategy nothing changes.
    """

    def __init__(self, txn, kv, cs: Chain, base: Chain, ct: Chain, strategy, dsubs):
        self.txn, self.kv, self.cs, self.base, self.ct = txn, kv, cs, base, ct
        self.strategy = strategy
        self.dsubs = dsubs  # entries changed on either side since the fork
        self.plan: dict[bytes, bytes | None] = {}
        self.conflicts: set[bytes] = set()
        self.resolved = 0
        self.changes = 0  # plan changes so far (a repair step checks it moved)
        # inode -> SUBs ever planned under it (its own keys; for a directory, also the
        # entries in it): a repair looks at one inode without going through the plan
        self._planned: dict[int, set[bytes]] = {}
        self._vals: dict[tuple[int, bytes], bytes | None] = {}
        self._conflict_inos: set[int] | None = None
        self._naming: dict[int, dict[int, list[bytes]]] = {}  # side -> ino -> entries

    async def val(self, chain: Chain, sub: bytes) -> bytes | None:
        k = (chain.top, sub)
        if k not in self._vals:
            self._vals[k] = await lget(self.txn, chain, sub)
        return self._vals[k]

    async def mval(self, sub: bytes) -> bytes | None:
        """The merged value."""
        return self.plan[sub] if sub in self.plan else await self.val(self.ct, sub)

    def _plan(self, sub: bytes, value: bytes | None) -> None:
        if sub not in self.plan or self.plan[sub] != value:
            self.plan[sub] = value
            self.changes += 1
            self._planned.setdefault(keys.ino_of(sub), set()).add(sub)

    async def take(self, sub: bytes, value: bytes | None) -> None:
        if value == await self.val(self.ct, sub):
            if self.plan.pop(sub, self) is not self:
                self.changes += 1
        else:
            self._plan(sub, value)

    @property
    def winner(self) -> Chain | None:
        return {"theirs": self.cs, "ours": self.ct}.get(self.strategy)

    async def by_key(self, subs, target_subs=()) -> None:
        """Merge the keys the source changed (``subs``); ``target_subs``: those the
        target changed (only its chunks are looked at: who rewrote a file)."""
        # files whose chunks each side changed (their mtimes: _merge_inode)
        rewrote: dict[str, set[int]] = {"s": set(), "t": set()}
        for side, chain, changed in (("s", self.cs, subs), ("t", self.ct, target_subs)):
            for sub in changed:
                if sub.startswith(keys.CHUNK_PREFIX) and \
                        await self.val(chain, sub) != await lget(self.txn, self.base, sub):
                    rewrote[side].add(keys.ino_of(sub))
        for sub in subs:
            sv, bv, tv = (await self.val(self.cs, sub), await lget(self.txn, self.base, sub),
                          await self.val(self.ct, sub))
            if _same_but_read(sub, sv, bv) or sv == tv:
                continue
            if _same_but_read(sub, tv, bv):
                self._plan(sub, sv)
                continue
            if sub.startswith(keys.INODE_PREFIX) and sv and tv and bv:
                ino = keys.ino_of(sub)
                merged, clash = _merge_inode(Inode.unpack(sv), Inode.unpack(bv),
                                             Inode.unpack(tv), ino in rewrote["s"],
                                             ino in rewrote["t"])
                if clash:  # (taken whole from the winner: _take_conflicted_whole)
                    self.conflicts.add(sub)
                else:
                    await self.take(sub, merged.pack())
                continue
            self.conflicts.add(sub)
            if self.strategy == "theirs":
                self._plan(sub, sv)
        if self.conflicts and self.strategy is None:
            await self.refuse(self.conflicts)
        self.resolved = len(self.conflicts)
        await self._take_conflicted_whole()

    async def _take_conflicted_whole(self) -> None:
        """An inode with a key in conflict comes whole from the winning side: attributes,
        every chunk's slices, xattrs, symlink target (or its absence). Taken key by key,
        a file could get the winner's bytes with the loser's size, or a chunk of each."""
        inos = {keys.ino_of(s) for s in self.conflicts if not s.startswith(keys.DENTRY_PREFIX)}
        for ino in sorted(inos):
            for sub in await self._subs_of(ino):
                await self.take(sub, await self.val(self.winner, sub))

    async def refuse(self, subs, hint: str = "use --theirs or --ours"):
        pt, ps = _Paths(self.kv, self.ct), _Paths(self.kv, self.cs)
        paths = set()
        for sub in subs:
            p = await pt.of_sub(self.txn, sub)
            if p.startswith((b"?", b"<")):
                p = await ps.of_sub(self.txn, sub)
            paths.add(p.decode(errors="surrogateescape"))
        raise MergeConflict(sorted(paths), hint)

    async def settle(self) -> None:
        for _ in range(2 * len(self.dsubs) + 8):
            if not await self._round():
                return
        await self.refuse(self.dsubs[:20], "the merge did not settle; merge by hand")

    async def _round(self) -> bool:
        """Repair what this pass finds to repair (True: another pass follows, on the
        new plan), or set the derived fields. Repairs are made together, one pass for
        all (a pass per repair made a merge needing many of them quadratic); a repair
        only adds names, entries and keys of the inode it is about, and the counts
        are taken afresh by the next pass."""
        ents = [(sub, v) for sub, v in self.plan.items() if sub.startswith(keys.DENTRY_PREFIX)]
        if await self._keep_needed(ents):
            return True
        names, subdirs, placed = await self._count(ents)
        inos = set(names) | set(subdirs) | {keys.ino_of(s) for s in self.plan
                                             if not s.startswith(keys.DENTRY_PREFIX)}
        fixed, clashes, repaired = {}, [], False
        for ino in sorted(inos):
            mv, tv = await self.mval(keys.inode(ino)), await self.val(self.ct, keys.inode(ino))
            ti = Inode.unpack(tv) if tv else None
            if mv is None:
                named = (ti.nlink if not ti.is_dir() else ino != ROOT) + names[ino] > 0 \
                    if ti is not None else False
                if named or ti is not None and ti.is_dir() and not await self._empty(ino):
                    await self._restore(ino, self.ct)  # names or entries of the target use it
                    repaired = True
                elif await self._set_keys(ino):  # keys left of an inode the merge deletes
                    repaired = True
                continue
            mi = Inode.unpack(mv)
            sv = await self.val(self.cs, keys.inode(ino))
            side = self.ct if sv is None else self.cs
            if (sv is None) != (ti is None) and await self._set_keys(ino, side):
                repaired = True  # one side deleted it, the merge keeps it: whole, data too
                continue
            if mi.is_dir():
                n = (ti is not None and ino != ROOT) + names[ino]
                mi.nlink = (ti.nlink if ti else 2) + subdirs[ino]
                mi.parent = placed.get(ino, ti.parent if ti else 0)
            else:
                n = mi.nlink = (ti.nlink if ti else 0) + names[ino]
            if n == 0 and ino != ROOT and not (ti and ti.nlink == 0 and not names[ino]):
                # no name left (an inode the target holds open unlinked stays so)
                win = self.winner
                if win is not None and await self.val(win, keys.inode(ino)) is not None and \
                        await self._in_conflict(ino):
                    await self._restore(ino, win, names=True)
                elif not mi.is_dir() or await self._empty(ino):
                    await self._set_keys(ino)
                else:
                    await self.refuse([keys.inode(ino)], "cannot be merged automatically")
                repaired = True
                continue
            if mi.is_dir() and n > 1:
                clashes.append(ino)
            fixed[ino] = mi
        if repaired:
            return True
        if not clashes:
            clashes = await self._cycle(fixed, placed)
        if clashes:  # a directory in two places, or in itself
            if self.winner is None:
                await self.refuse([s for s in self.dsubs for ino in clashes
                                   if await self._names(s, ino)])
            for ino in clashes:
                for s in self.dsubs:
                    if await self._names(s, ino):
                        await self.take(s, await self.val(self.winner, s))
            self.resolved += 1
            return True
        for ino, mi in fixed.items():
            await self.take(keys.inode(ino), mi.pack())
        return False

    async def _keep_needed(self, ents) -> bool:
        """An entry needs its directory and its inode: restore those the merge deleted
        (True if any)."""
        restored = False
        for sub, v in ents:
            if v is None:
                continue
            for ino in (keys.ino_of(sub), unpack_dentry(v)[0]):
                if await self.mval(keys.inode(ino)) is None:
                    side = self.cs if v == await self.val(self.cs, sub) else self.ct
                    if await self.val(side, keys.inode(ino)) is None:
                        side = self.ct if side is self.cs else self.cs
                    await self._restore(ino, side)
                    restored = True
        return restored

    async def _count(self, ents):
        """Names and subdirectories gained (lost: negative) against the target, and the
        directory each moved directory is in now."""
        names, subdirs, placed = Counter(), Counter(), {}
        for sub, v in ents:
            parent = keys.ino_of(sub)
            for val, sign in ((await self.val(self.ct, sub), -1), (v, 1)):
                if val is not None:
                    ino, fmt = unpack_dentry(val)
                    names[ino] += sign
                    if stat.S_ISDIR(fmt):
                        subdirs[parent] += sign
                        if sign > 0:
                            placed[ino] = parent
        return names, subdirs, placed

    async def _cycle(self, fixed, placed) -> list[int]:
        """Directories the merge moved that no longer lead up to the root."""
        for ino in placed:
            seen, cur = [ino], ino
            while cur != ROOT:
                if cur in fixed:
                    cur = fixed[cur].parent
                else:
                    v = await self.mval(keys.inode(cur))
                    cur = Inode.unpack(v).parent if v else 0
                if cur in seen or not cur or len(seen) > 100000:
                    return [d for d in seen if d in placed]
                seen.append(cur)
        return []

    async def _names(self, sub: bytes, ino: int) -> bool:
        """Whether entry ``sub`` names ``ino`` in the merge or on the winning side."""
        vals = [await self.mval(sub)]
        if self.winner is not None:
            vals.append(await self.val(self.winner, sub))
        return any(v is not None and unpack_dentry(v)[0] == ino for v in vals)

    async def _in_conflict(self, ino: int) -> bool:
        """Whether a conflicting key is one of the inode's, or an entry naming it."""
        if self._conflict_inos is None:  # (conflicts are all found before settling)
            self._conflict_inos = set()
            for sub in self.conflicts:
                if not sub.startswith(keys.DENTRY_PREFIX):
                    self._conflict_inos.add(keys.ino_of(sub))
                    continue
                for chain in (self.cs, self.ct):
                    v = await self.val(chain, sub)
                    if v is not None:
                        self._conflict_inos.add(unpack_dentry(v)[0])
        return ino in self._conflict_inos

    async def _entries_naming(self, ino: int, side: Chain) -> list[bytes]:
        """The changed entries (``dsubs``) that name ``ino`` on ``side``."""
        index = self._naming.get(side.top)
        if index is None:
            index = self._naming[side.top] = {}
            for sub in self.dsubs:
                v = await self.val(side, sub)
                if v is not None:
                    index.setdefault(unpack_dentry(v)[0], []).append(sub)
        return index.get(ino, [])

    async def _subs_of(self, ino: int) -> set[bytes]:
        """The SUBs of an inode on either side and in the plan (entries not included)."""
        out = {keys.inode(ino), keys.symlink(ino)}
        for chain in (self.cs, self.ct):
            for prefix in (keys.chunk_prefix(ino), keys.xattr_prefix(ino)):
                out.update(sub for sub, _ in await lscan(self.txn, chain, prefix))
        out.update(s for s in self._planned.get(ino, ()) if not s.startswith(keys.DENTRY_PREFIX))
        return out

    async def _restore(self, ino: int, side: Chain, names: bool = False) -> None:
        """Take inode ``ino`` whole from ``side``, with the names it has there (``names``;
        a directory always: it needs its one name, entries of a file have their own)."""
        iv = await self.val(side, keys.inode(ino))
        await self.take(keys.inode(ino), iv)
        await self._set_keys(ino, side)
        if not names and not Inode.unpack(iv).is_dir():
            return
        for sub in await self._entries_naming(ino, side):
            v = await self.val(side, sub)
            mv = await self.mval(sub)
            if mv is not None and unpack_dentry(mv)[0] != ino:
                await self.refuse([sub], "a name was reused; merge by hand")
            await self.take(sub, v)

    async def _set_keys(self, ino: int, side: Chain | None = None) -> bool:
        """Make an inode's data, xattrs and symlink those of ``side``, or delete them and
        the inode (None); True if the plan changed."""
        before = self.changes
        for sub in await self._subs_of(ino):
            if side is None:
                await self.take(sub, None)
            elif not sub.startswith(keys.INODE_PREFIX):
                await self.take(sub, await self.val(side, sub))
        return self.changes != before

    async def _empty(self, ino: int) -> bool:
        p = keys.dir_prefix(ino)
        for sub, _ in await lscan(self.txn, self.ct, p):
            if await self.mval(sub) is not None:
                return False
        return not any(s.startswith(p) and self.plan.get(s) is not None
                       for s in self._planned.get(ino, ()))


async def _source_unchanged(txn, name: str, chain: Chain) -> None:
    """Busy unless snapshot ``name`` still names ``chain``'s top layer (read in the
    transaction: deleted meanwhile, its layer's hidden versions may be pruned)."""
    rec = await _load(txn, keys.snapshot(name))
    if rec is None or rec["layer"] != chain.top:
        raise Busy(f"snapshot {name!r} changed during the merge; try again")


async def op_merge(kv, source: str, into: str, strategy: str | None = None) -> dict:
    if strategy not in (None, "theirs", "ours"):
        raise Invalid("strategy is theirs or ours")
    if source == into:
        raise Invalid("cannot merge a tree into itself")
    skind, cs = await tree_chain(kv, source)
    tkind, ct = await tree_chain(kv, into)
    if tkind != "branch":
        raise Invalid(f"{into!r} is a snapshot; merge into a branch")
    base, xs, xt = _fork(cs, ct)
    if not xs:
        return {"result": "up to date", "applied": 0, "conflicts": []}
    target_changes = await _changed_subs(kv, xt)
    if not target_changes:
        async def ff(txn):
            rec = await _load(txn, keys.branch(into))
            if rec["head"] != ct.top:
                raise Busy(f"branch {into!r} changed during the merge; try again")
            if skind == "branch":
                srec = await _load(txn, keys.branch(source))
                if srec is None or srec["head"] != cs.top:
                    raise Busy(f"branch {source!r} changed during the merge; try again")
                frozen = await _freeze(txn, source, srec)
            else:
                await _source_unchanged(txn, source, cs)
                frozen = cs.top
            rec["head"] = await _new_layer(txn, frozen)
            txn.put(keys.branch(into), json.dumps(rec).encode())
        touched = await _changed_subs(kv, xs)
        await kv.transact(ff)
        await collect_layers(kv)
        return {"result": "fast-forward", "applied": 0, "conflicts": [],
                TOUCHED: (into, touched)}

    subs = sorted(await _changed_subs(kv, xs))
    dsubs = sorted({s for s in subs if s.startswith(keys.DENTRY_PREFIX)} |
                   {s for s in target_changes if s.startswith(keys.DENTRY_PREFIX)})
    tchunks = sorted(s for s in target_changes if s.startswith(keys.CHUNK_PREFIX))

    async def three_way(txn):
        rec = await _load(txn, keys.branch(into))
        if rec["head"] != ct.top:
            raise Busy(f"branch {into!r} changed during the merge; try again")
        if skind == "snapshot":  # (a branch's layers below its head stay as they are)
            await _source_unchanged(txn, source, cs)
        m = _Merge(txn, kv, cs, base, ct, strategy, dsubs)
        await m.by_key(subs, tchunks)
        await m.settle()
        for sub, value in m.plan.items():
            if sub.startswith(keys.CHUNK_PREFIX):
                ino, idx = keys.chunk_of(sub)
                await put_chunk(txn, ct, ino, idx, unpack_slices(value) if value else [])
            elif value is None:
                await ldel(txn, ct, sub)
            else:
                await lput(txn, ct, sub, value)
        # record counts follow the merged records (chunks and xattrs merge key by key)
        planned = list(m.plan)
        for ino in sorted({keys.ino_of(s) for s in planned
                           if not s.startswith(keys.DENTRY_PREFIX)}):
            if await recount(txn, ct, ino):
                planned.append(keys.inode(ino))
        return planned, m.resolved
    plan, nconf = await kv.transact(three_way)
    return {"result": "merged", "applied": len(plan), "conflicts_resolved": nconf,
            "strategy": strategy, TOUCHED: (into, set(plan))}
