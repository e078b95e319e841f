"""bmfs admin-group [NAME | --none] [-m MOUNTPOINT | --volume DIR]: the group whose
members may manage branches and snapshots (docs/operations.md, "Threat model")."""
from __future__ import annotations

import os

from .common import control, mount_root_of, mounts, run_trio
from .main import UserError


def add_parser(sub):
    p = sub.add_parser("admin-group", help="show, or (root) set, the group that may "
                       "manage branches and snapshots")
    p.add_argument("group", nargs="?", help="a group name (or gid) of this machine")
    p.add_argument("--none", action="store_true", help="no group: root alone")
    p.add_argument("-m", "--mount", help="a mount of the volume (default: the mount "
                   "holding the current directory)")
    p.add_argument("--volume", help="the volume directory (if it is not mounted)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.group and args.none:
        raise UserError("give a group or --none, not both")
    setting = args.group is not None or args.none
    mp = _mount(args)
    if mp is not None:
        r = control(mp, "set_admin_group", group=args.group) if setting else \
            control(mp, "admin_group")
    else:
        r = run_trio(_offline, args.volume, args.group, setting)
    print(f"admin group: {r['admin_group'] or 'none (root alone)'}")
    return 0


def _mount(args) -> str | None:
    if args.mount:
        return os.path.abspath(args.mount)
    if args.volume:
        target = os.path.abspath(args.volume)
        for m in mounts():
            if m["source"] == f"bmfs:{target}":
                return m["mountpoint"]
        return None
    return mount_root_of(os.getcwd())


async def _offline(path: str, group: str | None, setting: bool) -> dict:
    from ..vfs.control import read_admin_group, store_admin_group
    from ..volume.volume import Volume
    vol = await Volume.open(path, upgrade=setting)
    try:
        if setting:
            await store_admin_group(vol.kv, group)
        return {"admin_group": await read_admin_group(vol.kv)}
    finally:
        await vol.aclose()
