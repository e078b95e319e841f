"""Framing and authentication of the storage-node protocol (schemas/node.proto).

A frame is ``u32 header length | u32 payload length | header | payload``. Payloads
are received straight into a buffer the connection reuses (``recv_into``), so a
4 MiB fragment costs no allocation per request. Both sides prove knowledge of the
cluster secret before anything else (HMAC-SHA256 over the peer's random challenge).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct

import trio

from ..wire import node_pb2 as pb

VERSION = 1
PREFIX = struct.Struct("<II")
MAX_HEADER = 64 << 10
MAX_PAYLOAD = 64 << 20
HANDSHAKE_TIMEOUT = 5.0


class ProtocolError(Exception):
    """The peer broke the protocol (bad frame, bad proof); the connection is closed."""


class Connection:
    """One framed connection over a trio socket, with a reusable receive buffer."""

    def __init__(self, sock: trio.socket.SocketType):
        self.sock = sock
        self._buf = bytearray(1 << 20)
        self._prefix = bytearray(PREFIX.size)

    async def _recv_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = await self.sock.recv_into(view[got:])
            if n == 0:
                raise EOFError("connection closed by peer")
            got += n

    async def recv(self, message_type) -> tuple[object, memoryview]:
        """The next frame: (parsed header, payload view valid until the next recv)."""
        await self._recv_exact(memoryview(self._prefix))
        hlen, plen = PREFIX.unpack(self._prefix)
        if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
            raise ProtocolError(f"oversized frame (header {hlen}, payload {plen} bytes)")
        need = hlen + plen
        if len(self._buf) < need:
            self._buf = bytearray(max(need, 2 * len(self._buf)))
        view = memoryview(self._buf)[:need]
        await self._recv_exact(view)
        msg = message_type()
        try:
            msg.ParseFromString(view[:hlen])
        except Exception as e:  # protobuf raises DecodeError (and others on garbage)
            raise ProtocolError(f"undecodable {message_type.__name__} header: {e}") from e
        return msg, view[hlen:need]

    async def send(self, message, payload_parts=()) -> None:
        head = message.SerializeToString()
        plen = sum(len(p) for p in payload_parts)
        await self._sendall(PREFIX.pack(len(head), plen) + head)
        for p in payload_parts:
            await self._sendall(p)

    async def _sendall(self, data) -> None:
        view = memoryview(data)
        while view:
            n = await self.sock.send(view)
            view = view[n:]

    def close(self) -> None:
        self.sock.close()


def proof(secret: bytes, role: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, role + challenge, hashlib.sha256).digest()


async def server_handshake(conn: Connection, secret: bytes, node: str) -> None:
    """Raises ProtocolError unless the client proves the secret."""
    challenge = os.urandom(32)
    await conn.send(pb.Hello(version=VERSION, challenge=challenge, node=node))
    with trio.fail_after(HANDSHAKE_TIMEOUT):
        auth, payload = await conn.recv(pb.Auth)
    if payload or not hmac.compare_digest(auth.proof, proof(secret, b"client", challenge)):
        raise ProtocolError("authentication failed: wrong cluster secret")
    if len(auth.challenge) < 16:
        raise ProtocolError("authentication failed: short challenge")
    await conn.send(pb.AuthOk(proof=proof(secret, b"node", auth.challenge)))


async def client_handshake(conn: Connection, secret: bytes) -> str:
    """Returns the node's name. Raises ProtocolError if the node does not know the secret."""
    with trio.fail_after(HANDSHAKE_TIMEOUT):
        hello, _ = await conn.recv(pb.Hello)
        if hello.version != VERSION:
            raise ProtocolError(f"node speaks protocol {hello.version}, we speak {VERSION}")
        mine = os.urandom(32)
        await conn.send(pb.Auth(proof=proof(secret, b"client", hello.challenge), challenge=mine))
        try:
            ok, _ = await conn.recv(pb.AuthOk)
        except EOFError:
            raise ProtocolError("the node closed the connection: wrong cluster secret?")
    if not hmac.compare_digest(ok.proof, proof(secret, b"node", mine)):
        raise ProtocolError("the node failed to prove the cluster secret")
    return hello.node


def read_secret(path: str) -> bytes:
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"{path}: a cluster secret needs at least 16 bytes")
    return secret
