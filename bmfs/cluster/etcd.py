"""A local etcd cluster: members as processes on this machine, on free loopback ports.

Used by `bmfs cluster up DIR --meta etcd` (members beside the storage nodes, listed in
DIR/cluster.json so `bmfs cluster down` stops them by pid and `bmfs cluster start`
starts them again on their data) and by the tests (tests/etcd_cluster.py). A
production cluster runs etcd members on separate machines; what matters here is the
flags every member gets (see docs/etcd.md):

- ``--max-txn-ops 10000``: etcd's default of 128 operations per transaction is too
  small for bmfs (deleting a file touches every chunk and stripe record it has).
- ``--max-request-bytes 10485760``: the default 1.5 MiB is tight for transactions
  carrying small files inline.

``EtcdCluster(directory)`` starts the members and waits until every one is healthy;
``url`` is the ``etcd://`` URL for mkfs; ``kill(i)`` (SIGKILL by pid), ``restart(i)``,
``leader_index()``, ``wipe()`` and ``stop()`` serve failure tests. The member list
(pids, ports, data directories) is kept in ``DIRECTORY/members.json``.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

from ..errors import VolumeError
from ..proc import alive
from .local import free_ports  # noqa: F401  (also used by tests/etcd_cluster.py)

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
MAX_TXN_OPS = 10000
MAX_REQUEST_BYTES = 10 << 20
MEMBERS_FILE = "members.json"


def _post(endpoint: str, path: str, body: dict, timeout: float = 2.0) -> dict:
    req = urllib.request.Request(endpoint + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # our own child that exited is a zombie until reaped: reap it
        return os.waitpid(pid, os.WNOHANG)[0] == 0
    except ChildProcessError:
        return True


class EtcdCluster:
    """Members of one etcd cluster started by this process (or found in ``members.json``).

    Raises (from the constructor):
        VolumeError: the etcd binary is missing, or a member exited or did not become
            healthy within 20 s (its log is named).
    """

    def __init__(self, directory: str | None = None, size: int = 3,
                 max_txn_ops: int = MAX_TXN_OPS, max_request_bytes: int = MAX_REQUEST_BYTES):
        if not os.access(ETCD, os.X_OK):
            raise VolumeError(f"etcd is not installed ({ETCD}); install etcd-server "
                              "(tools/setup.sh --test does)")
        self._own_dir = directory is None
        self.dir = tempfile.mkdtemp(prefix="bmfs-etcd-") if directory is None else directory
        os.makedirs(self.dir, exist_ok=True)
        ports = free_ports(2 * size)
        self.client_ports, self.peer_ports = ports[:size], ports[size:]
        self.names = [f"m{i}" for i in range(size)]
        self.max_txn_ops = max_txn_ops
        self.max_request_bytes = max_request_bytes
        self.procs: list[subprocess.Popen | None] = [None] * size
        self._pids: list[int | None] = [None] * size
        self.endpoints = [f"http://127.0.0.1:{p}" for p in self.client_ports]
        try:
            for i in range(size):
                self._start(i, "new")
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    @property
    def pids(self) -> list[int | None]:
        return list(self._pids)

    def members(self) -> list[dict]:
        return [{"name": n, "pid": pid, "client": f"127.0.0.1:{c}", "peer": f"127.0.0.1:{p}",
                 "data_dir": os.path.join(self.dir, n), "log": os.path.join(self.dir, n + ".log")}
                for n, pid, c, p in zip(self.names, self._pids, self.client_ports,
                                        self.peer_ports)]

    def _save(self) -> None:
        tmp = os.path.join(self.dir, MEMBERS_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"url": self.url, "members": self.members()}, f, indent=2)
        os.rename(tmp, os.path.join(self.dir, MEMBERS_FILE))

    def _start(self, i: int, state: str) -> None:
        addr = "127.0.0.1:{}".format
        self.procs[i] = start_member(
            self.dir, self.names[i], addr(self.client_ports[i]), addr(self.peer_ports[i]),
            [(n, addr(p)) for n, p in zip(self.names, self.peer_ports)], state,
            self.max_txn_ops, self.max_request_bytes)
        self._pids[i] = self.procs[i].pid
        self._save()

    def wait_healthy(self, timeout: float = 20.0) -> None:
        """Wait until every running member reports health (a leader and a quorum)."""
        deadline = time.monotonic() + timeout
        for i, pid in enumerate(self._pids):
            if pid is not None:
                wait_member_healthy(self.dir, self.names[i], self.endpoints[i], self.procs[i],
                                    deadline)

    def status(self, i: int) -> dict:
        return _post(self.endpoints[i], "/v3/maintenance/status", {})

    def leader_index(self, timeout: float = 10.0) -> int:
        """Index of the current leader, asked of the running members (waits for one)."""
        deadline = time.monotonic() + timeout
        while True:
            ids, leaders = {}, set()
            for i, pid in enumerate(self._pids):
                if pid is not None:
                    try:
                        st = self.status(i)
                    except OSError:
                        continue
                    ids[st["header"]["member_id"]] = i
                    leaders.add(st.get("leader"))
            if len(leaders) == 1 and (leader := leaders.pop()) in ids:
                return ids[leader]
            if time.monotonic() > deadline:
                raise VolumeError(f"no etcd leader among running members after {timeout}s")
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` by its pid (and reap it)."""
        proc, self.procs[i] = self.procs[i], None
        pid, self._pids[i] = self._pids[i], None
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        if proc is not None:
            proc.wait()
        elif pid is not None:
            while _alive(pid):
                time.sleep(0.02)
        self._save()

    def restart(self, i: int) -> None:
        self.kill(i)
        self._start(i, "existing")
        self.wait_healthy()

    def wipe(self) -> None:
        """Delete every key (the conformance checks expect an empty store)."""
        every = base64.b64encode(b"\0").decode()
        for i, pid in enumerate(self._pids):
            if pid is not None:
                _post(self.endpoints[i], "/v3/kv/deleterange", {"key": every, "range_end": every})
                return

    def stop(self) -> None:
        """Kill every member by pid; remove the directory if this object made it."""
        for i in range(len(self._pids)):
            self.kill(i)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def start_member(directory: str, name: str, client: str, peer: str,
                 peers: list[tuple[str, str]], state: str, max_txn_ops: int = MAX_TXN_OPS,
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> subprocess.Popen:
    """Start etcd member ``name`` (data in DIRECTORY/NAME, log in DIRECTORY/NAME.log)
    listening on ``client`` and ``peer`` (HOST:PORT); ``peers`` lists every member as
    (name, peer HOST:PORT). ``state`` is "new" for a first start, "existing" for a member
    that has its data directory already. Does not wait: see :func:`wait_member_healthy`."""
    log = open(os.path.join(directory, f"{name}.log"), "ab")
    try:
        return subprocess.Popen([
            ETCD, "--name", name,
            "--data-dir", os.path.join(directory, name),
            "--listen-client-urls", f"http://{client}",
            "--advertise-client-urls", f"http://{client}",
            "--listen-peer-urls", f"http://{peer}",
            "--initial-advertise-peer-urls", f"http://{peer}",
            "--initial-cluster", ",".join(f"{n}=http://{p}" for n, p in peers),
            "--initial-cluster-state", state,
            "--initial-cluster-token", os.path.basename(os.path.abspath(directory)),
            "--max-txn-ops", str(max_txn_ops),
            "--max-request-bytes", str(max_request_bytes),
            "--log-level", "warn",
        ], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # outlives the command that started it
    finally:
        log.close()


def wait_member_healthy(directory: str, name: str, endpoint: str,
                        proc: subprocess.Popen | None, deadline: float) -> None:
    """Wait until the member at ``endpoint`` reports health (a leader and a quorum).

    Raises:
        VolumeError: ``proc`` (when given) exited, or the monotonic ``deadline`` passed.
    """
    log = os.path.join(directory, name + ".log")
    while True:
        if proc is not None and proc.poll() is not None:
            raise VolumeError(f"etcd member {name} exited; see {log}")
        try:
            with urllib.request.urlopen(endpoint + "/health", timeout=1) as r:
                if json.loads(r.read()).get("health") == "true":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise VolumeError(f"etcd member {name} not healthy in time; see {log}")
        time.sleep(0.05)


# -- `bmfs cluster up DIR --meta etcd` ----------------------------------------------------
def start_for_cluster(directory: str, size: int = 3) -> str:
    """Start ``size`` members in DIR/etcd; returns the ``etcd://`` URL for mkfs."""
    cluster = EtcdCluster(os.path.join(directory, "etcd"), size)
    return cluster.url


def restart_for_cluster(directory: str, members: list[dict], timeout: float = 20.0) -> list[str]:
    """Start the members of DIR/cluster.json's ``etcd`` list that are not running, on
    their ports and their data in DIR/etcd, and wait until every member is healthy.

    Sets the ``pid`` of each member started in ``members`` (also when a later one fails,
    so `bmfs cluster down` can stop it) and returns their names.

    Raises:
        VolumeError: a member exited or did not become healthy within ``timeout``.
    """
    etcd_dir = os.path.join(directory, "etcd")
    peers = [(m["name"], m["peer"]) for m in members]
    procs: dict[str, subprocess.Popen] = {}
    for m in members:
        if m.get("pid") and alive(m["pid"]):
            continue
        procs[m["name"]] = start_member(etcd_dir, m["name"], m["client"], m["peer"], peers,
                                        "existing")
        m["pid"] = procs[m["name"]].pid
    deadline = time.monotonic() + timeout
    for m in members:  # one member alone has no quorum: wait once all are started
        wait_member_healthy(etcd_dir, m["name"], f"http://{m['client']}", procs.get(m["name"]),
                            deadline)
    return list(procs)


def record_in_cluster(directory: str) -> None:
    """List the members started by :func:`start_for_cluster` in DIR/cluster.json
    (``etcd``: name, pid, client and peer address, data directory, log)."""
    from . import local
    with open(os.path.join(directory, "etcd", MEMBERS_FILE)) as f:
        members = json.load(f)["members"]
    info = local.read_info(directory)
    info["etcd"] = members
    local.write_info(directory, info)
