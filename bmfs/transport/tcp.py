"""TCP transport: fragment requests to storage nodes over authenticated connections.

Each node gets a small pool of connections (requests on one connection are served in
order, so parallelism comes from several). A request that fails (connection refused
or reset, timeout, node error) raises DeviceError; the connection is dropped, and the
node is marked down for a short while so placement and reads skip it instead of
waiting on it again.
"""
from __future__ import annotations

import collections
import errno
import itertools
import json
import logging
import math
import socket
import time

import trio

from ..config import get_settings
from ..node.protocol import (CLIENT, REPLY_OVERHEAD, Connection, ProtocolError,
                             client_handshake, read_batch, read_spun)
from ..node.tls import wrap
from ..wire import node_pb2 as pb
from ..errors import DeviceError
from . import TooSlow

log = logging.getLogger(__name__)
Req = pb.Request  # its enum values as class attributes: pb.Request.Op.X looks up more
DOWN_FOR = 2.0        # seconds a failed node is skipped before it is tried again
LATE_DOWN = 3         # callers' deadlines missed in a row that mark a node down too
CONNECT_TIMEOUT = 2.0
CLIENT_BUFFER = 256 << 10  # replies larger than 64 KiB get buffers of their own
SMALL_READ = 64 << 10      # reads up to this size measure a node's latency (for hedging)
# the C client's limits (native/client_reads.c): requests of one read_many sent and
# taken in C at the most, ranges of one request, bytes of a fragment name
MAX_SPUN, SPUN_RANGES, SPUN_NAME = 16, 8, 64
# a batch's reads pipelined in C (read_many(batch=True)): idle connections of a node
# its requests are spread over at the most, and the bytes of replies one connection
# takes at the most (protocol.read_batch grows its buffer for them)
BATCH_CONNS, BATCH_BUFFER = 2, 2 << 20
# what a request can fail with that is the node's doing (or its deadlines'): DeviceError
# or TooSlow for the caller (TcpTransport._failed)
_FAILURES = (trio.TooSlowError, OSError, EOFError, ProtocolError)
# how an idle pooled connection that the node closed (it restarted, say) fails: not a
# sign of trouble, the request is tried again on a fresh connection
_STALE = (EOFError, ConnectionResetError, BrokenPipeError)


def _read_request(name: str, ranges):
    return pb.Request(op=Req.READ, name=name,
                      ranges=[pb.Range(offset=o, length=n) for o, n in ranges])


def _small(ranges) -> bool:
    return sum(n for _, n in ranges) <= SMALL_READ


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
                 pool: int = 8, tls=None):
        """``tls``: an ssl.SSLContext (node/tls.py: TlsConfig.context) for connections
        to nodes that require TLS, or None (plain TCP). Under TLS small reads are not
        taken in C (native/client_reads.c writes to the raw socket)."""
        self.secret = secret
        self.tls = tls
        self.timeout = timeout
        self.pool = pool
        self.nodes = {addr: _Node(addr) for addr in set(devices.values())}
        self.device_node = {dev: self.nodes[addr] for dev, addr in devices.items()}
        self._ids = itertools.count(1)
        self._inflight = 0  # requests under way
        self.watch_fd = -1  # the FUSE device, if known (watch_requests)
        # reads being started side by side (DataClient.side_by_side): the event loop
        # waits while C spins, and their tasks would wait with it to send theirs
        self.side_by_side = 0
        self.stores = {dev: addr for dev, addr in devices.items()}  # for status
        # seconds a lone small read's reply is spun for (Connection._spin_loop;
        # Settings.spin, BMFS_SPIN_US; 0: off). Spinning wins where waking a sleeping
        # CPU is slow (VMs: docs/architecture.md); on bare metal it buys less for the
        # CPU it burns.
        self.spin = get_settings().spin

    def add_device(self, dev: int, address: str) -> None:
        """Reach device ``dev`` at the node at ``address`` from now on (a device known
        already: its node moved there)."""
        node = self.nodes.get(address)
        if node is None:
            node = self.nodes[address] = _Node(address)
        old = self.device_node.get(dev)
        self.device_node[dev] = node
        self.stores[dev] = address
        self._drop_unused(old)

    def forget_device(self, dev: int) -> None:
        """Reach ``dev`` no more (removed from the volume, or never answered)."""
        self._drop_unused(self.device_node.pop(dev, None))
        self.stores.pop(dev, None)

    def _drop_unused(self, node: _Node | None) -> None:
        """Close the idle connections of ``node`` and forget it if no device is on it."""
        if node is None or any(n is node for n in self.device_node.values()):
            return
        for c in node.idle:
            c.close()
        node.idle.clear()
        if self.nodes.get(node.address) is node:
            del self.nodes[node.address]

    def watch_requests(self, fd: int) -> None:
        """``fd`` (the FUSE device) is readable when requests wait for the event loop:
        small reads' replies spun for in C (protocol.read_spun) stop spinning then."""
        self.watch_fd = fd

    def is_up(self, dev: int) -> bool:
        node = self.device_node.get(dev)
        return node is not None and node.down_until <= time.monotonic()

    async def _connect(self, node: _Node, deadline: float = math.inf) -> Connection:
        with trio.fail_at(min(trio.current_time() + CONNECT_TIMEOUT, deadline)):
            sock = trio.socket.socket()
            try:
                await sock.connect((node.host, node.port))
                sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
                sock = socket.socket(fileno=sock.detach())
                sock.setblocking(False)
                if self.tls is not None:
                    sock = await wrap(sock, self.tls, server=False)
            except BaseException:
                sock.close()
                raise
            conn = Connection(sock, CLIENT_BUFFER)
            try:
                # (a device of this node's: the proof is good for this node alone)
                await client_handshake(conn, self.secret, min(
                    (d for d, n in self.device_node.items() if n is node), default=0))
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
        node = self._node(dev)
        own = trio.current_time() + (timeout or self.timeout)
        self._inflight += 1
        try:
            conn, pooled = await self._start(node, dev, req, parts, own, deadline)
            spin = self.spin if quick and self._inflight == 1 else 0.0
            resp, payload = await self._finish(node, dev, req, parts, conn, pooled,
                                               own, deadline, spin)
        finally:
            self._inflight -= 1
        return resp, payload

    def _node(self, dev: int) -> _Node:
        node = self.device_node.get(dev)
        if node is None:
            raise DeviceError(dev, "unknown device")
        return node

    async def _start(self, node: _Node, dev: int, req, parts, own: float, deadline: float):
        """Send ``req`` on a pooled connection of ``node`` (or a new one): (connection,
        whether pooled). Every request is idempotent: an idle connection the node
        closed (it restarted, say) is not a sign of trouble, a fresh one is tried.
        Failures raise as request() says (_failed); the connection is closed."""
        req.id = next(self._ids)
        req.device = dev
        at = min(own, deadline)
        while True:
            pooled = bool(node.idle)
            try:
                conn = node.idle.pop() if pooled else await self._connect(node, at)
            except _FAILURES as e:
                raise self._failed(node, dev, e, own, deadline) from e
            conn.deadline = at
            try:
                await conn.send(req, parts)
                return conn, pooled
            except BaseException as e:
                self._broken(node, dev, conn, pooled, e, own, deadline)

    async def _finish(self, node: _Node, dev: int, req, parts, conn, pooled: bool,
                      own: float, deadline: float, spin: float, into=None):
        """The reply to ``req``, sent on ``conn`` by _start: (reply, payload). The
        connection goes back to the pool; on a failure it is closed (its stream is
        out of step) and the error raised as request() says. ``into``: a READ's
        buffer for its last range (read_many), received into where the reply's last
        part is exactly that long (the payload is then (rest, into))."""
        def tail(resp, plen):
            ok = resp.id == req.id and not resp.errno and resp.lengths and \
                resp.lengths[-1] == len(into) <= plen
            return into if ok else None
        while True:
            # (set each time: a reply there at once leaves spin unused)
            conn.spin = spin
            try:
                # the payload is a buffer of its own (large ones are received into it
                # directly): slices of it are handed out without copies
                resp, payload = await conn.recv(pb.Response, own_payload=True,
                                                tail=None if into is None else tail)
                break
            except BaseException as e:
                self._broken(node, dev, conn, pooled, e, own, deadline)
            # a pooled connection the node had closed: the request again, afresh
            conn, pooled = await self._start(node, dev, req, parts, own, deadline)
        if resp.id != req.id:
            conn.close()
            raise DeviceError(dev, f"node {node.address}: reply out of order")
        self._answered(node, conn)
        if resp.errno:
            raise DeviceError(dev, f"node {node.address}: {resp.error or errno.errorcode.get(resp.errno)}",
                              resp.errno)
        return resp, payload

    def _broken(self, node: _Node, dev: int, conn, pooled: bool, e: BaseException,
                own: float, deadline: float) -> None:
        """Called in the handler of ``e``, which broke off a request on ``conn``: close
        the connection (its stream is out of step: a reply may still come); return if
        it was an idle pooled one that the node had closed (the caller tries afresh),
        else raise what request() says (_failed), or ``e`` itself (cancellation)."""
        conn.close()
        if pooled and isinstance(e, _STALE):
            return
        if isinstance(e, _FAILURES):
            raise self._failed(node, dev, e, own, deadline) from e
        raise e

    @staticmethod
    def _failed(node: _Node, dev: int, e: Exception, own: float,
                deadline: float) -> Exception:
        """What a request that failed with ``e`` (one of _FAILURES) raises: TooSlow
        past the caller's ``deadline`` (earlier than ``own``, the transport's
        timeout), else DeviceError, and the node is marked down."""
        late = isinstance(e, trio.TooSlowError)
        if late and deadline < own and trio.current_time() >= deadline:
            # a node that misses hedged reads' deadlines again and again (stalled, or
            # unreachable with connects timing out) is skipped for a while, or every
            # read of it would wait for the hedge first
            node.late += 1
            if node.late < LATE_DOWN:
                return TooSlow(f"device {dev}: no reply within the caller's deadline")
            node.late = 0
            node.down_until = time.monotonic() + DOWN_FOR
            return TooSlow(f"device {dev}: no reply within the caller's deadline "
                           f"({LATE_DOWN} in a row: skipped for {DOWN_FOR:g} s)")
        node.down_until = time.monotonic() + DOWN_FOR
        what = "timed out" if late else str(e) or type(e).__name__
        return DeviceError(dev, f"node {node.address}: {what}")

    async def put(self, dev: int, name: str, parts) -> None:
        await self.request(dev, pb.Request(op=Req.PUT, name=name, durable=True), parts)

    async def read(self, dev: int, name: str, ranges, check=None,
                   deadline: float = math.inf, into=None) -> list[bytes]:
        """The parts of fragment ``name`` that ``ranges`` ((offset, length) pairs) ask
        for, with ``check(parts)`` run on them; raises DeviceError, TooSlow or what
        ``check`` raises."""
        (out,) = await self.read_many([(dev, name, ranges, check)], deadline,
                                      into=None if into is None else [into])
        if isinstance(out, Exception):
            raise out
        return out

    def _answered(self, node: _Node, conn) -> None:
        """``node`` answered on ``conn``: the connection goes back to the pool (or is
        closed if the pool is full), and the node counts as up and in time."""
        if len(node.idle) < self.pool:
            node.idle.append(conn)
        else:
            conn.close()
        node.down_until = 0.0
        node.late = 0

    async def read_many(self, reads, deadline: float = math.inf,
                        batch: bool = False, into=None) -> list:
        """Several reads as read() does them, ``reads`` a list of (dev, name, ranges,
        check), from this one task: every request is sent before any reply is
        awaited, then the replies are taken in turn (all are wanted, so waiting for
        them in order costs nothing). Item by item, the parts read, or the
        DeviceError, TooSlow or exception of ``check`` that the read failed with.

        A degraded small read asks k nodes at once. As k tasks each sleeping on its
        socket it costs markedly more time and client CPU than from one task
        (docs/benchmarks.md): the replies that came meanwhile are taken without a sleep
        and a wake-up each, and a small one not there yet is spun for when nothing else
        is under way (Connection._spin_loop). Connections are opened one after another:
        nodes that drop connects (not refuse them) cost CONNECT_TIMEOUT each, once (then
        they are down). Only the first reply's round trip goes into its node's latency:
        the later ones' include the wait for those before them.

        Small reads with nothing else under way, where the Python path would spin
        for their replies, are sent and taken in C where a pooled connection is idle
        (_read_spun): a lone read, the usual case, and the k of a degraded one.

        ``batch``: the caller has an event loop of its own (the direct client's
        batches): the small reads go out pipelined on the nodes' idle connections and
        their replies are waited for in C, the loop held meanwhile (_read_batched)."""
        own = trio.current_time() + self.timeout
        out: list = [None] * len(reads)
        sent = collections.deque()
        self._inflight += len(reads)
        try:
            first, spun = True, ()
            if batch and CLIENT is not None and self.tls is None:
                first = await self._read_batched(reads, own, deadline, out)
            elif CLIENT is not None and self.tls is None and self.spin and \
                    self._inflight == len(reads) and \
                    not self.side_by_side and all(_small(r[2]) for r in reads):
                first = self._read_spun(reads, own, deadline, out, sent)
                spun = {item[0] for item in sent}  # (sent in C, replies still owed)
            for i, (dev, name, ranges, _) in enumerate(reads):
                if out[i] is not None or i in spun:
                    continue
                req = _read_request(name, ranges)
                try:
                    node = self._node(dev)
                    conn, pooled = await self._start(node, dev, req, (), own, deadline)
                except (DeviceError, TooSlow) as e:
                    out[i] = e
                    continue
                sent.append((i, node, req, conn, pooled, time.monotonic(), None))
            while sent:
                # (off the list first: _finish pools or closes conn, whatever happens)
                i, node, req, conn, pooled, t0, spin = sent.popleft()
                dev, _, ranges, check = reads[i]
                if spin is None:  # (not spun for in C already)
                    quiet = self._inflight == len(reads)
                    spin = self.spin if quiet and _small(ranges) else 0.0
                try:
                    resp, payload = await self._finish(node, dev, req, (), conn, pooled,
                                                       own, deadline, spin,
                                                       into[i] if into else None)
                except (DeviceError, TooSlow) as e:
                    out[i] = e
                    continue
                out[i] = self._parts(dev, resp, payload, t0 if first else None)
                first = False
                self._check(out, i, check)
        finally:
            self._inflight -= len(reads)
            for item in sent:  # cancelled: replies still owed on these
                item[3].close()
        return out

    def _read_spun(self, reads, own: float, deadline: float, out: list, sent) -> bool:
        """read_many's requests that a pooled connection is idle for, sent and their
        replies taken in C (protocol.read_spun) for up to the spin: the parts of those
        that came (checked) go into ``out``; those still owed go into ``sent`` as if
        _start had sent them (_finish waits for them as ever; a spin cut short by a
        FUSE request goes on in _spin_loop, which lets other tasks run). The others
        (no idle connection; one that failed: the node closed it, say) are left to
        _start, the request again (every request is idempotent). Returns whether
        the first round trip is still to be noted (None came back)."""
        batch = []
        for i, (dev, name, ranges, _) in enumerate(reads[:MAX_SPUN]):
            node = self.device_node.get(dev)
            name = name.encode()
            if node is not None and node.idle and len(ranges) <= SPUN_RANGES and \
                    len(name) <= SPUN_NAME:
                batch.append((i, node, node.idle.pop(), next(self._ids), name))
        if not batch:
            return True
        for _, _, conn, _, _ in batch:
            conn.deadline = min(own, deadline)
        t0 = time.monotonic()
        fastest = None
        try:
            got = read_spun([(conn, rid, reads[i][0], name, reads[i][2])
                             for i, _, conn, rid, name in batch], self.spin, self.watch_fd)
            while batch:
                i, node, conn, rid, _ = batch.pop(0)
                parts, status, unsent, seconds = got.pop(0)
                dev, name, ranges, check = reads[i]
                if parts is not None:
                    self._answered(node, conn)
                    out[i] = parts
                    if fastest is None or seconds < fastest[1]:
                        fastest = (node, seconds, sum(len(p) for p in parts))
                    self._check(out, i, check)
                elif status != CLIENT.CLOSED and unsent is None:
                    req = _read_request(name, ranges)
                    req.id, req.device = rid, dev
                    # (what is left of a spin cut short by a FUSE request is
                    # _spin_loop's, which lets other tasks run)
                    spin = max(0.0, self.spin - (time.monotonic() - t0)) \
                        if status == CLIENT.WANTED else 0.0
                    sent.append((i, node, req, conn, True, t0, spin))
                else:  # (unsent: a full send buffer on an idle connection: no good sign)
                    conn.close()
        finally:
            for _, _, conn, _, _ in batch:  # (read_spun raised: nothing was sent)
                conn.close()
        if fastest is None:
            return True
        self._took(fastest[0], fastest[2], fastest[1])
        return False

    async def _read_batched(self, reads, own: float, deadline: float, out: list) -> bool:
        """read_many's small reads pipelined in C (protocol.read_batch): each node's
        spread over BATCH_CONNS of its connections (opened first where the pool
        has fewer idle: the reads of a node none can be opened to fail at once, as
        _failed says; up to BATCH_BUFFER bytes of replies each), all sent at once,
        the replies taken as they come until the deadline. The parts of those that
        came (checked) go into ``out``; those the time ran out on fail as a request
        past its deadline does (_failed); the others (large ones, those beyond the
        connections' room, an error reply's and those after it on its connection,
        a connection that failed or was stale) are left to the Python path, the
        request again (every request is idempotent); a connection not answered in
        full is closed. Returns whether the first round trip is still to be noted
        (always: a pipelined reply's time says little of its node's latency)."""
        shares: dict = {}  # node -> [[conn, room, [(i, rid)], requests], ...]
        refused: dict = {}  # node -> the error its connect failed with
        at = min(own, deadline)
        try:
            await self._batch_shares(reads, own, deadline, out, shares, refused)
        except BaseException:  # (cancelled while connecting: nothing sent yet)
            for node, conns in shares.items():
                node.idle.extend(c[0] for c in conns)
            raise
        groups, owners = [], []
        for node, conns in shares.items():
            for conn, _, items, requests in conns:
                if items:
                    groups.append((conn, requests))
                    owners.append((node, items))
                else:
                    node.idle.append(conn)
        if not groups:
            return True
        wait = at - trio.current_time()
        try:
            got = read_batch(groups, wait)
        except BaseException:
            for conn, _ in groups:  # (read_batch raised: nothing was sent)
                conn.close()
            raise
        for (conn, _), (node, items), (status, replies) in zip(groups, owners, got):
            for i, parts in zip(items, replies):
                out[i] = parts
                self._check(out, i, reads[i][3])
            if status == CLIENT.REPLY:
                self._answered(node, conn)
                continue
            conn.close()
            if status == CLIENT.SPUN:
                for i in items[len(replies):]:
                    out[i] = self._failed(node, reads[i][0], trio.TooSlowError(), own,
                                          deadline)
        return True

    async def _batch_shares(self, reads, own: float, deadline: float, out: list,
                            shares: dict, refused: dict) -> None:
        """_read_batched's plan: into ``shares``, node by node, its connections, each
        with its room left, read indexes and requests; into ``refused``, the nodes
        no connection could be opened to (and their reads' errors into ``out``)."""
        at = min(own, deadline)
        for i, (dev, name, ranges, _) in enumerate(reads):
            node = self.device_node.get(dev)
            if node is None or len(ranges) > SPUN_RANGES or not _small(ranges):
                continue
            bname = name.encode()
            if len(bname) > SPUN_NAME:
                continue
            if node in refused:
                out[i] = refused[node]
                continue
            conns = shares.get(node)
            if conns is None:
                # (a pool short of idle connections: a batch's first, say, which would
                # otherwise open one per request on the Python path)
                while len(node.idle) < BATCH_CONNS and node.down_until <= time.monotonic():
                    try:
                        node.idle.append(await self._connect(node, at))
                    except _FAILURES as e:
                        if not node.idle:  # (its reads fail at once, not one by one)
                            out[i] = refused[node] = self._failed(node, dev, e, own,
                                                                  deadline)
                        break
                if node in refused:
                    continue
                conns = shares[node] = [[c, BATCH_BUFFER, [], []] for c in (
                    node.idle.pop() for _ in range(min(len(node.idle), BATCH_CONNS)))]
            need = sum(n for _, n in ranges) + REPLY_OVERHEAD
            share = max(conns, key=lambda c: c[1], default=None)
            if share is None or share[1] < need:
                continue
            share[1] -= need
            rid = next(self._ids)
            share[2].append(i)
            share[3].append((rid, dev, bname, ranges))

    @staticmethod
    def _check(out: list, i: int, check) -> None:
        """Run the caller's ``check`` on the parts ``out[i]``; what it raises replaces
        them."""
        if check is not None:
            try:
                check(out[i])
            except Exception as e:  # noqa: BLE001 (the caller's, returned to it)
                out[i] = e

    def _parts(self, dev: int, resp, payload, t0: float | None) -> list:
        """A READ's reply as its ranges' parts (views of the payload, no copies); a
        small one's round trip, since ``t0`` (time.monotonic) if given, goes into the
        node's smoothed latency (the transfer time of a large one would not say how
        slow the node is)."""
        into = None
        if isinstance(payload, tuple):  # (the last part received into the caller's buffer)
            payload, into = payload
        if t0 is not None:
            self._took(self.device_node[dev], len(payload) + len(into or b""),
                       time.monotonic() - t0)
        out, pos = [], 0
        for n in resp.lengths[:-1] if into is not None else resp.lengths:
            out.append(payload[pos:pos + n])
            pos += n
        if into is not None:
            out.append(into)
        return out

    @staticmethod
    def _took(node: _Node, n: int, seconds: float) -> None:
        """A read of ``n`` bytes from ``node`` took ``seconds``: a small one's round
        trip goes into the node's smoothed latency (the transfer time of a large one
        would not say how slow the node is)."""
        if n <= SMALL_READ:
            node.latency = 0.8 * node.latency + 0.2 * seconds

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


async def stat_device(address: str, dev: int, secret: bytes, timeout: float = 5.0,
                      tls=None) -> dict:
    """STAT device ``dev`` at the node at ``address`` through a connection of its own
    (a volume's transport is left as it is): the node's usage reply, whose "volume"
    names the volume it serves (nodes of before that field: absent). Raises
    DeviceError, OSError or trio.TooSlowError when the node does not answer for it."""
    probe = TcpTransport({dev: address}, secret, timeout=timeout, tls=tls)
    try:
        with trio.fail_after(timeout):
            return await probe.stat(dev)
    finally:
        await probe.aclose()
