"""`bmfs cluster up/start/add/down`: a test cluster of storage-node processes on this machine.

DIR/cluster.json lists every process with its pid and address; DIR is also the volume
directory (volume.json, the metadata, the cluster secret), so `bmfs mount MP --volume
DIR` mounts it. Each node is a separate `bmfs node serve` process on loopback owning
one device directory DIR/nodeN/dev. `down` stops every process and renames the file to
DIR/cluster.json.down; `start` renames it back and starts every process again on the
same ports and data. `add` starts one more node with a new device and adds the device
to the volume.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import trio

from ..errors import VolumeError
from ..node.protocol import make_secret
from .directory import CLUSTER_FILE, DOWN_FILE, free_ports, read_info, write_info


def node_command(i: int, port: int, dev: int, path: str, secret: str, uuid: str,
                 fault: str | None = None, meta: str | None = None,
                 tls: dict | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "bmfs.cli.main", "node", "serve", "--name", f"node{i}",
           "--listen", f"127.0.0.1:{port}", "--device", f"{dev}={path}",
           "--secret-file", secret, "--volume-uuid", uuid]
    if tls:  # (certs.make_ca_and_certs: this node's certificate, key and the CA)
        cmd += ["--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["ca"]]
    if fault:
        cmd += ["--fault", fault]
    if meta and meta.startswith("etcd:"):
        cmd += ["--meta", meta]  # leased membership record (volume/membership.py)
    return cmd


def start_node(directory: str, node: dict, fault: str | None = None) -> int:
    """Start (or restart) one node process; returns its pid once it accepts connections."""
    log = open(os.path.join(directory, f"node{node['index']}.log"), "ab")
    cmd = node_command(node["index"], node["port"], node["device"], node["path"],
                       os.path.join(directory, "secret"), node["uuid"], fault, node.get("meta"),
                       node.get("tls"))
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VolumeError(f"node{node['index']} exited with status {proc.returncode}; "
                              f"see {directory}/node{node['index']}.log")
        try:
            socket.create_connection(("127.0.0.1", node["port"]), timeout=0.2).close()
            return proc.pid
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise VolumeError(f"node{node['index']} did not start listening within 20 s")


def up(directory: str, nodes: int, k: int, m: int, meta: str | None = None,
       domains: int = 0, layout: str | None = None, tls: bool = False) -> dict:
    """Start ``nodes`` nodes; with ``domains`` > 0, node i is in failure domain
    ``d{i % domains}`` (placement spreads a stripe's fragments over domains first).
    With ``tls``, node connections are TLS with certificates of a CA made in DIR/tls
    (certs.py), named in volume.json's tls section for mounts."""
    from ..volume.volume import check_new_volume_dir, mkfs
    if os.path.exists(os.path.join(directory, CLUSTER_FILE)):
        raise VolumeError(f"{directory} already holds a cluster (bmfs cluster down first)")
    check_new_volume_dir(directory)
    if nodes < k + m:
        raise VolumeError(f"--ec {k}+{m} needs at least {k + m} nodes, {nodes} given")
    os.makedirs(directory, exist_ok=True)
    make_secret(os.path.join(directory, "secret"))
    ports = free_ports(nodes)
    paths = [os.path.join(os.path.abspath(directory), f"node{i}", "dev") for i in range(nodes)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    doms = [f"d{i % domains}" for i in range(nodes)] if domains else None
    settings = trio.run(lambda: mkfs(directory, k, m, devices=paths, meta=meta,
                                     nodes=addrs, domains=doms, layout=layout))
    info = {"volume": os.path.abspath(directory), "uuid": settings.uuid, "ec": f"{k}+{m}",
            "meta": meta or f"sqlite:{os.path.abspath(directory)}/meta.db", "nodes": [],
            "tls": tls}
    certs = _make_tls(directory, [f"node{i}" for i in range(nodes)]) if tls else {}
    try:
        for i in range(nodes):
            node = {"index": i, "device": i, "path": paths[i], "port": ports[i],
                    "address": addrs[i], "uuid": settings.uuid, "meta": meta,
                    "tls": certs.get(f"node{i}")}
            node["pid"] = start_node(directory, node)
            info["nodes"].append(node)
    except BaseException:
        for node in info["nodes"]:
            _stop(node["pid"])
        raise
    write_info(directory, info)
    return info


def add_node(directory: str, dev: int, domain: str | None = None) -> dict:
    """Start one more node serving device ``dev`` (an id the volume has not used), in
    a new device directory DIR/nodeN/dev formatted for the volume (the layout of node
    0's), and list it in cluster.json; the caller adds the device to the volume
    (devices.add_device), or undoes this with drop_node if that fails. If the node does
    not start, nothing is left behind. The node's record."""
    import shutil
    from ..store.pmem import format_store, layout_of
    info = read_info(directory)
    index = max(n["index"] for n in info["nodes"]) + 1
    path = os.path.join(os.path.abspath(directory), f"node{index}", "dev")
    layout = layout_of(info["nodes"][0]["path"])
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # a failed add's leftovers
    port = free_ports(1)[0]
    node = {"index": index, "device": dev, "path": path, "port": port,
            "address": f"127.0.0.1:{port}", "uuid": info["uuid"], "meta": info.get("meta"),
            "tls": _make_tls(directory, [f"node{index}"])[f"node{index}"]
            if info.get("tls") else None}
    if domain:
        node["domain"] = domain
    try:
        format_store(path, info["uuid"], dev, layout)
        node["pid"] = start_node(directory, node)
    except BaseException:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        raise
    info["nodes"].append(node)
    write_info(directory, info)
    return node


def _make_tls(directory: str, names: list[str]) -> dict:
    """Certificates for ``names`` and the mounts' ("client", named in volume.json's tls
    section) from the CA in DIR/tls (made at the first call)."""
    from ..volume.volume import VOLUME_FILE
    from .certs import make_ca_and_certs, member_files
    made = make_ca_and_certs(os.path.join(directory, "tls"), names + ["client"])
    path = os.path.join(directory, VOLUME_FILE)
    with open(path) as f:
        volume = json.load(f)
    volume["tls"] = {"cert": "tls/client.crt", "key": "tls/client.key", "ca": "tls/ca.crt"}
    with open(path + ".tmp", "w") as f:
        json.dump(volume, f)
    os.rename(path + ".tmp", path)
    return {name: member_files(made, name) for name in names}


def drop_node(directory: str, node: dict) -> None:
    """Undo add_node: stop the node, take it out of cluster.json, delete its directory."""
    import shutil
    _stop(node["pid"])
    info = read_info(directory)
    info["nodes"] = [n for n in info["nodes"] if n["index"] != node["index"]]
    write_info(directory, info)
    shutil.rmtree(os.path.dirname(node["path"]), ignore_errors=True)


from ..proc import alive as _alive  # noqa: E402


def _stop(pid: int, timeout: float = 5.0) -> None:
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            if not _alive(pid):
                return
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout  # gone, its port too, before a restart
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _reopen(directory: str) -> None:
    """After `bmfs cluster down`: DIR/cluster.json back from DIR/cluster.json.down, with
    no pids (the old ones may belong to other processes by now)."""
    stopped = os.path.join(directory, DOWN_FILE)
    if os.path.exists(os.path.join(directory, CLUSTER_FILE)) or not os.path.exists(stopped):
        return
    with open(stopped) as f:
        info = json.load(f)
    for proc in info["nodes"] + info.get("etcd", []):
        proc["pid"] = None
    write_info(directory, info)
    os.remove(stopped)


def restart(directory: str, index: int | None = None, fault: str | None = None) -> list[str]:
    """Without ``index``: start every etcd member, then every node, that is not running,
    also after `bmfs cluster down`. With it: (re)start node ``index``. The new pids go
    into cluster.json (also those started before a failure); returns the names started.

    Raises:
        VolumeError: DIR is no cluster (or, with ``index``, one that is down), or a
            process exited or did not start listening in time (its log is named).
    """
    if index is None:
        _reopen(directory)
    info = read_info(directory)
    started = []
    try:
        if index is None and info.get("etcd"):
            from . import etcd  # imports this module: not at the top
            started += [f"etcd {name}" for name in etcd.restart_for_cluster(directory,
                                                                            info["etcd"])]
        for node in info["nodes"]:
            if index is not None and node["index"] != index:
                continue
            if node.get("pid") and _alive(node["pid"]):
                if index is None:
                    continue
                _stop(node["pid"])
            node["pid"] = start_node(directory, node, fault)
            started.append(f"node{node['index']}")
    finally:
        write_info(directory, info)
    return started


def down(directory: str) -> int:
    info = read_info(directory)
    n = 0
    for node in info["nodes"]:
        if node.get("pid"):
            _stop(node["pid"])
            n += 1
    for member in info.get("etcd", []):
        if member.get("pid"):
            _stop(member["pid"])
            n += 1
    os.rename(os.path.join(directory, CLUSTER_FILE), os.path.join(directory, DOWN_FILE))
    return n
