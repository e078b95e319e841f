"""Level 0: codec, fragment format and slice arithmetic (no I/O)."""
import os
import random

import pytest

from bmfs.format import fragment as fr
from bmfs.data.codec import LIB_HEADER, codec
from bmfs.format.records import (UNCOUNTED, Inode, Slice, SliceMap, Stripe, compact, pack_slices,
                                unpack_slices, visible)


@pytest.mark.parametrize("k,m", [(4, 2), (2, 1), (6, 3)])
@pytest.mark.parametrize("size", [1, 4095, 4096, 100_000, 4 << 20])
def test_decode_from_any_k(k, m, size):
    c = codec(k, m)
    data = os.urandom(size)
    frags = c.encode(data)
    assert len(frags) == k + m
    # systematic: data fragment i holds bytes [i*B, (i+1)*B) after the library header
    b = len(frags[0]) - LIB_HEADER
    for i in range(k):
        assert frags[i][LIB_HEADER:LIB_HEADER + len(data[i * b:(i + 1) * b])] == data[i * b:(i + 1) * b]
    rng = random.Random(size)
    for _ in range(4):
        pick = rng.sample(range(k + m), k)
        assert c.decode([frags[i] for i in pick]) == data


@pytest.mark.parametrize("version", [1, 2])
def test_fragment_header_roundtrip_and_corruption(version):
    payload = os.urandom(3 * fr.BLOCK + 123)
    geo = fr.geometry(version, len(payload))
    head = fr.build_header(77, 3, 4, 2, payload, version)
    assert len(head) == geo.data_offset
    table = fr.parse_header(head, 77, 3, len(payload), version)
    assert len(table) == geo.blocks == (4 if version == 1 else 5)
    fr.check_blocks(table, 0, payload, version)
    fr.check_blocks(table, 2, payload[geo.block_start(2):], version)
    for j in range(geo.blocks):  # every block is checked, block 0 (short in 2) too
        bad = bytearray(payload)
        bad[geo.block_start(j)] ^= 1
        with pytest.raises(fr.CorruptFragment, match=f"block {j}"):
            fr.check_blocks(table, 0, bad, version)
    with pytest.raises(fr.CorruptFragment, match="another fragment"):
        fr.parse_header(head, 78, 3, len(payload), version)
    with pytest.raises(fr.CorruptFragment, match="revision"):  # the record says otherwise
        fr.parse_header(head, 77, 3, len(payload), 3 - version)
    h = bytearray(head)
    h[40] ^= 0xFF  # inside the block table
    with pytest.raises(fr.CorruptFragment, match="header checksum"):
        fr.parse_header(bytes(h), 77, 3, len(payload), version)
    with pytest.raises(fr.CorruptFragment, match="truncated"):
        fr.parse_header(head[:20], 77, 3, len(payload), version)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("version", [1, 2])
def test_bad_blocks_and_padding(version, native):
    """bad_blocks names each block whose bytes do not match, and every block a
    truncated payload does not hold whole; the header's padding must be zeros."""
    from bmfs.native import NATIVE
    impl = NATIVE if native else None
    payload = os.urandom(5 * fr.BLOCK + 321)
    geo = fr.geometry(version, len(payload))
    head = fr.build_header(5, 1, 4, 2, payload, version)
    table = fr.parse_header(head, 5, 1, len(payload), version)
    assert fr.bad_blocks(table, payload, len(payload), version, impl) == []
    bad = bytearray(payload)
    for j in (0, 2, geo.blocks - 1):
        bad[geo.block_start(j + 1) - 1] ^= 0x10
    assert fr.bad_blocks(table, bad, len(payload), version, impl) == [0, 2, geo.blocks - 1]
    for cut in (0, 1, geo.lead, geo.block_start(3), geo.block_start(3) + 5, len(payload) - 1):
        whole = geo.block_of(cut) if cut else 0  # blocks held whole
        assert fr.bad_blocks(table, payload[:cut], len(payload), version, impl) == \
            list(range(whole, geo.blocks)), cut
    if version == 2:
        assert geo.data_offset > geo.table_end
        h = bytearray(head)
        h[geo.data_offset - 1] = 1
        with pytest.raises(fr.CorruptFragment, match="nonzero bytes"):
            fr.parse_header(bytes(h), 5, 1, len(payload), version)
        fr.parse_header(bytes(h)[:geo.table_end], 5, 1, len(payload), version)  # not read


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_rebuild_range_takes_only_the_range(native):
    """Codec.rebuild_range rebuilds bytes [start, end) of missing data fragments from
    k others' same bytes alone: the survivors' bytes elsewhere, their liberasurecode
    headers included, may be anything."""
    from bmfs.data.codec import Codec
    cd = codec(4, 2) if native else Codec(4, 2, native=None)
    data = os.urandom(1 << 20)
    frags = cd.encode(data)
    start, end = LIB_HEADER + 4096, LIB_HEADER + 3 * 4096
    survivors = {}
    for i in (1, 3, 4, 5):
        junk = bytearray(os.urandom(len(frags[i])))
        junk[start:end] = frags[i][start:end]
        survivors[i] = bytes(junk)
    got = cd.rebuild_range(survivors, [0, 2], start, end, len(data))
    assert [bytes(g) for g in got] == [frags[0][start:end], frags[2][start:end]]


@pytest.mark.parametrize("size", [1, 4096, 100_000, 4 << 20])
def test_revision_2_puts_stripe_data_on_pages_of_the_file(size):
    """A 4 KiB read at a 4 KiB offset of the stripe is one page of the fragment file
    and one checksum block (revision 1: two blocks, over three pages)."""
    frags = codec(4, 2).encode(os.urandom(size))
    plen = len(frags[0])
    geo = fr.geometry(2, plen)
    assert (geo.data_offset + LIB_HEADER) % 4096 == 0
    assert geo.data_offset >= geo.table_end
    for x in range(0, plen - LIB_HEADER, 4096):  # stripe data offset x of this fragment
        n = min(4096, plen - LIB_HEADER - x)
        b0, start, length = geo.span(LIB_HEADER + x, n)
        assert (start, length) == (LIB_HEADER + x, n)
        assert (geo.data_offset + start) % 4096 == 0
    old = fr.geometry(1, plen)
    if plen > 8192:
        assert old.span(LIB_HEADER + 4096, 4096)[2] == 8192
    # every payload byte is in exactly one block, blocks in order, none empty
    for g in (geo, old):
        starts = [g.block_start(j) for j in range(g.blocks + 1)]
        assert starts[0] == 0 and starts[-1] == plen and starts == sorted(set(starts))
        assert all(g.block_of(starts[j]) == j and g.block_of(starts[j + 1] - 1) == j
                   for j in range(g.blocks))


def test_records_roundtrip():
    i = Inode(0o100644, 1, 2, 3, 1 << 40, 5, 6, 7, 8, 9, 10, 11)
    assert Inode.unpack(i.pack()) == i
    # an inode of format revision 3 (64 bytes, no record counts) reads as uncounted,
    # and counting an uncounted field leaves it so
    old = Inode.unpack(i.pack()[:64])
    assert (old.chunks, old.xattrs) == (UNCOUNTED, UNCOUNTED) and old.size == 1 << 40
    old.count("chunks", +1)
    i.count("chunks", +1)
    assert old.chunks == UNCOUNTED and i.chunks == 11
    sl = [Slice(0, 10, 5, 0), Slice(4, 2, 6, 100)]
    assert unpack_slices(pack_slices(sl)) == sl
    st = Stripe(1, 5000, 2, 4, 2, 1330, [0, 1, 2, 3, 4, 0xFFFF], frag_version=2)
    assert Stripe.unpack(st.pack()) == st
    old = bytearray(st.pack())  # a record written before revision 2 has a 0 there
    old[3] = 0
    assert Stripe.unpack(bytes(old)).frag_version == 1
    inl = Stripe(0, 3, 1, data=b"abc")
    assert Stripe.unpack(inl.pack()) == inl


def _paint(slices, size):
    out = [0] * size
    for s in slices:
        for j in range(s.length):
            if s.pos + j < size:
                out[s.pos + j] = (s.sid, s.soff + j)
    return out


def _flat_slices(rng):
    """Slices in offset order without overlaps, with gaps (a file written front to back)."""
    out, pos = [], rng.randrange(5)
    for _ in range(rng.randrange(0, 8)):
        n = rng.randrange(0, 15)  # some of no bytes (visible() shows nothing of them)
        out.append(Slice(pos, n, rng.randrange(1, 9), rng.randrange(100)))
        pos += n + rng.choice((0, 0, rng.randrange(1, 6)))
    return out


def test_visible_matches_painting():
    rng = random.Random(1)
    for case in range(1200):
        if case % 2:
            slices = _flat_slices(rng)
        elif case % 4 == 0:
            slices = [Slice(rng.randrange(50), rng.randrange(0, 30), rng.randrange(1, 9),
                            rng.randrange(100)) for _ in range(rng.randrange(1, 8))]
        else:  # many small scattered writes over holes, now and then a large one
            slices = [Slice(rng.randrange(78), rng.choice((1, 2, 3, 5, rng.randrange(40))),
                            rng.randrange(1, 9), rng.randrange(100))
                      for _ in range(rng.randrange(1, 40))]
        a = rng.randrange(60)
        b = rng.randrange(a, 80)
        painted = _paint(slices, 80)
        got = [0] * 80
        pieces = visible(slices, a, b)
        pos = a
        for p in pieces:  # in order, end to end, covering [a, b) once
            assert p.pos == pos and (p.length > 0 or a == b), (slices, a, b, pieces)
            pos += p.length
            for j in range(p.length):
                got[p.pos + j] = (p.sid, p.soff + j) if p.sid else 0
        assert pos == b
        assert got[a:b] == painted[a:b]
        # reads take the same pieces through SliceMap (bisection when flat)
        smap = SliceMap(slices)
        if case % 2:
            assert smap.starts is not None  # searched by bisection
        assert smap.pieces(a, b) == visible(slices, a, b), (slices, a, b)
        c = compact(slices, 80)
        assert _paint(c, 80) == painted
        assert len(c) <= len(slices) + 8
