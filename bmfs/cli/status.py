"""bmfs status [VOLUME|MOUNTPOINT] [--json]"""
import json
import os

from .common import control, find_mount, mount_root_of, mounts, run_trio


def add_parser(sub):
    p = sub.add_parser("status", help="show a volume's devices, health and usage")
    p.add_argument("target", nargs="?", help="a volume directory or a mount point "
                   "(default: the mount holding the current directory, or the only "
                   "bmfs mount)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..volume.status import render
    target = os.path.abspath(args.target) if args.target else mount_root_of(os.getcwd())
    m = find_mount(target)
    if m is None:
        # a volume that is mounted is asked through its mount (it owns the metadata)
        for mm in mounts():
            if mm["volume"] == target:
                m = mm
    if m is not None:
        st = control(m["mountpoint"], "status")
        st["mountpoint"] = m["mountpoint"]
    else:
        st = run_trio(_offline, target)
    print(json.dumps(st, indent=2) if args.json else render(st))
    return 0


async def _offline(path):
    from ..volume.status import volume_status
    from ..volume.volume import Volume
    vol = await Volume.open(path, upgrade=False)  # only reads
    try:
        return await volume_status(vol)
    finally:
        await vol.aclose()
