"""Framing and authentication of the storage-node protocol (schemas/node.proto).

A frame is ``u32 header length | u32 payload length | header | payload``. Frames are
received into a buffer the connection reuses (``recv_into``, as much as the socket
has: a small frame costs one call), except that a client's large reply payloads are
received straight into a buffer of their own, handed out without a copy. A frame is
sent with one call (``sendmsg`` gathers header and payload parts). Both sides prove knowledge of the
cluster secret before anything else (HMAC-SHA256 over the peer's random challenge).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import math
import mmap
import os
import socket
import ssl
import struct
import sys

import trio

from ..native import optional
from ..wire import node_pb2 as pb

# small READs sent and their replies taken in C (native/client_reads.c: read_spun),
# or None: the Python path does it (Connection.send, recv and _spin_loop)
CLIENT = optional("bmfs.node._client")

VERSION = 2
PREFIX = struct.Struct("<II")
MAX_HEADER = 64 << 10
MAX_PAYLOAD = 64 << 20
HANDSHAKE_TIMEOUT = 5.0
OWN_DIRECT = 64 << 10  # own payloads larger than this are received into their own buffer
SEND_JOIN = 64 << 10   # payloads up to this are joined with the header into one send
ALIGNED = 64 << 10     # a node receives larger payloads into a page-aligned buffer
READ_AHEAD = 64 << 10  # a blocking receive takes at most this much beyond what it needs
# a large payload's wait for the rest of it asks the socket to report readable only
# once that much is in (SO_RCVLOWAT, at most this): a 1 MiB reply over loopback comes
# in ~4 pieces, and waking for each cost the mount ~17% more CPU in cold sequential
# cluster reads (the kernel caps it at half the receive buffer's limit)
LOWAT_MAX = 1 << 20
REPLY_BUFFERS = 48     # large reply buffers a client keeps for reuse (~1 MiB each)


class ProtocolError(Exception):
    """The peer broke the protocol (bad frame, bad proof); the connection is closed."""


# what a non-blocking socket raises when it cannot go on yet (a TLS one: that it needs
# to read, or write, first)
_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def _waiter(e: Exception, default):
    """What to wait for after ``e`` (one of _WOULD_BLOCK): a TLS socket may need the
    other direction (a key update, say) before it can go on."""
    if isinstance(e, ssl.SSLWantReadError):
        return trio.lowlevel.wait_readable
    if isinstance(e, ssl.SSLWantWriteError):
        return trio.lowlevel.wait_writable
    return default


class _ReplyBuffers:
    """Buffers for large reply payloads, reused once nothing refers to them any more
    (no view of one is left: the caller and the FUSE reply are done with it, it left
    the decoded-stripe cache). A fresh zero-filled bytearray per 1 MiB reply was ~5% of
    the mount's CPU when reading. Used from the event loop thread only."""

    def __init__(self, keep: int):
        self.keep = keep
        self.bufs: list[bytearray] = []

    def get(self, n: int) -> memoryview:
        for b in self.bufs:
            # referenced by the list, by b and by getrefcount's argument: nothing else
            if n <= len(b) <= 2 * n and sys.getrefcount(b) == 3:
                return memoryview(b)[:n]
        b = bytearray(n)
        if len(self.bufs) < self.keep:
            self.bufs.append(b)
        return memoryview(b)


_reply_buffers = _ReplyBuffers(REPLY_BUFFERS)


class _Framing:
    """Frame parsing over a receive buffer; subclasses move the bytes (async or blocking).

    Receives read as much as the socket has (a small frame usually arrives in one
    ``recv_into``, prefix and all) and keep any bytes past the frame for the next one.
    A frame goes out in one send (prefix, header and payload parts gathered).
    """

    def __init__(self, sock, buffer_size: int, pending: bytes = b"",
                 max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD):
        self.sock = sock
        # a frame announcing more is refused before anything is allocated for it
        # (a node's handshake takes a few hundred bytes: server.HANDSHAKE_FRAME)
        self.max_header, self.max_payload = max_header, max_payload
        # TLS (an ssl.SSLSocket): no sendmsg, sendfile or SO_RCVLOWAT (see tls.py)
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._buf = bytearray(max(buffer_size, len(pending)))
        self._buf[:len(pending)] = pending
        self._start, self._end = 0, len(pending)  # unconsumed: _buf[_start:_end]

    def pending(self) -> bytes:
        """Bytes received past the last frame (to hand the socket on)."""
        return bytes(self._buf[self._start:self._end])

    def _room(self, need: int) -> memoryview | None:
        """None if ``need`` unconsumed bytes are buffered; else a view to receive into,
        after moving (or growing) the buffer so that they fit."""
        have = self._end - self._start
        if have >= need:
            return None
        if have == 0:
            self._start = self._end = 0
        if self._start + need > len(self._buf):
            buf = self._buf if need <= len(self._buf) else bytearray(max(need, 2 * len(self._buf)))
            buf[:have] = self._buf[self._start:self._end]
            self._buf, self._start, self._end = buf, 0, have
        return memoryview(self._buf)

    def _sizes(self) -> tuple[int, int]:
        hlen, plen = PREFIX.unpack_from(self._buf, self._start)
        if hlen > self.max_header or plen > self.max_payload:
            raise ProtocolError(f"oversized frame (header {hlen}, payload {plen} bytes)")
        return hlen, plen

    def _header(self, message_type, hlen: int):
        """Parse the buffered header; returns it and consumes prefix and header."""
        h0 = self._start + PREFIX.size
        msg = message_type()
        try:
            msg.ParseFromString(memoryview(self._buf)[h0:h0 + hlen])
        except Exception as e:  # protobuf raises DecodeError (and others on garbage)
            raise ProtocolError(f"undecodable {message_type.__name__} header: {e}") from e
        self._start = h0 + hlen
        return msg

    def _take(self, n: int) -> memoryview:
        view = memoryview(self._buf)[self._start:self._start + n]
        self._start += n
        return view

    def _own_start(self, plen: int) -> tuple[memoryview, int]:
        """A buffer of its own for a payload, with the bytes already received copied in."""
        payload = _reply_buffers.get(plen)
        got = min(plen, self._end - self._start)
        payload[:got] = self._take(got)
        return payload, got

    @staticmethod
    def _frame(message, payload_parts):
        """The frame as one buffer (small payloads) or a list of views (large ones)."""
        head = message.SerializeToString()
        plen = sum(len(p) for p in payload_parts)
        first = PREFIX.pack(len(head), plen) + head
        if plen <= SEND_JOIN:  # small: one buffer (a copy is cheaper than an iovec)
            return first + b"".join(payload_parts) if plen else first
        return [memoryview(first)] + [memoryview(p).cast("B") for p in payload_parts if len(p)]

    @staticmethod
    def _advance(views: list, n: int) -> None:
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0

    def close(self) -> None:
        self.sock.close()


class Connection(_Framing):
    """One framed connection for trio tasks, with a reusable receive buffer.

    Takes a trio socket (or a non-blocking stdlib one) and works on the stdlib socket
    with trio's ``wait_readable``/``wait_writable``: a call that can complete at once
    costs no trip through the scheduler (trio's socket methods add one to each call).
    It still yields whenever it waits, so a stalled peer can be cancelled or timed out.
    """

    def __init__(self, sock, buffer_size: int = 1 << 20, max_header: int = MAX_HEADER,
                 max_payload: int = MAX_PAYLOAD):
        if isinstance(sock, trio.socket.SocketType):
            sock = socket.socket(fileno=sock.detach())
        sock.setblocking(False)
        super().__init__(sock, buffer_size, max_header=max_header, max_payload=max_payload)
        self.spin = 0.0  # seconds: see _spin_loop
        self.deadline = math.inf  # trio time: see _wait

    async def _recv_into(self, view) -> int:
        while True:
            try:
                n = self.sock.recv_into(view)
            except _WOULD_BLOCK as e:
                n = await self._spin_loop(view) if self.spin else None
                if n is None:
                    await self._wait(_waiter(e, trio.lowlevel.wait_readable))
                    continue
            if n == 0:
                raise EOFError("connection closed by peer")
            return n

    async def _wait(self, wait) -> None:
        """``wait(sock)`` (trio's wait_readable or wait_writable); past ``deadline``,
        trio.TooSlowError. The deadline scope is entered only here, when the
        connection has to sleep: awaits inside a cancel scope cost more in trio, and a
        scope around every request is a large share of a small read's round trip."""
        if self.deadline == math.inf:
            await wait(self.sock)
            return
        with trio.fail_at(self.deadline):
            await wait(self.sock)

    async def _spin_loop(self, view) -> int | None:
        """Wait for data without sleeping, for up to ``spin`` seconds (then reset): try
        to receive, let the event loop run a round (its other tasks, and epoll with no
        timeout), again; None if nothing came. The caller sets ``spin`` when a short
        reply is due soon and nothing else is under way. A thread that sleeps lets the
        virtual machine's CPUs halt, and waking one costs far more than the wait: a
        loopback round trip with both sides asleep between messages takes several
        times one with a side spinning (docs/architecture.md). Other tasks run
        meanwhile; cancellation and ``deadline`` (a hedged read's) are seen at each
        round: past the deadline it stops, and _wait raises."""
        end = min(trio.current_time() + self.spin, self.deadline)
        self.spin = 0.0
        recv = self.sock.recv_into
        while trio.current_time() < end:
            await trio.lowlevel.checkpoint()
            try:
                return recv(view)
            except _WOULD_BLOCK:
                pass
        return None

    async def _fill(self, need: int) -> None:
        view = self._room(need)
        while view is not None and self._end - self._start < need:
            self._end += await self._recv_into(view[self._end:])

    async def recv(self, message_type, own_payload: bool = False,
                   tail=None) -> tuple[object, object]:
        """The next frame: (parsed header, payload view valid until the next recv).
        With ``own_payload`` the payload is a fresh buffer of its own (received into
        directly when it is large), valid for as long as the caller keeps it.
        ``tail(header, payload_length)``: where it returns a writable view (of at
        most the payload's length) of a large payload, the payload's last bytes are
        received straight into it, and the payload is (own buffer of the rest, view)."""
        await self._fill(PREFIX.size)
        hlen, plen = self._sizes()
        direct = own_payload and plen > OWN_DIRECT
        await self._fill(PREFIX.size + hlen + (0 if direct else plen))
        msg = self._header(message_type, hlen)
        if not direct:
            view = self._take(plen)
            return msg, (memoryview(bytes(view)) if own_payload else view)
        into = tail(msg, plen) if tail is not None else None
        if into is not None:
            rest = plen - len(into)  # (a header's bytes, or nothing: no pooled buffer)
            head = _reply_buffers.get(rest) if rest > OWN_DIRECT else memoryview(bytearray(rest))
            got = min(rest, self._end - self._start)
            head[:got] = self._take(got)
            n = min(len(into), self._end - self._start)
            into[:n] = self._take(n)
            await self._recv_all(head, got)
            await self._recv_all(into, n)
            return msg, (head, into)
        view, got = self._own_start(plen)
        await self._recv_all(view, got)
        return msg, view

    async def _recv_all(self, view, got: int) -> None:
        """Receive into ``view`` from ``got`` to its end, straight from the socket."""
        plen, lowat = len(view), 1
        try:
            while got < plen:
                try:
                    n = self.sock.recv_into(view[got:])
                except _WOULD_BLOCK as e:
                    # wake when the rest is there (what is left, every time: a mark
                    # above it would never be reached), not at every piece; not under
                    # TLS, where part of a record may sit in the TLS layer already
                    want = min(plen - got, LOWAT_MAX)
                    if want != lowat and not self.tls:
                        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                        lowat = want
                    await self._wait(_waiter(e, trio.lowlevel.wait_readable))
                    continue
                if n == 0:
                    raise EOFError("connection closed by peer")
                got += n
        finally:
            if lowat != 1:  # (a socket that broke meanwhile is closed by the caller)
                with contextlib.suppress(OSError):
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    async def send(self, message, payload_parts=()) -> None:
        frame = self._frame(message, payload_parts)
        if not isinstance(frame, list):
            await self._sendall(frame)
            return
        if self.tls:  # (an SSLSocket has no sendmsg)
            for part in frame:
                await self._sendall(part)
            return
        while frame:
            try:
                self._advance(frame, self.sock.sendmsg(frame))
            except BlockingIOError:
                await self._wait(trio.lowlevel.wait_writable)

    async def _sendall(self, data) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except _WOULD_BLOCK as e:
                await self._wait(_waiter(e, trio.lowlevel.wait_writable))


def read_spun(requests, spin: float, watch_fd: int = -1) -> list:
    """READ requests, each ``(conn, rid, device, name, ranges)`` (a Connection, the
    request's id, its device, the fragment name as bytes, (offset, length) pairs),
    all sent, then their replies received for up to ``spin`` seconds (no later than
    the connections' ``deadline``) in C (CLIENT.read_all), with neither the GIL nor
    the event loop: a try costs a recv, where Connection._spin_loop's costs a
    scheduler round and an exception, and no Python runs from the requests' building
    to the replies' taking. The event loop waits meanwhile, so the spin ends early once
    ``watch_fd`` (the FUSE device) has a request.

    For each request: (parts, status, unsent, seconds). ``parts``: the reply's
    parts (views of one buffer of their own) when it came, plain (no error), in
    time, ``seconds`` after the first send; else None and what CLIENT says of the
    wait (FRAME: another frame is buffered for recv; SPUN, WANTED; CLOSED: the
    connection failed), with the part of the request the socket did not take (or
    None): the caller sends that and takes the reply with recv, as for a request
    sent by send."""
    now = trio.current_time()
    spin = min([spin] + [r[0].deadline - now for r in requests])
    args = []
    for conn, rid, device, name, ranges in requests:
        if conn._start == conn._end:
            conn._start = conn._end = 0
        args.append((conn.sock.fileno(), conn._buf, conn._start, conn._end, rid, device,
                     name, ranges))
    out = []
    for (conn, *_), (status, conn._end, p0, lengths, unsent, seconds) in zip(
            requests, CLIENT.read_all(args, max(0, int(spin * 1e9)), watch_fd)):
        if status != CLIENT.REPLY:
            out.append((None, status, unsent, seconds))
            continue
        end = p0 + sum(lengths)
        payload = memoryview(bytes(memoryview(conn._buf)[p0:end]))  # (the buffer is reused)
        conn._start = end
        parts, pos = [], 0
        for n in lengths:
            parts.append(payload[pos:pos + n])
            pos += n
        out.append((parts, status, None, seconds))
    return out



# the bytes a READ reply's frame takes beside its payload, at the most (read_batch)
REPLY_OVERHEAD = 256


def read_batch(groups, wait: float) -> list:
    """A batch's READs pipelined on connections, in C (CLIENT.read_batch) without the
    GIL: ``groups``, [(conn, [(rid, device, name, ranges), ...]), ...] (a Connection,
    nothing owed on it, and its requests: the request's id, its device, the fragment
    name as bytes, (offset, length) pairs); its buffer grows for the batch if it
    cannot hold every reply. Every connection's requests are sent at once, and their
    replies (a node answers a connection's requests in order) taken as they come
    from all the connections, sleeping in poll(2) between, for up to ``wait``
    seconds. The event loop waits meanwhile: for callers of their own loop
    (the direct client), not a mount's.

    For each group: (status, replies): ``replies``, the parts of each plain reply
    taken, in request order (views of one buffer of their own per group), a prefix
    of its requests; ``status``, CLIENT.REPLY when they are all there, else what
    ended the wait (FRAME: the next frame is not the next request's plain reply;
    SPUN: the time is up; CLOSED: the connection failed): the connection is out of
    step then, the caller closes it."""
    args, sizes = [], []
    for conn, requests in groups:
        if conn._start == conn._end:
            conn._start = conn._end = 0
        # room for every reply: a buffer of the batch's own if the connection's is short
        need = conn._end + sum(n for r in requests for _, n in r[3]) + \
            REPLY_OVERHEAD * len(requests)
        sizes.append(len(conn._buf))
        if need > len(conn._buf):
            buf = bytearray(need)
            buf[:conn._end] = conn._buf[:conn._end]
            conn._buf = buf
        args.append((conn.sock.fileno(), conn._buf, conn._start, conn._end, requests))
    out = []
    for (conn, _), size, (status, conn._end, taken, replies) in zip(
            groups, sizes, CLIENT.read_batch(args, max(0, int(wait * 1e9)))):
        got = []
        if replies:
            first = replies[0][0]
            whole = memoryview(bytes(memoryview(conn._buf)[first:taken]))  # (reused)
            for p0, lengths in replies:
                pos = p0 - first
                parts = []
                for n in lengths:
                    parts.append(whole[pos:pos + n])
                    pos += n
                got.append(parts)
            conn._start = taken
        if len(conn._buf) > size and conn._start == conn._end:
            conn._buf, conn._start, conn._end = bytearray(size), 0, 0  # (copied out)
        out.append((status, got))
    return out


class FileRange:
    """A payload part sent from a file with sendfile(2) (page cache to socket, no copy
    through user memory): ``length`` bytes at ``offset`` of descriptor ``fd``;
    ``release()``, if given, is called once it is sent (or not) instead of closing
    ``fd`` (a store's extent: store/pool.py)."""
    __slots__ = ("fd", "offset", "length", "release")

    def __init__(self, fd: int, offset: int, length: int, release=None):
        self.fd, self.offset, self.length, self.release = fd, offset, length, release

    def __len__(self) -> int:
        return self.length


class BlockingConnection(_Framing):
    """The same framing over a blocking socket: a node serves each connection in a
    thread of its own (a blocking recv wakes that thread directly, which costs far
    less than an event loop's round per request).

    A payload larger than ``ALIGNED`` is received into a page-aligned buffer of the
    connection (so a store can write it with O_DIRECT); receives take at most
    ``READ_AHEAD`` bytes past what they need, so little of it lands in the frame
    buffer first and has to be moved."""

    def __init__(self, sock, buffer_size: int = 1 << 20, pending: bytes = b""):
        super().__init__(sock, buffer_size, pending)
        self._aligned = None

    def _fill(self, need: int) -> None:
        view = self._room(need)
        while view is not None and self._end - self._start < need:
            want = max(need - (self._end - self._start), READ_AHEAD)
            n = self.sock.recv_into(view[self._end:], min(want, len(view) - self._end))
            if n == 0:
                raise EOFError("connection closed by peer")
            self._end += n

    def _aligned_view(self, n: int) -> memoryview:
        if self._aligned is None or len(self._aligned) < n:
            # an anonymous mapping starts on a page; an older one is freed with its views
            self._aligned = memoryview(mmap.mmap(-1, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE))
        return self._aligned[:n]

    def recv(self, message_type) -> tuple[object, memoryview]:
        """The next frame: (parsed header, payload view valid until the next recv).
        A payload larger than ``ALIGNED`` starts on a page boundary."""
        self._fill(PREFIX.size)
        hlen, plen = self._sizes()
        if plen <= ALIGNED:
            self._fill(PREFIX.size + hlen + plen)
            msg = self._header(message_type, hlen)
            return msg, self._take(plen)
        self._fill(PREFIX.size + hlen)
        msg = self._header(message_type, hlen)
        view = self._aligned_view(plen)
        got = min(plen, self._end - self._start)
        view[:got] = self._take(got)
        while got < plen:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise EOFError("connection closed by peer")
            got += n
        return msg, view

    def send(self, message, payload_parts=()) -> None:
        """Send a frame; parts may be FileRanges (then header and parts go out one by
        one)."""
        if any(isinstance(p, FileRange) for p in payload_parts):
            self._send_files(message, payload_parts)
            return
        frame = self._frame(message, payload_parts)
        if not isinstance(frame, list):
            self.sock.sendall(frame)
            return
        if self.tls:  # (an SSLSocket has no sendmsg)
            for part in frame:
                self.sock.sendall(part)
            return
        while frame:
            self._advance(frame, self.sock.sendmsg(frame))

    def _send_files(self, message, parts) -> None:
        # no MSG_MORE on the header: corked, it holds sendfile's data back until the
        # kernel's cork timer fires
        head = message.SerializeToString()
        self.sock.sendall(PREFIX.pack(len(head), sum(len(p) for p in parts)) + head)
        for p in parts:
            if not isinstance(p, FileRange):
                self.sock.sendall(p)
                continue
            sent = 0
            while sent < p.length:
                k = os.sendfile(self.sock.fileno(), p.fd, p.offset + sent, p.length - sent)
                if k == 0:  # the file shrank under us: the frame can't be completed
                    raise OSError(errno.EIO, "fragment file truncated while sent")
                sent += k


def proof(secret: bytes, role: bytes, challenge: bytes, device: int) -> bytes:
    """What proves the secret: an HMAC over the role, the peer's challenge and the
    device the client asked for. The device binds a client's proof to the node it
    meant to reach: every node knows the same secret, so a proof over the challenge
    alone could be relayed by whoever answers at one node's address (a local user on
    a port its node left) to another node, which would take the relay for the client."""
    return hmac.new(secret, role + challenge + device.to_bytes(4, "big"),
                    hashlib.sha256).digest()


async def server_handshake(conn: Connection, secret: bytes, devices) -> None:
    """Raises ProtocolError unless the client proves the secret for one of ``devices``
    (those this node serves). The Hello says nothing of the node (no name:
    ``Hello.node`` stays empty) to a peer that has not proved anything yet; the caller
    bounds the time it takes (server.py)."""
    challenge = os.urandom(32)
    await conn.send(pb.Hello(version=VERSION, challenge=challenge))
    auth, payload = await conn.recv(pb.Auth)
    if payload or auth.device not in devices or not hmac.compare_digest(
            auth.proof, proof(secret, b"client", challenge, auth.device)):
        raise ProtocolError("authentication failed: wrong cluster secret or a device "
                            "this node does not serve")
    if len(auth.challenge) < 16:
        raise ProtocolError("authentication failed: short challenge")
    await conn.send(pb.AuthOk(proof=proof(secret, b"node", auth.challenge, auth.device)))


async def client_handshake(conn: Connection, secret: bytes, device: int) -> None:
    """Prove the secret to the node serving ``device``. Raises ProtocolError if the
    node does not know the secret or does not serve ``device``."""
    with trio.fail_after(HANDSHAKE_TIMEOUT):
        hello, _ = await conn.recv(pb.Hello)
        if hello.version != VERSION:
            raise ProtocolError(f"node speaks protocol {hello.version}, we speak {VERSION}")
        mine = os.urandom(32)
        await conn.send(pb.Auth(proof=proof(secret, b"client", hello.challenge, device),
                                challenge=mine, device=device))
        try:
            ok, _ = await conn.recv(pb.AuthOk)
        except EOFError:
            raise ProtocolError(f"the node closed the connection: wrong cluster secret, "
                                f"or it does not serve device {device}?")
    if not hmac.compare_digest(ok.proof, proof(secret, b"node", mine, device)):
        raise ProtocolError("the node failed to prove the cluster secret")


def make_secret(path: str) -> None:
    """Write a new random cluster secret to ``path`` (mode 0600) unless one is there."""
    if os.path.exists(path):
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, os.urandom(32).hex().encode())
    finally:
        os.close(fd)


def read_secret(path: str) -> bytes:
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"{path}: a cluster secret needs at least 16 bytes")
    return secret
