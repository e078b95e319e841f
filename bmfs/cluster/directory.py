"""A cluster directory's list of its processes (DIR/cluster.json) and the loopback
ports they listen on: what `bmfs cluster` (local.py) and its etcd members (etcd.py)
both keep there."""
from __future__ import annotations

import json
import os
import socket

from ..errors import VolumeError

CLUSTER_FILE = "cluster.json"
DOWN_FILE = CLUSTER_FILE + ".down"  # what `down` leaves: the same list, nothing running


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def read_info(directory: str) -> dict:
    try:
        with open(os.path.join(directory, CLUSTER_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        if os.path.exists(os.path.join(directory, DOWN_FILE)):
            raise VolumeError(f"{directory}: the cluster is down "
                              f"(`bmfs cluster start {directory}` starts all of it)") from None
        raise VolumeError(f"{directory}: no {CLUSTER_FILE} (not a cluster started by "
                          f"`bmfs cluster up`)") from None


def write_info(directory: str, info: dict) -> None:
    tmp = os.path.join(directory, CLUSTER_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(info, f, indent=2)
    os.rename(tmp, os.path.join(directory, CLUSTER_FILE))
