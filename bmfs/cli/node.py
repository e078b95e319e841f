"""bmfs node serve|format|drain|remove|undrain|add|set-address"""
from __future__ import annotations

import os

from ..config import LAYOUTS, get_settings
from .main import UserError
from .common import metrics_option, run_trio, start_metrics
from .repair import limit_option, run_op


def add_parser(sub):
    n = sub.add_parser("node", help="storage nodes")
    ns = n.add_subparsers(dest="action", metavar="ACTION")
    ns.required = True
    s = ns.add_parser("serve", help="run a storage node (foreground)")
    s.add_argument("--listen", required=True, help="HOST:PORT")
    s.add_argument("--device", action="append", required=True, metavar="ID=PATH",
                   help="a device this node owns (repeatable); a formatted directory may "
                        "be given as PATH alone: its id is the one it was formatted with "
                        "(one command line for every machine, e.g. a Kubernetes DaemonSet)")
    s.add_argument("--secret-file", required=True, help="file holding the cluster secret")
    s.add_argument("--volume-uuid", required=True,
                   help="the volume's uuid (bmfs mkfs prints it; bmfs status shows it)")
    s.add_argument("--name", default=None, help="the node's name in its membership "
                   "record (default: the --listen address)")
    s.add_argument("--meta", help="etcd://... : keep a leased membership record there, "
                                  "and announce the node's address for its devices")
    s.add_argument("--advertise", metavar="HOST:PORT",
                   help="the address clients reach this node at, announced with --meta "
                        "(default: the --listen address, unless it is 0.0.0.0 or ::)")
    s.add_argument("--format", action="store_true",
                   help="format each device directory that is new or empty for the volume "
                        "first (a device to add with bmfs node add --address)")
    s.add_argument("--layout", choices=LAYOUTS, default="files",
                   help="the layout --format gives a directory (as bmfs mkfs --layout)")
    s.add_argument("--tls-cert", metavar="PEM", help="serve over TLS with this "
                   "certificate (with --tls-key and --tls-ca; docs/deploy.md)")
    s.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    s.add_argument("--tls-ca", metavar="PEM", help="the cluster CA: clients must present "
                   "a certificate it signed")
    metrics_option(s)
    s.add_argument("--fault", default=get_settings().node_fault,
                   help="test fault control: delay=SECONDS slows every read reply")
    s.set_defaults(func=run_serve)
    f = ns.add_parser("format", help="format new or empty device directories for a "
                                     "volume (what serve --format does first)")
    f.add_argument("--device", action="append", required=True, metavar="ID=PATH",
                   help="a device directory to format as device ID (repeatable)")
    f.add_argument("--volume-uuid", required=True,
                   help="the volume's uuid (bmfs mkfs prints it; bmfs status shows it)")
    f.add_argument("--layout", choices=LAYOUTS, default="files",
                   help="how the directory keeps fragments (as bmfs mkfs --layout)")
    f.set_defaults(func=run_format)
    for action, helptext in (("drain", "move every fragment off a device"),
                             ("remove", "drain a device, then forget it")):
        d = ns.add_parser(action, help=helptext)
        d.add_argument("device", type=int, help="device id (see bmfs status)")
        _target_options(d)
        limit_option(d)
        d.set_defaults(func=run_drain, remove=action == "remove")
    u = ns.add_parser("undrain", help="put a drained device back in service")
    u.add_argument("device", type=int, help="device id (see bmfs status)")
    _target_options(u)
    u.set_defaults(func=lambda a: run_op(a, "undrain", device=a.device))
    r = ns.add_parser("set-address", help="reach a device at the node's new address "
                                          "(the node serving it moved)")
    r.add_argument("device", type=int, help="device id (see bmfs status)")
    r.add_argument("address", metavar="HOST:PORT", help="the node's new address")
    _target_options(r)
    r.set_defaults(func=lambda a: run_op(a, "set_address", device=a.device, address=a.address))
    a = ns.add_parser("add", help="add a device to a volume (new stripes use it)")
    a.add_argument("path", help="the device directory (pmem:PATH for a pool file); on a "
                                "storage node, its path there")
    a.add_argument("--address", metavar="HOST:PORT",
                   help="the storage node serving it (volumes on storage nodes): start it "
                        "first with bmfs node serve --device ID=PATH")
    a.add_argument("--id", type=int, help="the device id (default: the next free one; "
                                          "the id the node serves it under)")
    a.add_argument("--domain", help="its failure domain (default: its node)")
    a.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="a new directory's layout (default: that of the volume's devices)")
    _target_options(a)
    a.set_defaults(func=run_add)


def _target_options(p) -> None:
    p.add_argument("--volume", help="volume directory (unmounted)")
    p.add_argument("-m", "--mount", help="a mount of the volume")


def run_add(args) -> int:
    path = args.path  # made absolute here: the mount's working directory is not ours
    if args.address is None:
        if path.startswith("pmem:"):
            file, sep, size = path[5:].partition(":")
            path = "pmem:" + os.path.abspath(file) + sep + size
        else:
            path = os.path.abspath(path)
    return run_op(args, "add_device", path=path, address=args.address, device=args.id,
                  domain=args.domain, layout=args.layout)


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
    if args.advertise is not None:
        ahost, _, aport = args.advertise.rpartition(":")
        if not ahost or not aport.isdigit() or not 0 < int(aport) < 65536:
            raise UserError(f"--advertise wants HOST:PORT, not {args.advertise!r}")
    # first: an address in use fails before a device is formatted or locked
    start_metrics(args.metrics)
    devices = _devices(args, formatted=not args.format)
    if args.format:
        _format_new(devices, args.volume_uuid, args.layout)
    _tighten(devices)
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
    from ..proc import notify_ready
    name, tls = args.name or args.listen, _tls(args)
    beside = None
    if args.meta:  # the node's record in the volume's metadata, kept beside it
        from ..volume.membership import keeper
        beside = keeper(args.meta, name, args.volume_uuid, secret,
                        tls and tls.context(server=False))
    run_trio(run_node, name, host, int(port), secret, devices, args.volume_uuid,
             lambda bound: notify_ready(f"serving on {host}:{bound}"), delay, beside,
             args.advertise, tls)
    return 0


def _tls(args):
    """The node's tls.TlsConfig from --tls-cert/--tls-key/--tls-ca (all or none,
    checked usable), or None."""
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return None
    if not all(given):
        raise UserError("TLS wants all of --tls-cert, --tls-key and --tls-ca")
    from ..node.tls import TlsConfig
    tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_ca)
    try:
        tls.context(server=True)
        return tls
    except OSError as e:  # (ssl.SSLError is one)
        raise UserError(f"cannot use the TLS files: {e.strerror or e}")


def _devices(args, formatted: bool = False) -> dict[int, str]:
    """--device ID=PATH options as {id: path}; with ``formatted`` (serving, not
    formatting) also PATH alone, a formatted directory, under the id it was formatted
    with."""
    devices = {}
    for d in args.device:
        ident, eq, path = d.partition("=")
        numbered = eq and ident.isascii() and ident.isdigit()
        if formatted and not numbered and not d.startswith("pmem:") and \
                (not eq or os.path.isdir(d)):  # (a path may hold "=")
            from ..errors import VolumeError
            from ..store.pmem import marker_device
            try:
                ident, path = str(marker_device(d)), d
            except VolumeError as e:
                raise UserError(f"--device {d}: {e}; format it first (bmfs node format "
                                f"--device ID={d} --volume-uuid UUID) or give ID=PATH")
        if not (ident.isascii() and ident.isdigit()) or not path:
            raise UserError(f"--device wants ID=PATH, not {d!r}")
        if int(ident) in devices:
            raise UserError(f"--device: device {ident} given twice")
        devices[int(ident)] = path
    return devices


def run_format(args) -> int:
    """bmfs node format: what serve --format does, alone (a step of its own for
    service managers: a unit that formatted at every start would format the empty
    directory left where a disk failed to mount)."""
    for dev, path, made in _format_new(_devices(args), args.volume_uuid, args.layout):
        print(f"device {dev}: {path} {'formatted' if made else 'is formatted already'}")
    return 0


def _format_new(devices: dict[int, str], uuid: str, layout: str) -> list:
    """Format the devices that are new or empty directories (or pmem pools not made
    yet); formatted ones are left as they are (serving checks they are this volume's).
    Returns (device, path, whether formatted now) for each."""
    from ..errors import VolumeError
    from ..store.pmem import format_if_new, marker_matches
    out = []
    for dev, path in devices.items():
        try:
            made = format_if_new(path, uuid, dev, layout)
            if not made:  # formatted already: as this volume's device ``dev``?
                marker_matches(path, uuid, dev)
            out.append((dev, path, made))
        except (VolumeError, OSError) as e:
            raise UserError(f"cannot format {path}: {e}")
    return out


def _tighten(devices: dict[int, str]) -> None:
    """Devices formatted by an older bmfs left their folders readable: closed now."""
    import logging
    from ..store.pmem import tighten_device
    changed: list[str] = []
    for path in devices.values():
        try:
            tighten_device(path, changed)
        except OSError as e:
            logging.getLogger(__name__).warning("%s: permissions not tightened: %s", path, e)
    if changed:
        logging.getLogger(__name__).warning(
            "tightened permissions of %d paths other users could reach (directories now "
            "0700, files 0600): %s%s", len(changed), ", ".join(changed[:8]),
            " ..." if len(changed) > 8 else "")


def run_drain(args) -> int:
    return run_op(args, "drain", device=args.device, remove=args.remove, limit=args.limit)
