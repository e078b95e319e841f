"""Level 2: the data path over the tcp transport to in-process storage nodes.

Framing edge cases (frames split across sends, several frames in one), the small-read
path (a fragment's verified checksum table is kept, so later reads fetch only their
blocks and still catch corruption), degraded and hedged reads, stale pooled
connections, and reads that meet a fragment being rewritten.
"""
import math
import os
import socket
import struct
import threading
import time

import pytest
import trio

from bmfs.config import Settings, use_settings
from bmfs.data import client as client_mod
from bmfs.data.client import DataClient
from bmfs.format import fragment as fr
from bmfs.data.codec import LIB_HEADER
from bmfs.node.protocol import BlockingConnection, Connection, PREFIX
from bmfs.node import protocol
from bmfs.node import server as node_server
from bmfs.node.server import NodeServer
from bmfs.store.file import FileStore
from bmfs.errors import DeviceError
from bmfs.transport import tcp
from bmfs.transport.tcp import LATE_DOWN, TcpTransport
from bmfs.wire import node_pb2 as pb

SECRET = b"s" * 32


class Nodes:
    """k+m in-process nodes (one device each) on loopback, and a client over tcp."""

    def __init__(self, tmp_path, nursery, n=6):
        self.tmp_path, self.nursery, self.n = tmp_path, nursery, n
        self.stores, self.servers, self.scopes, self.ports = {}, {}, {}, {}

    async def start(self, dev, delay=0.0):
        path = str(self.tmp_path / f"d{dev}")
        if dev not in self.stores:
            FileStore.format(path, "vol", dev)
        self.stores[dev] = FileStore(path, "vol", dev)
        self.servers[dev] = NodeServer(f"n{dev}", SECRET, {dev: self.stores[dev]}, delay)
        scope = self.scopes[dev] = trio.CancelScope()

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await self.servers[dev].serve("127.0.0.1", self.ports.get(dev, 0), task_status)
        self.ports[dev] = await self.nursery.start(run)

    def stop(self, dev):
        """Stop accepting; connections already served keep their threads (a kill -9 of
        a process is what the cluster tests do)."""
        self.scopes[dev].cancel()

    def spy_reads(self) -> list:
        """From now on, record (fragment name, ranges) of every READ the client sends
        (by read_many, which read goes through too)."""
        self.reads, real_many = [], self.transport.read_many

        async def spy_many(reads, deadline=math.inf, batch=False, into=None):
            self.reads.extend((name, ranges) for _, name, ranges, _ in reads)
            return await real_many(reads, deadline, batch, into)
        self.transport.read_many = spy_many
        return self.reads

    async def client(self):
        for dev in range(self.n):
            await self.start(dev)
        self.transport = TcpTransport({d: f"127.0.0.1:{p}" for d, p in self.ports.items()},
                                      SECRET)
        self.damage = []
        return DataClient(self.transport, list(range(self.n)), 4, 2, 16 << 10,
                          on_damage=lambda *a: self.damage.append(a))


def run_with_nodes(tmp_path, body):
    async def main():
        async with trio.open_nursery() as nursery:
            nodes = Nodes(tmp_path, nursery)
            client = await nodes.client()
            try:
                await body(nodes, client)
            finally:
                await nodes.transport.aclose()
                nursery.cancel_scope.cancel()
    trio.run(main)


def test_roundtrip_ranges_and_table_cache(tmp_path):
    data = os.urandom((4 << 20) - 12345)

    async def body(nodes, client):
        st = await client.write_stripe(7, data)
        assert bytes(await client.read(7, st, 0, len(data))) == data
        for off, n in [(0, 1), (4095, 2), (1 << 20, 4096), ((1 << 20) - 10, 20),
                       (len(data) - 5, 100), (12345, 300_000)]:
            assert bytes(await client.read(7, st, off, n)) == data[off:off + n]
        assert (7, 0) in client._tables  # verified tables are kept
        # a small read now asks for its blocks only
        asked = nodes.spy_reads()
        assert bytes(await client.read(7, st, 8192, 4096)) == data[8192:12288]
        assert len(asked) == 1 and len(asked[0][1]) == 1
        # corruption after the table was cached is still caught, and never returned
        path = nodes.stores[st.devices[0]]._file(fr.fragment_name(7, 0))
        geo = fr.geometry(st.frag_version, st.frag_len)
        with open(path, "r+b") as f:
            f.seek(geo.data_offset + 8192 + 100)
            f.write(b"\xde\xad")
        assert bytes(await client.read(7, st, 8192, 4096)) == data[8192:12288]
        assert client.stats["corrupt_fragments"] == 1 and client.stats["degraded_reads"] == 1
        assert nodes.damage and nodes.damage[0][:2] == (7, 0)
    run_with_nodes(tmp_path, body)


def test_large_reads_sent_from_the_file_match_small_ones(tmp_path):
    """READs over 64 KiB are sent with sendfile: same bytes, same clipping at the end of
    the fragment, several ranges in one reply, as the small path."""
    data = os.urandom(3 << 20)

    async def body(nodes, client):
        st = await client.write_stripe(3, data)
        dev, name = st.devices[1], fr.fragment_name(3, 1)
        with open(nodes.stores[dev]._file(name), "rb") as f:
            whole = f.read()
        end = len(whole)
        for ranges in ([(0, 64)], [(0, 100), (5000, 300_000)], [(end - 1000, 200_000)],
                       [(0, end)], [(end + 10, 100_000)], [(7, 70_000), (end - 3, 90_000)]):
            got = await nodes.transport.read(dev, name, ranges)
            assert [bytes(g) for g in got] == [whole[o:o + n] for o, n in ranges], ranges
        # reply buffers are reused, but never while a reader still holds a view of one
        kept = [await nodes.transport.read(st.devices[i], fr.fragment_name(3, i), [(0, end)])
                for i in range(6)]
        for _ in range(3):
            for i in range(6):
                await nodes.transport.read(st.devices[i], fr.fragment_name(3, i), [(0, end)])
        assert bytes(kept[1][0]) == whole and len({bytes(k[0]) for k in kept}) == 6
        with pytest.raises(DeviceError):
            await nodes.transport.read(dev, fr.fragment_name(99, 1), [(0, 1 << 20)])
        assert bytes(await client.read(3, st, 0, len(data))) == data  # the node still serves
    run_with_nodes(tmp_path, body)


def test_fragment_read_often_in_small_pieces_is_read_whole(tmp_path):
    """The third small READ of a fragment within 2 s makes its node read all of it into
    the page cache; small reads spread over many fragments do not."""
    data = os.urandom(4 << 20)

    async def body(nodes, client):
        sids = range(10, 20)
        stripes = {sid: await client.write_stripe(sid, data) for sid in sids}
        for sid in sids:  # one small read of fragment 0 of each stripe: nothing read whole
            assert bytes(await client.read(sid, stripes[sid], 8192, 4096)) == data[8192:12288]
        node = nodes.servers[stripes[10].devices[0]]
        before = node.stats["fragments_read_whole"]
        assert sum(s.stats["fragments_read_whole"] for s in nodes.servers.values()) == 0
        for off in (0, 40960, 81920):
            assert bytes(await client.read(10, stripes[10], off, 4096)) == data[off:off + 4096]
        with trio.fail_after(5):  # asked by a thread of the node's own, after the reply
            while node.stats["fragments_read_whole"] == before:
                await trio.sleep(0.01)
        await trio.sleep(0.2)  # and nothing else follows
        assert node.stats["fragments_read_whole"] == before + 1
        assert sum(s.stats["fragments_read_whole"] for s in nodes.servers.values()) == 1
    run_with_nodes(tmp_path, body)


@pytest.mark.parametrize("native", [True, False])
def test_pipelined_small_reads_leave_a_fragment_cold(tmp_path, native):
    """A batch's READs pipelined on a connection (a direct client's read_many) do not
    make their fragment hot, on the node's C path or its Python path: a batch of 12
    small reads of one fragment leaves it unread whole; three lone reads after it
    still read it whole."""
    from bmfs.transport import tcp
    if tcp.CLIENT is None:
        pytest.skip("the C client is not built: batches are not pipelined")
    data = os.urandom(4 << 20)

    async def body(nodes, client):
        if not native:
            for server in nodes.servers.values():
                server.native_reads = ()  # every frame to the Python path
        st = await client.write_stripe(10, data)
        dev = st.devices[0]
        node = nodes.servers[dev]
        reads = [(dev, fr.fragment_name(10, 0), [(off, 4096)], None)
                 for off in range(8192, 8192 + 12 * 4096, 4096)]

        async def batch():  # (a loop of its own, as a direct client's: a batch holds it)
            transport = TcpTransport({d: f"127.0.0.1:{p}" for d, p in nodes.ports.items()},
                                     SECRET)
            try:
                return await transport.read_many(reads, batch=True)
            finally:
                await transport.aclose()
        got = await trio.to_thread.run_sync(trio.run, batch)
        assert all(isinstance(g, list) and len(g[0]) == 4096 for g in got)
        await trio.sleep(0.3)
        assert node.stats["fragments_read_whole"] == 0
        for off in (0, 40960, 81920):
            assert bytes(await client.read(10, st, off, 4096)) == data[off:off + 4096]
        with trio.fail_after(5):
            while node.stats["fragments_read_whole"] == 0:
                await trio.sleep(0.01)
    run_with_nodes(tmp_path, body)


def test_degraded_streaming_reads_fetch_k_fragments_once(tmp_path):
    data = os.urandom(4 << 20)

    async def body(nodes, client):
        st = await client.write_stripe(9, data)
        st2 = await client.write_stripe(10, data[::-1])
        dead = st.devices[1]
        nodes.stop(dead)
        for conn in nodes.transport.device_node[dead].idle:
            conn.close()  # the node "died": its connections are gone too
        nodes.transport.device_node[dead].idle.clear()
        # the first read that needs it finds the node dead, and decodes
        assert bytes(await client.read(9, st, (1 << 20) + 5, 10)) == data[(1 << 20) + 5:][:10]
        assert client.stats["degraded_reads"] == 1 and not nodes.transport.is_up(dead)
        nodes.spy_reads()
        out = [None] * 4

        async def one(j):  # read-ahead: the four MiB of a stripe asked for at once
            out[j] = bytes(await client.read(10, st2, j << 20, 1 << 20))
        async with trio.open_nursery() as n:
            for j in range(4):
                n.start_soon(one, j)
        assert b"".join(out) == data[::-1]
        # one decode served all four: k fragments fetched once, none from the dead node
        assert client.stats["degraded_reads"] == 2
        fetched = [name for name, _ in nodes.reads]
        assert len(fetched) == 4 and len(set(fetched)) == 4
        assert fr.fragment_name(10, st2.devices.index(dead)) not in fetched


def test_small_reads_of_a_dead_node_rebuild_just_their_range(tmp_path):
    """With a data fragment's node dead, a small read is rebuilt from the same range of
    k other fragments: k small READs, not k whole fragments, and the bytes are exact
    at every alignment (in a block, across blocks, the fragment's first and last)."""
    data = os.urandom((4 << 20) - 5000)

    async def body(nodes, client):
        st = await client.write_stripe(21, data)
        bs = st.frag_len - LIB_HEADER
        dead = st.devices[1]
        nodes.stop(dead)
        for conn in nodes.transport.device_node[dead].idle:
            conn.close()
        nodes.transport.device_node[dead].idle.clear()
        nodes.spy_reads()
        cases = [(bs + 5, 10), (bs + 4096, 4096), (bs + 4000, 5000), (bs, 1),
                 (2 * bs - 7, 7), (bs + 12345, 60_000)]
        for off, n in cases:
            assert bytes(await client.read(21, st, off, n)) == data[off:off + n], (off, n)
        assert client.stats["ranges_rebuilt"] == len(cases)
        assert client.stats["degraded_reads"] == len(cases) and not client._decoded
        # the dead node once, then k=4 ranges of other fragments for each read
        assert len(nodes.reads) == 1 + 4 * len(cases)
        assert all(sum(n for _, n in ranges) <= 72 << 10 for _, ranges in nodes.reads)
        # only the first read asked the dead node (and found it dead)
        assert [name for name, _ in nodes.reads].count(fr.fragment_name(21, 1)) == 1
        # a read spanning two fragments still decodes the stripe (and keeps it)
        off = bs - 100
        assert bytes(await client.read(21, st, off, 200)) == data[off:off + 200]
        assert client.stats["ranges_rebuilt"] == len(cases) and 21 in client._decoded
    run_with_nodes(tmp_path, body)


def test_read_many_sends_every_request_first_and_keeps_failures_apart(tmp_path):
    """transport.read_many (a degraded small read's k ranges): every request is on its
    way before any reply is awaited; each item gets its own parts or its own error (a
    dead node's DeviceError, a failed check's exception), and the connections stay in
    step for the reads after it."""
    data = os.urandom(4 << 20)

    async def body(nodes, client):
        st = await client.write_stripe(31, data)
        t = nodes.transport
        want = {i: client._range_read(31, st, i, LIB_HEADER + 8192, 4096)
                for i in range(4)}

        def reads(check_of=lambda i: want[i].verify):
            return [(st.devices[i], want[i].name, want[i].ranges, check_of(i))
                    for i in range(4)]

        got = await t.read_many(reads())
        for i in range(4):
            assert want[i].done(want[i].outcome(got[i])) == \
                data[i * (1 << 20) + 8192:][:4096]
        # the first node holds its reply for 0.5 s: the others have their requests
        # (and have answered) meanwhile
        slow, other = st.devices[0], st.devices[3]
        nodes.servers[slow].read_delay = 0.5
        seen = nodes.servers[other].stats["requests"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.read_many, reads())
            await trio.sleep(0.3)
            assert nodes.servers[other].stats["requests"] == seen + 1
        nodes.servers[slow].read_delay = 0.0
        # a dead node and a check that fails: their items only
        dead = st.devices[1]
        nodes.stop(dead)
        for conn in t.device_node[dead].idle:
            conn.close()
        t.device_node[dead].idle.clear()

        def check_of(i):
            if i != 2:
                return want[i].verify

            def bad(parts):
                raise fr.CorruptFragment("checked and refused")
            return bad
        got = await t.read_many(reads(check_of))
        assert isinstance(got[1], DeviceError) and not t.is_up(dead)
        assert isinstance(got[2], fr.CorruptFragment)
        for i in (0, 3):
            assert bytes(got[i][-1])[-4096:] == data[i * (1 << 20) + 8192:][:4096]
        # cancelled while replies are owed: those connections are closed, not pooled
        # (a later read must not take an old reply for its own)
        nodes.servers[slow].read_delay = 0.3
        with trio.move_on_after(0.1):
            await t.read_many(reads())
        nodes.servers[slow].read_delay = 0.0
        degraded = client.stats["degraded_reads"]
        for i in (0, 2, 3):
            off = i * (1 << 20) + 4096
            assert bytes(await client.read(31, st, off, 4096)) == data[off:off + 4096]
        assert client.stats["degraded_reads"] == degraded and t.is_up(slow)
    run_with_nodes(tmp_path, body)


def test_hedged_read_avoids_the_slow_node(tmp_path):
    data = os.urandom(4 << 20)

    async def body(nodes, client):
        st = await client.write_stripe(11, data)
        slow = st.devices[2]
        nodes.servers[slow].read_delay = 1.0
        with trio.fail_after(0.8):  # well below the slow node's delay
            got = await client.read(11, st, (2 << 20) + 4096, 4096)
        assert bytes(got) == data[(2 << 20) + 4096:(2 << 20) + 8192]
        assert client.stats["hedged_reads"] == 1
        # slow is not down: once it answers again it is read directly, and the reply
        # it still owed the hedged read is not taken for another one's
        assert nodes.transport.is_up(slow)
        nodes.servers[slow].read_delay = 0.0
        for off in (8192, 3 * 4096, 4096):
            got = await client.read(11, st, (2 << 20) + off, 4096)
            assert bytes(got) == data[(2 << 20) + off:(2 << 20) + off + 4096]
        assert client.stats["hedged_reads"] == 1 and client.stats["degraded_reads"] == 1
        # a node that keeps missing the hedge's deadline is skipped for a while: after
        # LATE_DOWN hedged reads in a row, reads of it decode at once
        nodes.servers[slow].read_delay = 1.0
        for n in range(1, LATE_DOWN + 1):
            assert nodes.transport.is_up(slow)
            off = n * 40960  # not where the last rebuilt range ended (_sequential)
            got = await client.read(11, st, (2 << 20) + off, 4096)
            assert bytes(got) == data[(2 << 20) + off:(2 << 20) + off + 4096]
        assert not nodes.transport.is_up(slow) and client.stats["hedged_reads"] == 1 + LATE_DOWN
        with trio.fail_after(0.8):
            got = await client.read(11, st, (3 << 20) - 4096, 4096)
        assert bytes(got) == data[(3 << 20) - 4096:3 << 20]
        assert client.stats["hedged_reads"] == 1 + LATE_DOWN
    run_with_nodes(tmp_path, body)


def test_node_that_does_not_answer_in_time_is_marked_down(tmp_path):
    """A request past the transport's own timeout fails with DeviceError and the node
    is skipped for a while (placement and reads go elsewhere)."""
    data = os.urandom(1 << 20)

    async def body(nodes, client):
        st = await client.write_stripe(12, data)
        dev = st.devices[0]
        nodes.servers[dev].read_delay = 1.0
        nodes.transport.timeout = 0.2
        with pytest.raises(DeviceError, match="timed out"):
            await nodes.transport.read(dev, fr.fragment_name(12, 0), [(0, 4096)])
        assert not nodes.transport.is_up(dev)
        # the client reads around it, from the other fragments
        got = await client.read(12, st, 4096, 4096)
        assert bytes(got) == data[4096:8192] and client.stats["degraded_reads"] == 1
    run_with_nodes(tmp_path, body)


def test_stale_pooled_connection_is_retried_not_marked_down(tmp_path):
    data = os.urandom(1 << 20)

    async def body(nodes, client):
        st = await client.write_stripe(13, data)
        assert bytes(await client.read(13, st, 0, 4096)) == data[:4096]
        dev = st.devices[0]
        node = nodes.transport.device_node[dev]
        assert node.idle
        for conn in node.idle:  # the node closed them (as a restarted node would)
            conn.sock.shutdown(socket.SHUT_RDWR)
        assert bytes(await client.read(13, st, 4096, 4096)) == data[4096:8192]
        assert nodes.transport.is_up(dev) and client.stats["degraded_reads"] == 0
    run_with_nodes(tmp_path, body)


def _held_writes(store):
    """Make ``store``'s writes leave the file torn until ``release`` is set (after
    ``entered``): (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real_write = store.write

    def slow_write(n, parts):
        with open(store._file(n), "wb") as f:
            f.write(b"b" * 10)  # torn for now
        entered.set()
        release.wait(5)
        real_write(n, parts)
    store.write = slow_write
    store.write_aligned = lambda n, buf: slow_write(n, [buf])  # large PUTs: O_DIRECT
    return entered, release


def test_read_waits_for_a_fragment_being_written(tmp_path):
    """A READ never sees a fragment file half-written (repair rewrites in place)."""
    store_path = str(tmp_path / "d0")
    FileStore.format(store_path, "vol", 0)
    store = FileStore(store_path, "vol", 0)
    server = NodeServer("n0", SECRET, {0: store})
    name = fr.fragment_name(5, 0)
    store.write(name, [b"a" * 100_000])
    entered, release = _held_writes(store)
    writer = threading.Thread(target=server._dispatch, args=(
        pb.Request(op=pb.Request.PUT, device=0, name=name), memoryview(b"b" * 100_000)))
    writer.start()
    assert entered.wait(5)
    got = []
    reader = threading.Thread(target=lambda: got.append(server._dispatch(
        pb.Request(op=pb.Request.READ, device=0, name=name,
                   ranges=[pb.Range(offset=0, length=60_000)]), b"")))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()  # waiting for the write
    release.set()
    writer.join(5)
    reader.join(5)
    resp, parts = got[0]
    assert list(resp.lengths) == [60_000] and parts[0] == b"b" * 60_000


@pytest.mark.parametrize("chunk", [7, 4099, 1 << 20])
def test_framing_split_and_coalesced(chunk):
    """Frames arrive in pieces of any size, or several in one segment; both ends agree."""
    a, b = socket.socketpair()
    frames = [(pb.Response(id=i, lengths=[n]), os.urandom(n))
              for i, n in enumerate([0, 5, 70_000, 3, 300_000, 10])]
    wire = bytearray()
    for msg, payload in frames:
        head = msg.SerializeToString()
        wire += PREFIX.pack(len(head), len(payload)) + head + payload

    def feed():
        for i in range(0, len(wire), chunk):
            a.sendall(wire[i:i + chunk])
    t = threading.Thread(target=feed)
    t.start()
    blocking = BlockingConnection(b, 4096)
    for msg, payload in frames[:3]:
        got, view = blocking.recv(pb.Response)
        assert got.id == msg.id and bytes(view) == payload
    rest = blocking.pending()

    async def async_side():
        b.setblocking(False)
        conn = Connection(trio.socket.from_stdlib_socket(b), 4096)
        conn._buf[:len(rest)] = rest  # hand over what was read ahead
        conn._start, conn._end = 0, len(rest)
        for msg, payload in frames[3:]:
            got, view = await conn.recv(pb.Response, own_payload=True)
            assert got.id == msg.id and bytes(view) == payload
    trio.run(async_side)
    t.join()
    a.close()
    b.close()


def test_oversized_frame_is_refused():
    a, b = socket.socketpair()
    a.sendall(struct.pack("<II", 10, 1 << 30))
    with pytest.raises(Exception, match="oversized"):
        BlockingConnection(b).recv(pb.Request)
    a.close()
    b.close()


def test_spinning_wait_lets_others_run_falls_back_and_can_be_cancelled():
    """A lone small read spins for its reply (Connection._spin_loop) instead of
    sleeping: the event loop's other tasks keep running meanwhile (here the task that
    sends the reply), a reply later than the spin still arrives, and a deadline (a
    hedged read's) cancels the wait at once."""
    frame = pb.Response(id=7).SerializeToString()

    async def main():
        a, b = trio.socket.socketpair()
        conn = Connection(b, 4096)

        async def reply_after(seconds):
            await trio.sleep(seconds)
            await a.send(PREFIX.pack(len(frame), 0) + frame)

        async with trio.open_nursery() as nursery:
            # the reply comes from a task of this loop: a spin that held the loop would
            # only see it after its 10 s
            conn.spin = 10.0
            nursery.start_soon(reply_after, 0.01)
            t0 = trio.current_time()
            got, _ = await conn.recv(pb.Response)
            assert got.id == 7 and conn.spin == 0.0
            assert trio.current_time() - t0 < 5
            # a reply that comes after the spin: the wait goes on in the event loop
            conn.spin = 0.001
            nursery.start_soon(reply_after, 0.2)
            with trio.fail_after(5):
                got, _ = await conn.recv(pb.Response)
            assert got.id == 7
            # the connection's deadline (a hedged read's) ends the spin and the wait
            conn.spin = 10.0
            conn.deadline = trio.current_time() + 0.05
            t0 = trio.current_time()
            with pytest.raises(trio.TooSlowError):
                await conn.recv(pb.Response)
            assert trio.current_time() - t0 < 5
            conn.deadline = math.inf
            nursery.start_soon(reply_after, 0)  # (the reply it gave up on)
            got, _ = await conn.recv(pb.Response)
            # cancelled while spinning
            conn.spin = 10.0
            t0 = trio.current_time()
            with trio.move_on_after(0.05) as scope:
                await conn.recv(pb.Response)
            assert scope.cancelled_caught and trio.current_time() - t0 < 5
        a.close()
        conn.close()
    trio.run(main)


def test_large_reply_waits_for_its_rest_then_small_ones_are_not_held_back():
    """A large payload that comes in pieces is received whole, each wait asking the
    socket to report readable once the rest is there (SO_RCVLOWAT: what is left, at
    most LOWAT_MAX; a mark left above what is left would never be reached); afterwards
    the socket reports a small frame at once again (a mark left set would hold it back
    until the transport's timeout)."""
    from bmfs.node.protocol import LOWAT_MAX
    payload = os.urandom(2 * LOWAT_MAX + 12345)
    big = pb.Response(id=1, lengths=[len(payload)]).SerializeToString()
    small = pb.Response(id=2).SerializeToString()

    async def main():
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = trio.socket.socket()
        await client.connect(listener.getsockname())
        server, _ = await listener.accept()
        conn = Connection(client, 4096)

        async def send_all(data):
            view = memoryview(data)
            while view:
                view = view[await server.send(view):]

        marks = []

        async def send_in_pieces():
            # the prefix and a little, most of it, then the rest
            cuts = [0, 100_000, LOWAT_MAX + LOWAT_MAX // 2, len(payload)]
            await send_all(PREFIX.pack(len(big), len(payload)) + big)
            for a, b in zip(cuts, cuts[1:]):
                await send_all(payload[a:b])
                await trio.sleep(0.05)
                # the receiver waits for the rest meanwhile: the socket's mark says so
                marks.append(conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
            await server.send(PREFIX.pack(len(small), 0) + small)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_in_pieces)
            with trio.fail_after(5):
                got, data = await conn.recv(pb.Response, own_payload=True)
            assert got.id == 1 and bytes(data) == payload
            assert marks[0] == LOWAT_MAX and 1 < marks[1] < LOWAT_MAX
            assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
            with trio.fail_after(2):
                got, _ = await conn.recv(pb.Response, own_payload=True)
            assert got.id == 2
        for s in (listener, server):
            s.close()
        conn.close()
    trio.run(main)


def test_spin_setting_from_the_environment(caplog):
    def spin_setting(environ):
        return Settings.from_environ(environ).spin
    assert spin_setting({}) == 0.0005
    assert spin_setting({"BMFS_SPIN_US": "0"}) == 0.0
    assert spin_setting({"BMFS_SPIN_US": "250"}) == 0.00025
    for bad in ("fast", "-5", "1e9", "nan"):
        assert spin_setting({"BMFS_SPIN_US": bad}) == 0.0005
    assert "BMFS_SPIN_US='fast'" in caplog.text


def _serve_socketpair(server):
    """A connection to ``server`` over a socketpair, served by a thread as an
    authenticated one is (the node's _serve_connection): the client's end."""
    a, b = socket.socketpair()
    t = threading.Thread(target=server._serve_connection, args=(BlockingConnection(b),),
                         daemon=True)
    t.start()
    return a, t


def _frame(header: bytes, payload: bytes = b"") -> bytes:
    return PREFIX.pack(len(header), len(payload)) + header + payload


def _replies(sock, count):
    """``count`` replies from ``sock``: (Response, payload bytes) each."""
    conn = BlockingConnection(sock, 4096)
    out = []
    for _ in range(count):
        resp, payload = conn.recv(pb.Response)
        out.append((resp, bytes(payload)))
    return out


@pytest.mark.skipif(node_server.READS is None, reason="the C helper is not built")
@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_small_reads_served_in_c_answer_as_python_does(tmp_path, chunk):
    """A node's small READs are served by its C path (native/node_reads.c), which hands
    every other frame to the Python path untouched. The same requests to a node
    without it get the same replies, byte for byte: ranges in and past a fragment's
    end, none, 64 and 65 of them, reads over 64 KiB, a missing fragment, a bad name,
    an unknown device and field, a PUT in between (read back after), sent in pieces of
    any size or all at once; and the C path did serve the plain ones."""
    path = str(tmp_path / "d0")
    FileStore.format(path, "vol", 3)
    body = os.urandom(200_000)
    name = fr.fragment_name(0xabc, 2)
    FileStore(path, "vol", 3).write(name, [body])

    def req(**kw):
        return pb.Request(op=pb.Request.READ, device=3, name=name, **kw)

    def ranges(*pairs):
        return [pb.Range(offset=o, length=n) for o, n in pairs]
    reqs = [
        req(id=1, ranges=ranges((0, 4096))),
        req(id=2, ranges=ranges((5000, 100), (0, 10), (199_990, 100))),  # short at the end
        req(id=3, ranges=ranges((300_000, 50), (7, 0))),                 # past the end
        req(id=0, ranges=[]),
        req(id=2 ** 63 + 5, ranges=ranges(*[(i * 100, 10) for i in range(64)])),
        req(id=5, ranges=ranges(*[(i, 1) for i in range(65)])),          # too many
        req(id=6, ranges=ranges((0, 100_000))),                          # sent from the file
        req(id=7, ranges=ranges((2 ** 63, 10))),
        pb.Request(id=8, op=pb.Request.READ, device=3, name=fr.fragment_name(0xdef, 0),
                   ranges=ranges((0, 10))),                              # no such fragment
        pb.Request(id=9, op=pb.Request.READ, device=3, name="../DEVICE",
                   ranges=ranges((0, 10))),
        pb.Request(id=10, op=pb.Request.READ, device=4, name=name, ranges=ranges((0, 10))),
        req(id=11, ranges=ranges((64, 64))),
    ]
    wire = b"".join(_frame(r.SerializeToString()) for r in reqs)
    # a field this node does not know (a newer client's): the Python path serves it
    wire += _frame(req(id=12, ranges=ranges((1, 2))).SerializeToString() + b"\x78\x01")
    put = pb.Request(id=13, op=pb.Request.PUT, device=3, name=name)
    wire += _frame(put.SerializeToString(), b"new" * 1000)
    wire += _frame(req(id=14, ranges=ranges((0, 4000))).SerializeToString())
    count = len(reqs) + 3

    def run(native: bool):
        FileStore(path, "vol", 3).write(name, [body])
        server = NodeServer("n", SECRET, {3: FileStore(path, "vol", 3)})
        if not native:
            server.native_reads = ()
        sock, thread = _serve_socketpair(server)

        def feed():
            for i in range(0, len(wire), chunk):
                sock.sendall(wire[i:i + chunk])
        feeder = threading.Thread(target=feed)
        feeder.start()
        got = _replies(sock, count)
        feeder.join()
        sock.close()
        thread.join(5)
        assert server.stats["requests"] == count
        return [(r.SerializeToString(), payload) for r, payload in got], server

    fast, fast_server = run(True)
    slow, _ = run(False)
    assert fast == slow
    # ids 1, 2, 3, 0, 2**63+5, 11 and 14 (after the PUT)
    assert node_server.READS.served(fast_server._native) == 7
    replies = [pb.Response.FromString(h) for h, _ in fast]
    assert [r.id for r in replies] == [r.id for r in reqs] + [12, 13, 14]
    assert fast[0][1] == body[:4096] and fast[-1][1] == (b"new" * 1000)[:3000]
    assert list(replies[1].lengths) == [100, 10, 10] and list(replies[2].lengths) == [0, 0]
    assert fast[1][1] == body[5000:5100] + body[:10] + body[199_990:]
    assert [r.errno != 0 for r in replies] == [False] * 5 + [True] + [False] + [True] * 4 + \
        [False] * 4


@pytest.mark.skipif(node_server.READS is None, reason="the C helper is not built")
def test_c_path_leaves_reads_to_python_while_a_fragment_is_written(tmp_path):
    """While a PUT is under way, a READ on another connection goes to the Python path,
    which waits for a write of the same fragment: it never sees the file half-written."""
    path = str(tmp_path / "d0")
    FileStore.format(path, "vol", 0)
    store = FileStore(path, "vol", 0)
    name = fr.fragment_name(5, 0)
    store.write(name, [b"a" * 8192])
    server = NodeServer("n", SECRET, {0: store})
    entered, release = _held_writes(store)
    writer, wt = _serve_socketpair(server)
    reader, rt = _serve_socketpair(server)
    writer.sendall(_frame(pb.Request(id=1, op=pb.Request.PUT, device=0,
                                     name=name).SerializeToString(), b"b" * 8192))
    assert entered.wait(5)
    reader.sendall(_frame(pb.Request(id=2, op=pb.Request.READ, device=0, name=name,
                                     ranges=[pb.Range(offset=0, length=4096)])
                          .SerializeToString()))
    reader.settimeout(0.3)
    with pytest.raises(socket.timeout):
        reader.recv(1)  # waiting for the write
    reader.settimeout(5)
    release.set()
    ((resp, payload),) = _replies(reader, 1)
    assert list(resp.lengths) == [4096] and payload == b"b" * 4096
    assert _replies(writer, 1)[0][0].errno == 0
    # and once it is written, READs are the C path's again
    reader.sendall(_frame(pb.Request(id=3, op=pb.Request.READ, device=0, name=name,
                                     ranges=[pb.Range(offset=8000, length=500)])
                          .SerializeToString()))
    ((resp, payload),) = _replies(reader, 1)
    assert payload == b"b" * 192 and node_server.READS.served(server._native) == 1
    for s in (writer, reader):
        s.close()
    wt.join(5)
    rt.join(5)


# -- a mount's lone small READ, sent and taken in C (native/client_reads.c) -------------
needs_client = pytest.mark.skipif(protocol.CLIENT is None, reason="the C helper is not built")


@needs_client
def test_c_client_builds_the_request_python_builds():
    """The READ frame the C path sends is the Python path's, byte for byte: ids and
    devices of 0 (left out, as proto3 does) and of 64 bits, offsets and lengths of 0,
    no ranges and 8; more than 8 ranges or a name over 64 bytes are refused."""
    cases = [(1, 0, "00000000000001a3.2", [(8192, 4096)]), (0, 0, "x", [(0, 0)]),
             (2 ** 64 - 1, 2 ** 32 - 1, "a" * 64, [(2 ** 63, 1), (0, 2 ** 40)]),
             (5, 3, "", []), (7, 1, "f.1", [(i * 4096, 4096 + i) for i in range(8)])]
    for rid, dev, name, ranges in cases:
        req = tcp._read_request(name, ranges)
        req.id, req.device = rid, dev
        assert protocol.CLIENT.read_frame(rid, dev, name.encode(), ranges) == \
            Connection._frame(req, ())
    with pytest.raises(ValueError):
        protocol.CLIENT.read_frame(1, 0, b"x", [(0, 1)] * 9)
    with pytest.raises(ValueError):
        protocol.CLIENT.read_frame(1, 0, b"x" * 65, [(0, 1)])


def _spun(conn, rid, dev, name, ranges, spin, watch_fd=-1):
    """One request through protocol.read_spun: (parts, status, unsent)."""
    ((parts, status, unsent, _),) = protocol.read_spun([(conn, rid, dev, name, ranges)],
                                                       spin, watch_fd)
    return parts, status, unsent


@needs_client
def test_c_client_takes_plain_replies_and_leaves_the_rest_to_python():
    """protocol.read_spun against a peer that answers as told: a plain reply (also
    one that comes in pieces) is taken in C, its parts right and the buffer left at
    the next frame; an error reply, one with another id or an oversized prefix is left
    for recv, which parses (or refuses) it as ever; a reply later than the spin is
    left to recv's wait; a readable watched descriptor ends a long spin at once; a
    peer that closed the connection is told."""
    payload = os.urandom(5000)

    def reply(rid, lengths=(4096, 904), **kw):
        return _frame(pb.Response(id=rid, lengths=list(lengths), **kw).SerializeToString(),
                      payload[:sum(lengths)])

    async def main():
        a, b = socket.socketpair()
        conn = Connection(b, 64 << 10)
        ranges = [(0, 4096), (10, 904)]

        def asked():  # the request the peer got, and whether anything followed it
            conn_a = BlockingConnection(a, 4096)
            req, _ = conn_a.recv(pb.Request)
            return req, conn_a.pending()

        def answer_later(data, pieces=1, pause=0.0):
            def go():
                req = asked()
                step = max(1, len(data) // pieces)
                for i in range(0, len(data), step):
                    time.sleep(pause)
                    a.sendall(data[i:i + step])
                got.append(req)
            got = []
            t = threading.Thread(target=go)
            t.start()
            return t, got

        # a plain reply, whole and then in 50 pieces
        for pieces, pause in ((1, 0.0), (50, 0.001)):
            t, got = answer_later(reply(11), pieces, pause)
            parts, status, unsent = _spun(conn, 11, 3, b"00000000000000ab.1", ranges, 5.0)
            t.join()
            assert status == protocol.CLIENT.REPLY and unsent is None
            assert [bytes(p) for p in parts] == [payload[:4096], payload[4096:5000]]
            req, more = got[0]
            assert req.id == 11 and req.device == 3 and more == b"" and \
                [(r.offset, r.length) for r in req.ranges] == ranges
            assert conn._start == conn._end
        # an error reply, another id, an oversized prefix: recv's
        for data, check in [
                (_frame(pb.Response(id=12, errno=5, error="bad").SerializeToString()),
                 lambda resp: resp.errno == 5 and resp.error == "bad"),
                (reply(99), lambda resp: resp.id == 99)]:
            t, _ = answer_later(data)
            parts, status, _ = _spun(conn, 12, 0, b"n", ranges, 5.0)
            t.join()
            assert parts is None and status == protocol.CLIENT.FRAME
            resp, _ = await conn.recv(pb.Response)
            assert check(resp)
            assert conn._start == conn._end
        # later than the spin: recv waits for it
        t, _ = answer_later(reply(13), 1, 0.2)
        parts, status, _ = _spun(conn, 13, 0, b"n", ranges, 0.001)
        assert parts is None and status == protocol.CLIENT.SPUN
        with trio.fail_after(5):
            resp, data = await conn.recv(pb.Response)
        t.join()
        assert resp.id == 13 and bytes(data) == payload
        # the watched descriptor readable: a 10 s spin ends at once
        r, w = os.pipe()
        os.write(w, b"x")
        t, _ = answer_later(reply(14), 1, 0.3)
        t0 = time.monotonic()
        parts, status, _ = _spun(conn, 14, 0, b"n", ranges, 10.0, r)
        assert status == protocol.CLIENT.WANTED and time.monotonic() - t0 < 2
        with trio.fail_after(5):
            resp, _ = await conn.recv(pb.Response)
        t.join()
        assert resp.id == 14
        os.close(r)
        os.close(w)
        # an oversized frame: recv refuses it (and the caller closes the connection)
        t, _ = answer_later(PREFIX.pack(1 << 30, 0))
        parts, status, _ = _spun(conn, 15, 0, b"n", ranges, 5.0)
        t.join()
        assert status == protocol.CLIENT.FRAME
        with pytest.raises(protocol.ProtocolError):
            await conn.recv(pb.Response)
        conn.close()
        # the peer closes
        a, b = socket.socketpair()
        conn = Connection(b, 4096)
        t = threading.Thread(target=lambda: (asked(), a.shutdown(socket.SHUT_RDWR)))
        t.start()
        parts, status, _ = _spun(conn, 16, 0, b"n", ranges, 5.0)
        t.join()
        assert parts is None and status == protocol.CLIENT.CLOSED
        a.close()
        conn.close()
    trio.run(main)


def _spy_spun(monkeypatch) -> list:
    """From now on, record the statuses of each batch of requests the transport sends
    and takes in C (protocol.read_spun)."""
    batches, real = [], tcp.read_spun

    def spy(requests, *args, **kw):
        out = real(requests, *args, **kw)
        batches.append([status for _, status, _, _ in out])
        return out
    monkeypatch.setattr(tcp, "read_spun", spy)
    return batches


@needs_client
def test_reads_through_the_c_client_match_the_python_path(tmp_path, monkeypatch):
    """Small reads of a stripe over real node servers give the same bytes with the C
    client and without it (tcp.CLIENT None: the Python path), and the C client did
    take the replies; a corrupt block is caught either way; a pooled connection the
    node closed is replaced, the node not marked down."""
    data = os.urandom(3 << 20)
    spans = [(0, 4096), (4000, 200), (1 << 20, 4096), ((1 << 20) - 100, 300),
             (len(data) - 4096, 4096), (12345, 60_000)]
    taken = _spy_spun(monkeypatch)
    # (a loaded machine: no reply comes too late for the spin, or for a hedge)
    monkeypatch.setattr(client_mod, "HEDGE_MIN", 10.0)

    async def body(nodes, client):
        st = await client.write_stripe(21, data)
        for native in (True, False, True):
            monkeypatch.setattr(tcp, "CLIENT", protocol.CLIENT if native else None)
            del taken[:]
            for off, n in spans:
                assert bytes(await client.read(21, st, off, n)) == data[off:off + n]
            if native:
                assert taken == [[protocol.CLIENT.REPLY]] * len(spans)
            else:
                assert taken == []
        # a read of two fragments sends both requests before either waits: not in C
        # (it would hold the event loop, and the other read's task, until answered)
        del taken[:]
        bs = st.frag_len - LIB_HEADER
        assert bytes(await client.read(21, st, bs - 2048, 4096)) == data[bs - 2048:bs + 2048]
        assert taken == []
        assert client.stats["degraded_reads"] == 0
        # a pooled connection the node closed: a fresh one, no degraded read
        dev = st.devices[0]
        for conn in nodes.transport.device_node[dev].idle:
            conn.sock.shutdown(socket.SHUT_RDWR)
        assert bytes(await client.read(21, st, 8192, 4096)) == data[8192:12288]
        assert nodes.transport.is_up(dev) and client.stats["degraded_reads"] == 0
        # corruption is caught on the C client's replies too
        path = nodes.stores[dev]._file(fr.fragment_name(21, 0))
        geo = fr.geometry(st.frag_version, st.frag_len)
        with open(path, "r+b") as f:
            f.seek(geo.data_offset + 8192 + 500)
            f.write(b"\xde\xad")
        assert bytes(await client.read(21, st, 8192, 4096)) == data[8192:12288]
        assert client.stats["corrupt_fragments"] == 1, (client.stats, nodes.damage)
    with use_settings(spin=2.0):  # (a loaded machine: no reply comes too late)
        run_with_nodes(tmp_path, body)


@needs_client
def test_c_client_takes_several_replies_at_once(tmp_path, monkeypatch):
    """A degraded small read's k requests go out together and their replies are taken
    in C (protocol.read_spun with k requests): with two nodes stopped, small reads of
    their fragments are rebuilt from k others right, each such read one batch of k
    plain replies; of two peers, the one that answers late is left to recv."""
    data = os.urandom(4 << 20)
    batches = _spy_spun(monkeypatch)
    monkeypatch.setattr(client_mod, "HEDGE_MIN", 10.0)

    async def body(nodes, client):
        st = await client.write_stripe(31, data)
        for off in range(0, 1 << 20, 256 << 10):  # the tables, while all are up
            await client.read(31, st, off, 4096)
        for i in (0, 1):  # the nodes of data fragments 0 and 1 stop answering
            dev = st.devices[i]
            nodes.stop(dev)
            for conn in nodes.transport.device_node[dev].idle:
                conn.close()
            nodes.transport.device_node[dev].idle.clear()
            nodes.transport.device_node[dev].down_until = math.inf
        del batches[:]
        for off in (8192, (1 << 20) + 4096 * 7):
            assert bytes(await client.read(31, st, off, 4096)) == data[off:off + 4096]
        assert batches == [[protocol.CLIENT.REPLY] * 4] * 2
        assert client.stats["ranges_rebuilt"] == 2
    with use_settings(spin=2.0):  # (a loaded machine: no reply comes too late)
        run_with_nodes(tmp_path, body)

    # two peers, one quick and one late
    async def main():
        pairs = [socket.socketpair() for _ in range(2)]
        conns = [Connection(b, 64 << 10) for _, b in pairs]
        late = threading.Event()

        def answer(sock, rid, wait):
            BlockingConnection(sock, 4096).recv(pb.Request)
            if wait:
                assert late.wait(10)
            sock.sendall(_frame(pb.Response(id=rid, lengths=[3]).SerializeToString(), b"abc"))
        threads = [threading.Thread(target=answer, args=(pairs[0][0], 1, False)),
                   threading.Thread(target=answer, args=(pairs[1][0], 2, True))]
        for t in threads:
            t.start()
        got = protocol.read_spun([(conns[0], 1, 0, b"a", [(0, 3)]),
                                  (conns[1], 2, 0, b"b", [(0, 3)])], 0.3)
        late.set()
        assert [g[1] for g in got] == [protocol.CLIENT.REPLY, protocol.CLIENT.SPUN]
        assert bytes(got[0][0][0]) == b"abc" and got[0][3] < 0.3
        with trio.fail_after(5):
            resp, payload = await conns[1].recv(pb.Response)
        assert resp.id == 2 and bytes(payload) == b"abc"
        for t in threads:
            t.join()
        for (a, _), c in zip(pairs, conns):
            a.close()
            c.close()
    trio.run(main)


# -- a direct client's batch, pipelined in C (protocol.read_batch) ----------------------
@needs_client
def test_c_client_pipelines_a_batch_on_one_connection():
    """read_batch sends a connection's requests at once (the frames read_frame builds,
    one after another) and takes their replies in order, whole or split across
    receives; at an error reply it stops (FRAME) with the replies before it taken and
    the rest left; a peer that closes is CLOSED, one that does not answer SPUN; a
    connection whose buffer is short for the replies gets a larger one for the batch."""
    reqs = [(11, 2, b"f.0", [(0, 3)]), (12, 2, b"f.1", [(5, 2), (9, 1)]),
            (13, 3, b"f.2", [(0, 4)])]
    pairs = [socket.socketpair() for _ in range(4)]
    conns = [Connection(b, 64 << 10) for _, b in pairs]
    for _, b in pairs:
        b.setblocking(False)
    seen = []

    def peer(sock, n, replies, close=False):
        want = b"".join(protocol.CLIENT.read_frame(*r) for r in reqs)
        got = b""
        while len(got) < len(want):
            got += sock.recv(1 << 16)
        seen.append(got == want)
        for r in replies[:n]:
            for i in range(0, len(r), 5):  # (in pieces: several receives)
                sock.sendall(r[i:i + 5])
                time.sleep(0.001)
        if close:
            sock.close()

    ok = [_frame(pb.Response(id=11, lengths=[3]).SerializeToString(), b"abc"),
          _frame(pb.Response(id=12, lengths=[2, 1]).SerializeToString(), b"xyz"),
          _frame(pb.Response(id=13, lengths=[4]).SerializeToString(), b"1234")]
    bad = ok[:1] + [_frame(pb.Response(id=12, errno=2, error="gone").SerializeToString())]
    threads = [threading.Thread(target=peer, args=a) for a in (
        (pairs[0][0], 3, ok), (pairs[1][0], 2, bad), (pairs[2][0], 1, ok, True),
        (pairs[3][0], 0, ok))]
    for t in threads:
        t.start()
    got = protocol.read_batch([(c, reqs) for c in conns], 1.0)
    for t in threads:
        t.join(10)
    assert seen == [True] * 4
    C = protocol.CLIENT
    assert [status for status, _ in got] == [C.REPLY, C.FRAME, C.CLOSED, C.SPUN]
    assert [[bytes(p) for p in parts] for parts in got[0][1]] == \
        [[b"abc"], [b"xy", b"z"], [b"1234"]]
    assert [len(replies) for _, replies in got] == [3, 1, 1, 0]
    assert bytes(got[1][1][0][0]) == b"abc"
    # replies that the connection's buffer cannot hold: it grows for the batch
    a, b = socket.socketpair()
    b.setblocking(False)
    small = Connection(b, 4096)
    big = [(21 + i, 1, b"g.%d" % i, [(0, 3000)]) for i in range(4)]
    blobs = [os.urandom(3000) for _ in big]

    def answer():
        BlockingConnection(a, 4096).recv(pb.Request)  # (the first; the rest buffered)
        for (rid, *_), blob in zip(big, blobs):
            a.sendall(_frame(pb.Response(id=rid, lengths=[3000]).SerializeToString(), blob))
    t = threading.Thread(target=answer)
    t.start()
    ((status, replies),) = protocol.read_batch([(small, big)], 10.0)
    t.join(10)
    assert status == protocol.CLIENT.REPLY
    assert [bytes(p[0]) for p in replies] == blobs and len(small._buf) == 4096
    a.close()
    b.close()
    # the error reply is still there for the Python parser
    resp, _ = trio.run(conns[1].recv, pb.Response)
    assert resp.id == 12 and resp.errno == 2
    for a, b in pairs:
        a.close()
        b.close()


def test_batched_reads_with_and_without_the_c_client(tmp_path, monkeypatch):
    """A batch (read_many(batch=True)) of small reads of every fragment of two stripes
    over real node servers gives the Python path's bytes, sent in C where the C client
    is built (several requests on a connection) and not where it is absent (tcp.CLIENT
    None); with a node stopped and its connections gone, the reads of its fragments
    fail with DeviceError, the others are right."""
    data = os.urandom(3 << 20)
    calls = []
    if protocol.CLIENT is not None:
        real = tcp.read_batch

        def spy(groups, wait):
            calls.append(sum(len(r) for _, r in groups))
            return real(groups, wait)
        monkeypatch.setattr(tcp, "read_batch", spy)

    async def body(nodes, client):
        sts = [await client.write_stripe(sid, data) for sid in (41, 42)]
        reads = [(st.devices[i], fr.fragment_name(sid, i), [(LIB_HEADER + off, n)], None)
                 for sid, st in zip((41, 42), sts) for i in range(len(st.devices))
                 for off, n in ((0, 4096), (8192 + 17, 3000), (1 << 19, 1))]
        t = nodes.transport
        # (the Python path first: these nodes share the loop that C holds, so they
        # must have taken the connections before; real nodes are processes of their
        # own: a fresh client's first batch is test_t8_client's)
        monkeypatch.setattr(tcp, "CLIENT", None)
        want = [[bytes(p) for p in parts] for parts in await t.read_many(reads)]
        assert calls == [] and len(want) == len(reads) == 36
        for native in (True, True, False):
            monkeypatch.setattr(tcp, "CLIENT", protocol.CLIENT if native else None)
            del calls[:]
            got = await t.read_many(reads, batch=True)
            assert [[bytes(p) for p in parts] for parts in got] == want
            if native and protocol.CLIENT is not None:
                assert sum(calls) == len(reads)
            else:
                assert calls == []
        dev = sts[0].devices[1]
        nodes.stop(dev)
        node = t.device_node[dev]
        for conn in node.idle:
            conn.sock.shutdown(socket.SHUT_RDWR)
        for native in (True, False):
            monkeypatch.setattr(tcp, "CLIENT", protocol.CLIENT if native else None)
            got = await t.read_many(reads, batch=True)
            for (d, *_), w, g in zip(reads, want, got):
                if d == dev:
                    assert isinstance(g, DeviceError)
                else:
                    assert [bytes(p) for p in g] == w
    run_with_nodes(tmp_path, body)
