"""bmfs node serve|drain|remove"""
from __future__ import annotations

import os

import trio

from .main import UserError


def add_parser(sub):
    n = sub.add_parser("node", help="storage nodes")
    ns = n.add_subparsers(dest="action", metavar="ACTION")
    ns.required = True
    s = ns.add_parser("serve", help="run a storage node (foreground)")
    s.add_argument("--listen", required=True, help="HOST:PORT")
    s.add_argument("--device", action="append", required=True, metavar="ID=PATH",
                   help="a device this node owns (repeatable)")
    s.add_argument("--secret-file", required=True, help="file holding the cluster secret")
    s.add_argument("--volume-uuid", required=True)
    s.add_argument("--name", default=None)
    s.add_argument("--meta", help="etcd://... : keep a leased membership record there")
    s.add_argument("--fault", default=os.environ.get("BMFS_NODE_FAULT"),
                   help="test fault control: delay=SECONDS slows every read reply")
    s.set_defaults(func=run_serve)
    for action, helptext in (("drain", "move every fragment off a device"),
                             ("remove", "drain a device, then forget it")):
        d = ns.add_parser(action, help=helptext)
        d.add_argument("device", type=int, help="device id (see bmfs status)")
        d.add_argument("--volume", help="volume directory (unmounted)")
        d.add_argument("-m", "--mount", help="a mount of the volume")
        d.set_defaults(func=run_drain, remove=action == "remove")


def run_serve(args) -> int:
    import logging
    from ..node.protocol import read_secret
    from ..node.server import run_node
    logging.basicConfig(level=logging.INFO, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--listen wants HOST:PORT, not {args.listen!r}")
    devices = {}
    for d in args.device:
        ident, _, path = d.partition("=")
        if not ident.isdigit() or not path:
            raise UserError(f"--device wants ID=PATH, not {d!r}")
        devices[int(ident)] = path
    delay = 0.0
    if args.fault:
        key, _, val = args.fault.partition("=")
        if key != "delay":
            raise UserError(f"unknown fault {args.fault!r} (known: delay=SECONDS)")
        delay = float(val)
    try:
        secret = read_secret(args.secret_file)
    except OSError as e:
        raise UserError(f"cannot read {args.secret_file}: {e.strerror}")
    trio.run(run_node, args.name or args.listen, host, int(port), secret, devices,
             args.volume_uuid, None, delay, args.meta)
    return 0


def run_drain(args) -> int:
    from .repair import run_op
    return run_op(args, "drain", device=args.device, remove=args.remove)
