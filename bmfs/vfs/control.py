"""The hidden control directory ``/.bm`` of a mount.

``/.bm/branches/NAME`` and ``/.bm/snapshots/NAME`` are the roots of those trees (each
a view, see views.py); ``/.bm/ctl`` is the control file through which the CLI sends
commands to a running mount: write one JSON request, read one JSON reply on the same
handle. ``/.bm/progress`` (read-only, anyone) reads as a JSON list of the long
operations under way (op, pid of the process that asked, done, total): the CLI
draws its bars from it, as a request on ``ctl`` would wait for the kernel's lock of
that file, which the long operation's own request holds. ``.bm`` is not listed in
the root directory but can always be entered.

Who may send what (docs/operations.md, "Threat model"): anyone may open the control
file (mode 0666, owner root, group the volume's admin group) and send a read-only
request; branch and snapshot operations are root's and the admin group's; device
operations, repair, scrub and the admin group itself are root's. The sender is the
process that opened the handle (its uid, gid and groups when it opened it), as for
any file whose permissions are checked at open. A reply is kept per handle.

Branch and snapshot requests are run here (meta/branches.py). Volume administration
(status, device records, repair, drain...) lives above the vfs, in bmfs/volume/: its
requests are run by the handlers that layer installs (``Control.serve``, from
volume/admin.py), and refused with EOPNOTSUPP where none is installed.
"""
from __future__ import annotations

import json
import logging
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..config import group_id
from ..errors import Access, FsError, Invalid, NotDir, NotFound, NotSupported
from ..meta import branches, diff, keys, merge, trees
from .attr import Attr
from .views import (CTL_BRANCHES, CTL_FILE, CTL_PROGRESS, CTL_ROOT, CTL_SNAPSHOTS,
                    VIEW_SHIFT)

log = logging.getLogger(__name__)

# who may send a request: anyone, root and the admin group, root alone
ANYONE, BRANCH_ADMIN, ROOT = "anyone", "branch-admin", "root"
_STR, _INT, _BOOL, _RATE = (str,), (int,), (bool,), (int, float)
_NONE = (type(None),)
# op -> (who, {field: (accepted types, required)}). A request naming another field,
# missing a required one or giving one of another type is refused (EINVAL).
OPS: dict[str, tuple[str, dict[str, tuple[tuple, bool]]]] = {
    "status": (ANYONE, {}),
    "mounted": (ANYONE, {}),
    "devices": (ANYONE, {}),
    "admin_group": (ANYONE, {}),
    "branch_list": (ANYONE, {}),
    "snapshot_list": (ANYONE, {}),
    "diff": (ANYONE, {"a": (_STR, True), "b": (_STR, True)}),
    "branch_create": (BRANCH_ADMIN, {"name": (_STR, True), "source": (_STR, False)}),
    "snapshot_create": (BRANCH_ADMIN, {"name": (_STR, True), "branch": (_STR, False)}),
    "branch_delete": (BRANCH_ADMIN, {"name": (_STR, True)}),
    "snapshot_delete": (BRANCH_ADMIN, {"name": (_STR, True)}),
    "branch_reset": (BRANCH_ADMIN, {"name": (_STR, True), "to": (_STR, True)}),
    "merge": (BRANCH_ADMIN, {"source": (_STR, True), "into": (_STR, True),
                             "strategy": (_STR + _NONE, False)}),
    "repair": (ROOT, {"limit": (_RATE + _NONE, False)}),
    "scrub": (ROOT, {"limit": (_RATE + _NONE, False)}),
    "rebalance": (ROOT, {"limit": (_RATE + _NONE, False)}),
    "drain": (ROOT, {"device": (_INT, True), "remove": (_BOOL, False),
                     "limit": (_RATE + _NONE, False)}),
    "undrain": (ROOT, {"device": (_INT, True)}),
    "add_device": (ROOT, {"path": (_STR, True), "address": (_STR + _NONE, False),
                          "device": (_INT + _NONE, False), "domain": (_STR + _NONE, False),
                          "layout": (_STR + _NONE, False)}),
    "set_address": (ROOT, {"device": (_INT, True), "address": (_STR, True)}),
    "set_admin_group": (ROOT, {"group": (_STR + _NONE, True)}),
}
# the tree operations (meta/): op -> its function
_TREE_OPS = {
    "branch_list": branches.op_branch_list, "snapshot_list": branches.op_snapshot_list,
    "branch_create": branches.op_branch_create, "snapshot_create": branches.op_snapshot_create,
    "branch_delete": branches.op_branch_delete, "snapshot_delete": branches.op_snapshot_delete,
    "branch_reset": branches.op_branch_reset, "diff": diff.op_diff, "merge": merge.op_merge,
}
# the requests served from above (Control.serve): volume administration
SERVED_FROM_ABOVE = ("status", "devices", "repair", "scrub", "rebalance", "drain", "undrain",
                     "add_device", "set_address")
# a request's handler: called with the request's checked fields, it returns the reply's
# result (JSON-able) or raises FsError
Handler = Callable[..., Awaitable[object]]
# the operations whose progress /.bm/progress reports
PROGRESSING = ("repair", "scrub", "rebalance", "drain", "merge")
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               type(None): "null"}


@dataclass(frozen=True)
class Caller:
    """Who sent a control request: the process that opened the control file."""
    uid: int
    gid: int
    groups: frozenset = field(default_factory=frozenset)
    pid: int = 0  # its process (whose long operations' progress it is: Control.running)

    @classmethod
    def of_process(cls, uid: int, gid: int, pid: int) -> "Caller":
        """The caller ``uid``/``gid`` (as the kernel gave them) with the supplementary
        groups of process ``pid`` (from /proc, as libfuse's fuse_getgroups does; none if
        it cannot be read: the process is gone, or in another pid namespace)."""
        groups: set[int] = set()
        tgid = pid  # (FUSE gives the thread's id: its process is the Tgid)
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Tgid:"):
                        tgid = int(line.split()[1])
                    elif line.startswith("Groups:"):
                        groups = {int(g) for g in line.split()[1:]}
                        break
        except (OSError, ValueError):
            pass
        return cls(uid, gid, frozenset(groups), tgid)


IN_PROCESS = Caller(0, 0)  # a program that opened the volume itself (no FUSE request)


def check_request(req, caller: Caller, admin_gid: int | None) -> tuple[str, dict]:
    """``(op, arguments)`` of a request ``caller`` may send.

    Raises:
        Invalid: not a request (not an object, no such op, a field missing, unknown or
            of the wrong type).
        Access: ``caller`` may not send it (who may is said).
    """
    if not isinstance(req, dict) or not isinstance(req.get("op"), str):
        raise Invalid("bad request: a request is a JSON object with an \"op\" string")
    op = req["op"]
    if op not in OPS:
        raise Invalid(f"bad request: unknown control operation {op!r}")
    who, spec = OPS[op]
    allowed = (who == ANYONE or caller.uid == 0 or who == BRANCH_ADMIN and admin_gid is not None
               and (caller.gid == admin_gid or admin_gid in caller.groups))
    if not allowed:  # (before the fields: whatever else is wrong, this is what matters)
        whom = "root" if who == ROOT or admin_gid is None else \
            f"root and the volume's admin group (gid {admin_gid})"
        raise Access(f"permission denied: {op} is for {whom} only")
    args = {k: v for k, v in req.items() if k != "op"}
    for name in args:
        if name not in spec:
            raise Invalid(f"bad request: {op} takes no field {name!r} (it takes: "
                          f"{', '.join(spec) or 'none'})")
    for name, (types, required) in spec.items():
        if name not in args:
            if required:
                raise Invalid(f"bad request: {op} needs the field {name!r}")
            continue
        v = args[name]
        # (a JSON true is a Python int too: refused where an integer is wanted)
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            want = " or ".join(_TYPE_NAMES[t] for t in types)
            given = json.dumps(v)
            given = given if len(given) <= 40 else given[:37] + "..."
            raise Invalid(f"bad request: {name!r} of {op} is {want}, not {given}")
    return op, args


class Control:
    def __init__(self, fs):
        self.fs = fs
        self.kv = fs.kv
        self._replies: dict[int, bytes] = {}
        self._callers: dict[int, Caller] = {}  # who opened each handle
        # long operations under way: handle -> {op, pid, done, total} (/.bm/progress
        # lists them; the CLI shows its own as a bar)
        self.running: dict[int | str, dict] = {}
        self._read_only: set[int] = set()  # handles of /.bm/progress
        self._next = 1 << 40  # control handles live apart from file handles
        self._t = time.time_ns()
        settings = getattr(getattr(fs, "volume", None), "settings", None)
        self._group = getattr(settings, "admin_group", None)  # its name, as stored
        self.admin_gid = self._resolve(self._group)
        self._handlers: dict[str, Handler] = {}

    def serve(self, op: str, handler: Handler) -> None:
        """Run request ``op`` (one of SERVED_FROM_ABOVE) with ``handler`` from now on."""
        if op not in SERVED_FROM_ABOVE:
            raise ValueError(f"{op!r} is not a request served from above the vfs")
        self._handlers[op] = handler

    def getattr(self, fino: int):
        t = self._t
        if fino == CTL_FILE:
            # anyone may open it to ask; what a request may do is checked per request
            return Attr(fino, stat.S_IFREG | 0o666, 1, 0, self.admin_gid or 0, 0, 0, t, t, t)
        if fino == CTL_PROGRESS:
            return Attr(fino, stat.S_IFREG | 0o444, 1, 0, 0, 0, 0, t, t, t)
        if fino in (CTL_ROOT, CTL_BRANCHES, CTL_SNAPSHOTS):
            return Attr(fino, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 0, t, t, t)
        raise NotFound()

    async def lookup(self, parent: int, name: bytes):
        if parent == CTL_ROOT:
            table = {b"branches": CTL_BRANCHES, b"snapshots": CTL_SNAPSHOTS, b"ctl": CTL_FILE,
                     b"progress": CTL_PROGRESS}
            if name == b"ctl":  # its group is the admin group's: as stored now
                await self.load_group()
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
        if fino == CTL_ROOT:
            return [(b"branches", self.getattr(CTL_BRANCHES)),
                    (b"ctl", self.getattr(CTL_FILE)),
                    (b"progress", self.getattr(CTL_PROGRESS)),
                    (b"snapshots", self.getattr(CTL_SNAPSHOTS))]
        kind = "branch" if fino == CTL_BRANCHES else "snapshot"
        names = await trees.list_names(self.kv, kind)
        out = []
        for n in names:
            view = await self.fs.views.add(kind, n)
            out.append((n.encode(), Attr(view.id << VIEW_SHIFT | 1, stat.S_IFDIR)))
        return out

    # -- the control file -------------------------------------------------------------------
    def open(self, caller: Caller = IN_PROCESS) -> int:
        """A handle of the control file for ``caller`` (its requests are checked
        against it; call ``load_group`` first, as another mount may have set it)."""
        fh = self._next
        self._next += 1
        self._replies[fh] = b""
        self._callers[fh] = caller
        return fh

    def open_progress(self) -> int:
        """A handle of /.bm/progress: it reads as the operations under way now."""
        fh = self.open()
        self._read_only.add(fh)
        self._replies[fh] = json.dumps(list(self.running.values())).encode() + b"\n"
        return fh

    async def load_group(self) -> None:
        """Read the volume's admin group afresh."""
        name = await read_admin_group(self.kv)
        if name != self._group:
            self._group, self.admin_gid = name, self._resolve(name)

    @staticmethod
    def _resolve(name: str | None) -> int | None:
        try:
            return group_id(name)
        except KeyError:
            log.warning("the volume's admin group %r is unknown on this machine: branch "
                        "and snapshot operations are root's alone here", name)
            return None

    def owns(self, fh: int) -> bool:
        return fh in self._replies

    async def write(self, fh: int, data: bytes) -> int:
        """Run one request; its reply is read back on this handle. A request the
        handle's opener may not send fails the write itself with EACCES (its reply,
        saying who may, can still be read): nothing is done.

        Raises:
            Access: as above.
        """
        if fh in self._read_only:  # (root may open it for writing: 0444 binds no root)
            raise Access("/.bm/progress is read-only: requests go to /.bm/ctl")
        refused = None
        try:
            try:
                req = json.loads(data)
            except (ValueError, RecursionError) as e:
                raise Invalid(f"bad request: not JSON ({e})") from None
            op, args = check_request(req, self._callers[fh], self.admin_gid)
            if op in PROGRESSING:
                entry = self.running[fh] = {"op": op, "pid": self._callers[fh].pid,
                                            "done": 0, "total": 0}
                args = dict(args, progress=progress_into(entry))
            try:
                result = await self.run(op, args)
            finally:
                self.running.pop(fh, None)
            reply = {"ok": True, "result": result}
        except Access as e:
            refused = e
            reply = {"ok": False, "error": str(e), "errno": e.errno}
        except FsError as e:
            reply = {"ok": False, "error": str(e), "errno": e.errno}
            if isinstance(e, merge.MergeConflict):  # (bmfs merge --json lists them)
                reply["conflicts"] = list(e.paths)
        except (ValueError, TypeError, KeyError) as e:
            reply = {"ok": False, "error": f"bad request: {e}", "errno": 22}
        self._replies[fh] = json.dumps(reply).encode() + b"\n"
        if refused is not None:
            raise refused
        return len(data)

    def read(self, fh: int, offset: int, size: int) -> bytes:
        return self._replies[fh][offset:offset + size]

    def release(self, fh: int) -> None:
        self._replies.pop(fh, None)
        self._callers.pop(fh, None)
        self._read_only.discard(fh)

    async def _invalidate(self, branch: str, subs) -> None:
        """Drop the kernel's cached attributes, data and names for what changed."""
        notify = self.fs.notify
        if notify is None:
            return
        views = [v for v in self.fs.views.by_id.values()
                 if v.kind == "branch" and v.name == branch]
        for view in views:
            for sub in subs:
                if sub.startswith(keys.DENTRY_PREFIX):
                    parent, name = keys.dentry_of(sub)
                    await notify.entry(view.id << VIEW_SHIFT | parent, name)
                else:
                    await notify.inode(view.id << VIEW_SHIFT | keys.ino_of(sub))

    async def run(self, op: str, args: dict):
        """Run request ``op`` with ``args`` (checked by check_request)."""
        if op == "mounted":  # the tree at the mount's root
            view = self.fs.views.get(0)
            return {"kind": view.kind, "name": view.name}
        if op in SERVED_FROM_ABOVE:
            handler = self._handlers.get(op)
            if handler is None:
                raise NotSupported(f"{op} is not served here (no volume administration "
                                   f"installed on this filesystem)")
            return await handler(**args)
        if op == "admin_group":
            return {"admin_group": self._group, "gid": self.admin_gid}
        if op == "set_admin_group":
            return await self._set_group(args["group"])
        if op != "merge":
            args.pop("progress", None)
        fn = _TREE_OPS[op]
        deleting = op in ("branch_delete", "snapshot_delete")
        if deleting:
            # the layers only the tree used are collected in the background (a pass
            # over every layered key of the volume: seconds at a million files)
            args["collect"] = False
        result = await fn(self.kv, **args)
        await self.fs.views.refresh()
        if isinstance(result, dict) and trees.TOUCHED in result:
            await self._invalidate(*result.pop(trees.TOUCHED))
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

    async def _set_group(self, name: str | None) -> dict:
        gid = await store_admin_group(self.kv, name)
        self._group, self.admin_gid = name or None, gid
        if self.fs.notify is not None:  # the control file's group changed
            await self.fs.notify.inode(CTL_FILE)
        return {"admin_group": self._group, "gid": gid}


def progress_into(entry: dict):
    """A ``progress(done, total)`` callback that records into ``entry``."""
    def progress(done: int, total: int) -> None:
        entry["done"], entry["total"] = done, total
    return progress


async def read_admin_group(kv) -> str | None:
    """The volume's admin group (its name, as stored), or None."""
    raw = await kv.get(keys.SETTINGS)
    return json.loads(raw).get("admin_group") if raw else None


async def store_admin_group(kv, name: str | None) -> int | None:
    """Name the group whose members may manage branches and snapshots (None: root
    alone); returns its gid. It must exist on this machine; it is stored by name in
    the volume's settings and looked up on each machine that mounts the volume.

    Raises:
        Invalid: no such group here.
    """
    name = name or None
    try:
        gid = group_id(name)
    except KeyError:
        raise Invalid(f"no group {name!r} on this machine") from None

    async def fn(txn):
        d = json.loads(await txn.get(keys.SETTINGS))
        d["admin_group"] = name
        txn.put(keys.SETTINGS, json.dumps(d).encode())
    await kv.transact(fn)
    return gid
