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
            path = path.replace("%i", self.instance)
            if path.startswith("-"):  # (a file that may be missing)
                if not os.path.exists(path[1:]):
                    continue
                path = path[1:]
            env.update(read_env(path))
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


def _write_once_devices_are_up(path, data: bytes, timeout: float = 30.0) -> None:
    """Write ``path``, again while it fails with ENOSPC: the mount takes devices just
    added up through its watch."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.write_bytes(data)
            return
        except OSError as err:
            assert err.errno == errno.ENOSPC and time.monotonic() < deadline
            time.sleep(0.5)


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
    etcd_cluster.wipe()  # (shared with the other tests of the module)
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
        # the mount's metrics endpoint, from mount.env.example on a free port
        metrics_port = free_ports(1)[0]
        example_env = read_env(os.path.join(UNITS, "mount.env.example"))
        assert "--metrics 127.0.0.1:" in example_env["BMFS_MOUNT_OPTS"]
        (etc / "mount.env").write_text("BMFS_MOUNT_OPTS=" + re.sub(
            r"127\.0\.0\.1:\d+", f"127.0.0.1:{metrics_port}",
            example_env["BMFS_MOUNT_OPTS"]) + "\n")
        mount = Unit("bmfs-mount.service", root)
        mp = root / "bm"
        mount.start()
        try:
            assert is_mounted(mp)
            import urllib.request
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                assert b"bmfs_fuse_operations_total" in r.read()
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
            _write_once_devices_are_up(mp / "big", data)
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


KUBE = os.path.join(os.path.dirname(__file__), "..", "mount", "kubernetes", "bmfs.yaml")


class Pod:
    """A container of a DaemonSet in mount/kubernetes/bmfs.yaml, carried out on this
    machine as a process (there is no Kubernetes here): ``$(VAR)`` in its command is
    expanded from its env (fieldRefs from ``fields``, configMapKeyRefs from
    ``config``), and each volumeMount's path is replaced by the directory standing for
    the volume on this "machine" (``host``: a hostPath's path under it; a Secret's
    files in ``secrets[name]``). /dev/fuse is this machine's."""

    def __init__(self, spec: dict, host, fields: dict, config: dict, secrets: dict):
        self.spec, self.host = spec, host
        self.fields, self.config, self.secrets = fields, config, secrets
        self.volumes = {v["name"]: v for v in spec["volumes"]}

    def _path(self, volume: str):
        v = self.volumes[volume]
        if "secret" in v:
            return self.secrets[v["secret"]["secretName"]]
        path = self.host / v["hostPath"]["path"].lstrip("/")
        if v["hostPath"].get("type") == "DirectoryOrCreate":
            path.mkdir(parents=True, exist_ok=True)
        return path

    def command(self, container: dict) -> list[str]:
        env = {}
        for e in container.get("env", []):
            ref = e["valueFrom"]
            if "fieldRef" in ref:
                env[e["name"]] = self.fields[ref["fieldRef"]["fieldPath"]]
            else:
                env[e["name"]] = self.config[ref["configMapKeyRef"]["key"]]
        mounts = sorted(((m["mountPath"], self._path(m["name"]))
                         for m in container["volumeMounts"] if m["mountPath"] != "/dev/fuse"),
                        key=lambda m: -len(m[0]))
        out = []
        for arg in container["command"]:
            arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
            for mount_path, local in mounts:
                arg = re.sub(re.escape(mount_path) + r"(?=/|\s|$)", str(local), arg)
            out.append(arg)
        if out[0] == "bmfs":
            out[0] = BMFS_BIN
        return out

    def run(self, container: dict, log_path):
        """The container's command as a process (its output to ``log_path``), with
        this bmfs first on PATH (a shell command's `bmfs`)."""
        env = dict(os.environ, PATH=os.path.dirname(BMFS_BIN) + os.pathsep + os.environ["PATH"])
        with open(log_path, "ab") as log:
            return subprocess.Popen(self.command(container), stdout=log, stderr=log, env=env)


def _kube_docs() -> dict:
    import yaml  # (a test dependency: pyproject.toml)
    with open(KUBE) as f:
        return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(f)}


def _wait_mounted(mp, proc, log_path, timeout: float = 60.0) -> None:
    """Until a working mount is at ``mp`` (a dead one is listed too: it answers
    ENOTCONN)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        if is_mounted(mp):
            try:
                os.listdir(mp)
                return
            except OSError as e:
                assert e.errno == errno.ENOTCONN, e
        time.sleep(0.1)


def _wait_listening(port: int, proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.1)


def test_the_kubernetes_daemonsets_commands(tmp_path, etcd_cluster):
    """mount/kubernetes/bmfs.yaml, its containers' commands run as processes (Pod):
    the steps docs/deploy.md gives (mkfs, the Secret's files, each machine's device
    formatted under an id of its own), six storage-node pods from one template
    serving their machines' devices under the ids their directories say, a mount pod
    whose command prepares the volume directory and mounts, the mount working through
    a node add per device, a mount container that died detached by its next start, and
    the preStop unmount ending the mount's process. What Kubernetes alone does
    (privileged, /dev/fuse, propagation, host networking, the updates) is checked in
    the manifest."""
    docs = _kube_docs()
    node_ds, mount_ds = docs[("DaemonSet", "bmfs-node")], docs[("DaemonSet", "bmfs-mount")]
    node_spec, mount_spec = node_ds["spec"]["template"]["spec"], mount_ds["spec"]["template"]["spec"]
    assert node_spec["hostNetwork"] and mount_spec["hostNetwork"]
    mount_c = mount_spec["containers"][0]
    assert mount_c["securityContext"]["privileged"] and "initContainers" not in mount_spec
    state = [m for m in mount_c["volumeMounts"] if m["name"] == "state"][0]
    assert state["mountPath"] == "/var/lib/bmfs" and state["mountPropagation"] == "Bidirectional"
    assert {"name": "fuse", "mountPath": "/dev/fuse"} in mount_c["volumeMounts"]
    assert mount_c["lifecycle"]["preStop"]["exec"]["command"] == \
        ["bmfs", "umount", "/var/lib/bmfs/bm"]
    assert mount_spec["terminationGracePeriodSeconds"] >= 120  # (storing written data)
    assert mount_ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert {v["name"]: v for v in node_spec["volumes"]}["device"]["hostPath"]["type"] == "Directory"

    etcd_cluster.wipe()  # (shared with the other tests of the module)
    vol = tmp_path / "vol"
    bmfs("mkfs", vol, "--on-nodes", "--meta", etcd_cluster.url)
    uuid = json.loads((vol / "volume.json").read_text())["uuid"]
    secret_dir = tmp_path / "secret-bmfs-volume"  # kubectl create secret --from-file
    secret_dir.mkdir()
    for name in ("volume.json", "secret"):
        shutil.copy(vol / name, secret_dir / name)
    config = dict(docs[("ConfigMap", "bmfs")]["data"], **{"volume-uuid": uuid,
                                                           "meta": etcd_cluster.url})
    secrets = {"bmfs-volume": secret_dir}
    node_c = node_spec["containers"][0]
    device_host = {v["name"]: v for v in node_spec["volumes"]}["device"]["hostPath"]["path"]
    nodes, ports = [], free_ports(6)
    client = tmp_path / "client"
    client_pod = Pod(mount_spec, client, {"status.hostIP": "127.0.0.1"}, config, secrets)
    mount_c = dict(mount_c, command=list(mount_c["command"]))  # (a free metrics port)
    mount_metrics = free_ports(1)[0]
    mount_c["command"][-1] = mount_c["command"][-1].replace(
        "$(NODE_IP):9100", f"$(NODE_IP):{mount_metrics}")
    bm = client / "var/lib/bmfs/bm"
    proc = None
    try:
        # a device directory not formatted (a disk that did not mount, say) is refused,
        # with what to do
        blank = tmp_path / "blank"
        blank.mkdir()
        r = bmfs("node", "serve", "--listen", "127.0.0.1:0", "--device", blank,
                 "--secret-file", secret_dir / "secret", "--volume-uuid", uuid, check=False)
        assert r.returncode == 2 and "not a formatted device directory" in r.stderr \
            and "bmfs node format" in r.stderr, r.stderr
        assert os.listdir(blank) == []
        for i, port in enumerate(ports):
            host = tmp_path / f"machine{i}"
            device = host / device_host.lstrip("/")
            bmfs("node", "format", "--device", f"{10 + i}={device}", "--volume-uuid", uuid)
            pod = Pod(node_spec, host, {"spec.nodeName": f"machine{i}",
                                        "status.hostIP": "127.0.0.1"}, config, secrets)
            cmd = pod.command(node_c)
            # (six "machines" on one address: each node gets a port of its own)
            cmd[cmd.index("127.0.0.1:7000")] = f"127.0.0.1:{port}"
            cmd[cmd.index("127.0.0.1:9101")] = f"127.0.0.1:{free_ports(1)[0]}"
            with open(tmp_path / f"node{i}.log", "ab") as log:
                nodes.append(subprocess.Popen(cmd, stdout=log, stderr=log))
        for port, node in zip(ports, nodes):
            _wait_listening(port, node)
        # the mount pod: its command prepares the volume directory, then mounts
        proc = client_pod.run(mount_c, tmp_path / "mount.log")
        _wait_mounted(bm, proc, tmp_path / "mount.log")
        # the cluster secret is read from the Secret's volume: none on the machine's disk
        assert not (client / "var/lib/bmfs/volume/secret").exists()
        host_volume = json.loads((client / "var/lib/bmfs/volume/volume.json").read_text())
        assert host_volume["secret"] == str(secret_dir / "secret")
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{mount_metrics}/metrics") as r:
            assert b"bmfs_fuse_operations_total" in r.read()
        for i, port in enumerate(ports):  # step 4 of the manifest's header
            bmfs("node", "add", device_host, "--id", 10 + i, "--address",
                 f"127.0.0.1:{port}", "-m", bm)
        data = os.urandom(9 << 20)
        _write_once_devices_are_up(bm / "big", data)
        _drop_caches()
        assert (bm / "big").read_bytes() == data
        status = bmfs("status", bm).stdout
        for i, port in enumerate(ports):
            assert f"127.0.0.1:{port}" in status and f"machine{i}" in status
        # the container dies: started again, its command detaches the dead mount first
        proc.kill()
        proc.wait()
        with pytest.raises(OSError) as e:
            os.listdir(bm)
        assert e.value.errno == errno.ENOTCONN
        proc = client_pod.run(mount_c, tmp_path / "mount.log")
        _wait_mounted(bm, proc, tmp_path / "mount.log")
        _drop_caches()
        assert (bm / "big").read_bytes() == data
        # the pod stops: preStop unmounts, and the mount's process ends by itself
        pre_stop = client_pod.command(dict(mount_c, command=mount_c["lifecycle"]["preStop"]
                                           ["exec"]["command"]))
        assert subprocess.run(pre_stop, capture_output=True).returncode == 0
        assert proc.wait(timeout=60) == 0
        assert not is_mounted(bm)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if is_mounted(bm):
            subprocess.run(["fusermount3", "-uz", str(bm)])
        for node in nodes:
            node.terminate()
        statuses = [node.wait(timeout=30) for node in nodes]
    assert all(s in (0, -signal.SIGTERM) for s in statuses), statuses
