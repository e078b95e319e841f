"""The collection of layers: the keys of layers no branch or snapshot uses any more
(collect_layers), and versions in frozen layers that every tree above them shadows
(prune_shadowed). Both read the layered keys a page at a time.
"""
from __future__ import annotations

import json
import logging
from collections import defaultdict

import trio

from ..errors import FsError
from ..kv import prefix_end
from . import keys, trees
from .namespace import adjust_refs
from ..format.records import unpack_slices
from .trees import tree_heads

log = logging.getLogger(__name__)
# keys a page of the layer collection reads (collect_layers, prune_shadowed). It runs in
# a mount's background beside its requests, and a local engine (SQLite) reads on the
# event loop: it yields after each page, and a request, which waits at each of its
# own steps, waits for a page per step; a page ten times this size makes an open
# during a pass wait visibly (docs/branches.md has the figures)
GC_PAGE = 1000


async def collect_layers(kv, batch: int = 500, progress=None) -> int:
    """Delete every layer no branch or snapshot uses, with its keys and references;
    then the versions that layers kept under another hide (prune_shadowed).

    Safe beside other mounts' branch operations: a layer made after the pass read the
    heads (numbered from the layer counter read before them) is never taken for dead;
    a layer a head left meanwhile (a reset) is taken for live, and left to the next
    pass. It yields to the event loop after each page of keys it reads.
    ``progress(done, total)`` is told of the kinds of keys gone through (a bar's)."""
    first_new = int(await kv.get(keys.counter("layer")) or 2)
    live = await trees.live_layers(kv)
    layer_rows = await kv.range(*keys.span(keys.LAYER_PREFIX))
    dead = {lay for lay in (keys.layer_of(k) for k, _ in layer_rows) if lay < first_new} - live
    if not dead:
        await _prune(kv)
        return 0
    steps = len(keys.LAYERED_PREFIXES) + 1
    for n, prefix in enumerate(keys.LAYERED_PREFIXES):
        if progress:
            progress(n, steps)
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
    if progress:
        progress(steps, steps)
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
    heads = await tree_heads(kv)
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
