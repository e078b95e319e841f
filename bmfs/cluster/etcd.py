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

Secure (the default): nobody who reaches a member's ports without the cluster's
credentials reads or writes anything. A private CA and certificates are made with
openssl in DIRECTORY/pki (bmfs/cluster/certs.py; 0700, keys 0600): every member serves
clients and peers over TLS and accepts only certificates of that CA
(``--client-cert-auth``, ``--peer-client-cert-auth``); and, through the JSON gateway
(no etcdctl), a ``root`` user with a random password (DIRECTORY/root.password, 0600)
is made and authentication turned on, so even a holder of a client certificate needs
the password. ``url`` names these files (bmfs/kv/etcd_auth.py), never their contents.

``EtcdCluster(directory)`` starts the members and waits until every one is healthy;
``url`` is the ``etcd://`` URL for mkfs; ``post(i, path, body)`` sends a gateway request
to member ``i`` with the credentials; ``kill(i)`` (SIGKILL by pid), ``restart(i)``,
``leader_index()``, ``wipe()`` and ``stop()`` serve failure tests. The member list
(pids, ports, data directories) is kept in ``DIRECTORY/members.json``.
"""
from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

from ..errors import VolumeError
from ..proc import alive
from .certs import make_ca_and_certs
from .directory import free_ports, read_info, write_info

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
MAX_TXN_OPS = 10000
MAX_REQUEST_BYTES = 10 << 20
MEMBERS_FILE = "members.json"
PKI = "pki"                       # DIRECTORY/pki: the CA, members' and client's certificates
PASSWORD_FILE = "root.password"   # DIRECTORY/root.password: etcd's root user's password
CLIENT = "client"                 # the certificate bmfs presents (DIRECTORY/pki/client.crt)


def _post(endpoint: str, path: str, body: dict, timeout: float = 2.0,
          tls: ssl.SSLContext | None = None, token: str | None = None) -> dict:
    headers = {"Authorization": token} if token else {}
    req = urllib.request.Request(endpoint + path, data=json.dumps(body).encode(),
                                 method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout, context=tls) as resp:
        return json.loads(resp.read())


class Credentials:
    """The client side of a secure cluster's files in DIRECTORY (see the module doc)."""

    def __init__(self, directory: str):
        self.dir = os.path.abspath(directory)
        pki = os.path.join(self.dir, PKI)
        self.ca = os.path.join(pki, "ca.crt")
        self.cert = os.path.join(pki, f"{CLIENT}.crt")
        self.key = os.path.join(pki, f"{CLIENT}.key")
        self.password_file = os.path.join(self.dir, PASSWORD_FILE)
        self._tls: ssl.SSLContext | None = None
        self.token: str | None = None

    @staticmethod
    def present(directory: str) -> bool:
        return os.path.exists(os.path.join(directory, PKI, "ca.crt"))

    def make(self, names: list[str]) -> None:
        """Certificates for the members ``names`` and the client; the root password
        (one left by an earlier attempt is kept)."""
        make_ca_and_certs(os.path.join(self.dir, PKI), names + [CLIENT])
        try:
            fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")

    def password(self) -> str:
        with open(self.password_file) as f:
            return f.readline().strip()

    @property
    def tls(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context(cafile=self.ca)
            self._tls.load_cert_chain(self.cert, self.key)
        return self._tls

    def url_options(self) -> str:
        """The etcd URL's options naming these files (bmfs/kv/etcd_auth.py)."""
        return "?" + urllib.parse.urlencode({"cacert": self.ca, "cert": self.cert,
                                             "key": self.key, "user": "root",
                                             "password-file": self.password_file},
                                            safe="/")

    def member_flags(self, name: str) -> list[str]:
        pki = os.path.join(self.dir, PKI)
        crt, key = os.path.join(pki, f"{name}.crt"), os.path.join(pki, f"{name}.key")
        return ["--cert-file", crt, "--key-file", key, "--trusted-ca-file", self.ca,
                "--client-cert-auth",
                "--peer-cert-file", crt, "--peer-key-file", key,
                "--peer-trusted-ca-file", self.ca, "--peer-client-cert-auth"]

    def post(self, endpoint: str, path: str, body: dict, timeout: float = 2.0) -> dict:
        """A gateway request with the client certificate and, once authentication is
        on, a token (fetched again when etcd no longer takes it)."""
        for again in (False, True):
            try:
                return _post(endpoint, path, body, timeout, self.tls, self.token)
            except urllib.error.HTTPError as e:
                text = e.read().decode(errors="replace")
                if again or e.code not in (400, 401, 403):
                    raise VolumeError(f"etcd {endpoint}{path}: HTTP {e.code}: {text}") from None
            # no token yet (etcd then says "permission denied" or "user name is
            # empty"), or an old one
            self.token = self._authenticate(endpoint, timeout)
        raise AssertionError("unreachable")

    def _authenticate(self, endpoint: str, timeout: float) -> str | None:
        try:
            return _post(endpoint, "/v3/auth/authenticate",
                         {"name": "root", "password": self.password()}, timeout,
                         self.tls)["token"]
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            if "authentication is not enabled" in text:
                return None
            raise VolumeError(f"etcd {endpoint}: authentication failed: {text}") from None

    def enable_auth(self, endpoint: str) -> None:
        """Make the root user (with the root role) and turn authentication on, through
        the gateway of a member of a new cluster."""
        self.post(endpoint, "/v3/auth/user/add", {"name": "root", "password": self.password()})
        self.post(endpoint, "/v3/auth/role/add", {"name": "root"})
        self.post(endpoint, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        self.post(endpoint, "/v3/auth/enable", {})


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
                 max_txn_ops: int = MAX_TXN_OPS, max_request_bytes: int = MAX_REQUEST_BYTES,
                 secure: bool = True, flags: tuple[str, ...] = ()):
        """``secure``: certificates and a root password (the module doc); ``flags``:
        more etcd flags for every member (e.g. ``--quota-backend-bytes``)."""
        if not os.access(ETCD, os.X_OK):
            raise VolumeError(f"etcd is not installed ({ETCD}); install etcd-server "
                              "(tools/setup.sh --test does)")
        self._own_dir = directory is None
        self.dir = tempfile.mkdtemp(prefix="bmfs-etcd-") if directory is None else directory
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        ports = free_ports(2 * size)
        self.client_ports, self.peer_ports = ports[:size], ports[size:]
        self.names = [f"m{i}" for i in range(size)]
        self.max_txn_ops = max_txn_ops
        self.max_request_bytes = max_request_bytes
        self.flags = tuple(flags)
        self.procs: list[subprocess.Popen | None] = [None] * size
        self._pids: list[int | None] = [None] * size
        self.creds = Credentials(self.dir) if secure else None
        scheme = "https" if secure else "http"
        self.endpoints = [f"{scheme}://127.0.0.1:{p}" for p in self.client_ports]
        try:
            if self.creds is not None:
                self.creds.make(self.names)
            for i in range(size):
                self._start(i, "new")
            self.wait_healthy()
            if self.creds is not None:
                self.creds.enable_auth(self.endpoints[0])
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.url_of(range(len(self.names)))

    def url_of(self, members) -> str:
        """The ``etcd://`` URL of the members of index ``members``, in that order (with
        the credentials' options)."""
        hosts = ",".join(f"127.0.0.1:{self.client_ports[i]}" for i in members)
        return "etcd://" + hosts + (self.creds.url_options() if self.creds else "")

    def post(self, i: int, path: str, body: dict, timeout: float = 2.0) -> dict:
        """A gateway request to member ``i`` (with the credentials, if secure).

        Raises:
            OSError: the member did not answer; VolumeError: it refused the request.
        """
        if self.creds is None:
            return _post(self.endpoints[i], path, body, timeout)
        return self.creds.post(self.endpoints[i], path, body, timeout)

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
            self.max_txn_ops, self.max_request_bytes, self.creds, self.flags)
        self._pids[i] = self.procs[i].pid
        self._save()

    def wait_healthy(self, timeout: float = 20.0) -> None:
        """Wait until every running member reports health (a leader and a quorum)."""
        deadline = time.monotonic() + timeout
        for i, pid in enumerate(self._pids):
            if pid is not None:
                wait_member_healthy(self.dir, self.names[i], self.endpoints[i], self.procs[i],
                                    deadline, self.creds)

    def status(self, i: int) -> dict:
        return self.post(i, "/v3/maintenance/status", {})

    def leader_index(self, timeout: float = 10.0) -> int:
        """Index of the current leader, asked of the running members (waits for one)."""
        deadline = time.monotonic() + timeout
        while True:
            ids, leaders = {}, set()
            for i, pid in enumerate(self._pids):
                if pid is not None:
                    try:
                        st = self.status(i)
                    except (OSError, VolumeError):
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
                self.post(i, "/v3/kv/deleterange", {"key": every, "range_end": every})
                return

    def stop(self) -> None:
        """Kill every member by pid; remove the directory if this object made it."""
        for i in range(len(self._pids)):
            self.kill(i)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def start_member(directory: str, name: str, client: str, peer: str,
                 peers: list[tuple[str, str]], state: str, max_txn_ops: int = MAX_TXN_OPS,
                 max_request_bytes: int = MAX_REQUEST_BYTES,
                 creds: Credentials | None = None, flags: tuple[str, ...] = ()
                 ) -> subprocess.Popen:
    """Start etcd member ``name`` (data in DIRECTORY/NAME, log in DIRECTORY/NAME.log)
    listening on ``client`` and ``peer`` (HOST:PORT); ``peers`` lists every member as
    (name, peer HOST:PORT). ``state`` is "new" for a first start, "existing" for a member
    that has its data directory already. With ``creds``, over TLS with client and peer
    certificates checked. Does not wait: see :func:`wait_member_healthy`."""
    s = "https" if creds is not None else "http"
    fd = os.open(os.path.join(directory, f"{name}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                 0o600)
    try:
        return subprocess.Popen([
            ETCD, "--name", name,
            "--data-dir", os.path.join(directory, name),
            "--listen-client-urls", f"{s}://{client}",
            "--advertise-client-urls", f"{s}://{client}",
            "--listen-peer-urls", f"{s}://{peer}",
            "--initial-advertise-peer-urls", f"{s}://{peer}",
            "--initial-cluster", ",".join(f"{n}={s}://{p}" for n, p in peers),
            "--initial-cluster-state", state,
            "--initial-cluster-token", os.path.basename(os.path.abspath(directory)),
            "--max-txn-ops", str(max_txn_ops),
            "--max-request-bytes", str(max_request_bytes),
            "--log-level", "warn",
            *(creds.member_flags(name) if creds is not None else ()), *flags,
        ], stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # outlives the command that started it
    finally:
        os.close(fd)


def wait_member_healthy(directory: str, name: str, endpoint: str,
                        proc: subprocess.Popen | None, deadline: float,
                        creds: Credentials | None = None) -> None:
    """Wait until the member at ``endpoint`` reports health (a leader and a quorum).

    Raises:
        VolumeError: ``proc`` (when given) exited, or the monotonic ``deadline`` passed.
    """
    log = os.path.join(directory, name + ".log")
    tls = creds.tls if creds is not None else None
    while True:
        if proc is not None and proc.poll() is not None:
            raise VolumeError(f"etcd member {name} exited; see {log}")
        try:
            with urllib.request.urlopen(endpoint + "/health", timeout=1, context=tls) as r:
                if json.loads(r.read()).get("health") == "true":
                    return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise VolumeError(f"etcd member {name} not healthy in time; see {log}")
        time.sleep(0.05)


# -- `bmfs cluster up DIR --meta etcd` ----------------------------------------------------
def start_for_cluster(directory: str, size: int = 3) -> str:
    """Start ``size`` secure members in DIR/etcd; returns the ``etcd://`` URL for mkfs
    (it names the credentials' files in DIR/etcd)."""
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
    creds = Credentials(etcd_dir) if Credentials.present(etcd_dir) else None
    peers = [(m["name"], m["peer"]) for m in members]
    procs: dict[str, subprocess.Popen] = {}
    for m in members:
        if m.get("pid") and alive(m["pid"]):
            continue
        procs[m["name"]] = start_member(etcd_dir, m["name"], m["client"], m["peer"], peers,
                                        "existing", creds=creds)
        m["pid"] = procs[m["name"]].pid
    deadline = time.monotonic() + timeout
    scheme = "https" if creds is not None else "http"
    for m in members:  # one member alone has no quorum: wait once all are started
        wait_member_healthy(etcd_dir, m["name"], f"{scheme}://{m['client']}",
                            procs.get(m["name"]), deadline, creds)
    return list(procs)


def record_in_cluster(directory: str) -> None:
    """List the members started by :func:`start_for_cluster` in DIR/cluster.json
    (``etcd``: name, pid, client and peer address, data directory, log)."""
    with open(os.path.join(directory, "etcd", MEMBERS_FILE)) as f:
        members = json.load(f)["members"]
    info = read_info(directory)
    info["etcd"] = members
    write_info(directory, info)
