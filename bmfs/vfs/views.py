"""Views: the trees a mount shows, and how their inode numbers are made.

A mount shows its branch at the root (view 0) and, under the hidden ``.bm``
directory, every branch and snapshot. Inode numbers seen by the kernel are
``view << 48 | ino``: view 0 keeps the stored numbers, so the mounted branch's inode
numbers are stable across mounts. View 0xFFFF holds the control directory itself.

The mounted branch's own directory under ``.bm`` is a view of its own (``by_name``
names it, not view 0): the kernel takes the root inode number for the mount's root
only (a lookup that returns it elsewhere fails with EIO), and a directory reached by
two paths would be moved between them. The two views of that branch are as two mounts
of it: close-to-open, and attributes the kernel cached through one path catch up with
a change made through the other at the next open or within the attribute timeout.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import NotFound
from ..meta import keys
from ..meta.layers import Chain

VIEW_SHIFT = 48
INO_MASK = (1 << VIEW_SHIFT) - 1
CTL_VIEW = 0xFFFF
CTL_ROOT = CTL_VIEW << VIEW_SHIFT | 1       # /.bm
CTL_BRANCHES = CTL_VIEW << VIEW_SHIFT | 2   # /.bm/branches
CTL_SNAPSHOTS = CTL_VIEW << VIEW_SHIFT | 3  # /.bm/snapshots
CTL_FILE = CTL_VIEW << VIEW_SHIFT | 4       # /.bm/ctl
CTL_PROGRESS = CTL_VIEW << VIEW_SHIFT | 5   # /.bm/progress
CTL_NAME = b".bm"


@dataclass
class View:
    id: int
    kind: str          # "branch" or "snapshot"
    name: str
    chain: Chain

    @property
    def writable(self) -> bool:
        return self.kind == "branch"


class Views:
    """The views of one mount, and the layer parents they are built from (cached)."""

    def __init__(self, kv):
        self.kv = kv
        self.by_id: dict[int, View] = {}
        self.by_name: dict[tuple[str, str], View] = {}
        self._parents: dict[int, int | None] = {}
        self._next = 1

    async def chain_for(self, kind: str, name: str, reader=None) -> Chain:
        """Resolve the chain of a branch or snapshot from its record."""
        reader = reader or self.kv
        raw = await reader.get(keys.branch(name) if kind == "branch" else keys.snapshot(name))
        if raw is None:
            raise NotFound(f"no {kind} named {name!r}")
        rec = json.loads(raw)
        return await self.chain_from(rec["head"] if kind == "branch" else rec["layer"],
                                     name if kind == "branch" else None)

    async def chain_from(self, top: int, branch: str | None) -> Chain:
        layers = []
        lay = top
        while lay is not None:
            layers.append(lay)
            if lay not in self._parents:
                raw = await self.kv.get(keys.layer(lay))
                self._parents[lay] = json.loads(raw)["parent"] if raw else None
            lay = self._parents[lay]
        return Chain(tuple(layers), branch)

    async def add(self, kind: str, name: str, view_id: int | None = None) -> View:
        """The view of a tree under ``.bm`` (made on first use), or with ``view_id=0``
        the mounted tree's view at the root."""
        key = (kind, name)
        if view_id is None and key in self.by_name:
            return self.by_name[key]
        chain = await self.chain_for(kind, name)
        if view_id is None:
            view_id = self._next
            self._next += 1
        v = View(view_id, kind, name, chain)
        self.by_id[view_id] = v
        if view_id != 0:
            self.by_name[key] = v
        return v

    def drop(self, kind: str, name: str) -> None:
        v = self.by_name.pop((kind, name), None)
        if v is not None:
            self.by_id.pop(v.id, None)

    async def refresh(self) -> None:
        """Re-read every view's chain (after a branch operation changed a head)."""
        for v in list(self.by_id.values()):
            try:
                v.chain = await self.chain_for(v.kind, v.name)
            except NotFound:
                if v.id != 0:
                    self.drop(v.kind, v.name)

    def of_tree(self, view: View) -> list[View]:
        """``view`` and the other views of its tree (the mounted branch has two)."""
        return [view] + [v for v in self.by_id.values() if v is not view and
                         v.kind == view.kind and v.name == view.name]

    def get(self, view_id: int) -> View:
        v = self.by_id.get(view_id)
        if v is None:
            raise NotFound("stale inode: its branch or snapshot is gone")
        return v
