"""The mount's metadata socket: its engine's reads, served to direct clients.

A one-machine (SQLite) volume has one owner, the mount, whose newest commits are in
its memory and redo log. A direct client (bmfs.connect) of the mounted volume reads
the metadata from here instead (bmfs/kv/mountsock.py: the client's engine and the
wire format): ``get`` and ``range`` of the mount's own engine, so it sees every
commit, the pending ones too. Nothing is written through it.

Who may connect: the socket is ``VOLUME/meta.sock``, mode 0600 and owned by the
mount's user, in the volume directory (0700); beyond the file's mode, each
connection's peer credentials (SO_PEERCRED) must name the mount's uid, or it is
closed unanswered. A client that sends garbage, an oversized frame or goes away
mid-request only loses its connection (logged); at most MAX_CONNECTIONS are served
at once, and one more is closed at once. Each request does a bounded piece of work
on the mount's loop: a range reply holds at most PAGE_ROWS rows (about PAGE_BYTES),
and the client asks for the rest.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import struct

import trio

from ..kv import mountsock as wire
from ..kv.mountsock import ProtocolError

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 512
PAGE_ROWS = 1024
PAGE_BYTES = 1 << 20
ACCEPT_PAUSE = 0.1  # seconds before accepting again after accept(2) failed
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_path(volume_path: str) -> str:
    return os.path.join(volume_path, wire.SOCKET_NAME)


def peer_uid(sock) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        _CRED.size))[1]


async def serve(kv, volume_path: str, mountpoint: str, uid: int | None = None,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``kv``'s reads on the volume's metadata socket until cancelled, to peers
    of ``uid`` (default: this process's). The socket file is removed at the end. A
    socket that cannot be made is logged, and the mount goes on without it (direct
    clients are then refused with EBUSY)."""
    path = socket_path(volume_path)
    uid = os.getuid() if uid is None else uid
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # bound under another name, made 0600 there, then moved into place (replacing one
    # a crashed mount left): it is never reachable with a wider mode
    tmp = f"{path}.{os.getpid()}"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        with wire.reachable(tmp) as at:
            await listener.bind(at)
        os.chmod(tmp, 0o600)
        os.rename(tmp, path)
        listener.listen(64)
        ours = os.stat(path).st_ino
    except OSError as e:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        log.warning("metadata socket %s cannot be made (%s): direct clients cannot read "
                    "this volume while it is mounted", path, e)
        task_status.started()
        return
    hello = json.dumps({"version": wire.VERSION,
                        "mountpoint": os.path.abspath(mountpoint)}).encode()
    open_now = 0
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                try:
                    sock, _ = await listener.accept()
                except OSError as e:  # (EMFILE, ENOBUFS: out of descriptors or memory)
                    log.warning("metadata socket: accepting a connection failed: %s", e)
                    await trio.sleep(ACCEPT_PAUSE)
                    continue
                if open_now >= MAX_CONNECTIONS:
                    log.warning("metadata socket: %d connections open already; one more "
                                "is closed", open_now)
                    sock.close()
                    continue
                open_now += 1

                async def connection(sock=sock):
                    nonlocal open_now
                    try:
                        await _connection(kv, sock, uid, hello)
                    finally:
                        open_now -= 1
                nursery.start_soon(connection)
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == ours:  # (not a later mount's)
                os.unlink(path)


async def _connection(kv, sock, uid: int, hello: bytes) -> None:
    """Answer one client's requests, in order, until it closes; a broken request ends
    the connection (logged), never the mount."""
    stream = trio.SocketStream(sock)
    try:
        try:
            peer = peer_uid(sock)
        except OSError as e:
            log.warning("metadata socket: cannot tell a peer's credentials (%s): closed", e)
            return
        if peer != uid:
            log.warning("metadata socket: a connection of uid %d refused (only uid %d "
                        "reads the metadata here)", peer, uid)
            return
        greeted = False
        while True:
            body = await wire.read_frame(stream, wire.MAX_REQUEST)
            if body is None:
                return
            if not body:
                raise ProtocolError("an empty request")
            op, payload = body[0], body[1:]
            if not greeted:
                if op != wire.OP_HELLO:
                    raise ProtocolError("a request before HELLO")
                version = wire.parse_hello(payload)
                if version != wire.VERSION:
                    await stream.send_all(wire.frame(wire.error_reply(
                        errno.EPROTO, f"the mount speaks metadata socket protocol "
                        f"{wire.VERSION}, not {version}: this bmfs and the mount's differ")))
                    return
                greeted = True
                await stream.send_all(wire.frame(bytes([wire.OK]) + hello))
                continue
            await stream.send_all(wire.frame(await _answer(kv, op, payload)))
    except Exception as e:  # noqa: BLE001 - one client's trouble never ends the mount
        log.warning("metadata socket: a client's connection closed: %s", e)
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _answer(kv, op: int, payload: bytes) -> bytes:
    """The reply to one request (after HELLO).

    Raises:
        ProtocolError: an unknown or malformed request.
    """
    # (the engine's primitives: values as stored, sealed, with their revisions; the
    # client checks the seals)
    try:
        if op == wire.OP_GET:
            value, rev = await kv._get(payload)
            return wire.get_reply(value, rev)
        if op == wire.OP_RANGE:
            start, end, limit = wire.parse_range(payload)
            ask = min(limit, PAGE_ROWS) if limit else PAGE_ROWS
            rows = await kv._range(start, end, ask)
            more = len(rows) == ask and ask != limit
            size, cut = 0, len(rows)
            for i, (k, v, _) in enumerate(rows):
                size += len(k) + len(v)
                if size >= PAGE_BYTES:
                    cut = i + 1
                    break
            if cut < len(rows):
                rows, more = rows[:cut], True
            return wire.range_reply(rows, more)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - the engine's error goes to the client
        log.warning("metadata socket: a read failed: %s", e)
        return wire.error_reply(wire.errno_of(e), f"the mount's metadata: {e}")
    raise ProtocolError(f"unknown request {op}")
