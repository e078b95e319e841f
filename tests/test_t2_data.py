"""Level 2: the data path over in-process devices, with broken, wiped and corrupt ones."""
import os
import random
import time

import pytest
import trio

from bmfs.data.client import DataClient
from bmfs.errors import IOFailure, NoSpace
from bmfs.format.records import EC, INLINE
from bmfs.store.file import FileStore
from bmfs.transport.local import LocalTransport


def make(tmp_path, k=4, m=2, inline=16 << 10):
    stores = {}
    for d in range(k + m):
        FileStore.format(str(tmp_path / f"d{d}"), "vol", d)
        stores[d] = FileStore(str(tmp_path / f"d{d}"), "vol", d)
    damage = []
    client = DataClient(LocalTransport(stores), list(stores), k, m, inline,
                        on_damage=lambda *a: damage.append(a))
    return client, stores, damage


def frag_path(store, sid, i):
    return store._file("%016x.%d" % (sid, i))


def test_roundtrip_and_ranges(tmp_path):
    client, stores, damage = make(tmp_path)
    data = os.urandom(4 << 20)

    async def main():
        st = await client.write_stripe(7, data)
        assert st.kind == EC and len(st.devices) == 6
        assert await client.read(7, st, 0, len(data)) == data
        for off, n in [(0, 1), (4095, 2), (1 << 20, 4096), ((1 << 20) - 10, 20), (len(data) - 5, 100)]:
            assert await client.read(7, st, off, n) == data[off:off + n]
        small = await client.write_stripe(8, b"tiny")
        assert small.kind == INLINE and await client.read(8, small, 1, 2) == b"in"
    trio.run(main)
    assert damage == [] and client.stats["degraded_reads"] == 0


def test_degraded_read_two_devices_wiped(tmp_path):
    client, stores, damage = make(tmp_path)
    data = os.urandom(3_000_000)

    async def main():
        st = await client.write_stripe(9, data)
        for i in (0, 2):
            os.unlink(frag_path(stores[st.devices[i]], 9, i))
        assert await client.read(9, st, 0, len(data)) == data
        assert await client.read(9, st, 100, 5000) == data[100:5100]
        os.unlink(frag_path(stores[st.devices[5]], 9, 5))
        assert await client.read(9, st, 7, 9) == data[7:16]  # decoded stripe is cached
        client._decoded.clear()
        with pytest.raises(IOFailure, match="only 3 of 6"):
            await client.read(9, st, 0, 10)
    trio.run(main)
    assert client.stats["degraded_reads"] >= 2
    assert {(s, i) for s, i, _ in damage} >= {(9, 0), (9, 2)}


def test_corrupt_fragment_detected_and_never_returned(tmp_path):
    client, stores, damage = make(tmp_path)
    data = os.urandom(2_000_000)

    async def main():
        st = await client.write_stripe(11, data)
        p = frag_path(stores[st.devices[1]], 11, 1)
        with open(p, "r+b") as f:
            f.seek(os.path.getsize(p) - 1000)
            f.write(b"\xff" * 8)
        assert await client.read(11, st, 0, len(data)) == data
        # a header byte too
        p = frag_path(stores[st.devices[0]], 11, 0)
        with open(p, "r+b") as f:
            f.seek(10)
            f.write(b"\x00")
        assert await client.read(11, st, 0, len(data)) == data
    trio.run(main)
    reasons = " ".join(r for _, _, r in damage)
    assert "corrupt" in reasons and client.stats["corrupt_fragments"] >= 2


def test_writes_survive_lost_devices_until_fewer_than_k(tmp_path):
    client, stores, damage = make(tmp_path)

    async def main():
        data = os.urandom(100_000)
        stores[0] = FileNotFoundError("device gone")
        stores[1] = FileNotFoundError("device gone")
        st = await client.write_stripe(12, data)
        # every fragment stored, two of them doubled up on live devices until repair
        assert 0xFFFF not in st.devices and not {0, 1} & set(st.devices)
        assert len(client.needs_repair(st)) == 2
        assert await client.read(12, st, 0, len(data)) == data
        stores[2] = FileNotFoundError("device gone")
        with pytest.raises(NoSpace, match="on 3 devices"):
            await client.write_stripe(13, data)
    trio.run(main)


def test_placement_spreads_over_failure_domains():
    from bmfs.data.placement import place_available
    devices = list(range(9))
    domains = {d: f"rack{d % 3}" for d in devices}
    load = {d: 0 for d in devices}
    for sid in range(1, 3001):
        devs = place_available(sid, devices, 3, domains)
        assert len({domains[d] for d in devs}) == 3, devs   # one fragment per rack
        for d in devs:
            load[d] += 1
    assert max(load.values()) < 1.25 * min(load.values())  # spread evenly
    # 6 fragments over 3 racks: two per rack, never two on one device
    for sid in range(1, 200):
        devs = place_available(sid, devices, 6, domains)
        assert len(set(devs)) == 6
        assert sorted(domains[d] for d in devs).count("rack0") == 2
    # fewer devices than fragments: every fragment still placed
    assert len(place_available(5, [1, 2], 3, {1: "a", 2: "b"})) == 3


class SlowStore(FileStore):
    """A device whose reads stall (a failing disk): each read takes ``delay`` seconds."""
    delay = 0.0

    def read_parts(self, name, ranges, into=None):
        import time
        time.sleep(self.delay)
        return super().read_parts(name, ranges, into)


def test_small_reads_inline_unless_device_slow_or_stalled(tmp_path):
    """A small read is served on the event loop (concurrent ones too, one after the
    other); a large one goes to a worker thread. A slow device (reads slower than a
    thread hop) is read inline only while nothing else waits; a device that stalled
    is read from threads for a while. Every path returns the same bytes."""
    stores = {}
    for d in range(6):
        FileStore.format(str(tmp_path / f"d{d}"), "vol", d)
        stores[d] = SlowStore(str(tmp_path / f"d{d}"), "vol", d)
    transport = LocalTransport(stores)
    client = DataClient(transport, list(stores), 4, 2, 1024)
    data = os.urandom(4 << 20)
    r, w = os.pipe()
    transport.watch_requests(r)  # stands for the FUSE device: written = a request waits

    async def main():
        st = await client.write_stripe(5, data)
        stats = transport.stats
        inline, threads = stats["inline_reads"], stats["thread_reads"]

        def counts(i, t):
            assert (stats["inline_reads"] - inline, stats["thread_reads"] - threads) == (i, t)

        assert await client.read(5, st, 8192, 4096) == data[8192:12288]
        counts(1, 0)
        assert await client.read(5, st, 0, 1 << 20) == data[:1 << 20]  # large: a thread
        counts(1, 1)

        out = {}

        async def one(i, at=0):
            out[i] = await client.read(5, st, at + 100 * i, 50)
        async with trio.open_nursery() as nursery:  # several at once: each inline
            for i in range(1, 3):
                nursery.start_soon(one, i)
        assert out == {i: data[100 * i:100 * i + 50] for i in range(1, 3)}
        counts(3, 1)
        transport._latency.clear()    # (no cold read of this disk counted: all fast)
        os.write(w, b"x")             # a request waits: a fast device is still inline
        assert await client.read(5, st, 200, 50) == data[200:250]
        counts(4, 1)
        os.read(r, 1)

        dev = st.devices[0]
        stores[dev].delay = 0.003     # slow, not stalling: inline while alone ...
        for i in range(8):
            assert await client.read(5, st, 1000 + i, 50) == data[1000 + i:1050 + i]
        counts(12, 1)
        os.write(w, b"x")
        assert await client.read(5, st, 300, 50) == data[300:350]  # ... not while one waits
        counts(12, 2)
        os.read(r, 1)                 # alone again: inline
        assert await client.read(5, st, 400, 50) == data[400:450]
        counts(13, 2)
        out.clear()                   # nor while a read is under way in a thread
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.read, 5, st, 0, 1 << 20)  # large: a thread
            while not transport._threaded:
                await trio.sleep(0)
            for i in range(1, 4):
                nursery.start_soon(one, i, 7)
        assert out == {i: data[7 + 100 * i:57 + 100 * i] for i in range(1, 4)}
        counts(13, 6)

        stores[dev].delay = 0.03      # the device stalls once: threads from then on,
        inline, threads = stats["inline_reads"], stats["thread_reads"]
        assert await client.read(5, st, 500, 50) == data[500:550]
        counts(1, 0)
        assert await client.read(5, st, 600, 50) == data[600:650]
        counts(1, 1)
        first = transport._stalled[dev] - time.monotonic()
        transport._stalled[dev] = 0.0  # its time out is over; it stalls again: twice as long
        assert await client.read(5, st, 700, 50) == data[700:750]
        counts(2, 1)
        assert transport._stalled[dev] - time.monotonic() > 1.5 * first
        stores[dev].delay = 0.0
        other = st.devices[1]         # other devices are still read inline
        assert await client.read(5, st, (1 << 20) + 10, 50) == data[(1 << 20) + 10:(1 << 20) + 60]
        counts(3, 1)
        assert other != dev

        # a fragment gone from a device read inline: decoded from the others
        os.unlink(stores[other]._file("%016x.%d" % (5, 1)))
        client._tables.clear()
        assert await client.read(5, st, (1 << 20) + 10, 50) == data[(1 << 20) + 10:(1 << 20) + 60]
        assert client.stats["degraded_reads"] >= 1
    try:
        trio.run(main)
    finally:
        os.close(r)
        os.close(w)


def test_singular_choice_of_survivors_decoded_from_others(tmp_path):
    """ISA-L's Vandermonde code is not MDS for m > 4: some choices of k fragments do not
    determine the stripe. With more than k intact, the reads decode from k that do;
    with none such left, the read fails with IOFailure (not pyeclib's error)."""
    from bmfs.native import NATIVE
    client, stores, damage = make(tmp_path, 6, 6)
    data = os.urandom(600_000)

    async def main():
        st = await client.write_stripe(3, data)
        for i in (0, 3, 5, 8, 9):  # 7 left; the first 6 of them, 1 2 4 6 7 10, singular
            os.unlink(frag_path(stores[st.devices[i]], 3, i))
        assert await client.read(3, st, 1000, 4096) == data[1000:5096]
        assert client.stats["ranges_rebuilt"] == (NATIVE is not None)
        assert await client.read(3, st, 0, len(data)) == data
        client._decoded.clear()
        assert await client.read(3, st, 0, len(data)) == data
        os.unlink(frag_path(stores[st.devices[11]], 3, 11))  # the singular 6 are left
        client._decoded.clear()
        for at, n in [(1000, 4096), (0, len(data))]:
            with pytest.raises(IOFailure, match="no 6 of them determine"):
                await client.read(3, st, at, n)
    trio.run(main)


def test_singular_choices_known_to_the_client():
    """The client's model of which k fragments determine a stripe (pick) agrees with
    pyeclib's reconstruct for every choice of 6 of 6+6 fragments."""
    import itertools
    from pyeclib.ec_iface import ECDriver
    from bmfs.data.degraded import pick
    driver = ECDriver(k=6, m=6, ec_type="isa_l_rs_vand")
    frags = driver.encode(os.urandom(1000))
    singular = 0
    for have in itertools.combinations(range(12), 6):
        missing = [i for i in range(6) if i not in have]
        try:
            got = driver.reconstruct([frags[i] for i in have], missing or [0])
            ok = [bytes(g) for g in got] == [frags[i] for i in missing or [0]]
        except Exception:
            ok = False
        assert (pick(6, 6, have) == have) == ok, have
        singular += not ok
    assert singular == 8
    assert pick(6, 6, (1, 2, 4, 6, 7, 10, 11)) == (1, 2, 4, 6, 7, 11)


class CountingStore(FileStore):
    """A device that counts its reads and the bytes they returned."""
    reads = nbytes = 0

    def read_parts(self, name, ranges, into=None):
        type(self).reads += 1
        out = super().read_parts(name, ranges, into)
        type(self).nbytes += sum(map(len, out))
        return out


def test_sequential_small_degraded_reads_decode_the_stripe_once(tmp_path):
    """A sequential reader in small requests of a fragment that must be rebuilt gets the
    stripe decoded once (k fragment reads) from its second request on, not each range
    rebuilt from k others; random small reads still rebuild just their range."""
    from bmfs.native import NATIVE
    stores = {}
    for d in range(6):
        FileStore.format(str(tmp_path / f"d{d}"), "vol", d)
        stores[d] = CountingStore(str(tmp_path / f"d{d}"), "vol", d)
    client = DataClient(LocalTransport(stores), list(stores), 4, 2, 1024)
    data = os.urandom(4 << 20)
    step = 128 << 10

    async def main():
        sts = {}
        for sid in (1, 2):
            st = sts[sid] = await client.write_stripe(sid, data)
            os.unlink(frag_path(stores[st.devices[1]], sid, 1))
        CountingStore.reads = CountingStore.nbytes = 0
        for at in range(0, len(data), step):
            assert await client.read(1, sts[1], at, step) == data[at:at + step]
        # 8 direct, the first of fragment 1 rebuilt (a failed read + 4), then decoded
        # (a failed read + 4 whole fragments): was 64 reads of 8 MiB
        assert CountingStore.reads <= 20 and CountingStore.nbytes < 5.7 * 2**20
        rebuilt = client.stats["ranges_rebuilt"]
        for at in (3 * step, 5 * step, 4 * step, 7 * step):  # random: ranges rebuilt
            at += 1 << 20
            assert await client.read(2, sts[2], at, step) == data[at:at + step]
        assert client.stats["ranges_rebuilt"] - rebuilt == (4 if NATIVE is not None else 0)
        assert (2 in client._decoded) == (NATIVE is None)
    trio.run(main)


def test_concurrent_reads_of_a_stripe_share_one_decode_and_never_strand_a_reader():
    """Read-ahead asks for a stripe being decoded several times at once: the decode
    under way answers them all, its stripe or its failure (they used to decode again
    side by side after a failure, each taking the decoding mark over from the last;
    the first to finish removed another's mark, which then failed with KeyError, and a
    reader that came meanwhile waited for a mark nobody would set, its FUSE request
    stuck). A decode that was cancelled leaves the stripe to one of its waiters."""
    client = DataClient(None, list(range(6)), 4, 2, 4096)
    release = trio.Event()
    calls = []

    async def decode(sid, st, avoid=()):
        calls.append(sid)
        if len(calls) == 1:
            await release.wait()
            raise IOFailure("not this time")
        await trio.sleep(0.05)
        return Decoded(("stripe", len(calls)))

    from bmfs.data.degraded import Decoded
    client._decode_stripe = decode
    got, failed = [], []

    async def reader():
        try:
            got.append(await client._read_degraded(5, None))
        except IOFailure:
            failed.append(1)

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(3):  # the first decodes, two wait for it
                    nursery.start_soon(reader)
                await trio.sleep(0.05)
                release.set()  # the decode fails: all three see it
            assert failed == [1, 1, 1] and not got and len(calls) == 1
            # the next reads decode afresh; one cancelled while decoding hands the
            # stripe to a reader that waited for it
            scopes = []

            async def cancelled_reader():
                with trio.CancelScope() as scope:
                    scopes.append(scope)
                    await client._read_degraded(5, None)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancelled_reader)
                await trio.sleep(0.01)  # it decodes (for 0.05 s)
                nursery.start_soon(reader)  # this one waits for it
                await trio.sleep(0.01)
                scopes[0].cancel()
            assert got == [("stripe", 3)] and len(calls) == 3 and not client._decoding
    trio.run(main)


# -- damaged blocks in several fragments -------------------------------------------------
# Each case: (fragment index, what is done to it) for the fragments of one 4+2 stripe of
# 4 MiB (1 MiB fragments, blocks of 4 KiB), and whether k good copies of every block row
# remain. ("block", j): a byte of payload block j flipped; ("cut", j): the file truncated
# in the middle of block j; "header": a byte of the block table flipped; "padding": a
# byte of the zeros between the table and the payload set (revision 2 has them);
# "long": bytes appended past the payload. Rows with more than m=2 bad copies cannot
# be read (dead_offsets); the others must.
BLOCK_DAMAGE = {
    # the issue's: one bad block in each of three fragments, each at its own row
    "three-rows": [(0, ("block", 3)), (1, ("block", 100)), (2, ("block", 200))],
    "every-fragment": [(0, ("block", 10)), (1, ("block", 10)), (2, ("block", 50)),
                       (3, ("block", 60)), (4, ("cut", 200)), (5, ("block", 120))],
    "header-and-rows": [(0, "header"), (1, ("block", 5)), (2, ("block", 6)),
                        (3, ("block", 7)), (4, ("block", 8)), (5, ("block", 9))],
    "padding-cut-row": [(1, "padding"), (2, ("cut", 150)), (3, ("block", 40)), (0, "long")],
    # block 0: pyeclib's header in revision 2 (no data: readable), data in revision 1
    "block-0": [(0, ("block", 0)), (1, ("block", 0)), (2, ("block", 0)),
                (3, ("block", 20)), (4, ("block", 20))],
    "three-in-a-row": [(0, ("block", 30)), (1, ("block", 30)), (5, ("block", 30)),
                       (2, ("block", 31))],
    "header-cut-row": [(0, "header"), (1, ("cut", 100)), (2, ("block", 150))],
}


def dead_offsets(damage, version, bs, k=4, m=2) -> set[int]:
    """Stripe offsets (4 KiB aligned) of the 4 KiB reads that ``damage`` leaves without
    their bytes: a block bad in its data fragment, in a row with fewer than k good."""
    from bmfs.format import fragment as fr
    geo = fr.geometry(version, bs + 80)
    rows: dict[int, set] = {}
    for i, how in damage:
        hit = range(geo.blocks) if how in ("header", "padding") else () if how == "long" \
            else range(how[1], geo.blocks) if how[0] == "cut" else (how[1],)
        for j in hit:
            rows.setdefault(j, set()).add(i)
    dead = set()
    for j, bad in rows.items():
        p0, p1 = max(geo.block_start(j), 80) - 80, geo.block_start(j + 1) - 80
        if len(bad) > m and p1 > p0:
            for i in bad & set(range(k)):
                dead |= set(range(i * bs + p0 // 4096 * 4096, i * bs + p1, 4096))
    return dead


def damage_fragment(path, how, version):
    """Do ``how`` (see BLOCK_DAMAGE) to the fragment file at ``path``."""
    from bmfs.format import fragment as fr
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(32)
    geo = fr.geometry(version, int.from_bytes(head[16:20], "little"))
    with open(path, "r+b") as f:
        if how == "long":
            f.seek(size)
            f.write(b"\x01" * 10)
        elif how == "header":
            f.seek(fr.HEAD_FIXED + 8)
            b = f.read(1)
            f.seek(fr.HEAD_FIXED + 8)
            f.write(bytes([b[0] ^ 0x40]))
        elif how == "padding":
            assert geo.data_offset > geo.table_end + 10
            f.seek(geo.table_end + 10)
            f.write(b"\x01")
        elif how[0] == "cut":
            f.truncate(geo.data_offset + geo.block_start(how[1]) + 7)
        else:  # a byte of the block flipped
            at = geo.data_offset + geo.block_start(how[1]) + 17
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("case", sorted(BLOCK_DAMAGE))
def test_bad_blocks_in_several_fragments_decode_row_by_row(tmp_path, monkeypatch, case,
                                                           version, native):
    """Bad blocks, damaged headers and padding, truncated and overlong fragments of one
    stripe: where every block row keeps k good copies, reads of every size (4 KiB at
    every block, 128 KiB, the whole stripe) give the stripe's bytes, each row rebuilt
    from k fragments good there, whatever fragments the other bad blocks sit in; the
    damaged fragments are reported. Where some row does not, reads that need it fail
    with IOFailure, the others give the right bytes: never a wrong byte."""
    from bmfs.data import client as client_mod
    from bmfs.data import degraded
    from bmfs.data.codec import Codec
    from bmfs.format import fragment as fr
    if not native:  # as with BMFS_NATIVE=0: pyeclib and Python checksums
        monkeypatch.setattr(degraded, "NATIVE", None)
        for mod in (client_mod, degraded):
            monkeypatch.setattr(mod, "codec", lambda k, m: Codec(k, m, native=None))
    monkeypatch.setattr(fr, "VERSION", version)
    damage = BLOCK_DAMAGE[case]
    if version == 1 and (not native or any(how == "padding" for _, how in damage)):
        pytest.skip("revision 1 has no padding; the Python path is the same for both")
    client, stores, reported = make(tmp_path)
    data = os.urandom(4 << 20)
    bs = 1 << 20  # a data fragment's share of the stripe
    dead = dead_offsets(damage, version, bs)  # 4 KiB reads that cannot be answered
    recoverable = not dead
    assert recoverable == (case not in ("three-in-a-row", "header-cut-row")
                           and (case, version) != ("block-0", 1))

    def fresh():  # nothing remembered from earlier reads
        client._decoded.clear()
        client._tables.clear()
        client._rebuilt_end.clear()

    async def read(off, n):
        fresh()
        if any(o in dead for o in range(off - off % 4096, off + n, 4096)):
            with pytest.raises(IOFailure):
                await client.read(5, st, off, n)
            return
        assert bytes(await client.read(5, st, off, n)) == data[off:off + n], (off, n)

    async def main():
        nonlocal st
        st = await client.write_stripe(5, data)
        assert st.frag_version == version
        for i, how in damage:
            damage_fragment(frag_path(stores[st.devices[i]], 5, i), how, version)
        await read(0, len(data))
        # 4 KiB reads at and around every damaged row of every data fragment, and some
        rows = {how[1] for _, how in damage if how[0] in ("block", "cut")} | {1, 255}
        near = {i * bs + 4096 * (j + d) for i in range(4) for j in rows for d in (-2, -1, 0, 1)}
        rng = random.Random(case)
        for off in sorted(o for o in near if 0 <= o < len(data)) + \
                [rng.randrange(0, len(data), 4096) for _ in range(32)]:
            await read(off, 4096)
        for off in range(0, len(data), 512 << 10):
            await read(off + 1000, 128 << 10)
        if recoverable:  # and one decode serves them all
            client._decoded.clear()
            assert await client.read(5, st, 0, len(data)) == data
            for off in range(0, len(data), 4096):
                assert await client.read(5, st, off, 4096) == data[off:off + 4096]
    st = None
    trio.run(main)
    assert {i for _, i, _ in reported} >= {i for i, _ in damage}
    assert all(why.startswith(("corrupt", "unreadable")) for _, _, why in reported)


def test_padding_and_overlong_fragments_are_damage(tmp_path):
    """Every byte of a fragment file is checked: a nonzero byte in the padding after
    the block table fails the fragment's reads (reported, read around), as a fragment
    longer than its header says fails a whole read of it (scrub's)."""
    client, stores, reported = make(tmp_path)
    data = os.urandom(3 << 20)

    async def main():
        st = await client.write_stripe(6, data)
        damage_fragment(frag_path(stores[st.devices[0]], 6, 0), "padding", 2)
        damage_fragment(frag_path(stores[st.devices[4]], 6, 4), "long", 2)
        assert await client.read(6, st, 100, 4096) == data[100:4196]
        with pytest.raises(fr.CorruptFragment, match="between the block table"):
            await client._read_fragment(6, st, 0)
        with pytest.raises(fr.CorruptFragment, match="longer than its header"):
            await client._read_fragment(6, st, 4)
        await client._read_fragment(6, st, 1)

    from bmfs.format import fragment as fr
    trio.run(main)
    assert {(i, why.split(":")[0]) for _, i, why in reported} == {(0, "corrupt"), (4, "corrupt")}
