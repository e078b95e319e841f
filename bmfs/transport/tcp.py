"""TCP transport: fragment requests to storage nodes over authenticated connections.

Each node gets a small pool of connections (requests on one connection are served in
order, so parallelism comes from several). A request that fails (connection refused
or reset, timeout, node error) raises DeviceError; the connection is dropped, and the
node is marked down for a short while so placement and reads skip it instead of
waiting on it again.
"""
from __future__ import annotations

import errno
import itertools
import json
import logging
import math
import os
import time

import trio

from ..node.protocol import Connection, ProtocolError, client_handshake
from ..wire import node_pb2 as pb
from . import DeviceError, TooSlow

log = logging.getLogger(__name__)
Req = pb.Request  # its enum values as class attributes: pb.Request.Op.X costs ~1 us a lookup
DOWN_FOR = 2.0        # seconds a failed node is skipped before it is tried again
LATE_DOWN = 3         # callers' deadlines missed in a row that mark a node down too
CONNECT_TIMEOUT = 2.0
CLIENT_BUFFER = 256 << 10  # replies larger than 64 KiB get buffers of their own
SMALL_READ = 64 << 10      # reads up to this size measure a node's latency (for hedging)


def spin_setting(environ=os.environ) -> float:
    """Seconds a lone small read's reply is spun for (Connection._spin_loop): the
    environment's BMFS_SPIN_US (microseconds, 0 turns spinning off), else 500 us.
    Spinning wins where waking a sleeping CPU is slow (VMs: docs/architecture.md);
    on bare metal it buys less for the CPU it burns."""
    raw = environ.get("BMFS_SPIN_US", "500")
    try:
        us = float(raw)
        if not 0 <= us <= 100_000:
            raise ValueError
    except ValueError:
        log.warning("BMFS_SPIN_US=%r is not a number of microseconds from 0 to 100000; "
                    "using 500", raw)
        us = 500.0
    return us / 1e6


SPIN = spin_setting()


class _Node:
    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self.address, self.host, self.port = address, host, int(port)
        self.idle: list[Connection] = []
        self.down_until = 0.0
        self.late = 0  # callers' deadlines missed in a row (see LATE_DOWN)
        self.latency = 0.002  # smoothed READ latency (seconds), for hedging


class TcpTransport:
    def __init__(self, devices: dict[int, str], secret: bytes, timeout: float = 10.0,
                 pool: int = 8):
        self.secret = secret
        self.timeout = timeout
        self.pool = pool
        self.nodes = {addr: _Node(addr) for addr in set(devices.values())}
        self.device_node = {dev: self.nodes[addr] for dev, addr in devices.items()}
        self._ids = itertools.count(1)
        self._inflight = 0  # requests under way
        self.stores = {dev: addr for dev, addr in devices.items()}  # for status

    def is_up(self, dev: int) -> bool:
        node = self.device_node.get(dev)
        return node is not None and node.down_until <= time.monotonic()

    async def _connect(self, node: _Node, deadline: float = math.inf) -> Connection:
        with trio.fail_at(min(trio.current_time() + CONNECT_TIMEOUT, deadline)):
            sock = trio.socket.socket()
            try:
                await sock.connect((node.host, node.port))
                sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
            except BaseException:
                sock.close()
                raise
            conn = Connection(sock, CLIENT_BUFFER)
            try:
                await client_handshake(conn, self.secret)
            except BaseException:
                conn.close()
                raise
        return conn

    async def request(self, dev: int, req, parts=(), timeout: float | None = None,
                      quick: bool = False, deadline: float = math.inf):
        """Send ``req`` (with payload ``parts``) to ``dev``'s node; (reply, payload view).
        ``quick``: a short reply is expected soon (a small READ): if no other request
        is under way, spin for it for a moment rather than sleep (Connection.spin).
        Past ``timeout`` (seconds) the node is taken for down (DeviceError); past
        ``deadline`` (trio time, the caller's: a hedged read's) TooSlow, and the node
        is not marked down. Both are the connection's (Connection.deadline), checked
        only when it has to sleep: no cancel scope per request."""
        node = self.device_node.get(dev)
        if node is None:
            raise DeviceError(dev, "unknown device")
        req.id = next(self._ids)
        req.device = dev
        conn = None
        own = trio.current_time() + (timeout or self.timeout)
        self._inflight += 1
        try:
            while True:
                pooled = bool(node.idle)
                at = min(own, deadline)
                conn = node.idle.pop() if pooled else await self._connect(node, at)
                conn.deadline = at
                try:
                    # (set each time: a reply there at once leaves spin unused)
                    conn.spin = SPIN if quick and self._inflight == 1 else 0.0
                    await conn.send(req, parts)
                    # the payload is a buffer of its own (large ones are received
                    # into it directly): slices of it are handed out without copies
                    resp, payload = await conn.recv(pb.Response, own_payload=True)
                    break
                except (EOFError, ConnectionResetError, BrokenPipeError):
                    if not pooled:
                        raise
                    # an idle connection the node closed (it restarted, say): not a
                    # sign of trouble; every request is idempotent, try a fresh one
                    conn.close()
                    conn = None
        except trio.TooSlowError as e:
            if conn is not None:  # the reply may still come: the stream is out of step
                conn.close()
            if deadline < own and trio.current_time() >= deadline:
                # a node that misses hedged reads' deadlines again and again (stalled,
                # or unreachable with connects timing out) is skipped for a while, or
                # every read of it would wait for the hedge first
                node.late += 1
                if node.late >= LATE_DOWN:
                    node.late = 0
                    node.down_until = time.monotonic() + DOWN_FOR
                raise TooSlow(f"device {dev}: no reply within the caller's deadline") from e
            node.down_until = time.monotonic() + DOWN_FOR
            raise DeviceError(dev, f"node {node.address}: timed out") from e
        except (OSError, EOFError, ProtocolError) as e:
            if conn is not None:
                conn.close()
            node.down_until = time.monotonic() + DOWN_FOR
            raise DeviceError(dev, f"node {node.address}: {str(e) or type(e).__name__}") from e
        except BaseException:
            if conn is not None:  # cancelled mid-request: the stream is out of step
                conn.close()
            raise
        finally:
            self._inflight -= 1
        if resp.id != req.id:
            conn.close()
            raise DeviceError(dev, f"node {node.address}: reply out of order")
        if len(node.idle) < self.pool:
            node.idle.append(conn)
        else:
            conn.close()
        node.down_until = 0.0
        node.late = 0
        if resp.errno:
            raise DeviceError(dev, f"node {node.address}: {resp.error or errno.errorcode.get(resp.errno)}")
        return resp, payload

    async def put(self, dev: int, name: str, parts) -> None:
        await self.request(dev, pb.Request(op=Req.PUT, name=name, durable=True), parts)

    async def read(self, dev: int, name: str, ranges, check=None,
                   deadline: float = math.inf) -> list[bytes]:
        t0 = time.monotonic()
        resp, payload = await self.request(
            dev, pb.Request(op=Req.READ, name=name,
                            ranges=[pb.Range(offset=o, length=n) for o, n in ranges]),
            quick=sum(n for _, n in ranges) <= SMALL_READ, deadline=deadline)
        if len(payload) <= SMALL_READ:  # the round trip, not the transfer time
            node = self.device_node[dev]
            node.latency = 0.8 * node.latency + 0.2 * (time.monotonic() - t0)
        out, pos = [], 0
        for n in resp.lengths:
            out.append(payload[pos:pos + n])  # views: no copy
            pos += n
        if check is not None:
            check(out)
        return out

    async def delete(self, dev: int, name: str) -> None:
        await self.request(dev, pb.Request(op=Req.DELETE, name=name))

    async def sync(self, dev: int) -> None:
        await self.request(dev, pb.Request(op=Req.SYNC))

    async def names(self, dev: int) -> list[str]:
        resp, _ = await self.request(dev, pb.Request(op=Req.LIST), timeout=60)
        return list(resp.names)

    async def stat(self, dev: int) -> dict:
        resp, _ = await self.request(dev, pb.Request(op=Req.STAT), timeout=5)
        return json.loads(resp.info_json)

    def expected_latency(self, dev: int) -> float:
        """The node's smoothed round trip of small reads (seconds)."""
        node = self.device_node.get(dev)
        return node.latency if node else 0.01

    async def aclose(self) -> None:
        for node in self.nodes.values():
            for c in node.idle:
                c.close()
            node.idle.clear()
