"""bmfs branch|snapshot|merge|diff: branch commands sent to a running mount.

Each command takes ``-m MOUNTPOINT`` or works from a directory inside the mount.
Where a branch is left out (``branch create --from``, ``snapshot create --branch``,
``merge --into``) it is the branch of the current directory (a directory under
``.bm/branches/NAME``), else the branch mounted at the root.

``bmfs merge`` exits with MERGE_CONFLICTS (4) when the merge found conflicts and
changed nothing; ``--json`` then prints ``{"result": "conflicts", "conflicts":
[paths]}`` on stdout.
"""
import json
import os
import sys

from .common import ControlError, control, mount_root_of

MERGE_CONFLICTS = 4  # exit status of a merge refused for its conflicts


def _mount_arg(p):
    p.add_argument("-m", "--mount", help="the bmfs mount point (default: the mount "
                   "holding the current directory)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_parser(sub):
    b = sub.add_parser("branch", help="create, list, delete or reset branches")
    bs = b.add_subparsers(dest="action", metavar="ACTION")
    bs.required = True
    c = bs.add_parser("create", help="create a branch (O(1), shares all data)")
    c.add_argument("name", help="the new branch's name")
    c.add_argument("--from", dest="source", help="the branch or snapshot it starts from "
                   "(default: the branch of the current directory, else the mounted one)")
    c.set_defaults(func=lambda a: _do(a, "branch_create", name=a.name,
                                      source=a.source or _current(a, "branch_create")))
    ls = bs.add_parser("list", help="list branches")
    ls.set_defaults(func=lambda a: _do(a, "branch_list"))
    d = bs.add_parser("delete", help="delete a branch and free what only it used")
    d.add_argument("name", help="the branch to delete")
    d.set_defaults(func=lambda a: _do(a, "branch_delete", name=a.name))
    r = bs.add_parser("reset", help="reset a branch to a snapshot")
    r.add_argument("name", help="the branch to reset")
    r.add_argument("--to", required=True, help="the snapshot it becomes")
    r.set_defaults(func=lambda a: _do(a, "branch_reset", name=a.name, to=a.to))
    for p in (c, ls, d, r):
        _mount_arg(p)

    s = sub.add_parser("snapshot", help="create, list or delete read-only snapshots")
    ss = s.add_subparsers(dest="action", metavar="ACTION")
    ss.required = True
    c = ss.add_parser("create", help="snapshot a branch (O(1))")
    c.add_argument("name", help="the new snapshot's name")
    c.add_argument("--branch", help="the branch to snapshot (default: the branch of the "
                   "current directory, else the mounted one)")
    c.set_defaults(func=lambda a: _do(a, "snapshot_create", name=a.name,
                                      branch=a.branch or _current(a, "snapshot_create")))
    ls = ss.add_parser("list", help="list snapshots")
    ls.set_defaults(func=lambda a: _do(a, "snapshot_list"))
    d = ss.add_parser("delete", help="delete a snapshot")
    d.add_argument("name", help="the snapshot to delete")
    d.set_defaults(func=lambda a: _do(a, "snapshot_delete", name=a.name))
    for p in (c, ls, d):
        _mount_arg(p)

    m = sub.add_parser("merge", help="merge SOURCE into TARGET")
    m.add_argument("source", help="the branch or snapshot whose changes are taken")
    m.add_argument("--into", help="the target branch (default: the branch of the "
                   "current directory, else the mounted one)")
    g = m.add_mutually_exclusive_group()
    g.add_argument("--theirs", action="store_true", help="on conflict, the source wins")
    g.add_argument("--ours", action="store_true", help="on conflict, the target wins")
    m.set_defaults(func=lambda a: _do(a, "merge", source=a.source,
                                      into=a.into or _current(a, "merge"),
                                      strategy="theirs" if a.theirs else "ours" if a.ours else None))
    _mount_arg(m)

    df = sub.add_parser("diff", help="paths added, removed and changed from A to B")
    df.add_argument("a", help="a branch or snapshot")
    df.add_argument("b", help="another branch or snapshot")
    df.set_defaults(func=lambda a: _do(a, "diff", a=a.a, b=a.b))
    _mount_arg(df)


def _mountpoint(args) -> str:
    return os.path.abspath(args.mount) if args.mount else mount_root_of(os.getcwd())


def _current(args, op: str) -> str:
    """The branch a command acts on when none is named: the one whose directory
    (``.bm/branches/NAME``) holds the current directory, else the mounted one (for
    branch create, a snapshot mounted at the root is taken too)."""
    mp = _mountpoint(args)
    rel = os.path.relpath(os.getcwd(), mp).split(os.sep)
    if rel[:2] == [".bm", "branches"] and len(rel) > 2:
        return rel[2]
    try:
        tree = control(mp, "mounted")
    except ControlError as e:
        if e.reply.get("errno") == 22:  # a mount of a bmfs before "mounted": main
            return "main"
        raise
    if tree["kind"] != "branch" and op == "branch_create":
        return tree["name"]  # a branch of the snapshot mounted
    if tree["kind"] != "branch":
        raise ControlError({"error": f"{op}: the mount shows snapshot {tree['name']!r}, "
                                     f"not a branch: name the branch", "errno": 22})
    return tree["name"]


def _do(args, op, **kw) -> int:
    mp = _mountpoint(args)
    try:
        if op == "merge":  # (long on large trees: a bar on a terminal)
            from .progress import Bar, in_mount
            result = in_mount(mp, op, Bar("merge", "keys"), **kw)
        else:
            result = control(mp, op, **kw)
    except ControlError as e:
        if "conflicts" not in e.reply:
            raise
        if args.json:
            print(json.dumps({"result": "conflicts", "conflicts": e.reply["conflicts"]},
                             indent=2))
        print(f"bmfs: {e}", file=sys.stderr)
        return MERGE_CONFLICTS
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(op, result)
    return 0


def _print(op, r):
    out = sys.stdout
    if op in ("branch_list", "snapshot_list"):
        for item in r:
            extra = f"from {item['from']}" if item.get("from") else \
                f"of {item['branch']}" if item.get("branch") else ""
            out.write(f"{item['name']}\t{extra}\n")
    elif op == "diff":
        for tag, key in (("A", "added"), ("D", "removed"), ("M", "changed")):
            for p in r[key]:
                out.write(f"{tag}\t{p}\n")
    elif op == "merge":
        out.write(f"{r['result']}" + (f": {r['applied']} changes applied" if r.get('applied') else "") + "\n")
    elif op.endswith("_create"):
        out.write(f"created {op.split('_')[0]} {r['name']}\n")
    elif op.endswith("_delete"):
        if r.get("freed_layers") is None:
            out.write("deleted; what only it used is freed in the background "
                      "(bmfs status says when)\n")
        else:
            out.write(f"deleted; {r['freed_layers']} layers freed\n")
    elif op == "branch_reset":
        out.write(f"branch {r['branch']} reset to snapshot {r['to']}\n")
