"""The fragment format on a device, byte by byte (revisions 1 and 2).

=======  ====  ============================================================
offset   size  field
=======  ====  ============================================================
0        4     magic ``BMFR``
4        1     format revision (1 or 2; written: 2)
5        1     fragment index (0..k+m-1; < k is a data fragment)
6        1     k
7        1     m
8        8     stripe id (little-endian)
16       4     payload length P (the pyeclib fragment, its 80-byte header included)
20       4     checksum block size S (4096)
24       4     number of blocks N
28       4     crc32c of bytes [0, 28) and of the block table
32       4*N   crc32c of each block of the payload (the first and last may be short)
32+4N          revision 2: zeros up to the payload offset D (checked by readers)
D        P     payload; revision 1: D = 32+4N
=======  ====  ============================================================

The revisions differ in where the payload's blocks lie:

- revision 1: blocks of S bytes from the payload's start, which follows the table;
- revision 2: block 0 is pyeclib's 80-byte header alone, block j >= 1 the S bytes
  from payload offset 80 + (j-1)S, and D + 80 is a multiple of 4096. So the stripe's
  data (payload offset 80 on) starts on a page of the file and each block is one
  page of it: a 4 KiB read at a 4 KiB offset of a file is one page of one fragment
  and one checksum block. In revision 1 it straddles two blocks (8 KiB over three
  pages, and more than twice the bytes off the disk when read cold).
  It costs up to 4 KiB of zeros per fragment (~0.3% of a 1 MiB one).

A stripe record names the revision of its fragments (``Stripe.frag_version``;
records written before revision 2 say 1). Both are read; new fragments are revision 2.

Per-block checksums let a 4 KiB read verify just the blocks it touches; every read
checks the header (with the padding after it: zeros) and the blocks it returns, so
no byte of the file goes unchecked (a whole read also checks nothing follows the
payload). A whole block table is computed by one
call of the C helper when it is built (bmfs/native.py), else block by block.
"""
from __future__ import annotations

import array
import functools
import struct
import sys

from crc32c import crc32c

from ..native import NATIVE

LIB_HEADER = 80  # liberasurecode's header, the start of each payload (data/codec.py)
MAGIC = b"BMFR"
VERSION = 2          # the revision written
BLOCK = 4096
_HEAD = struct.Struct("<4sBBBBQIII")
HEAD_FIXED = _HEAD.size + 4  # 32
_LEAD = {1: BLOCK, 2: LIB_HEADER}  # revision -> length of block 0


class CorruptFragment(Exception):
    """A fragment failed its checks; the message says which check."""


class Geometry:
    """Where the parts of a fragment of one revision and payload length lie.

    ``table_end``: the header and block table, bytes [0, table_end); ``data_offset``:
    the payload's offset in the file; ``lead``: the length of block 0 (S in revision
    1, pyeclib's header in revision 2); ``blocks``: N."""
    __slots__ = ("version", "payload_length", "lead", "blocks", "table_end", "data_offset")

    def __init__(self, version: int, payload_length: int):
        if version not in _LEAD:
            raise CorruptFragment(f"unknown fragment revision {version}")
        self.version, self.payload_length = version, payload_length
        self.lead = _LEAD[version]
        self.blocks = self.block_of(max(payload_length - 1, 0)) + 1 if payload_length else 0
        self.table_end = HEAD_FIXED + 4 * self.blocks
        if version == 1:
            self.data_offset = self.table_end
        else:  # the stripe's data (after pyeclib's header) on a page boundary
            self.data_offset = -(-(self.table_end + LIB_HEADER) // BLOCK) * BLOCK - LIB_HEADER

    def block_of(self, p: int) -> int:
        """The block holding payload byte ``p``."""
        return 0 if p < self.lead else 1 + (p - self.lead) // BLOCK

    def block_start(self, j: int) -> int:
        """Payload offset of block ``j``'s first byte (``payload_length`` past the end)."""
        return min(0 if j == 0 else self.lead + (j - 1) * BLOCK, self.payload_length)

    def span(self, p0: int, n: int) -> tuple[int, int, int]:
        """The whole blocks holding payload bytes [p0, p0+n): (first block, its payload
        offset, length in bytes)."""
        b0 = self.block_of(p0)
        start = self.block_start(b0)
        return b0, start, self.block_start(self.block_of(p0 + n - 1) + 1) - start


@functools.lru_cache(maxsize=256)
def geometry(version: int, payload_length: int) -> Geometry:
    return Geometry(version, payload_length)


def _blocks(data, lead: int, native=NATIVE) -> bytes:
    """The crc32c of ``data``'s first ``lead`` bytes, then of each BLOCK bytes after
    them, as little-endian uint32s."""
    mv = memoryview(data)
    if lead != BLOCK:
        return struct.pack("<I", crc32c(mv[:lead])) + (_blocks(mv[lead:], BLOCK, native)
                                                       if len(mv) > lead else b"")
    if native is not None:
        return native.crc32c_blocks((mv,), BLOCK)
    n = (len(mv) + BLOCK - 1) // BLOCK
    return struct.pack("<%dI" % n, *(crc32c(mv[i * BLOCK:(i + 1) * BLOCK]) for i in range(n)))


def block_table(data, version: int = VERSION, native=NATIVE) -> bytes:
    """The block checksum table of payload ``data`` in revision ``version``."""
    return _blocks(data, geometry(version, len(data)).lead, native)


def build_header(sid: int, index: int, k: int, m: int, payload, version: int = VERSION) -> bytes:
    """Everything before the payload in the file: header, block table (and in revision
    2 the zeros up to the payload offset)."""
    geo = geometry(version, len(payload))
    table = block_table(payload, version)
    fixed = _HEAD.pack(MAGIC, version, index, k, m, sid, len(payload), BLOCK, geo.blocks)
    head = fixed + struct.pack("<I", crc32c(table, crc32c(fixed))) + table
    return head + bytes(geo.data_offset - len(head))


def parse_header(buf, sid: int, index: int, payload_length: int,
                 version: int = VERSION) -> tuple[int, ...]:
    """Check a header read from a device (its first ``geometry(...).table_end``
    bytes at least; what ``buf`` holds of the padding up to ``data_offset`` must be
    zeros, which readers check by reading it all); return the block checksum table."""
    if len(buf) < HEAD_FIXED:
        raise CorruptFragment("truncated header")
    magic, ver, idx, _k, _m, fsid, plen, bsize, n = _HEAD.unpack_from(buf)
    if magic != MAGIC or ver != version:
        raise CorruptFragment("bad magic or revision")
    if fsid != sid or idx != index or plen != payload_length or bsize != BLOCK \
            or n != geometry(version, plen).blocks:
        raise CorruptFragment("header names another fragment")
    if len(buf) < HEAD_FIXED + 4 * n:
        raise CorruptFragment("truncated block table")
    table = bytes(buf[HEAD_FIXED:HEAD_FIXED + 4 * n])
    (hcrc,) = struct.unpack_from("<I", buf, _HEAD.size)
    if crc32c(table, crc32c(bytes(buf[:_HEAD.size]))) != hcrc:
        raise CorruptFragment("header checksum mismatch")
    geo = geometry(version, plen)
    pad = bytes(buf[geo.table_end:geo.data_offset])  # (what of it ``buf`` holds)
    if pad.count(0) != len(pad):
        raise CorruptFragment("nonzero bytes between the block table and the payload")
    return struct.unpack("<%dI" % n, table)


def header_names(buf, sid: int, index: int) -> bool:
    """Whether ``buf`` starts with a fragment header of fragment ``index`` of stripe
    ``sid`` (magic, revision and names only: a pool uses it to tell which of two
    slots claiming one extent after a crash owns it)."""
    if len(buf) < _HEAD.size:
        return False
    magic, ver, idx, _k, _m, fsid, *_ = _HEAD.unpack_from(buf)
    return magic == MAGIC and ver in _LEAD and fsid == sid and idx == index


def is_parity(buf) -> bool:
    """Whether ``buf`` starts with the header of a parity fragment (index >= k)."""
    if len(buf) < 8 or bytes(buf[:4]) != MAGIC:
        return False
    return buf[5] >= buf[6]


def check_blocks(table, first_block: int, data, version: int = VERSION,
                 native=NATIVE) -> None:
    """Verify ``data``, which starts at block ``first_block`` of the payload and ends
    at a block's end (or the payload's). ``table``: the block checksums (a tuple, or
    an array of uint32 in machine order)."""
    mv = memoryview(data)
    lead = _LEAD[version]
    if first_block == 0 and lead != BLOCK and len(mv):  # revision 2's short block 0
        if crc32c(mv[:lead]) != table[0]:
            raise CorruptFragment("block 0 checksum mismatch")
        mv, first_block = mv[lead:], 1
    n = (len(mv) + BLOCK - 1) // BLOCK
    if native is not None and n > 1:  # one C call; on a mismatch, find the block below
        want = table[first_block:first_block + n]
        if isinstance(want, array.array) and sys.byteorder == "little":
            want = want.tobytes()
        else:
            want = struct.pack("<%dI" % len(want), *want)
        if native.crc32c_blocks((mv,), BLOCK) == want:
            return
    for j in range(0, len(mv), BLOCK):
        if crc32c(mv[j:j + BLOCK]) != table[first_block + j // BLOCK]:
            raise CorruptFragment(f"block {first_block + j // BLOCK} checksum mismatch")


def bad_blocks(table, data, payload_length: int, version: int = VERSION,
               native=NATIVE) -> list[int]:
    """The blocks of a payload of ``payload_length`` bytes that ``data`` (what was
    read of it from its start: shorter if the fragment is truncated) does not hold
    intact: a checksum mismatch, or missing at the end."""
    geo = geometry(version, payload_length)
    mv = memoryview(data)[:payload_length]
    whole = geo.blocks if len(mv) == payload_length else geo.block_of(len(mv))
    crcs = struct.unpack("<%dI" % whole, _blocks(mv[:geo.block_start(whole)], geo.lead,
                                                 native)) if whole else ()
    return [j for j in range(whole) if crcs[j] != table[j]] + list(range(whole, geo.blocks))


def fragment_name(sid: int, index: int) -> str:
    return "%016x.%d" % (sid, index)
