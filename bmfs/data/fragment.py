"""The fragment format on a device, byte by byte (revision 1).

=======  ====  ============================================================
offset   size  field
=======  ====  ============================================================
0        4     magic ``BMFR``
4        1     format version (1)
5        1     fragment index (0..k+m-1; < k is a data fragment)
6        1     k
7        1     m
8        8     stripe id (little-endian)
16       4     payload length P (the pyeclib fragment, its 80-byte header included)
20       4     checksum block size S (4096)
24       4     number of blocks N = ceil(P / S)
28       4     crc32c of bytes [0, 28) and of the block table
32       4*N   crc32c of each S-byte block of the payload (the last may be short)
32+4N    P     payload
=======  ====  ============================================================

Per-block checksums let a 4 KiB read verify just the blocks it touches; every read
checks the header and the blocks it returns. A whole block table is computed by one
call of the C helper when it is built (bmfs/data/native.py), else block by block.
"""
from __future__ import annotations

import array
import struct
import sys

from crc32c import crc32c

from .native import NATIVE

MAGIC = b"BMFR"
VERSION = 1
BLOCK = 4096
_HEAD = struct.Struct("<4sBBBBQIII")
HEAD_FIXED = _HEAD.size + 4  # 32


class CorruptFragment(Exception):
    """A fragment failed its checks; the message says which check."""


def header_length(payload_length: int) -> int:
    return HEAD_FIXED + 4 * ((payload_length + BLOCK - 1) // BLOCK)


def block_table(data, native=NATIVE) -> bytes:
    """The crc32c of each BLOCK-byte block of ``data``, as little-endian uint32s."""
    if native is not None:
        return native.crc32c_blocks((data,), BLOCK)
    mv = memoryview(data)
    n = (len(mv) + BLOCK - 1) // BLOCK
    return struct.pack("<%dI" % n, *(crc32c(mv[i * BLOCK:(i + 1) * BLOCK]) for i in range(n)))


def build_header(sid: int, index: int, k: int, m: int, payload) -> bytes:
    table = block_table(payload)
    n = len(table) // 4
    fixed = _HEAD.pack(MAGIC, VERSION, index, k, m, sid, len(payload), BLOCK, n)
    return fixed + struct.pack("<I", crc32c(table, crc32c(fixed))) + table


def parse_header(buf, sid: int, index: int, payload_length: int) -> tuple[int, ...]:
    """Check a header read from a device; return the block checksum table."""
    if len(buf) < HEAD_FIXED:
        raise CorruptFragment("truncated header")
    magic, ver, idx, _k, _m, fsid, plen, bsize, n = _HEAD.unpack_from(buf)
    if magic != MAGIC or ver != VERSION:
        raise CorruptFragment("bad magic or version")
    if fsid != sid or idx != index or plen != payload_length or bsize != BLOCK:
        raise CorruptFragment("header names another fragment")
    if len(buf) < HEAD_FIXED + 4 * n:
        raise CorruptFragment("truncated block table")
    table = bytes(buf[HEAD_FIXED:HEAD_FIXED + 4 * n])
    (hcrc,) = struct.unpack_from("<I", buf, _HEAD.size)
    if crc32c(table, crc32c(bytes(buf[:_HEAD.size]))) != hcrc:
        raise CorruptFragment("header checksum mismatch")
    return struct.unpack("<%dI" % n, table)


def header_names(buf, sid: int, index: int) -> bool:
    """Whether ``buf`` starts with a fragment header of fragment ``index`` of stripe
    ``sid`` (magic, version and names only: a pool uses it to tell which of two
    slots claiming one extent after a crash owns it)."""
    if len(buf) < _HEAD.size:
        return False
    magic, ver, idx, _k, _m, fsid, *_ = _HEAD.unpack_from(buf)
    return magic == MAGIC and ver == VERSION and fsid == sid and idx == index


def is_parity(buf) -> bool:
    """Whether ``buf`` starts with the header of a parity fragment (index >= k)."""
    if len(buf) < 8 or bytes(buf[:4]) != MAGIC:
        return False
    return buf[5] >= buf[6]


def check_blocks(table, first_block: int, data, native=NATIVE) -> None:
    """Verify ``data``, which starts at block ``first_block`` of the payload.
    ``table``: the block checksums (a tuple, or an array of uint32 in machine order)."""
    mv = memoryview(data)
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


def fragment_name(sid: int, index: int) -> str:
    return "%016x.%d" % (sid, index)
