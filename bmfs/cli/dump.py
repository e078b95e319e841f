"""bmfs dump VOLUME FILE / bmfs load FILE VOLUME [--meta URL]: a volume's whole
metadata to a file and back (bmfs/volume/dump.py; what moves: docs/operations.md)."""
from __future__ import annotations

import os

from .common import run_trio
from .main import UserError


def add_parser(sub):
    d = sub.add_parser("dump", help="write a volume's whole metadata to a file",
                       description="Write every branch, snapshot, file, directory, "
                       "xattr, type and stripe reference of VOLUME (not mounted) to "
                       "FILE: a versioned, checksummed file (0600). The file data stays "
                       "on the devices; a volume loaded from FILE reads them there.")
    d.add_argument("volume", help="the volume directory (not mounted)")
    d.add_argument("file", help="the dump file to make (must not exist)")
    d.set_defaults(func=run_dump)
    ld = sub.add_parser("load", help="make a volume from a dump (e.g. a trial SQLite "
                        "volume moved to etcd)",
                        description="Make a new volume in VOLUME from the dump FILE: the "
                        "same uuid, settings, devices, branches, snapshots and files. "
                        "FILE is checked whole first; nothing is written from a "
                        "truncated, damaged or foreign dump. Retire the dumped volume "
                        "once it is loaded: both name the same devices.")
    ld.add_argument("file", help="a file made by bmfs dump")
    ld.add_argument("volume", help="a new or empty directory for the volume")
    ld.add_argument("--meta", help="metadata URL, which must hold nothing yet (default "
                    "sqlite:VOLUME/meta.db; etcd://...: docs/etcd.md)")
    ld.add_argument("--node", action="append", default=[], metavar="ID=HOST:PORT",
                    help="device ID is now served by the storage node at HOST:PORT "
                    "(bmfs node serve --device ID=ITS-DIRECTORY); give one for every "
                    "device, or none (repeatable)")
    ld.add_argument("--secret-file", metavar="FILE", help="the cluster secret the "
                    "storage nodes hold (a dump of a volume on nodes: its VOLUME/secret); "
                    "default: a new one, for the nodes to be started with")
    ld.set_defaults(func=run_load)


def run_dump(args) -> int:
    from ..volume.dump import dump
    h = run_trio(dump, os.path.abspath(args.volume), os.path.abspath(args.file))
    print(f"dumped volume {h['uuid']} ({h['keys']} keys) to {args.file}")
    return 0


def _nodes(given: list[str]) -> dict[int, str]:
    out = {}
    for g in given:
        dev, sep, address = g.partition("=")
        if not sep or not dev.isdigit() or ":" not in address:
            raise UserError(f"--node {g!r}: give ID=HOST:PORT (e.g. 0=10.0.0.5:7000)")
        if int(dev) in out:
            raise UserError(f"--node: device {dev} is given twice")
        out[int(dev)] = address
    return out


def run_load(args) -> int:
    from ..volume.dump import load
    vol = os.path.abspath(args.volume)
    h = run_trio(load, os.path.abspath(args.file), vol, args.meta, _nodes(args.node),
                 args.secret_file)
    print(f"loaded volume {h['uuid']} ({h['keys']} keys) into {vol}")
    if h["on_nodes"] and not args.secret_file:
        print(f"its devices are storage nodes': each serves its directory with the new "
              f"cluster secret {vol}/secret (bmfs node serve --secret-file ... "
              f"--volume-uuid {h['uuid']} --device ID=DIR)")
    return 0
