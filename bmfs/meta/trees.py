"""Trees (branches and snapshots) and their layers, as records: names, the chain of
layers under a tree, which layers are live. Shared by the lifecycle operations
(branches.py), the layer collection (layer_gc.py), diff (diff.py) and merge (merge.py).
"""
from __future__ import annotations

import json
import re
import time

from ..errors import Invalid, NotFound
from ..kv import prefix_end
from . import keys
from .layers import Chain

TOUCHED = "_touched"  # result key: (branch, SUBs whose visible value changed); not sent
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}$")


def validate_name(kind: str, name) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise Invalid(f"invalid {kind} name {name!r}: use 1-128 characters from A-Z a-z 0-9 "
                      f"and ._+- , starting with a letter, digit or _, without '..'")
    return name


async def list_names(kv, kind: str) -> list[str]:
    prefix = keys.BRANCH_PREFIX if kind == "branch" else keys.SNAPSHOT_PREFIX
    return [keys.tree_name_of(k) for k, _ in await kv.range(prefix, prefix_end(prefix))]


async def load_record(txn, key):
    raw = await txn.get(key)
    return json.loads(raw) if raw is not None else None


async def new_layer(txn, parent: int | None) -> int:
    v = await txn.get(keys.counter("layer"))
    lay = int(v) if v else 2
    txn.put(keys.counter("layer"), b"%d" % (lay + 1))
    txn.put(keys.layer(lay), json.dumps({"parent": parent, "created": time.time()}).encode())
    return lay


async def source_tree(txn, name: str) -> tuple[str, dict]:
    """A source tree by name: a branch if one has that name, else a snapshot."""
    rec = await load_record(txn, keys.branch(name))
    if rec is not None:
        return "branch", rec
    rec = await load_record(txn, keys.snapshot(name))
    if rec is not None:
        return "snapshot", rec
    raise NotFound(f"no branch or snapshot named {name!r}")


async def freeze_head(txn, branch: str, rec: dict) -> int:
    """Freeze a branch's head: it continues in a new layer. Returns the frozen layer."""
    frozen = rec["head"]
    rec["head"] = await new_layer(txn, frozen)
    txn.put(keys.branch(branch), json.dumps(rec).encode())
    return frozen


async def chain_of(kv, top: int, branch: str | None) -> Chain:
    layers, lay = [], top
    while lay is not None:
        layers.append(lay)
        rec = json.loads(await kv.get(keys.layer(lay)))
        lay = rec["parent"]
    return Chain(tuple(layers), branch)


async def tree_chain(kv, name: str) -> tuple[str, Chain]:
    txn = kv.begin()
    kind, rec = await source_tree(txn, name)
    if kind == "branch":
        return kind, await chain_of(kv, rec["head"], name)
    return kind, await chain_of(kv, rec["layer"], None)


async def tree_heads(kv) -> set[int]:
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
    for head in await tree_heads(kv):
        try:
            chain = await chain_of(kv, head, None)
        except TypeError:  # (deleted and collected meanwhile: a layer record is gone)
            continue
        if lay in chain.layers:
            out.append(chain)
    return counter, out


async def live_layers(kv) -> set[int]:
    live = set()
    for head in await tree_heads(kv):
        live.update((await chain_of(kv, head, None)).layers)
    return live
