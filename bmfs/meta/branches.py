"""Branches and snapshots: O(1) copy-on-write trees over layers (see layers.py); their
lifecycle (create, list, delete, reset). Diff and merge: diff.py and merge.py; the
collection of layers no tree uses: layer_gc.py; tree records: trees.py.

Creating a branch or snapshot writes four small keys whatever the size of the tree:
the source's head layer becomes frozen (no branch writes to it any more), the source
continues in a new empty layer on top of it, and the new tree gets its own new layer
(a branch) or is that frozen layer (a snapshot). Deleting a tree frees the layers
no other tree uses (their keys, and the references their slice lists held, which
queues stripes nothing else references for garbage collection).
"""
from __future__ import annotations

import json
import time

from ..errors import Exists, NotFound, Perm
from ..kv import prefix_end
from . import keys, layer_gc
from .diff import changed_subs, fork
from .trees import (TOUCHED, freeze_head, load_record, new_layer, source_tree, tree_chain,
                    validate_name)

# -- operations (called through a mount's control file: op_<name>) ------------------------
async def op_branch_create(kv, name: str, source: str = "main") -> dict:
    validate_name("branch", name)

    async def fn(txn):
        if await txn.get(keys.branch(name)) is not None:
            raise Exists(f"branch {name!r} exists")
        kind, rec = await source_tree(txn, source)
        base = await freeze_head(txn, source, rec) if kind == "branch" else rec["layer"]
        head = await new_layer(txn, base)
        txn.put(keys.branch(name), json.dumps(
            {"head": head, "created": time.time(), "from": source}).encode())
        return {"name": name, "from": source, "head": head}
    return await kv.transact(fn)


async def op_snapshot_create(kv, name: str, branch: str = "main") -> dict:
    validate_name("snapshot", name)

    async def fn(txn):
        if await txn.get(keys.snapshot(name)) is not None:
            raise Exists(f"snapshot {name!r} exists")
        rec = await load_record(txn, keys.branch(branch))
        if rec is None:
            raise NotFound(f"no branch named {branch!r}")
        lay = await freeze_head(txn, branch, rec)
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
    return {"freed_layers": await layer_gc.collect_layers(kv) if collect else None}


async def collect_pending(kv, progress=None) -> int | None:
    """Collect the layers of the trees deleted with ``collect=False`` (collect_layers):
    how many were freed, or None if none was pending. The mark is cleared only if no
    other delete came meanwhile (that one's layers may be missed by this pass): each
    delete marks with a number of its own. Safe to run in several mounts at once (see
    collect_layers): they only do the same work."""
    mark = await kv.get(keys.COLLECT_LAYERS)
    if mark is None:
        return None
    freed = await layer_gc.collect_layers(kv, progress=progress)

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
    _, xo, xn = fork(old, new)
    touched = await changed_subs(kv, xo | xn)

    async def fn(txn):
        rec = await load_record(txn, keys.branch(name))
        if rec is None:
            raise NotFound(f"no branch named {name!r}")
        snap = await load_record(txn, keys.snapshot(to))
        if snap is None:
            raise NotFound(f"no snapshot named {to!r}")
        rec["head"] = await new_layer(txn, snap["layer"])
        txn.put(keys.branch(name), json.dumps(rec).encode())
    await kv.transact(fn)
    return {"branch": name, "to": to, "freed_layers": await layer_gc.collect_layers(kv),
            TOUCHED: (name, touched)}
