"""The hidden control directory ``/.bm`` of a mount.

``/.bm/branches/NAME`` and ``/.bm/snapshots/NAME`` are the roots of those trees (each
a view, see views.py); ``/.bm/ctl`` is the control file through which the CLI sends
commands to a running mount: write one JSON request, read one JSON reply on the same
handle. ``.bm`` is not listed in the root directory but can always be entered.
"""
from __future__ import annotations

import json
import stat
import time

from ..errors import FsError, Invalid, NotFound, NotDir
from ..meta import branches
from .views import (CTL_BRANCHES, CTL_FILE, CTL_ROOT, CTL_SNAPSHOTS, VIEW_SHIFT)


class Control:
    def __init__(self, fs):
        self.fs = fs
        self.kv = fs.kv
        self._replies: dict[int, bytes] = {}
        self._next = 1 << 40  # control handles live apart from file handles
        self._t = time.time_ns()

    def getattr(self, fino: int):
        from .fs import Attr
        t = self._t
        if fino == CTL_FILE:
            return Attr(fino, stat.S_IFREG | 0o666, 1, 0, 0, 0, 0, t, t, t)
        if fino in (CTL_ROOT, CTL_BRANCHES, CTL_SNAPSHOTS):
            return Attr(fino, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 0, t, t, t)
        raise NotFound()

    async def lookup(self, parent: int, name: bytes):
        if parent == CTL_ROOT:
            table = {b"branches": CTL_BRANCHES, b"snapshots": CTL_SNAPSHOTS, b"ctl": CTL_FILE}
            if name in table:
                return self.getattr(table[name])
            raise NotFound()
        if parent in (CTL_BRANCHES, CTL_SNAPSHOTS):
            kind = "branch" if parent == CTL_BRANCHES else "snapshot"
            try:
                view = await self.fs.views.add(kind, name.decode())
            except (UnicodeDecodeError, NotFound):
                raise NotFound()
            return await self.fs.getattr(view.id << VIEW_SHIFT | 1)
        raise NotDir()

    async def readdir(self, fino: int):
        from .fs import Attr
        if fino == CTL_ROOT:
            return [(b"branches", self.getattr(CTL_BRANCHES)),
                    (b"ctl", self.getattr(CTL_FILE)),
                    (b"snapshots", self.getattr(CTL_SNAPSHOTS))]
        kind = "branch" if fino == CTL_BRANCHES else "snapshot"
        names = await branches.list_names(self.kv, kind)
        out = []
        for n in names:
            view = await self.fs.views.add(kind, n)
            out.append((n.encode(), Attr(view.id << VIEW_SHIFT | 1, stat.S_IFDIR)))
        return out

    # -- the control file -------------------------------------------------------------------
    def open(self) -> int:
        fh = self._next
        self._next += 1
        self._replies[fh] = b""
        return fh

    def owns(self, fh: int) -> bool:
        return fh in self._replies

    async def write(self, fh: int, data: bytes) -> int:
        try:
            req = json.loads(data)
            if not isinstance(req, dict) or "op" not in req:
                raise ValueError("a request is a JSON object with an 'op'")
            result = await self.run(req)
            reply = {"ok": True, "result": result}
        except FsError as e:
            reply = {"ok": False, "error": str(e), "errno": e.errno}
        except (ValueError, TypeError, KeyError) as e:
            reply = {"ok": False, "error": f"bad request: {e}", "errno": 22}
        self._replies[fh] = json.dumps(reply).encode() + b"\n"
        return len(data)

    def read(self, fh: int, offset: int, size: int) -> bytes:
        return self._replies[fh][offset:offset + size]

    def release(self, fh: int) -> None:
        self._replies.pop(fh, None)

    async def _invalidate(self, branch: str, subs) -> None:
        """Drop the kernel's cached attributes, data and names for what changed."""
        notify = self.fs.notify
        if notify is None:
            return
        views = [v for v in self.fs.views.by_id.values()
                 if v.kind == "branch" and v.name == branch]
        for view in views:
            for sub in subs:
                if sub.startswith(b"d/"):
                    await notify.entry(view.id << VIEW_SHIFT | int(sub[2:18], 16), sub[19:])
                else:
                    await notify.inode(view.id << VIEW_SHIFT | int(sub[2:18], 16))

    async def run(self, req: dict):
        op = req["op"]
        if op == "status":
            from .status import volume_status
            return await volume_status(self.fs.volume)
        if op == "devices":  # every device record, removed ones too
            from .volume import device_records
            return {str(dev): rec for dev, rec in (await device_records(self.kv)).items()}
        if op in ("repair", "scrub", "rebalance", "drain", "undrain", "add_device",
                  "set_address"):
            from . import repair
            args = {k: v for k, v in req.items() if k != "op"}
            return await getattr(repair, op)(self.fs.volume, **args)
        fn = getattr(branches, "op_" + op.replace("-", "_"), None)
        if fn is None:
            raise Invalid(f"unknown control operation {op!r}")
        args = {k: v for k, v in req.items() if k != "op"}
        deleting = op in ("branch_delete", "snapshot_delete")
        if deleting:
            # the layers only the tree used are collected in the background (a pass
            # over every layered key of the volume: seconds at a million files)
            args["collect"] = False
        result = await fn(self.kv, **args)
        await self.fs.views.refresh()
        if isinstance(result, dict) and branches.TOUCHED in result:
            await self._invalidate(*result.pop(branches.TOUCHED))
        if op in ("branch_delete", "snapshot_delete") and self.fs.notify is not None:
            # the kernel caches the name for the entry timeout: a deleted tree would
            # still show (with its contents) until then
            parent = CTL_BRANCHES if op == "branch_delete" else CTL_SNAPSHOTS
            await self.fs.notify.entry(parent, args["name"].encode())
        if deleting:
            self.fs.collect_now.set()
        elif op in ("branch_reset", "merge"):
            await self.fs.volume_gc()
        return result
