"""What `bmfs status` shows: volume settings, devices with health and usage, counters."""
from __future__ import annotations

import json
import os
import time


from ..format import fragment as fr
from ..meta import keys
from ..format.records import EC, NO_DEVICE, Stripe


async def volume_status(volume, data_stats: dict | None = None,
                        branch: str | None = None) -> dict:
    """What `bmfs status` shows; ``branch``: the branch a mount shows at its root."""
    s = volume.settings
    devices = []
    counts = {}
    usage = await volume.device_usage(max_age=0)
    queued = {}  # stripe -> fragment indexes queued as damaged
    for k, _ in await volume.kv.range(*keys.span(keys.DAMAGE_PREFIX)):
        sid, index = keys.damage_of(k)
        queued.setdefault(sid, set()).add(index)
    short = 0  # stripes a repair pass would find short of full redundancy
    # the repair backlog: fragments a repair pass would rebuild, by why
    backlog = {"queued": 0, "on_missing_devices": 0, "never_stored": 0}
    file_bytes = device_bytes = 0
    for k, v in await volume.kv.range(*keys.span(keys.STRIPE_PREFIX)):
        st = Stripe.unpack(v)
        file_bytes += st.length
        for dev in st.devices:
            counts[dev] = counts.get(dev, 0) + 1
        if st.kind != EC:
            continue
        frag_file = fr.geometry(st.frag_version, st.frag_len).data_offset + st.frag_len
        device_bytes += frag_file * sum(d != NO_DEVICE for d in st.devices)
        mine = queued.get(keys.stripe_of(k), set())
        lacking = 0
        for i, d in enumerate(st.devices):
            why = "never_stored" if d == NO_DEVICE else "queued" if i in mine else \
                "on_missing_devices" if isinstance(usage.get(d), Exception) else None
            if why:
                backlog[why] += 1
                lacking += 1
        if lacking or volume.data.needs_repair(st):
            short += 1
    for dev, path in sorted(volume.device_paths.items()):
        if dev in volume.removed:  # forgotten (`bmfs node remove`): listed apart
            continue
        u = usage.get(dev)
        nodes = getattr(volume.transport, "device_node", None)
        rec = {"id": dev, "path": path, "fragments": counts.get(dev, 0),
               "node": nodes[dev].address if nodes else "local",
               "domain": volume.data.domains.get(dev, dev),  # (placement's)
               "state": "in" if dev in volume.data.devices else
                        "drained" if not counts.get(dev) else "draining"}
        if isinstance(u, Exception) or u is None:
            rec.update(health="missing", error=str(u))
        else:
            rec.update(health="ok", total=u["total"], free=u["free"])
            if u.get("unexpected_entries"):  # links or foreign files where fragments go
                rec["unexpected_entries"] = u["unexpected_entries"]
        devices.append(rec)
    from .membership import live_nodes
    nodes = await live_nodes(volume.kv)
    for d in devices:
        for name, rec in nodes.items():
            if d["id"] in rec.get("devices", []):
                d["membership"] = {"node": name, "heartbeat": rec["heartbeat"]}
    pending_repair = sum(len(v) for v in queued.values())  # (fragments)
    clients = [dict(json.loads(v), id=keys.mount_id_of(k))
               for k, v in await volume.kv.range(*keys.span(keys.MOUNT_PREFIX))]
    if not clients and await volume.kv.get(keys.MOUNTED) is not None:  # (single owner)
        import socket
        clients = [{"host": socket.gethostname(), "single_owner": True}]
    gc_queue = len(await volume.kv.range(*keys.span(keys.GARBAGE_PREFIX)))
    collecting = await volume.kv.get(keys.COLLECT_LAYERS) is not None
    branches = [keys.tree_name_of(k)
                for k, _ in await volume.kv.range(*keys.span(keys.BRANCH_PREFIX))]
    snapshots = [keys.tree_name_of(k)
                 for k, _ in await volume.kv.range(*keys.span(keys.SNAPSHOT_PREFIX))]
    return {"volume": os.path.abspath(volume.path), "uuid": s.uuid, "ec": f"{s.k}+{s.m}",
            "format": s.format, "stripe_size": s.stripe_size, "inline_max": s.inline_max,
            "meta": volume.kv.url, "meta_engine": volume.kv.statistics(), "devices": devices,
            "removed_devices": sorted(volume.removed), "nodes": nodes, "fragments_awaiting_repair": pending_repair,
            "stripes_short": short,
            "stripes_awaiting_gc": gc_queue, "collecting_deleted_trees": collecting,
            "branches": branches, "snapshots": snapshots,
            "branch": branch,
            "usage": {"file_bytes": file_bytes, "device_bytes": device_bytes,
                      "amplification": round(device_bytes / file_bytes, 3)
                      if file_bytes else None},
            "clients": clients,
            "repair_backlog": dict(backlog, fragments=sum(backlog.values()), stripes=short),
            "data": data_stats or dict(volume.data.stats),
            "transport": dict(getattr(volume.transport, "stats", {}))}


def render(st: dict) -> str:
    lines = [f"volume   {st['volume']}  ({st['ec']}, format {st['format']}, uuid {st['uuid']})",
             f"metadata {st['meta']}"]
    if st.get("mountpoint"):
        lines.append(f"mounted  {st['mountpoint']}"
                     + (f"  (branch {st['branch']})" if st.get("branch") else ""))
    u = st.get("usage")
    if u:
        lines.append(f"usage    {_size(u['file_bytes'])} in files (each stripe once, however "
                     f"many branches share it), {_size(u['device_bytes'])} on devices"
                     + (f": space amplification {u['amplification']:.2f}x"
                        if u.get("amplification") else ""))
    if st.get("clients"):
        lines.append(f"clients  {len(st['clients'])} mount(s): " + ", ".join(
            f"{c.get('host', '?')}:{c.get('mountpoint', '?')}" if "mountpoint" in c else
            f"{c.get('host', '?')} (the volume's only mount: SQLite)" for c in st["clients"]))
    lines.append(f"branches {', '.join(st['branches']) or '-'}; "
                 f"snapshots {', '.join(st['snapshots']) or '-'}")
    lines.append("")
    lines.append(f"{'dev':>3}  {'health':<8} {'state':<8} {'fragments':>9} {'used':>10} "
                 f"{'free':>10}  path")
    for d in st["devices"]:
        used = d["total"] - d["free"] if "total" in d else None
        where = d["path"] if d.get("node") == "local" else f"{d['node']}  {d['path']}"
        lines.append(f"{d['id']:>3}  {d['health']:<8} {d.get('state', 'in'):<8} "
                     f"{d['fragments']:>9} {_size(used):>10} {_size(d.get('free')):>10}  {where}")
    odd = [f"{d['id']} ({d['unexpected_entries']})" for d in st["devices"]
           if d.get("unexpected_entries")]
    if odd:
        lines.append("devices that found links or foreign files where new fragments go "
                     "(left alone; see the log): " + ", ".join(odd))
    if st.get("removed_devices"):
        lines.append("removed (bmfs node remove): "
                     + ", ".join(str(d) for d in st["removed_devices"]))
    if st.get("nodes"):
        lines.append("")
        lines.append("nodes registered in the metadata (leased heartbeats):")
        for name, rec in sorted(st["nodes"].items()):
            lines.append(f"  {name:<10} {rec['address']:<22} devices {rec['devices']}  "
                         f"last heartbeat {max(0.0, time.time() - rec['heartbeat']):.1f} s ago")
    lines.append("")
    b = st.get("repair_backlog")
    if b:
        lines.append(f"repair backlog: {b['fragments']} fragments in {b['stripes']} stripes "
                     f"({b['queued']} queued as damaged, {b['on_missing_devices']} on devices "
                     f"that do not answer, {b['never_stored']} never stored)")
    lines.append(f"fragments awaiting repair: {st['fragments_awaiting_repair']}; "
                 f"stripes short of full redundancy: {st.get('stripes_short', 0)}; "
                 f"stripes awaiting GC: {st['stripes_awaiting_gc']}"
                 + ("; deleted branches or snapshots still being collected"
                    if st.get("collecting_deleted_trees") else ""))
    lines.append("seen by reads since mounted: " + ", ".join(
        f"{k.replace('_', ' ')} {v}" for k, v in st["data"].items()))
    return "\n".join(lines)


def _size(n):
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


__all__ = ["volume_status", "render", "json", "keys"]
