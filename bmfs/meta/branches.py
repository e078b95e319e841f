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
to different values is a conflict, except directory attributes (merged: newest
times, link counts adjusted by the source's change). Conflicts are listed by path and
nothing changes unless a strategy (``theirs``/``ours``) says which side wins.
"""
from __future__ import annotations

import json
import re
import time

from ..errors import Busy, Exists, FsError, Invalid, NotFound, Perm
from ..kv import prefix_end
from . import keys
from .layers import Chain, lget, lput, ldel
from .namespace import adjust_refs, put_chunk
from .records import Inode, unpack_dentry, unpack_slices

TOUCHED = "_touched"  # result key: (branch, SUBs whose visible value changed); not sent
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}$")


class MergeConflict(FsError):
    """A three-way merge found paths changed differently on both sides."""
    errno = 17

    def __init__(self, paths):
        self.paths = paths
        super().__init__("merge conflicts in: " + ", ".join(paths[:20]) +
                         (f" and {len(paths) - 20} more" if len(paths) > 20 else "") +
                         "; nothing was changed (use --theirs or --ours)")


def validate_name(kind: str, name) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise Invalid(f"invalid {kind} name {name!r}: use 1-128 characters from A-Z a-z 0-9 "
                      f"and ._+- , starting with a letter, digit or _, without '..'")
    return name


async def list_names(kv, kind: str) -> list[str]:
    prefix = b"b/" if kind == "branch" else b"n/"
    return [k[2:].decode() for k, _ in await kv.range(prefix, prefix_end(prefix))]


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
    return [{"name": k[2:].decode(), **json.loads(v)}
            for k, v in await kv.range(prefix, prefix_end(prefix))]


async def op_branch_list(kv) -> list[dict]:
    return await _list(kv, b"b/")


async def op_snapshot_list(kv) -> list[dict]:
    return await _list(kv, b"n/")


async def op_branch_delete(kv, name: str) -> dict:
    validate_name("branch", name)
    if name == "main":
        raise Perm("branch main cannot be deleted")

    async def fn(txn):
        if await txn.get(keys.branch(name)) is None:
            raise NotFound(f"no branch named {name!r}")
        txn.delete(keys.branch(name))
    await kv.transact(fn)
    return {"freed_layers": await collect_layers(kv)}


async def op_snapshot_delete(kv, name: str) -> dict:
    validate_name("snapshot", name)

    async def fn(txn):
        if await txn.get(keys.snapshot(name)) is None:
            raise NotFound(f"no snapshot named {name!r}")
        txn.delete(keys.snapshot(name))
    await kv.transact(fn)
    return {"freed_layers": await collect_layers(kv)}


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
async def live_layers(kv) -> set[int]:
    live = set()
    for prefix, field in ((b"b/", "head"), (b"n/", "layer")):
        for _, v in await kv.range(prefix, prefix_end(prefix)):
            live.update((await _chain(kv, json.loads(v)[field], None)).layers)
    return live


async def collect_layers(kv, batch: int = 500) -> int:
    """Delete every layer no branch or snapshot uses, with its keys and references."""
    live = await live_layers(kv)
    dead = {int(k[2:], 16) for k, _ in await kv.range(b"y/", b"y0")} - live
    if not dead:
        return 0
    for prefix in keys.LAYERED_PREFIXES:
        start = prefix
        while True:
            rows = await kv.range(start, prefix_end(prefix), 10000)
            doomed = [(k, v) for k, v in rows if k[-9:-8] == b"@" and int(k[-8:], 16) in dead]
            for i in range(0, len(doomed), batch):
                await _drop_keys(kv, doomed[i:i + batch])
            if len(rows) < 10000:
                break
            start = rows[-1][0] + b"\x00"
    for lay in dead:
        txn = kv.begin()
        txn.delete(keys.layer(lay))
        for k, _ in await kv.range(b"o/%08x/" % lay, b"o/%08x0" % lay):
            txn.delete(k)
        await kv.commit(txn)
    return len(dead)


async def _drop_keys(kv, rows):
    async def fn(txn):
        for k, v in rows:
            cur = await txn.get(k)
            if cur is None:
                continue
            txn.delete(k)
            if k.startswith(b"c/") and cur[:1] == keys.LIVE:
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
            for sub, v in await lscan(txn, self.chain, b"d/"):
                cino = unpack_dentry(v)[0]
                self._names.setdefault(cino, sub)
        sub = self._names.get(ino)
        if sub is None:
            return b"<inode %d>" % ino
        return await self.entry_path(txn, sub)

    async def entry_path(self, txn, sub: bytes) -> bytes:
        parent, name = int(sub[2:18], 16), sub[19:]
        d = await self.dir_path(txn, parent)
        return (d.rstrip(b"/") + b"/" + name)

    async def of_sub(self, txn, sub: bytes) -> bytes:
        if sub.startswith(b"d/"):
            return await self.entry_path(txn, sub)
        return await self.file_path(txn, int(sub[2:18], 16))


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
        if va == vb:
            continue
        if sub.startswith(b"d/"):
            if va is None:
                added.add(await pb.of_sub(txn, sub))
            elif vb is None:
                removed.add(await pa.of_sub(txn, sub))
            else:
                changed.add(await pb.of_sub(txn, sub))
        else:
            ino = int(sub[2:18], 16)
            ia = await lget(txn, ca, keys.inode(ino))
            ib = await lget(txn, cb, keys.inode(ino))
            if ia is None or ib is None or Inode.unpack(ib).is_dir():
                continue  # created/removed (seen through entries) or directory times
            changed.add(await pb.of_sub(txn, sub))
    changed -= added | removed
    dec = lambda s: sorted(p.decode(errors="surrogateescape") for p in s)  # noqa: E731
    return {"added": dec(added), "removed": dec(removed), "changed": dec(changed)}


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
                frozen = await _freeze(txn, source, srec)
            else:
                frozen = cs.top
            rec["head"] = await _new_layer(txn, frozen)
            txn.put(keys.branch(into), json.dumps(rec).encode())
        touched = await _changed_subs(kv, xs)
        await kv.transact(ff)
        await collect_layers(kv)
        return {"result": "fast-forward", "applied": 0, "conflicts": [],
                TOUCHED: (into, touched)}

    subs = sorted(await _changed_subs(kv, xs))

    async def three_way(txn):
        rec = await _load(txn, keys.branch(into))
        if rec["head"] != ct.top:
            raise Busy(f"branch {into!r} changed during the merge; try again")
        plan, conflicts = [], []
        for sub in subs:
            sv, bv, tv = (await lget(txn, cs, sub), await lget(txn, base, sub),
                          await lget(txn, ct, sub))
            if sv == bv or sv == tv:
                continue
            if tv == bv:
                plan.append((sub, sv))
                continue
            if sub.startswith(b"i/") and sv and tv and bv:
                si, ti, bi = Inode.unpack(sv), Inode.unpack(tv), Inode.unpack(bv)
                if si.is_dir() and ti.is_dir():
                    ti.nlink += si.nlink - bi.nlink
                    ti.mtime_ns = max(ti.mtime_ns, si.mtime_ns)
                    ti.ctime_ns = max(ti.ctime_ns, si.ctime_ns)
                    plan.append((sub, ti.pack()))
                    continue
            conflicts.append(sub)
        if conflicts and strategy is None:
            paths = _Paths(kv, ct)
            raise MergeConflict(sorted({(await paths.of_sub(txn, s)).decode(
                errors="surrogateescape") for s in conflicts}))
        if strategy == "theirs":
            for sub in conflicts:
                plan.append((sub, await lget(txn, cs, sub)))
        for sub, value in plan:
            if sub.startswith(b"c/"):
                ino, idx = int(sub[2:18], 16), int(sub[19:], 16)
                await put_chunk(txn, ct, ino, idx, unpack_slices(value) if value else [])
            elif value is None:
                await ldel(txn, ct, sub)
            else:
                await lput(txn, ct, sub, value)
        return [sub for sub, _ in plan], len(conflicts)
    plan, nconf = await kv.transact(three_way)
    return {"result": "merged", "applied": len(plan), "conflicts_resolved": nconf,
            "strategy": strategy, TOUCHED: (into, set(plan))}
