"""The storage-node daemon: serves fragment requests for the devices it owns.

Stateless apart from its stores. Each connection authenticates first; a peer that
sends a malformed, oversized or unknown frame gets an error reply (when one can be
framed) and is disconnected, and the node keeps serving everyone else. Requests on
one connection are served in order; clients open several connections for parallelism.

The event loop accepts connections and runs the handshake; an authenticated connection
is then served by a thread of its own with a blocking socket, which calls the store
(blocking file I/O) directly. On this path a request costs one thread wakeup, where an
event loop costs a round of its scheduler plus two thread hand-offs for the store
call: a 4 KiB READ answered in about half the CPU time.

Fault controls for tests (``--fault`` or the ``BMFS_NODE_FAULT`` environment variable):
``delay=SECONDS`` delays every READ reply (a straggler).
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import re
import socket
import struct
import threading
import time

import trio

from .. import metrics
from ..native import optional
from ..lru import LRU
from ..store.pmem import lock_device, open_store
from ..wire import node_pb2 as pb
from .protocol import (ALIGNED, READ_AHEAD, BlockingConnection, Connection, FileRange,
                       ProtocolError, server_handshake)
from .tls import wrap

log = logging.getLogger(__name__)
Req = pb.Request  # its enum values as class attributes: pb.Request.Op.X looks up more
# small READs of fragment files served in C (native/node_reads.c), or None: all in Python
READS = optional("bmfs.node._native")
MAX_CONNECTIONS = 256     # served at once (a thread each): see _make_room
IDLE_TIMEOUT = 300.0      # seconds an authenticated connection may sit silent
EVICT_IDLE = 1.0          # seconds of silence that let a full node close a connection
MAX_HANDSHAKES = 64       # handshakes under way at once: see _handle_stream
HANDSHAKE_DEADLINE = 3.0  # seconds from accept to an authenticated peer (TLS and all)
HANDSHAKE_BUFFER = 4096   # the event loop only receives the handshake
HANDSHAKE_FRAME = 512     # bytes of an Auth header at most (it takes ~70); no payload
REJECT_LOG = 10.0         # seconds between two log lines about rejected connections
SENDFILE_MIN = 64 << 10   # larger READs are sent from the file with sendfile(2)
HOT_READS = 3             # small READs of one fragment within HOT_WINDOW seconds
HOT_WINDOW = 2.0          # that make the node read the fragment whole (see
HOT_RATE = 256 << 20      # _note_small_read), at most HOT_RATE bytes/s;
HOT_TRACKED = 16384       # fragments whose recent small READs are counted
FRAGMENT_GUESS = 1 << 20  # bytes a whole-fragment read costs the budget
WARM_QUEUED = 256         # fragments waiting to be read whole, at most
_NAME = re.compile(r"[0-9a-f]{16}\.[0-9]+")  # stripe id (hex) . fragment index
# struct tcp_info (linux/tcp.h): u32 tcpi_last_data_recv (ms since data last came in)
_LAST_DATA_RECV = struct.Struct("=52xI")


class GroupSync:
    """Group commit: writers wait for one sync that started after their write.

    Concurrent PUTs (each in its connection's thread) share a sync (fsync of the files
    written, or one syncfs), so durability before acknowledgement costs a flush per
    batch, not per fragment.
    """

    def __init__(self, store):
        self.store = store
        self.requested = 0
        self.done = 0
        self.running = False
        self.changed = threading.Condition()

    def wait_durable(self) -> None:
        with self.changed:
            self.requested += 1
            mine = self.requested
            while self.done < mine:
                if self.running:
                    self.changed.wait()
                    continue
                self.running = True
                target = self.requested
                ok = False
                self.changed.release()
                try:
                    self.store.sync()
                    ok = True
                finally:
                    self.changed.acquire()
                    self.running = False
                    if ok:
                        self.done = max(self.done, target)
                    self.changed.notify_all()


class NodeServer:
    def __init__(self, name: str, secret: bytes, stores: dict,
                 read_delay: float = 0.0, tls=None, idle_timeout: float = IDLE_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS,
                 max_handshakes: int = MAX_HANDSHAKES,
                 handshake_deadline: float = HANDSHAKE_DEADLINE):
        """``tls``: an ssl.SSLContext (tls.TlsConfig.context) every connection must
        complete a TLS handshake with first, or None (plain TCP)."""
        self.name = name
        self.secret = secret
        self.stores = stores
        self.tls = tls
        self.idle_timeout = idle_timeout
        self.max_handshakes = max_handshakes
        self.handshake_deadline = handshake_deadline
        # handshakes under way (their cancel scopes, oldest first: _handle_stream), and
        # the connections served (a thread each: _make_room)
        self._handshakes: dict[trio.CancelScope, None] = {}
        self._served: set = set()
        self._served_lock = threading.Lock()
        self._rejects_logged_at, self._rejects_unlogged = -math.inf, 0
        # the C path's state (READs it served, the fault flag, PUTs under way, the
        # hot-fragment table), or None: Python serves all, with the table of its own
        self._native = None if READS is None else READS.state(
            HOT_TRACKED, HOT_READS, HOT_WINDOW, HOT_RATE, FRAGMENT_GUESS)
        self._python_requests = 0
        self.read_delay = read_delay
        self.volume_uuid = None  # told to clients in STAT replies (run_node sets it)
        self.connections = trio.CapacityLimiter(max_connections)  # (slots: _serve)
        self._threads = trio.CapacityLimiter(max_connections)  # (one a slot: no wait)
        self._stats = {"connections": 0, "rejected": 0, "requests": 0, "errors": 0,
                       "fragments_read_whole": 0, "evicted": 0}
        self.syncers = {dev: GroupSync(st) for dev, st in stores.items()}
        # fragments being written (files are written in place): a READ of one waits
        # for the write, so it never sees a half-written file (e.g. repair rewriting a
        # fragment that a degraded read or another repair is reading)
        self._writing: dict[tuple[int, str], int] = {}
        # fragments with recent small READs -> (first of them, how many); see
        # _note_small_read
        self._recent = LRU(HOT_TRACKED)
        self._hot_lock = threading.Lock()
        self._warm_queue: queue.Queue | None = None  # fragments to read whole (_warm)
        self._hot_tokens, self._hot_at = float(HOT_RATE), time.monotonic()
        self._written = threading.Condition()
        # (device, its fragment directory) of the stores whose small READs the C path
        # serves (fragment files; not pools); not while a fault delay is set
        # Not under TLS: the C path writes to the raw socket.
        self.native_reads = () if READS is None or tls is not None else tuple(
            (dev, st.fragment_dir.encode()) for dev, st in stores.items()
            if getattr(st, "fragment_dir", None))

    @property
    def stats(self) -> dict:
        """Counters: connections, rejected, requests (served by either path), errors,
        fragments_read_whole."""
        self._stats["requests"] = self._python_requests + (
            READS.served(self._native) if self._native else 0)
        return self._stats

    @property
    def read_delay(self) -> float:
        """Seconds every READ reply is held back (the ``delay`` fault; tests set it)."""
        return self._read_delay

    @read_delay.setter
    def read_delay(self, seconds: float) -> None:
        self._read_delay = seconds
        if self._native:
            READS.set_delayed(self._native, bool(seconds))

    async def serve(self, host: str, port: int, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(port, host=host)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle_stream, listeners)

    async def _handle_stream(self, stream):
        """Authenticate a new connection, then serve it (in a thread, _serve).

        Before the peer has proved the cluster secret it gets nothing but a random
        challenge, may send a frame of HANDSHAKE_FRAME bytes at most, and has
        ``handshake_deadline`` seconds (for TLS and the proof together). At most
        ``max_handshakes`` run at once: the oldest is closed to make room for a new
        one, so a flood of half-open connections holds no slot for long, and a
        client that completes its handshake in a round trip gets through."""
        self._stats["connections"] += 1
        conn = None
        with trio.move_on_after(self.handshake_deadline) as scope:
            self._handshakes[scope] = None
            if len(self._handshakes) > self.max_handshakes:
                oldest = next(iter(self._handshakes))
                del self._handshakes[oldest]  # (it runs later: not to be picked again)
                oldest.cancel()
            try:
                conn = await self._authenticate(stream.socket)
            finally:
                self._handshakes.pop(scope, None)
        if conn is None:
            self._stats["rejected"] += 1
            if scope.cancelled_caught:
                self._note_rejected(f"no handshake within {self.handshake_deadline:g} s, "
                                    f"or {self.max_handshakes} newer ones under way")
            return
        await self._serve(conn)

    async def _authenticate(self, sock) -> Connection | None:
        """The connection once the peer has authenticated (TLS first, if on), or None
        (it is closed: the peer gets no reason)."""
        sock = socket.socket(fileno=sock.detach())
        sock.setblocking(False)
        try:
            if self.tls is not None:
                sock = await wrap(sock, self.tls, server=True)
            conn = Connection(sock, HANDSHAKE_BUFFER, max_header=HANDSHAKE_FRAME,
                              max_payload=0)
            await server_handshake(conn, self.secret, self.stores)
            return conn
        except BaseException as e:
            sock.close()
            if not isinstance(e, (ProtocolError, EOFError, OSError)):  # (ssl.SSLError is
                raise  # an OSError; cancellation: the deadline, or a newer handshake)
            self._note_rejected(str(e))
            return None

    def _note_rejected(self, why: str) -> None:
        """Log a rejected connection: at most one line every REJECT_LOG seconds, with
        the number left out since (a flood must not fill the disk with its lines)."""
        now = time.monotonic()
        self._rejects_unlogged += 1
        if now - self._rejects_logged_at >= REJECT_LOG:
            log.warning("rejected a connection: %s (%d rejected since the last such line)",
                        why, self._rejects_unlogged)
            self._rejects_logged_at, self._rejects_unlogged = now, 0

    async def _serve(self, conn: Connection) -> None:
        """Serve an authenticated connection in a thread of its own, once one of
        ``max_connections`` slots is free: while it waits for one, it closes the
        connection that has been silent longest every EVICT_IDLE seconds
        (_make_room)."""
        slots = self.connections
        while True:
            if slots.borrowed_tokens >= slots.total_tokens:
                self._make_room()
            with trio.move_on_after(EVICT_IDLE):
                await slots.acquire_on_behalf_of(conn)
                break
        try:
            await self._serve_in_thread(conn)
        finally:
            slots.release_on_behalf_of(conn)

    async def _serve_in_thread(self, conn: Connection) -> None:
        sock = conn.sock
        sock.setblocking(True)
        if self.tls is not None:  # (SO_RCVTIMEO would make SSL retry its read forever)
            sock.settimeout(self.idle_timeout)
        else:  # (the kernel's: the C path's blocking recv sees it too)
            tv = struct.pack("ll", int(self.idle_timeout),
                             int(self.idle_timeout % 1 * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        blocking = BlockingConnection(sock, pending=conn.pending())
        # abandon_on_cancel: at shutdown the thread may sit in recv; the process exits
        await trio.to_thread.run_sync(self._serve_connection, blocking,
                                      abandon_on_cancel=True, limiter=self._threads)

    def _make_room(self) -> None:
        """Every slot is taken: close the connection that has been silent longest, if
        it has for EVICT_IDLE seconds (its thread ends, and its slot goes to a waiting
        connection), so that idle connections held open (by a peer with the secret,
        or pools of mounts gone quiet) never lock new clients out. A client whose
        pooled connection was closed tries a fresh one (transport/tcp.py)."""
        with self._served_lock:
            served = list(self._served)
        idlest, most = None, EVICT_IDLE * 1000
        for conn in served:
            try:
                ms, = _LAST_DATA_RECV.unpack_from(conn.sock.getsockopt(
                    socket.IPPROTO_TCP, socket.TCP_INFO, _LAST_DATA_RECV.size))
            except OSError:  # (closed meanwhile)
                continue
            if ms >= most:
                idlest, most = conn, ms
        if idlest is not None:
            self._stats["evicted"] += 1
            log.info("closing a connection idle for %.1f s: all %d slots are taken",
                     most / 1000, self.connections.total_tokens)
            try:  # (the socket's own shutdown: an SSLSocket's would drop its TLS state
                # under the thread that reads it)
                socket.socket.shutdown(idlest.sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def _serve_connection(self, conn: BlockingConnection) -> None:
        """Serve one authenticated connection until it closes, or is silent for
        ``idle_timeout`` (in its own thread).
        Small READs of fragment files are served by the C path when it is built
        (native/node_reads.c: a fraction of the Python path's CPU); it leaves every
        other frame to the Python path as it was received."""
        with self._served_lock:
            self._served.add(conn)
        try:
            self._serve_frames(conn)
        finally:
            with self._served_lock:
                self._served.discard(conn)

    def _serve_frames(self, conn: BlockingConnection) -> None:
        roots = self.native_reads
        behind = False  # the last request had another received behind it
        try:
            while True:
                if roots:
                    status, conn._start, conn._end, dev, name = READS.serve_reads(
                        conn.sock.fileno(), conn._buf, conn._start, conn._end, roots,
                        READ_AHEAD, SENDFILE_MIN, self._native)
                    if status == READS.HOT:
                        self._read_whole((dev, name))
                        continue
                    if status == READS.END:
                        break
                req, payload = conn.recv(pb.Request)
                self._python_requests += 1
                more = conn._end > conn._start
                self._serve_one(conn, req, payload, pipelined=more or behind)
                behind = more
        except EOFError:
            pass
        except (TimeoutError, BlockingIOError):  # silent for idle_timeout
            pass
        except ProtocolError as e:
            self._stats["errors"] += 1
            log.warning("closing a connection: %s", e)
            try:
                conn.send(pb.Response(errno=errno.EPROTO, error=str(e)))
            except OSError:
                pass
        except OSError:
            pass
        finally:
            conn.close()

    def _serve_one(self, conn, req, payload, pipelined: bool = False):
        t0 = time.perf_counter()
        try:
            resp, parts = self._dispatch(req, payload)
        except (ValueError, KeyError, OverflowError) as e:  # (offsets past off_t's)
            resp, parts = pb.Response(errno=errno.EINVAL, error=str(e)), ()
        except FileNotFoundError:
            resp, parts = pb.Response(errno=errno.ENOENT, error="no such fragment"), ()
        except OSError as e:
            resp, parts = pb.Response(errno=e.errno or errno.EIO, error=str(e)), ()
        resp.id = req.id
        if metrics.ON:
            _count(req.op, resp, payload, t0)
        try:
            conn.send(resp, parts)
        finally:
            if parts and isinstance(parts[0], FileRange):
                if parts[0].release is not None:
                    parts[0].release()
                else:
                    os.close(parts[0].fd)
        if req.op == Req.READ and not resp.errno and parts and \
                not isinstance(parts[0], FileRange) and not pipelined:
            self._note_small_read((req.device, req.name))

    def _note_small_read(self, key: tuple[int, str]) -> None:
        """A fragment read in small pieces again and again is read whole into the page
        cache (asynchronously, after the reply): its HOT_READS-th small READ within
        HOT_WINDOW seconds asks the kernel for all of it (~1 MiB, one sequential device
        read), at most HOT_RATE bytes a second. Reads spread thinly over much data (a
        fragment seldom read twice) cost no more than their blocks; a fragment read
        often costs one read of it. READs pipelined with others on their connection
        (a direct client's batch: another request received behind one, or it behind
        another) are not counted: that reader keeps its own reads in flight, and the
        whole-fragment reads would compete with them for the device (a batch of
        random 4 KiB reads over a 1 GiB file had the nodes read all of it)."""
        if self._native:  # one table with the C path's (READS.note: the same rule)
            if READS.note(self._native, *key):
                self._read_whole(key)
            return
        now = time.monotonic()
        with self._hot_lock:
            first, count = self._recent.pop(key, (now, 0))
            if now - first > HOT_WINDOW:
                first, count = now, 0
            count += 1
            if count < HOT_READS:
                self._recent.put(key, (first, count))
                return
            # a token bucket of HOT_RATE bytes/s, one second deep
            self._hot_tokens = min(HOT_RATE, self._hot_tokens + (now - self._hot_at) * HOT_RATE)
            self._hot_at = now
            if self._hot_tokens < FRAGMENT_GUESS:
                return
            self._hot_tokens -= FRAGMENT_GUESS
        self._read_whole(key)

    def _read_whole(self, key: tuple[int, str]) -> None:
        """Have the warm thread read fragment ``key`` whole (started at the first)."""
        with self._hot_lock:
            if self._warm_queue is None:
                self._warm_queue = queue.Queue(WARM_QUEUED)
                threading.Thread(target=self._warm, name="warm", daemon=True).start()
        # by a thread of its own: the kernel starts the fragment's read inside the
        # call, which would hold up this connection's next request
        try:
            self._warm_queue.put_nowait(key)
        except queue.Full:  # the device is behind: this one stays cold
            pass

    def _warm(self) -> None:
        """Ask the kernel to read the fragments queued by _note_small_read whole into
        the page cache, one after another (a thread of its own)."""
        while True:
            key = self._warm_queue.get()
            if key is None:  # close()
                return
            store = self.stores.get(key[0])
            if not hasattr(store, "extent"):
                continue  # a pmem pool is memory already
            try:
                fd, base, length, release = store.extent(key[1])
            except Exception:  # noqa: BLE001 (gone since, say: only a hint was lost)
                continue
            try:
                os.posix_fadvise(fd, base, length, os.POSIX_FADV_WILLNEED)
                self._stats["fragments_read_whole"] += 1
            except OSError:
                pass
            finally:
                release()

    def close(self) -> None:
        """Stop the read-ahead thread (if it was started)."""
        with self._hot_lock:
            if self._warm_queue is not None:
                try:
                    self._warm_queue.put_nowait(None)
                except queue.Full:
                    pass  # (a daemon thread: it ends with the process)

    def _store(self, req):
        store = self.stores.get(req.device)
        if store is None:
            raise KeyError(f"node {self.name} has no device {req.device}")
        return store

    @staticmethod
    def _check_name(name: str) -> str:
        if _NAME.fullmatch(name) is None:
            raise ValueError(f"invalid fragment name {name!r}")
        return name

    def _wait_written(self, key) -> None:
        with self._written:
            while key in self._writing:
                self._written.wait()

    @staticmethod
    def _file_ranges(store, name, ranges) -> list[FileRange]:
        """A large READ's ranges as parts sent from the file (clipped to its end, like
        pread); _serve_one releases the extent once they are sent."""
        fd, base, size, release = store.extent(name)
        out = [FileRange(fd, base + min(off, size), max(0, min(n, size - off)))
               for off, n in ranges]
        out[0].release = release  # _serve_one releases the first part's, once sent
        return out

    def _dispatch(self, req, payload):
        op = req.op
        if op == Req.PING:
            return pb.Response(), ()
        store = self._store(req)
        if op == Req.READ:
            name = self._check_name(req.name)
            if len(req.ranges) > 64:
                raise ValueError("too many ranges")
            ranges = [(r.offset, r.length) for r in req.ranges]
            if sum(n for _, n in ranges) > (64 << 20):
                raise ValueError("read larger than 64 MiB")
            if (req.device, name) in self._writing:
                self._wait_written((req.device, name))
            if sum(n for _, n in ranges) > SENDFILE_MIN and hasattr(store, "extent") \
                    and self.tls is None:  # (sendfile would bypass TLS)
                parts = self._file_ranges(store, name, ranges)
            else:
                parts = store.read_parts(name, ranges)
            if self.read_delay:
                time.sleep(self.read_delay)
            return pb.Response(lengths=[len(p) for p in parts]), parts
        if op == Req.PUT:
            # the payload view points into the receive buffer: stored before the next recv
            key = (req.device, self._check_name(req.name))
            with self._written:
                self._writing[key] = self._writing.get(key, 0) + 1
            if self._native:  # READs go to the Python path meanwhile (it waits)
                READS.puts(self._native, 1)
            try:
                if len(payload) > ALIGNED and hasattr(store, "write_aligned"):
                    store.write_aligned(key[1], payload)  # O_DIRECT: no page cache copy
                else:
                    store.write(key[1], [payload])
            finally:
                if self._native:
                    READS.puts(self._native, -1)
                with self._written:
                    if self._writing[key] == 1:
                        del self._writing[key]
                    else:
                        self._writing[key] -= 1
                    self._written.notify_all()
            if req.durable:
                self.syncers[req.device].wait_durable()
            return pb.Response(), ()
        if op == Req.DELETE:
            store.delete(self._check_name(req.name))
            return pb.Response(), ()
        if op == Req.SYNC:
            store.sync()
            return pb.Response(), ()
        if op == Req.LIST:
            return pb.Response(names=list(store.names())), ()
        if op == Req.STAT:
            info = store.usage()
            info["stats"] = dict(self.stats)
            if self.volume_uuid:  # (for a client to check it is this volume's device)
                info["volume"] = self.volume_uuid
            return pb.Response(info_json=json.dumps(info)), ()
        raise ValueError(f"unknown operation {op}")


_OP_NAMES = {v: k.lower() for k, v in pb.Request.Op.items()}


def _count(op: int, resp, payload, t0: float) -> None:
    """metrics.py: a request served by the Python path (the C path's READs are
    counted in C: bmfs_node_native_reads)."""
    name = _OP_NAMES.get(op, str(op))
    metrics.NODE_REQUESTS.labels(name).inc()
    metrics.NODE_SECONDS.labels(name).observe(time.perf_counter() - t0)
    if resp.errno:
        metrics.NODE_ERRORS.labels(name).inc()
    elif op == Req.PUT:
        metrics.NODE_BYTES.labels("written").inc(len(payload))
    elif op == Req.READ:
        metrics.NODE_BYTES.labels("sent").inc(sum(resp.lengths))


def metrics_source(server: "NodeServer", stores: dict):
    """The node's state for metrics.py: devices (health, size, free), the C path's
    READs, connections."""
    def rows():
        out = [("bmfs_node_connections", (), server.stats["connections"])]
        if server._native:
            out.append(("bmfs_node_native_reads", (), READS.served(server._native)))
        for dev, st in stores.items():
            try:
                st.check()  # (the directory vanished or was replaced: unhealthy)
                u = st.usage()
            except Exception:  # (VolumeError, OSError)
                out.append(("bmfs_device_healthy", (dev,), 0))
                continue
            out.append(("bmfs_device_healthy", (dev,), 1))
            out += metrics.device_rows(dev, u)
        return out
    return rows


async def run_node(name: str, host: str, port: int, secret: bytes, devices: dict[int, str],
                   volume_uuid: str, ready=None, read_delay: float = 0.0,
                   beside=None, advertise: str | None = None, tls=None) -> None:
    """Serve ``devices`` on ``host:port`` until cancelled, each locked for this process
    (lock_device), over TLS if ``tls`` (a tls.TlsConfig) is given. A node keeps nothing
    but its devices: its record in a volume's metadata is kept by ``beside``, started
    once the port is bound (``await nursery.start(beside, stores, address, advertise)``:
    the devices' stores, the address clients reach, and ``advertise``, the one given
    or, unless the address listened on is a wildcard, that one); ``ready(port)`` is
    called once it has started (bmfs/volume/membership.py ``keeper``)."""
    locks = []
    try:
        for dev in sorted(devices):  # (in one order: two overlapping lists cannot cross)
            locks.append(await trio.to_thread.run_sync(lock_device, devices[dev]))
        stores = {dev: open_store(path, volume_uuid, dev) for dev, path in devices.items()}
    except BaseException:
        for fd in locks:
            if fd >= 0:
                os.close(fd)
        raise
    server = NodeServer(name, secret, stores, read_delay=read_delay,
                        tls=tls and tls.context(server=True))
    server.volume_uuid = volume_uuid
    metrics.add_source(metrics_source(server, stores))
    try:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(server.serve, host, port)
            if advertise is None and host not in ("0.0.0.0", "::", ""):
                advertise = f"{host}:{bound}"
            if beside is not None:
                await nursery.start(beside, stores, advertise or f"{host}:{bound}", advertise)
            if ready:
                ready(bound)
    finally:
        server.close()
        for fd in locks:
            if fd >= 0:
                os.close(fd)


__all__ = ["NodeServer", "run_node"]
