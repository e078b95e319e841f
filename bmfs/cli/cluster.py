"""bmfs cluster up DIR --nodes N [--ec K+M] | bmfs cluster start DIR [--node I] |
bmfs cluster add DIR | bmfs cluster down DIR"""
from ..config import LAYOUTS, parse_ec
from .common import run_trio


def add_parser(sub):
    c = sub.add_parser("cluster", help="a local test cluster of storage-node processes")
    cs = c.add_subparsers(dest="action", metavar="ACTION")
    cs.required = True
    u = cs.add_parser("up", help="start N nodes and create the volume DIR")
    u.add_argument("dir", help="a new directory: the volume, nodes' devices, logs, "
                   "cluster.json")
    u.add_argument("--nodes", type=int, default=6, help="storage-node processes "
                   "(default 6)")
    u.add_argument("--ec", default="4+2", help="erasure code K+M (default 4+2)")
    u.add_argument("--meta", default="sqlite", help="sqlite (default) or etcd")
    u.add_argument("--domains", type=int, default=0,
                   help="put node i in failure domain i %% N (default: each node its own)")
    u.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="how each node's device keeps fragments (as bmfs mkfs --layout)")
    u.add_argument("--tls", action="store_true",
                   help="node connections over TLS, with certificates of a CA made in "
                        "DIR/tls (needs the openssl command)")
    u.set_defaults(func=run_up)
    r = cs.add_parser("start", help="start every node and etcd member that is not running "
                                    "(also after down), or one node")
    r.add_argument("dir", help="the cluster's directory (as given to up)")
    r.add_argument("--node", type=int, help="(re)start just this node index")
    r.add_argument("--fault", help="test fault control for the node: delay=SECONDS")
    r.set_defaults(func=run_start)
    a = cs.add_parser("add", help="start one more node with a new device and add the "
                                  "device to the volume (mounted or not)")
    a.add_argument("dir", help="the cluster's directory (as given to up)")
    a.add_argument("--domain", help="the new node's failure domain (default: its own)")
    a.set_defaults(func=run_add)
    d = cs.add_parser("down", help="stop every process of the cluster in DIR")
    d.add_argument("dir", help="the cluster's directory (as given to up)")
    d.set_defaults(func=run_down)


def run_up(args) -> int:
    from ..cluster import local
    from ..volume.volume import check_new_volume_dir
    k, m = parse_ec(args.ec)
    check_new_volume_dir(args.dir)  # (before etcd's files are made in it)
    meta = None
    if args.meta == "etcd":
        from ..cluster import etcd  # started beside the nodes; listed in cluster.json
        meta = etcd.start_for_cluster(args.dir)
    elif args.meta != "sqlite":
        raise ValueError(f"--meta is sqlite or etcd, not {args.meta!r}")
    info = local.up(args.dir, args.nodes, k, m, meta, args.domains, args.layout, args.tls)
    if args.meta == "etcd":
        etcd.record_in_cluster(args.dir)
    for n in info["nodes"]:
        print(f"node{n['index']}  pid {n['pid']}  {n['address']}  device {n['device']}")
    print(f"cluster up: mount it with `bmfs mount MOUNTPOINT --volume {args.dir}`")
    return 0


def run_down(args) -> int:
    from ..cluster import local
    n = local.down(args.dir)
    print(f"stopped {n} processes")
    return 0


def run_start(args) -> int:
    from ..cluster import local
    started = local.restart(args.dir, args.node, args.fault)
    print("started " + (", ".join(started) or "nothing (all running)"))
    return 0


def run_add(args) -> int:
    from ..cluster import local
    from .repair import run_op
    args.volume = args.dir
    known = _device_ids(args.dir) | {n["device"] for n in local.read_info(args.dir)["nodes"]}
    node = local.add_node(args.dir, max(known) + 1, args.domain)
    try:
        rc = run_op(args, "add_device", path=node["path"], address=node["address"],
                    device=node["device"], domain=args.domain)
    except BaseException:
        try:
            recorded = node["device"] in _device_ids(args.dir)
        except Exception:  # noqa: BLE001 (cannot tell: keep the node, say so below)
            recorded = True
        if not recorded:
            local.drop_node(args.dir, node)
        raise
    print(f"node{node['index']}  pid {node['pid']}  {node['address']}  device {node['device']}")
    return rc


def _device_ids(directory: str) -> set[int]:
    """Every device id the volume has used (removed ones too), through its mount if
    it is mounted (that mount owns an SQLite volume's metadata)."""
    from .common import control
    from .repair import _mount_of
    mp = _mount_of(directory)
    records = control(mp, "devices") if mp else run_trio(_offline_devices, directory)
    return {int(dev) for dev in records}


async def _offline_devices(directory):
    from ..volume.volume import Volume, device_records
    vol = await Volume.open(directory, upgrade=False)
    try:
        return await device_records(vol.kv)
    finally:
        await vol.aclose()
