"""A real 3-member etcd cluster for tests, run as subprocesses on free loopback ports.

``EtcdCluster`` starts the members in a temporary directory, waits until every one is
healthy and offers ``url`` (for ``EtcdKV.create``), ``pids``, ``leader_index()``,
``kill(i)`` (SIGKILL by pid), ``restart(i)``, ``wipe()`` and ``stop()`` (kills the
members it started by pid and removes the directory). The ``etcd_cluster`` fixture
gives one cluster per test module and skips when the etcd binary is missing
(``tools/setup.sh --test`` installs it).
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _post(endpoint: str, path: str, body: dict, timeout: float = 2.0) -> dict:
    req = urllib.request.Request(endpoint + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class EtcdCluster:
    def __init__(self, size: int = 3, max_txn_ops: int = 4096):
        self.dir = tempfile.mkdtemp(prefix="bmfs-etcd-")
        ports = _free_ports(2 * size)
        self.client_ports, self.peer_ports = ports[:size], ports[size:]
        self.names = [f"m{i}" for i in range(size)]
        self.max_txn_ops = max_txn_ops
        self.procs: list[subprocess.Popen | None] = [None] * size
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
        return [p.pid if p else None for p in self.procs]

    def _start(self, i: int, state: str) -> None:
        peers = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))
        log = open(os.path.join(self.dir, f"{self.names[i]}.log"), "ab")
        self.procs[i] = subprocess.Popen([
            ETCD, "--name", self.names[i],
            "--data-dir", os.path.join(self.dir, self.names[i]),
            "--listen-client-urls", self.endpoints[i],
            "--advertise-client-urls", self.endpoints[i],
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
            "--initial-cluster", peers, "--initial-cluster-state", state,
            "--initial-cluster-token", os.path.basename(self.dir),
            "--max-txn-ops", str(self.max_txn_ops), "--log-level", "warn",
        ], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

    def wait_healthy(self, timeout: float = 20.0) -> None:
        """Wait until every running member reports health (a leader and a quorum)."""
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(self.procs):
            while proc is not None:
                if proc.poll() is not None:
                    log = os.path.join(self.dir, self.names[i] + ".log")
                    raise RuntimeError(f"etcd member {i} exited; see {log}")
                try:
                    with urllib.request.urlopen(self.endpoints[i] + "/health", timeout=1) as r:
                        if json.loads(r.read()).get("health") == "true":
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member {i} not healthy after {timeout}s")
                time.sleep(0.05)

    def status(self, i: int) -> dict:
        return _post(self.endpoints[i], "/v3/maintenance/status", {})

    def leader_index(self, timeout: float = 10.0) -> int:
        """Index of the current leader, asked of the running members (waits for one)."""
        deadline = time.monotonic() + timeout
        while True:
            ids, leaders = {}, set()
            for i, pid in enumerate(self.pids):
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
                raise RuntimeError(f"no etcd leader among running members after {timeout}s")
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` by its pid."""
        proc, self.procs[i] = self.procs[i], None
        if proc is not None:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self, i: int) -> None:
        self.kill(i)
        self._start(i, "existing")
        self.wait_healthy()

    def wipe(self) -> None:
        """Delete every key (the conformance checks expect an empty store)."""
        every = base64.b64encode(b"\0").decode()
        for i, pid in enumerate(self.pids):
            if pid is not None:
                _post(self.endpoints[i], "/v3/kv/deleterange", {"key": every, "range_end": every})
                return

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd_cluster():
    if not os.access(ETCD, os.X_OK):
        pytest.skip(f"etcd not installed ({ETCD}); tools/setup.sh --test installs etcd-server")
    cluster = EtcdCluster()
    try:
        yield cluster
    finally:
        cluster.stop()
