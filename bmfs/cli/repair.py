"""bmfs repair|scrub|rebalance VOLUME|MOUNTPOINT: rebuild lost fragments; verify every
fragment; move fragments to where placement puts them now."""
from __future__ import annotations

import json
import os
import sys

from .common import control, find_mount, mounts, run_trio
from .main import UserError


def add_parser(sub):
    for name, helptext in (("repair", "rebuild missing, corrupt or doubled-up fragments"),
                           ("scrub", "verify every fragment's checksums, then repair"),
                           ("rebalance", "move fragments to the devices placement puts "
                                         "them on now (after bmfs node add)")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("target", help="a volume directory or a mount point")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        limit_option(p)
        p.set_defaults(func=lambda a, op=name: run_op(a, op, limit=a.limit))


def limit_option(p) -> None:
    from ..config import parse_rate
    p.add_argument("--limit", type=parse_rate, metavar="RATE",
                   help="device traffic at most RATE bytes a second on average (reads "
                        "and writes; K, M, G: powers of 1024, e.g. 50M); default: no limit")


def _mount_of(target: str | None):
    if not target:
        return None
    target = os.path.abspath(target)
    m = find_mount(target)
    if m:
        return m["mountpoint"]
    for mm in mounts():
        if mm["volume"] == target:
            return mm["mountpoint"]
    return None


def run_op(args, op, **kw) -> int:
    target = getattr(args, "target", None) or getattr(args, "mount", None) or \
        getattr(args, "volume", None)
    if not target:
        raise UserError("which volume? give --volume DIR or --mount MOUNTPOINT")
    mp = _mount_of(target)
    from .progress import Bar, in_mount
    with Bar(op) as bar:
        if mp:
            result = in_mount(mp, op, bar, **kw) if op in _PROGRESSING else \
                control(mp, op, **kw)
        else:
            result = run_trio(_offline, target, op, kw, bar)
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2))
    else:
        print(", ".join(f"{k.replace('_', ' ')}: {_shown(v)}" for k, v in result.items()))
    if not isinstance(result, dict):
        return 0
    left = result.get("fragments_left_on_device")
    if left:  # a drain that could not move everything (devices down, stripes unreadable)
        print(f"bmfs: {left} fragments are still on device {kw.get('device')}; "
              f"run it again once the volume's other devices are up", file=sys.stderr)
        return 1
    if op in ("repair", "scrub") and result.get("stripes_short"):  # not back to full
        # redundancy (a drain says what it left on its device, above)
        failed = result.get("stripes_failed")
        short = result.get("fragments_short") or {}
        print(f"bmfs: {op}: " + (f"{failed} stripes failed; " if failed else "")
              + f"{result['stripes_short']} stripes still short of full redundancy "
              f"(fragments: {_why(short)}); " + "; ".join(
                  HINTS[w] for w in sorted(short) if w in HINTS), file=sys.stderr)
        return 1
    failed = result.get("stripes_failed") or result.get("fragments_failed")
    if failed:  # a rebalance that could not do all it set out to
        what = "stripes" if result.get("stripes_failed") else "fragments"
        print(f"bmfs: {op}: {failed} {what} failed (unreadable, or their devices failed; "
              f"the mount log says which); run it again once the devices are up",
              file=sys.stderr)
        return 1
    return 0


# what to do about fragments left short, by reason (volume/repair.py's WHY)
HINTS = {"no_device": "add a device (bmfs node add) or bring the missing one back",
         "no_space": "free space on the devices or add one",
         "device_down": "run it again once the devices are up",
         "unreadable": "fewer than k good copies of some blocks: bring missing devices "
                       "back; with all up, that data is lost (the mount log says which)"}


def _shown(value) -> str:
    """A report's value as the one-line report shows it (a count by reason: WHY)."""
    if isinstance(value, dict):
        return _why(value) or "0"
    return str(value)


def _why(short: dict) -> str:
    """Fragments left short by reason, in words: "2 no device to place on, 1 ENOSPC"."""
    from ..volume.repair import WHY
    return ", ".join(f"{n} {WHY.get(why, why)}" for why, n in sorted(short.items()))


# what a mount reports the progress of (vfs/control.py PROGRESSING)
_PROGRESSING = ("repair", "scrub", "rebalance", "drain")


async def _offline(path, op, kw, bar):
    from ..volume.admin import DEVICE_OPS
    from ..volume.volume import Volume
    vol = await Volume.open(path)
    try:
        return await DEVICE_OPS[op](vol, progress=bar, **kw)
    finally:
        await vol.aclose()
