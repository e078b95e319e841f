"""Level 2: a storage node against unauthenticated and idle peers, and over TLS.

Raw sockets play the attacker against real node servers (in-process trio servers on
loopback, or a `bmfs node serve` process where its memory is measured): before the
handshake a node says nothing about itself, refuses oversized frames without
allocating them, closes slow and surplus handshakes, and after it closes idle
connections and makes room for new clients when every slot is taken. Over TLS
(certificates of a CA made by bmfs/cluster/certs.py) reads and writes work on the
Python paths only (neither C fast path touches a TLS socket), and a peer without a
certificate of the CA, or without TLS, gets nothing.
"""
import os
import socket
import subprocess
import sys
import time

import pytest
import trio

from bmfs.node import protocol
from bmfs.node import server as node_server
from bmfs.node.protocol import PREFIX, Connection, client_handshake
from bmfs.node.server import READS, NodeServer
from bmfs.node.tls import TlsConfig
from bmfs.store.file import FileStore
from bmfs.errors import DeviceError
from bmfs.transport.tcp import TcpTransport
from bmfs.wire import node_pb2 as pb

SECRET = b"s" * 32
NAME = "node-with-a-telling-name"


async def _start(tmp_path, nursery, **kw) -> tuple[NodeServer, int]:
    path = str(tmp_path / "d0")
    if not os.path.exists(path):
        FileStore.format(path, "vol", 0)
    server = NodeServer(NAME, SECRET, {0: FileStore(path, "vol", 0)}, **kw)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, port


async def _stat(port: int, timeout: float = 20.0, tls=None) -> dict:
    """A legitimate client's STAT of device 0 (raises if not served in ``timeout``)."""
    transport = TcpTransport({0: f"127.0.0.1:{port}"}, SECRET, timeout=timeout, tls=tls)
    try:
        with trio.fail_after(timeout):
            return await transport.stat(0)
    finally:
        await transport.aclose()


async def _authenticated(port: int) -> Connection:
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    conn = Connection(sock, 4096)
    await client_handshake(conn, SECRET, 0)
    return conn


def _everything_until_closed(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """What the node sends until it closes the connection (fails if it does not)."""
    sock.settimeout(timeout)
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def test_unauthenticated_peer_learns_no_name_and_slow_handshake_is_closed(tmp_path):
    """A peer that trickles its Auth frame a byte at a time gets the challenge and
    nothing else (no node name), and is closed at the handshake deadline."""
    async def main():
        async with trio.open_nursery() as nursery:
            _, port = await _start(tmp_path, nursery, handshake_deadline=1.0)
            loris = socket.create_connection(("127.0.0.1", port))
            frame = PREFIX.pack(70, 0) + b"\x0a" * 70

            def trickle():
                got = b""
                loris.settimeout(0.2)
                for b in frame:
                    try:
                        loris.send(bytes([b]))
                        chunk = loris.recv(4096)
                    except (TimeoutError, socket.timeout):
                        continue
                    except (BrokenPipeError, ConnectionResetError):
                        return got, True
                    if not chunk:
                        return got, True
                    got += chunk
                return got + _everything_until_closed(loris), True
            got, closed = await trio.to_thread.run_sync(trickle)
            loris.close()
            assert closed
            hlen, plen = PREFIX.unpack_from(got)
            hello = pb.Hello.FromString(got[PREFIX.size:PREFIX.size + hlen])
            assert hello.node == "" and len(hello.challenge) == 32
            assert NAME.encode() not in got
            assert len(got) == PREFIX.size + hlen + plen  # the Hello, nothing after it
            await _stat(port)  # and the node serves on
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_half_open_and_garbage_connections_leave_room_for_a_client(tmp_path):
    """Many more half-open handshakes than may run at once: the oldest are closed at
    once (not at the deadline), garbage is closed, and a client is served."""
    async def main():
        async with trio.open_nursery() as nursery:
            server, port = await _start(tmp_path, nursery, max_handshakes=8,
                                        handshake_deadline=60.0)
            half_open = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
            garbage = []
            for i in range(10):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(os.urandom(100 + i))
                garbage.append(s)
            info = await _stat(port)
            assert info["stats"]["connections"] >= 51
            # every garbage connection and all but 8 half-open ones closed well before
            # the 60 s deadline
            with trio.move_on_after(4):
                while server.stats["rejected"] < 10 + 40 - 8:
                    await trio.sleep(0.05)
            assert server.stats["rejected"] >= 10 + 40 - 8, server.stats
            for s in half_open + garbage:
                s.close()
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_hundreds_of_idle_authenticated_connections_do_not_lock_out_a_client(
        tmp_path, monkeypatch):
    """More idle authenticated connections than the node serves at once
    (MAX_CONNECTIONS): a new client is still served (the idlest are closed)."""
    monkeypatch.setattr(node_server, "EVICT_IDLE", 0.3, raising=False)
    held = node_server.MAX_CONNECTIONS + 44

    async def main():
        async with trio.open_nursery() as nursery:
            server, port = await _start(tmp_path, nursery)
            conns = [await _authenticated(port) for _ in range(held)]
            await trio.sleep(0.5)  # idle, all of them
            info = await _stat(port)
            assert info["stats"]["evicted"] >= 45
            for c in conns:
                c.close()
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_idle_authenticated_connection_is_closed_and_the_client_carries_on(tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            _, port = await _start(tmp_path, nursery, idle_timeout=0.5)
            conn = await _authenticated(port)
            with trio.fail_after(20):
                with pytest.raises(EOFError):
                    await conn.recv(pb.Response)
            conn.close()
            # a pooled connection the node closed for idleness is retried afresh
            transport = TcpTransport({0: f"127.0.0.1:{port}"}, SECRET)
            await transport.stat(0)
            await trio.sleep(1.5)
            assert transport.is_up(0)
            await transport.stat(0)
            assert transport.is_up(0)
            await transport.aclose()
            nursery.cancel_scope.cancel()
    trio.run(main)


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_oversized_preauth_frames_are_refused_unallocated(tmp_path):
    """Attackers announcing 64 MiB frames before authenticating (each sending a MiB of
    it): a real node process closes each at its prefix, and its peak memory stays
    low; it serves a client afterwards."""
    dev = tmp_path / "dev"
    (tmp_path / "secret").write_bytes(SECRET)
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    number = port.getsockname()[1]
    port.close()
    log = open(tmp_path / "node.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bmfs.cli.main", "node", "serve", "--format",
         "--listen", f"127.0.0.1:{number}", "--device", f"0={dev}",
         "--secret-file", str(tmp_path / "secret"), "--volume-uuid", "vol"],
        stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", number), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        trio.run(_stat, number)
        before = _peak_rss_kib(proc.pid)
        attackers = []
        for _ in range(32):  # (the old code grew by 64 MiB for each)
            s = socket.create_connection(("127.0.0.1", number))
            s.settimeout(30)
            attackers.append(s)
            try:
                s.sendall(PREFIX.pack(16, 64 << 20) + b"\0" * 16 + b"x" * (1 << 20))
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed already
        for s in attackers:
            _everything_until_closed(s)  # (the Hello at most)
            s.close()
        trio.run(_stat, number)
        grown = _peak_rss_kib(proc.pid) - before
        assert grown < 32 << 10, f"the node's peak RSS grew by {grown} KiB"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    from bmfs.cluster.certs import make_ca_and_certs, member_files
    base = tmp_path_factory.mktemp("tls")
    made = make_ca_and_certs(str(base / "ca"), ["node", "client"])
    other = make_ca_and_certs(str(base / "other"), ["intruder"])
    return {**{name: TlsConfig(**member_files(made, name)) for name in ("node", "client")},
            "intruder": TlsConfig(**member_files(other, "intruder"))}


def test_reads_and_writes_over_tls_take_the_python_paths(tmp_path, certs, monkeypatch):
    """Over TLS a fragment written and read back (small READs, which the C paths
    would take, and a large one, which sendfile would send) comes back whole, and
    neither the node's C path nor the client's served any of it."""
    from bmfs.transport import tcp
    spun = []
    monkeypatch.setattr(tcp, "read_spun", lambda *a, **k: spun.append(a) or [])
    name = "00000000000000ab.0"
    data = os.urandom(1 << 20)

    async def main():
        async with trio.open_nursery() as nursery:
            server, port = await _start(tmp_path, nursery,
                                        tls=certs["node"].context(server=True))
            assert server.native_reads == ()
            transport = TcpTransport({0: f"127.0.0.1:{port}"}, SECRET,
                                     tls=certs["client"].context(server=False))
            await transport.put(0, name, [data])
            for off in range(0, 64 << 10, 4096):
                (part,) = await transport.read(0, name, [(off, 4096)])
                assert bytes(part) == data[off:off + 4096]
            (whole,) = await transport.read(0, name, [(0, len(data))])
            assert bytes(whole) == data
            assert transport.is_up(0) and not spun
            if READS is not None:
                assert READS.served(server._native) == 0
            assert server.stats["requests"] >= 18
            await transport.aclose()
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_tls_node_refuses_peers_without_a_member_certificate(tmp_path, certs):
    """A TLS node: a client without a certificate, one of another CA, and a plain
    TCP client (also the bmfs transport without TLS) are closed and get nothing; a
    member is served."""
    import ssl

    async def main():
        async with trio.open_nursery() as nursery:
            server, port = await _start(tmp_path, nursery, handshake_deadline=2.0,
                                        tls=certs["node"].context(server=True))

            def as_peer(ctx):
                raw = socket.create_connection(("127.0.0.1", port), timeout=10)
                try:
                    sock = ctx.wrap_socket(raw) if ctx else raw
                    return _everything_until_closed(sock)
                except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
                    return b""
                finally:
                    raw.close()
            no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            no_cert.check_hostname = False
            no_cert.load_verify_locations(certs["node"].ca)
            for ctx in (no_cert, certs["intruder"].context(server=False), None):
                assert await trio.to_thread.run_sync(as_peer, ctx) == b""
            with pytest.raises(DeviceError):  # (closed by the node, or timed out)
                await _stat(port, timeout=5)
            info = await _stat(port, tls=certs["client"].context(server=False))
            assert info["stats"]["rejected"] >= 4
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_tls_options_and_section_mistakes_are_one_line(tmp_path, certs):
    """`bmfs node serve` with part of the TLS options, or unusable files, and a volume
    whose tls section names a missing file: one line, exit status 2, no traceback."""
    (tmp_path / "secret").write_bytes(SECRET)
    base = [sys.executable, "-m", "bmfs.cli.main", "node", "serve", "--format",
            "--listen", "127.0.0.1:0", "--device", f"0={tmp_path / 'dev'}",
            "--secret-file", str(tmp_path / "secret"), "--volume-uuid", "vol"]
    for extra, says in ((["--tls-cert", certs["node"].cert], "all of --tls-cert"),
                        (["--tls-cert", certs["node"].cert, "--tls-key", str(tmp_path),
                          "--tls-ca", certs["node"].ca], "cannot use the TLS files")):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, \
            r.stderr
    from bmfs.errors import VolumeError
    from bmfs.volume.volume import _tcp_transport
    with pytest.raises(VolumeError, match="tls section"):
        _tcp_transport(str(tmp_path), {"tls": {"cert": "nope.pem", "key": "k", "ca": "c"}},
                       {})
    with pytest.raises(VolumeError, match="tls section"):
        _tcp_transport(str(tmp_path), {"tls": {"cert": "a"}}, {})


def test_tls_client_of_a_plain_node_fails_cleanly(tmp_path, certs):
    """TLS on one side only, the client's: a DeviceError for it, and the node goes on
    serving plain clients."""
    async def main():
        async with trio.open_nursery() as nursery:
            server, port = await _start(tmp_path, nursery)
            with pytest.raises(DeviceError):
                await _stat(port, timeout=5, tls=certs["client"].context(server=False))
            await _stat(port)
            assert server.stats["rejected"] == 1
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_a_handshake_relayed_to_another_node_lets_nobody_in(tmp_path):
    """Whoever answers at one node's address (a local user on the port its node left)
    and relays a mount's handshake to another node of the cluster gets in nowhere:
    the mount's proof names the device it wants, which the other node does not serve,
    so that node closes the relay instead of taking it for a client."""
    async def main():
        async with trio.open_nursery() as nursery:
            path = str(tmp_path / "d1")
            FileStore.format(path, "vol", 1)
            other = NodeServer(NAME, SECRET, {1: FileStore(path, "vol", 1)})
            other_port = await nursery.start(other.serve, "127.0.0.1", 0)
            listener = trio.socket.socket()
            await listener.bind(("127.0.0.1", 0))
            listener.listen()
            got = {}

            async def relay():
                mount_sock, _ = await listener.accept()
                node_sock = trio.socket.socket()
                await node_sock.connect(("127.0.0.1", other_port))
                to_mount, to_node = Connection(mount_sock, 4096), Connection(node_sock, 4096)
                hello, _ = await to_node.recv(pb.Hello)
                await to_mount.send(hello)
                auth, _ = await to_mount.recv(pb.Auth)
                await to_node.send(auth)
                try:
                    await to_node.recv(pb.AuthOk)
                    # in: the relay asks for the node's fragments itself
                    await to_node.send(pb.Request(id=1, op=pb.Request.LIST, device=1))
                    resp, _ = await to_node.recv(pb.Response)
                    got["names"] = list(resp.names)
                except (EOFError, OSError) as e:
                    got["refused"] = repr(e)
                to_mount.close()
                to_node.close()
            nursery.start_soon(relay)
            port = listener.getsockname()[1]
            transport = TcpTransport({0: f"127.0.0.1:{port}"}, SECRET, timeout=5.0)
            try:
                with pytest.raises((DeviceError, OSError)):
                    with trio.fail_after(30):
                        await transport.stat(0)
            finally:
                await transport.aclose()
            with trio.fail_after(10):
                while not got:
                    await trio.sleep(0.05)
            assert "refused" in got, got
            nursery.cancel_scope.cancel()
    trio.run(main)
