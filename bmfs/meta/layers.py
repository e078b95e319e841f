"""Layered reads and writes: how one KV holds many copy-on-write trees.

A tree (a branch or a snapshot) is a chain of layers, top first. Every layered key is
stored as ``SUB@LAYER``; the versions of one SUB in different layers sit next to each
other in key order, so a lookup is one range read whatever the chain's depth, and it
returns the version of the first layer in the chain that has one (picked by the layers'
ranks: its cost grows with the key's versions, not with the chain's depth). Writes go to the
top layer only; deleting a SUB that a lower layer still shows writes a tombstone.
Creating a branch or snapshot freezes the current top and starts new empty layers
(branches.py): O(1) whatever the size of the tree, and no data is copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..kv import Txn, prefix_end
from . import keys

_SUFFIX = 9  # b"@" + 8 hex digits


@dataclass(frozen=True)
class Chain:
    """The layers of one tree, top first; ``branch`` is None for a snapshot."""
    layers: tuple[int, ...]
    branch: str | None

    @property
    def top(self) -> int:
        return self.layers[0]

    @property
    def writable(self) -> bool:
        return self.branch is not None

    @cached_property
    def rank(self) -> dict[int, int]:
        """Layer -> its place in the chain (0: the top). A lookup picks the version of
        the lowest rank among the few a key has: its cost does not grow with the
        chain's depth (a branch snapshotted hundreds of times)."""
        return {lay: i for i, lay in enumerate(self.layers)}


def lkey(sub: bytes, lay: int) -> bytes:
    return sub + b"@%08x" % lay


def split(key: bytes) -> tuple[bytes, int]:
    return key[:-_SUFFIX], int(key[-8:], 16)


def layered(key: bytes) -> tuple[bytes, int] | None:
    """``(SUB, layer)`` of a layered key, or None if it is not one."""
    if len(key) < 2 + _SUFFIX or key[-_SUFFIX:-8] != b"@":
        return None
    try:
        return split(key)
    except ValueError:
        return None


async def lget(txn: Txn, chain: Chain, sub: bytes) -> bytes | None:
    """The value of ``sub`` as the tree sees it, or None."""
    if len(chain.layers) == 1:
        v = await txn.get(lkey(sub, chain.top))
    else:
        rank, best, v = chain.rank, len(chain.layers), None
        want = len(sub) + _SUFFIX
        for k, val in await txn.range(sub + b"@", sub + b"A"):
            if len(k) == want:
                r = rank.get(int(k[-8:], 16), best)
                if r < best:
                    best, v = r, val
    if v is None or v[:1] == keys.TOMBSTONE:
        return None
    return v[1:]


async def lput(txn: Txn, chain: Chain, sub: bytes, value: bytes) -> None:
    txn.put(lkey(sub, chain.top), keys.LIVE + value)


async def ldel(txn: Txn, chain: Chain, sub: bytes) -> None:
    """Remove ``sub`` from the tree: delete the top version, tombstone lower ones."""
    txn.delete(lkey(sub, chain.top))
    if len(chain.layers) > 1:
        rank = chain.rank
        want = len(sub) + _SUFFIX
        for k, v in await txn.range(sub + b"@", sub + b"A"):
            if len(k) == want and rank.get(int(k[-8:], 16), 0) > 0:
                # something below shows through unless hidden
                if await _visible_below(txn, chain, sub):
                    txn.put(lkey(sub, chain.top), keys.TOMBSTONE)
                return


async def _visible_below(txn, chain, sub):
    below = Chain(chain.layers[1:], None)
    return await lget(txn, below, sub) is not None


async def top_value(txn: Txn, chain: Chain, sub: bytes) -> bytes | None:
    """The raw version stored in the top layer itself (tag byte included), or None."""
    return await txn.get(lkey(sub, chain.top))


async def lscan(txn: Txn, chain: Chain, prefix: bytes) -> list[tuple[bytes, bytes]]:
    """``(sub, value)`` for every SUB under ``prefix`` the tree shows, in SUB order."""
    rank = chain.rank
    best: dict[bytes, tuple[int, bytes]] = {}
    for k, v in await txn.range(prefix, prefix_end(prefix)):
        if k[-_SUFFIX:-8] != b"@":
            continue
        r = rank.get(int(k[-8:], 16))
        if r is None:
            continue
        sub = k[:-_SUFFIX]
        cur = best.get(sub)
        if cur is None or r < cur[0]:
            best[sub] = (r, v)
    out = [(sub, v[1:]) for sub, (_, v) in best.items() if v[:1] == keys.LIVE]
    out.sort()
    return out
