"""Level 6: deploying on machines of one's own, as docs/deploy.md says.

A volume made for storage nodes (`bmfs mkfs --on-nodes`, etcd metadata), its nodes and
its mount run from the systemd units in mount/systemd. There is no systemd here, so
``Unit`` carries their directives out as systemd does: EnvironmentFile, %i and %H,
${VAR} (one word) and $VAR (split into words), ExecStartPre (a leading '-' ignores
failure), Type=notify (the service is started once it sends READY=1 to
$NOTIFY_SOCKET), ExecStop, and SIGTERM for what is still running. Paths are the
units' own with /etc/bmfs, /bm and /usr/local/bin/bmfs moved under the test's
directory. Every process is real: etcd members, node processes, FUSE mounts.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from bmfs.cli.common import find_mount
from bmfs.cluster.local import free_ports
from etcd_cluster import etcd_cluster  # noqa: F401  (fixture)
from mountutil import Mounted, bmfs, is_mounted

UNITS = os.path.join(os.path.dirname(__file__), "..", "mount", "systemd")
BMFS_BIN = os.path.join(os.path.dirname(sys.executable), "bmfs")


def read_env(path) -> dict:
    """An EnvironmentFile: KEY=VALUE lines; comments and blank lines skipped."""
    env = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                value = value.strip()
                if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
                    value = value[1:-1]
                env[key.strip()] = value
    return env


class Unit:
    """One service unit, run as systemd would run it (see the module docstring)."""

    def __init__(self, name: str, root, instance: str = ""):
        self.root, self.instance, self.proc = str(root), instance, None
        with open(os.path.join(UNITS, name)) as f:
            text = f.read()
        text = text.replace("/usr/local/bin/bmfs", BMFS_BIN)
        text = text.replace("/etc/bmfs", f"{self.root}/etc/bmfs")
        text = re.sub(r"(?<![\w/.-])/bm(?![\w/.-])", f"{self.root}/bm", text)
        self.directives: dict[str, list[str]] = {}
        section = None
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, _, value = line.partition("=")
            self.directives.setdefault(f"{section}.{key}", []).append(value)

    def get(self, key: str) -> list[str]:
        return self.directives.get(f"Service.{key}", [])

    def env(self) -> dict:
        env = {}
        for path in self.get("EnvironmentFile"):
            env.update(read_env(path.replace("%i", self.instance)))
        return env

    def command(self, line: str) -> tuple[list[str], bool]:
        """(argv, whether a failure is ignored) of an Exec line."""
        ignore = line.startswith("-")
        line = line.lstrip("-").replace("%i", self.instance).replace("%H", socket.gethostname())
        env, argv = self.env(), []
        for word in shlex.split(line):
            alone = re.fullmatch(r"\$(\w+)", word)
            if alone:
                argv += env.get(alone.group(1), "").split()
            else:
                argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
        return argv, ignore

    def start(self, timeout: float = 60.0) -> None:
        for line in self.get("ExecStartPre"):
            argv, ignore = self.command(line)
            try:
                r = subprocess.run(argv, capture_output=True, text=True)
            except FileNotFoundError:
                assert ignore, f"{argv}: no such program"
                continue
            assert ignore or r.returncode == 0, f"{argv}: {r.stderr}"
        (argv, _), = [self.command(line) for line in self.get("ExecStart")]
        assert self.get("Type") == ["notify"]
        path = os.path.join(self.root, f"notify-{os.getpid()}-{id(self)}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.settimeout(timeout)
            self.log = open(os.path.join(self.root, f"unit-{id(self)}.log"), "wb")
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log,
                                         stderr=self.log, start_new_session=True,
                                         env={**os.environ, "NOTIFY_SOCKET": path})
            try:
                data, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except socket.timeout:
                self.stop()
                raise AssertionError(f"{argv} sent no READY=1 within {timeout} s")
            finally:
                os.unlink(path)
        assert "READY=1" in data.decode().splitlines(), data
        # NotifyAccess=main (the default): only the main process's message counts
        (pid, _, _), = [struct.unpack("3i", d[:12]) for level, kind, d in anc
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS]
        assert pid == self.proc.pid
        assert self.proc.poll() is None

    def journal(self) -> str:
        """What the service wrote to stdout and stderr (systemd's journal)."""
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 60.0) -> int:
        """ExecStop (which must succeed), then SIGTERM if still running; the main
        process's exit status."""
        if self.proc is None:
            return 0
        failed = []
        for line in self.get("ExecStop"):
            argv, _ = self.command(line)
            try:
                r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
                if r.returncode:
                    failed.append(f"{argv}: {r.stderr}")
            except subprocess.TimeoutExpired:
                failed.append(f"{argv}: no exit within {timeout} s")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self.proc = None
        self.log.close()
        assert not failed, failed
        return status


def _device(mp, dev) -> dict:
    """Device ``dev`` as `bmfs status --json` shows it."""
    devices = json.loads(bmfs("status", mp, "--json").stdout)["devices"]
    return [d for d in devices if d["id"] == dev][0]


@contextlib.contextmanager
def _node(log_path, dev, path, uuid, etc, etcd):
    """A `bmfs node serve` of ``dev`` at ``path`` (with --meta) outside the units,
    logging to ``log_path``; yields its address; killed on exit."""
    port = free_ports(1)[0]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [BMFS_BIN, "node", "serve", "--listen", f"127.0.0.1:{port}", "--device",
             f"{dev}={path}", "--secret-file", etc / "volume" / "secret",
             "--volume-uuid", uuid, "--meta", etcd.url], stdout=log, stderr=log)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            proc.kill()
            proc.wait()


def _wait_for_line(path, text, timeout=20.0):
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"{path}: no {text!r} in {timeout} s"
        time.sleep(0.2)


def _drop_caches():
    subprocess.run(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def test_a_volume_on_storage_nodes_run_from_the_systemd_units(tmp_path, etcd_cluster):
    """The walk-through of docs/deploy.md on one machine. `mkfs --on-nodes` makes a
    volume with no devices and a cluster secret; each node is formatted
    (`bmfs node format`), started from bmfs-node@.service with an environment file
    made from node.env.example, and added by address. With k devices in service a
    file's write fails with ENOSPC (a small file still fits in the metadata); once
    all six are added, the mount from bmfs-mount.service (which raised the mount's
    read-ahead, as a detached mount does) and a second mount share one namespace, a
    file survives two nodes killed -9, the nodes are listed through their leased
    membership records, a node that comes back on another port is reached there: at
    once when it announces its address (--meta), else once `bmfs node set-address`
    says where (and not at a node that does not serve the device, or serves another
    volume's); and stopping the units unmounts and ends every process."""
    root = tmp_path
    etc = root / "etc" / "bmfs"
    etc.mkdir(parents=True)
    vol = root / "vol"
    r = bmfs("mkfs", vol, "--on-nodes", "--meta", etcd_cluster.url)
    assert "bmfs node add" in r.stdout and "bmfs node serve" in r.stdout
    uuid = json.loads((vol / "volume.json").read_text())["uuid"]
    assert len((vol / "secret").read_text()) >= 32
    assert os.stat(vol / "secret").st_mode & 0o077 == 0
    shutil.copytree(vol, etc / "volume")  # "copy VOL to every machine"

    example = read_env(os.path.join(UNITS, "node.env.example"))
    node_unit = Unit("bmfs-node@.service", root)
    used = set(re.findall(r"\$\{?(\w+)", " ".join(node_unit.get("ExecStart"))))
    assert used <= set(example), f"the units use {used - set(example)} not in the example"
    nodes, devices = [], {}
    ports = free_ports(6)
    try:
        for i, port in enumerate(ports):
            devices[i] = root / f"nvme{i}" / "bmfs"
            env = dict(example, BMFS_LISTEN=f"127.0.0.1:{port}",
                       BMFS_DEVICE=f"{i}={devices[i]}", BMFS_VOLUME_UUID=uuid,
                       BMFS_NODE_OPTS=f"--meta {etcd_cluster.url}")
            (etc / f"node-n{i}.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
            r = bmfs("node", "format", "--device", f"{i}={devices[i]}", "--volume-uuid", uuid)
            assert f"{devices[i]} formatted" in r.stdout
            unit = Unit("bmfs-node@.service", root, instance=f"n{i}")
            unit.start()
            nodes.append(unit)
        r = bmfs("node", "format", "--device", f"9={devices[0]}", "--volume-uuid", uuid,
                 check=False)  # device 0's directory, formatted, is not device 9
        assert r.returncode == 2 and "cannot format" in r.stderr, r.stderr

        def add(i):
            bmfs("node", "add", devices[i], "--address", f"127.0.0.1:{ports[i]}",
                 "--id", i, "--volume", etc / "volume")

        for i in range(4):
            add(i)
        mount = Unit("bmfs-mount.service", root)
        mp = root / "bm"
        mount.start()
        try:
            assert is_mounted(mp)
            dev = find_mount(str(mp))["dev"]
            with open(f"/sys/class/bdi/{dev}/read_ahead_kb") as f:
                assert int(f.read()) == 4096
            (mp / "small").write_bytes(b"fits in the metadata")
            with pytest.raises(OSError) as e:
                (mp / "big").write_bytes(os.urandom(8 << 20))
            assert e.value.errno == errno.ENOSPC
            assert "writes need at least 5 (4+2)" in mount.journal()
            add(4)
            add(5)
            data = os.urandom(40 << 20)
            deadline = time.monotonic() + 30
            while True:  # the mount takes the new devices up through its watch
                try:
                    (mp / "big").write_bytes(data)
                    break
                except OSError as err:
                    assert err.errno == errno.ENOSPC and time.monotonic() < deadline
                    time.sleep(0.5)
            with Mounted(vol, root / "other"):  # another machine's mount
                assert (root / "other" / "big").read_bytes() == data
                assert (root / "other" / "small").read_bytes() == b"fits in the metadata"
            status = bmfs("status", mp).stdout
            for i in range(6):
                assert f"127.0.0.1:{ports[i]}" in status
            assert "nodes registered in the metadata" in status
            for i in range(6):
                assert f"{socket.gethostname()}-n{i}" in status
            for unit in nodes[1], nodes[4]:
                os.kill(unit.proc.pid, signal.SIGKILL)
            _drop_caches()
            assert (mp / "big").read_bytes() == data
            # node n2 comes back on another port: with --meta it announces the address
            # for its device, and the mount takes it up through its watch
            nodes[2].stop(timeout=20)
            new2 = free_ports(1)[0]
            env_file = etc / "node-n2.env"
            env_file.write_text(env_file.read_text().replace(f":{ports[2]}", f":{new2}"))
            nodes[2] = Unit("bmfs-node@.service", root, instance="n2")
            nodes[2].start()
            deadline = time.monotonic() + 30
            while _device(mp, 2)["node"] != f"127.0.0.1:{new2}":
                assert time.monotonic() < deadline, _device(mp, 2)
                time.sleep(0.2)
            _drop_caches()
            assert (mp / "big").read_bytes() == data
            # its failure domain (its address, by default) moved with it
            assert _device(mp, 2)["domain"] == f"127.0.0.1:{new2}"
            # node n3 comes back on another port without --meta: nothing announces it,
            # so with 1 and 4 dead reads fail, until set-address says where it is
            nodes[3].stop(timeout=20)
            new3 = free_ports(1)[0]
            env_file = etc / "node-n3.env"
            env_file.write_text(env_file.read_text().replace(f":{ports[3]}", f":{new3}")
                                .replace(f"BMFS_NODE_OPTS=--meta {etcd_cluster.url}",
                                         "BMFS_NODE_OPTS="))
            nodes[3] = Unit("bmfs-node@.service", root, instance="n3")
            nodes[3].start()
            _drop_caches()
            with pytest.raises(OSError) as e:
                (mp / "big").read_bytes()
            assert e.value.errno == errno.EIO
            r = bmfs("node", "set-address", 3, f"127.0.0.1:{ports[0]}", "-m", mp, check=False)
            assert r.returncode == 2 and "does not serve device 3" in r.stderr, r.stderr
            # a node with the secret serving a device 3 of another volume is refused too
            other = root / "other-volume-dev3"
            foreign = "11111111-2222-3333-4444-555555555555"
            bmfs("node", "format", "--device", f"3={other}", "--volume-uuid", foreign)
            with _node(root / "foreign.log", 3, other, foreign, etc, etcd_cluster) as addr:
                deadline = time.monotonic() + 20
                while True:
                    r = bmfs("node", "set-address", 3, addr, "-m", mp, check=False)
                    if "does not serve" not in r.stderr or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)  # (not listening yet)
                assert r.returncode == 2 and "of another volume" in r.stderr, r.stderr
                # nor does that node register or announce itself: the metadata is
                # another volume's
                _wait_for_line(root / "foreign.log", "is not volume")
            assert _device(mp, 3)["node"] == f"127.0.0.1:{ports[3]}"
            bmfs("node", "set-address", 3, f"127.0.0.1:{new3}", "-m", mp)
            _drop_caches()
            assert (mp / "big").read_bytes() == data
            assert _device(mp, 3)["node"] == f"127.0.0.1:{new3}"
            assert _device(mp, 3)["domain"] == f"127.0.0.1:{new3}"
            # a copy of device 5 served by another process while node n5 still serves
            # the device: the copy's node does not take the record over
            copy = root / "copy-of-dev5"
            shutil.copytree(devices[5], copy)
            with _node(root / "copy.log", 5, copy, uuid, etc, etcd_cluster):
                _wait_for_line(root / "copy.log", "still serves it")
            assert _device(mp, 5)["node"] == f"127.0.0.1:{ports[5]}"
            # the daemon dies: starting the unit again detaches the dead mount first
            os.kill(mount.proc.pid, signal.SIGKILL)
            mount.proc.wait()
            with pytest.raises(OSError) as e:
                os.listdir(mp)
            assert e.value.errno == errno.ENOTCONN
            mount.proc = None
            mount.log.close()
            mount.start()
            _drop_caches()
            assert (mp / "big").read_bytes() == data
        finally:
            status = mount.stop()
        assert status == 0  # the daemon itself: it exited once unmounted
        assert not is_mounted(mp)
    finally:
        statuses = [unit.stop(timeout=20) for unit in nodes]
    # the nodes end on SIGTERM (not killed after the timeout); 1 and 4 were killed -9
    assert all(s in (0, -signal.SIGTERM) for i, s in enumerate(statuses) if i not in (1, 4)), \
        statuses
