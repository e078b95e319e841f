"""A mount's metadata, read over its local socket: the engine of a direct client of a
mounted one-machine volume.

Caveat first: this engine only reads. A one-machine (SQLite) volume has one owner,
and while it is mounted its newest commits sit in the mount's memory and redo log
(bmfs/kv/sqlite.py), not in the database a second process could open. The mount
serves the read primitives of its own engine on ``VOLUME/meta.sock``
(bmfs/volume/metasock.py), so a reader here sees every commit the mount made, the
pending ones too. Commits raise ReadOnly (EROFS) naming the mount point: writes go
through the mount.

Caps: not the single writer (the mount commits behind this client's back, so the
vfs looks everything up afresh), no leases, no watch, no read cache: every ``_get``
and ``_range`` asks the mount, so reads are never stale and ``barrier`` has nothing
to do. A range read larger than one reply page is read in pages, each consistent
on its own (the mount may commit between two pages, as another etcd client may
between two reads).

The wire format (little-endian), one request and one reply per frame, in order, on a
connection of one process:

    frame:   u32 length, then the body (requests: at most MAX_REQUEST bytes)
    request: u8 op, then
             HELLO  u16 protocol version
             GET    key
             RANGE  u32 len(start), u32 limit (0: none), start, end (b"": no bound)
    reply:   u8 status (0 ok, 1 error), then
             error  u16 errno, message (UTF-8)
             HELLO  JSON {"version", "mountpoint"}
             GET    u64 revision (0: absent), value (absent: empty)
             RANGE  u8 more (1: rows past the last one may follow), then rows:
                    u32 len(key), u32 len(value), u64 revision, key, value

Values travel as stored, sealed (bmfs/kv/seal.py): this side checks them as every
engine's reader does. A peer that breaks the format gets its connection closed.
"""
from __future__ import annotations

import contextlib
import errno as _errno
import json
import os
import struct

import trio

from ..errors import FsError, ReadOnly, Unavailable
from . import KV, Capabilities

VERSION = 1
SOCKET_NAME = "meta.sock"  # in the volume directory
OP_HELLO, OP_GET, OP_RANGE = 1, 2, 3
OK, ERROR = 0, 1
MAX_REQUEST = 1 << 16  # bytes of a request body (keys are short)
MAX_REPLY = 64 << 20  # bytes of a reply body this side accepts
# connections one client process keeps to the mount (requests of a batch share them)
POOL = 4

_LEN = struct.Struct("<I")
_RANGE = struct.Struct("<II")
_ROW = struct.Struct("<IIQ")
_REV = struct.Struct("<Q")
_ERR = struct.Struct("<H")


class ProtocolError(Exception):
    """A peer broke the wire format (its connection is closed)."""


@contextlib.contextmanager
def reachable(path: str):
    """``path`` as a Unix socket address short enough to bind or connect to (108
    bytes at most): through a descriptor of its directory (/proc/self/fd/N/NAME)."""
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


def frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


async def read_frame(stream, limit: int) -> bytes | None:
    """The next frame's body from ``stream``, or None at a clean end of stream.

    Raises:
        ProtocolError: the frame is longer than ``limit``, or the stream ends inside it.
    """
    head = await _read_exactly(stream, _LEN.size, eof_ok=True)
    if head is None:
        return None
    n, = _LEN.unpack(head)
    if n > limit:
        raise ProtocolError(f"a frame of {n} bytes (at most {limit})")
    return await _read_exactly(stream, n)


async def _read_exactly(stream, n: int, eof_ok: bool = False) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            if eof_ok and not buf:
                return None
            raise ProtocolError("the connection ended inside a frame")
        buf += chunk
    return bytes(buf)


# -- the replies' bodies (built by the mount's side, bmfs/volume/metasock.py) -----------
def error_reply(code: int, message: str) -> bytes:
    return bytes([ERROR]) + _ERR.pack(code) + message.encode("utf-8", "replace")


def get_reply(value: bytes | None, rev: int) -> bytes:
    return bytes([OK]) + _REV.pack(rev if value is not None else 0) + (value or b"")


def range_reply(rows, more: bool) -> bytes:
    parts = [bytes([OK, 1 if more else 0])]
    for k, v, rev in rows:
        parts += (_ROW.pack(len(k), len(v), rev), k, v)
    return b"".join(parts)


def parse_range(payload: bytes) -> tuple[bytes, bytes, int]:
    """``(start, end, limit)`` of a RANGE request's payload.

    Raises:
        ProtocolError: it is malformed.
    """
    if len(payload) < _RANGE.size:
        raise ProtocolError("a short RANGE request")
    n, limit = _RANGE.unpack_from(payload)
    if _RANGE.size + n > len(payload):
        raise ProtocolError("a RANGE request's start runs past its end")
    at = _RANGE.size
    return payload[at:at + n], payload[at + n:], limit


def parse_hello(payload: bytes) -> int:
    if len(payload) != 2:
        raise ProtocolError("a malformed HELLO")
    return struct.unpack("<H", payload)[0]


class MountSockKV(KV):
    """A read-only view of a mount's engine. Create with ``await MountSockKV.create(path)``
    (``path``: the mount's socket, VOLUME/meta.sock)."""

    caps = Capabilities(single_writer=False, leases=False, watch=False, read_cache=False)

    def __init__(self, path: str):
        self.url = f"mount:{path}"
        self.path = path
        self.mountpoint = ""
        self._idle: list[trio.SocketStream] = []
        self._slots = trio.Semaphore(POOL)

    @classmethod
    async def create(cls, path: str) -> "MountSockKV":
        """Connect to the mount serving ``path`` and agree on the protocol.

        Raises:
            OSError: nothing answers there (FileNotFoundError, ConnectionRefusedError:
                no mount), or this user may not connect (PermissionError).
            Unavailable: the mount refused the connection or speaks another version.
        """
        kv = cls(path)
        kv._idle.append(await kv._connect())
        return kv

    async def _connect(self) -> trio.SocketStream:
        """A new connection, greeted (HELLO): the mount point is learnt from it."""
        with reachable(self.path) as at:
            stream = await trio.open_unix_socket(at)
        try:
            reply = await self._ask(stream, bytes([OP_HELLO]) + struct.pack("<H", VERSION))
            try:
                self.mountpoint = str(json.loads(reply)["mountpoint"])
            except (ValueError, KeyError, TypeError):
                raise Unavailable(f"{self.path}: the mount's answer is not understood") \
                    from None
        except BaseException:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            raise
        return stream

    async def _ask(self, stream, body: bytes) -> bytes:
        """Send one request on ``stream`` and return its reply's payload.

        Raises:
            FsError: the mount answered with an error (its errno).
            Unavailable: the connection broke (the stream is then unusable).
        """
        try:
            await stream.send_all(frame(body))
            reply = await read_frame(stream, MAX_REPLY)
        except (OSError, trio.BrokenResourceError, ProtocolError) as e:
            raise Unavailable(f"the mount's metadata socket {self.path} stopped answering "
                              f"(unmounted?): {e}") from None
        if reply is None:
            raise Unavailable(f"the mount's metadata socket {self.path} closed the "
                              "connection (unmounted, or it refused this process)")
        if reply[:1] == bytes([OK]):
            return reply[1:]
        if reply[:1] == bytes([ERROR]) and len(reply) >= 1 + _ERR.size:
            code, = _ERR.unpack_from(reply, 1)
            raise FsError(reply[1 + _ERR.size:].decode("utf-8", "replace"), code)
        raise Unavailable(f"{self.path}: a reply of an unknown kind from the mount")

    async def _request(self, body: bytes) -> bytes:
        self._check_open()
        async with self._slots:
            stream = self._idle.pop() if self._idle else await self._connect_or_fail()
            try:
                reply = await self._ask(stream, body)
            except FsError as e:
                if isinstance(e, Unavailable):
                    await stream.aclose()
                else:
                    self._idle.append(stream)
                raise
            except BaseException:  # cancelled mid-request: the reply would be out of step
                with trio.CancelScope(shield=True):
                    await stream.aclose()
                raise
            self._idle.append(stream)
            return reply

    async def _connect_or_fail(self) -> trio.SocketStream:
        try:
            return await self._connect()
        except OSError as e:
            raise Unavailable(f"cannot reach the mount's metadata socket {self.path} "
                              f"(unmounted?): {e.strerror or e}") from None

    async def _get(self, key):
        reply = await self._request(bytes([OP_GET]) + key)
        if len(reply) < _REV.size:
            raise Unavailable(f"{self.path}: a short reply from the mount")
        rev, = _REV.unpack_from(reply)
        return (reply[_REV.size:], rev) if rev else (None, 0)

    async def _range(self, start, end, limit):
        out: list[tuple[bytes, bytes, int]] = []
        while True:
            want = limit - len(out) if limit else 0
            reply = await self._request(bytes([OP_RANGE]) + _RANGE.pack(len(start), want)
                                        + start + end)
            more, rows = _rows(reply, self.path)
            out += rows
            if not more or not rows or (limit and len(out) >= limit):
                return out
            start = rows[-1][0] + b"\x00"  # the next key after the last one

    async def _commit(self, reads, writes):
        raise ReadOnly(self.refusal())

    def refusal(self) -> str:
        """Why this client cannot write, and where to."""
        at = self.mountpoint or "its mount point"
        return (f"the volume is mounted at {at}, and that mount owns its metadata: "
                f"write through the mount at {at} (a direct client of a mounted "
                "one-machine volume reads only)")

    async def sync(self):
        pass  # nothing committed here

    async def _aclose(self):
        idle, self._idle = self._idle, []
        for stream in idle:
            await stream.aclose()


def _rows(reply: bytes, path: str) -> tuple[bool, list[tuple[bytes, bytes, int]]]:
    if not reply:
        raise Unavailable(f"{path}: a short reply from the mount")
    more, at, rows = reply[0] == 1, 1, []
    try:
        while at < len(reply):
            klen, vlen, rev = _ROW.unpack_from(reply, at)
            at += _ROW.size
            k = reply[at:at + klen]
            v = reply[at + klen:at + klen + vlen]
            if len(k) != klen or len(v) != vlen:
                raise struct.error("row past the end")
            at += klen + vlen
            rows.append((k, v, rev))
    except struct.error:
        raise Unavailable(f"{path}: a malformed reply from the mount") from None
    return more, rows


def errno_of(e: BaseException) -> int:
    """The errno a reply reports for an error of the mount's engine."""
    return e.errno if isinstance(e, FsError) else _errno.EIO
