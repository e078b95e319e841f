"""Branches and snapshots: O(1) copy-on-write trees over layers (see layers.py)."""
from __future__ import annotations

from . import keys


async def list_names(kv, kind: str) -> list[str]:
    prefix = b"b/" if kind == "branch" else b"n/"
    return [k[2:].decode() for k, _ in await kv.range(prefix, prefix + b"\xff")]
