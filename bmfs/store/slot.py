"""The 64-byte index slot that names one fragment's extent, shared by the pmem pool
file (``pmem.py``) and a pool directory's ``index`` file (``pool.py``).

Little-endian: state u8 (1 = live), name length u8, reserved u16, name (28 bytes),
data offset u64, length u64, crc32c u32 of the slot's first 48 bytes, 12 reserved
bytes. A zeroed slot is free; a slot whose checksum fails was torn and counts as free.
"""
from __future__ import annotations

import struct

from crc32c import crc32c

SLOT = struct.Struct("<BBH28sQQI12x")
SLOT_SIZE = 64


def pack_slot(name: str, off: int, length: int) -> bytes:
    """A live index slot naming fragment ``name`` at ``off``, ``length`` bytes."""
    raw_name = name.encode()
    if len(raw_name) > 28:
        raise ValueError(f"fragment name too long for a pool slot: {name}")
    body = SLOT.pack(1, len(raw_name), 0, raw_name, off, length, 0)
    return body[:48] + struct.pack("<I", crc32c(body[:48])) + body[52:]


def unpack_slot(raw: bytes) -> tuple[str, int, int] | None:
    """``(name, offset, length)`` of a live, intact slot; None for a free or torn one."""
    state, nlen, _, name, off, length, crc = SLOT.unpack(raw)
    if state == 1 and crc == crc32c(raw[:48]) and nlen <= 28:
        return name[:nlen].decode(), off, length
    return None
