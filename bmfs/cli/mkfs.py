"""bmfs mkfs VOLUME [--ec K+M] [--device PATH ... | --on-nodes] [--meta URL] [--layout pool|files]"""
import os

from ..config import LAYOUTS, get_settings, parse_ec
from .common import run_trio
from .main import UserError


def add_parser(sub):
    p = sub.add_parser("mkfs", help="create a volume")
    p.add_argument("volume", help="directory for the volume (metadata and default devices)")
    p.add_argument("--ec", default="4+2", help="erasure code K+M (default 4+2)")
    p.add_argument("--device", action="append", default=[], metavar="PATH",
                   help="a device directory; give K+M or more (default: K+M inside VOLUME)")
    p.add_argument("--on-nodes", action="store_true",
                   help="the devices will be storage nodes' (other machines): none yet, "
                        "add each with bmfs node add --address; writes VOLUME/secret")
    p.add_argument("--meta", help="metadata URL (default sqlite:VOLUME/meta.db)")
    p.add_argument("--fragment-size", type=int, default=1 << 20, help=argparse_help())
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="how a device directory keeps fragments: pool files (pool) or a "
                        "file per fragment (files); default: %s" % get_settings().layout)
    p.add_argument("--admin-group", metavar="GROUP",
                   help="a group whose members may manage branches and snapshots "
                        "(default: root alone; bmfs admin-group changes it)")
    p.set_defaults(func=run)


def argparse_help():
    return "data bytes per fragment of a full stripe (default 1 MiB)"


# what an empty directory may hold: a fresh filesystem's lost+found, the secret an
# earlier `mkfs --on-nodes` wrote (kept, so nodes given it stay valid)
MAY_HOLD = {"lost+found", "secret"}


def check_volume_dir(path: str) -> None:
    """A new volume goes into a new or empty directory: never over a user's files, a
    regular file, or a place where files cannot be made (/proc, /sys)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UserError(f"{path} exists and is not a directory")
    if os.path.isdir(path):
        try:
            held = sorted(set(os.listdir(path)) - MAY_HOLD)
        except OSError as e:
            raise UserError(f"cannot list {path}: {e.strerror}")
        if held:
            raise UserError(f"{path} is not empty (it holds {held[0]!r}"
                            f"{f' and {len(held) - 1} more' if len(held) > 1 else ''}): "
                            f"mkfs makes a volume in a new or empty directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".mkfs-probe")
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"cannot make a volume in {path}: {e.strerror}")


def run(args) -> int:
    from ..volume.volume import mkfs
    k, m = parse_ec(args.ec)
    check_volume_dir(args.volume)
    if args.fragment_size < 4096 or args.fragment_size % 4096:
        raise ValueError("--fragment-size must be a multiple of 4096")
    s = run_trio(lambda: mkfs(args.volume, k, m, args.device or None, args.meta,
                              args.fragment_size, layout=args.layout, on_nodes=args.on_nodes,
                              admin_group=args.admin_group))
    print(f"created volume {args.volume} ({s.k}+{s.m}, uuid {s.uuid})")
    if args.on_nodes:
        vol = os.path.abspath(args.volume)
        if not (args.meta or "").startswith("etcd"):
            print(f"note: the metadata is in SQLite in {vol}: only this machine can mount "
                  f"the volume (--meta etcd://... for a volume every machine mounts)")
        print(f"cluster secret: {vol}/secret (copy it to every storage node and client)\n"
              f"next, for each device ID (0, 1, ...; {s.k + s.m} or more):\n"
              f"  on its machine: bmfs node serve --format --listen HOST:PORT "
              f"--device ID=PATH --secret-file SECRET --volume-uuid {s.uuid}\n"
              f"  then here:      bmfs node add PATH --address HOST:PORT --id ID "
              f"--volume {vol}")
    return 0
