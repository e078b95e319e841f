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
import os
import queue
import re
import threading
import time

import trio

from ..data.native import optional
from ..lru import LRU
from ..store.pmem import lock_device, open_store
from ..wire import node_pb2 as pb
from .protocol import (ALIGNED, READ_AHEAD, BlockingConnection, Connection, FileRange,
                       ProtocolError, server_handshake)

log = logging.getLogger(__name__)
Req = pb.Request  # its enum values as class attributes: pb.Request.Op.X costs ~1 us a lookup
# small READs of fragment files served in C (native/node_reads.c), or None: all in Python
READS = optional("bmfs.node._native")
MAX_CONNECTIONS = 256     # served at once (a thread each); more wait for a slot
HANDSHAKE_BUFFER = 4096   # the event loop only receives the handshake
SENDFILE_MIN = 64 << 10   # larger READs are sent from the file with sendfile(2)
HOT_READS = 3             # small READs of one fragment within HOT_WINDOW seconds
HOT_WINDOW = 2.0          # that make the node read the fragment whole (see
HOT_RATE = 256 << 20      # _note_small_read), at most HOT_RATE bytes/s;
HOT_TRACKED = 16384       # fragments whose recent small READs are counted
FRAGMENT_GUESS = 1 << 20  # bytes a whole-fragment read costs the budget
WARM_QUEUED = 256         # fragments waiting to be read whole, at most
_NAME = re.compile(r"[0-9a-f]{16}\.[0-9]+")  # stripe id (hex) . fragment index


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
                 read_delay: float = 0.0):
        self.name = name
        self.secret = secret
        self.stores = stores
        # the C path's state (READs it served, the fault flag, PUTs under way, the
        # hot-fragment table), or None: Python serves all, with the table of its own
        self._native = None if READS is None else READS.state(
            HOT_TRACKED, HOT_READS, HOT_WINDOW, HOT_RATE, FRAGMENT_GUESS)
        self._python_requests = 0
        self.read_delay = read_delay
        self.volume_uuid = None  # told to clients in STAT replies (run_node sets it)
        self.connections = trio.CapacityLimiter(MAX_CONNECTIONS)
        self._stats = {"connections": 0, "rejected": 0, "requests": 0, "errors": 0,
                       "fragments_read_whole": 0}
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
        self.native_reads = () if READS is None else tuple(
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
        conn = Connection(stream.socket, HANDSHAKE_BUFFER)
        self._stats["connections"] += 1
        try:
            await server_handshake(conn, self.secret, self.name)
        except (ProtocolError, EOFError, OSError, trio.TooSlowError) as e:
            self._stats["rejected"] += 1
            log.warning("rejected a connection: %s", e)
            conn.close()
            return
        conn.sock.setblocking(True)
        blocking = BlockingConnection(conn.sock, pending=conn.pending())
        # abandon_on_cancel: at shutdown the thread may sit in recv; the process exits
        await trio.to_thread.run_sync(self._serve_connection, blocking,
                                      abandon_on_cancel=True, limiter=self.connections)

    def _serve_connection(self, conn: BlockingConnection) -> None:
        """Serve one authenticated connection until it closes (in its own thread).
        Small READs of fragment files are served by the C path when it is built
        (native/node_reads.c: ~25 us of CPU where Python took ~110); it leaves every
        other frame to the Python path as it was received."""
        roots = self.native_reads
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
                self._serve_one(conn, req, payload)
        except EOFError:
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

    def _serve_one(self, conn, req, payload):
        try:
            resp, parts = self._dispatch(req, payload)
        except (ValueError, KeyError, OverflowError) as e:  # (offsets past off_t's)
            resp, parts = pb.Response(errno=errno.EINVAL, error=str(e)), ()
        except FileNotFoundError:
            resp, parts = pb.Response(errno=errno.ENOENT, error="no such fragment"), ()
        except OSError as e:
            resp, parts = pb.Response(errno=e.errno or errno.EIO, error=str(e)), ()
        resp.id = req.id
        try:
            conn.send(resp, parts)
        finally:
            if parts and isinstance(parts[0], FileRange):
                if parts[0].release is not None:
                    parts[0].release()
                else:
                    os.close(parts[0].fd)
        if req.op == Req.READ and not resp.errno and parts and not isinstance(parts[0], FileRange):
            self._note_small_read((req.device, req.name))

    def _note_small_read(self, key: tuple[int, str]) -> None:
        """A fragment read in small pieces again and again is read whole into the page
        cache (asynchronously, after the reply): its HOT_READS-th small READ within
        HOT_WINDOW seconds asks the kernel for all of it (~1 MiB, one sequential device
        read), at most HOT_RATE bytes a second. Reads spread thinly over much data (a
        fragment seldom read twice) cost no more than their blocks; a fragment read
        often costs one read of it."""
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
        # call (~0.3 ms at p90 here), which held up this connection's next request
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
            if sum(n for _, n in ranges) > SENDFILE_MIN and hasattr(store, "extent"):
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


async def run_node(name: str, host: str, port: int, secret: bytes, devices: dict[int, str],
                   volume_uuid: str, ready=None, read_delay: float = 0.0,
                   meta: str | None = None, advertise: str | None = None) -> None:
    """Serve ``devices`` on ``host:port`` until cancelled, each locked for this process
    (lock_device). With ``meta`` (etcd, this volume's), keep a leased membership record
    there, and announce ``advertise`` (default: the address listened on, unless that
    is a wildcard) as the devices' node address, beside serving (membership.announce)."""
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
    server = NodeServer(name, secret, stores, read_delay=read_delay)
    server.volume_uuid = volume_uuid
    kv = None
    try:
        if meta:
            from ..kv import open_kv
            kv = await open_kv(meta)
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(server.serve, host, port)
            if advertise is None and host not in ("0.0.0.0", "::", ""):
                advertise = f"{host}:{bound}"
            if kv is not None and hasattr(kv, "grant_lease"):
                from ..errors import FsError
                from .membership import announce, is_volume, keep_registered
                try:
                    ours = await is_volume(kv, volume_uuid)
                except FsError:  # unreachable for now: registered once it answers
                    ours = True
                if not ours:
                    log.warning("the metadata at %s is not volume %s's: not registered "
                                "there, no addresses announced", meta, volume_uuid)
                else:
                    if advertise:  # (beside serving: etcd may be slow or unreachable)
                        nursery.start_soon(announce, kv, stores, advertise, volume_uuid,
                                           secret)
                    await nursery.start(keep_registered, kv, name,
                                        advertise or f"{host}:{bound}", stores)
            if ready:
                ready(bound)
    finally:
        server.close()
        if kv is not None:
            await kv.aclose()
        for fd in locks:
            if fd >= 0:
                os.close(fd)


__all__ = ["NodeServer", "run_node"]
