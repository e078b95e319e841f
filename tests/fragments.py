"""Fragments on device directories as a failure test sees them, in either layout: a
file per fragment (bmfs/store/file.py) or a pool file and its index (store/pool.py).
Damage is done to the bytes on the device, as a failing disk would, behind the back
of any process that has the device open."""
from __future__ import annotations

import collections
import os
import struct

from bmfs.format import fragment as fr
from bmfs.store.slot import SLOT_SIZE, unpack_slot
from bmfs.store.pool import SPACE_SHIFT, SPACES

Fragment = collections.namedtuple("Fragment", "sid idx dev path offset length")


def on_device(devdir: str, dev: int = -1) -> list[Fragment]:
    """Every fragment the device directory holds, sorted by (stripe, index)."""
    out = []
    frags = os.path.join(devdir, "frags")
    if os.path.isdir(frags):
        for sub in os.listdir(frags):
            for name in os.listdir(os.path.join(frags, sub)):
                if not name.endswith(".tmp"):
                    path = os.path.join(frags, sub, name)
                    out.append(_fragment(name, dev, path, 0, os.path.getsize(path)))
    elif os.path.exists(os.path.join(devdir, "index")):
        with open(os.path.join(devdir, "index"), "rb") as f:
            raw = f.read()
        for at in range(0, len(raw) - SLOT_SIZE + 1, SLOT_SIZE):
            ent = unpack_slot(raw[at:at + SLOT_SIZE])
            if ent is not None:  # an offset's top bits: which file of the pool
                space, off = ent[1] >> SPACE_SHIFT, ent[1] & ((1 << SPACE_SHIFT) - 1)
                out.append(_fragment(ent[0], dev, os.path.join(devdir, SPACES[space]),
                                     off, ent[2]))
    return sorted(out)


def on_volume(volume) -> list[Fragment]:
    """Every fragment on the devices inside a single-machine volume (VOLUME/devN)."""
    out = []
    for name in os.listdir(str(volume)):
        if name.startswith("dev") and name[3:].isdigit():
            out += on_device(os.path.join(str(volume), name), int(name[3:]))
    return sorted(out)


def _fragment(name, dev, path, offset, length) -> Fragment:
    sid_hex, idx = name.split(".")
    return Fragment(int(sid_hex, 16), int(idx), dev, path, offset, length)


def flip(f: Fragment, at: int) -> None:
    """Invert the byte ``at`` bytes into the fragment."""
    with open(f.path, "r+b") as fh:
        fh.seek(f.offset + at)
        b = fh.read(1)
        fh.seek(f.offset + at)
        fh.write(bytes([b[0] ^ 0xFF]))


def revision(f: Fragment) -> int:
    """The fragment format revision its header says (format/fragment.py)."""
    with open(f.path, "rb") as fh:
        fh.seek(f.offset + 4)
        return fh.read(1)[0]


def payload_area(f: Fragment) -> tuple[int, int]:
    """(start, length) of the fragment's payload, from its header (format/fragment.py)."""
    with open(f.path, "rb") as fh:
        fh.seek(f.offset)
        head = fh.read(32)
    plen = struct.unpack_from("<I", head, 16)[0]
    return fr.geometry(head[4], plen).data_offset, plen


def lose(f: Fragment) -> None:
    """The device loses the fragment: its file is gone, or its extent in the pool
    reads as zeros (no header: a read finds no such fragment there)."""
    if f.offset == 0 and os.path.basename(f.path) not in SPACES:
        os.unlink(f.path)
        return
    with open(f.path, "r+b") as fh:
        fh.seek(f.offset)
        fh.write(bytes(f.length))


def empty_device(devdir: str) -> None:
    """The device comes back empty (a replaced disk): its marker stays, every fragment
    is gone."""
    frags = os.path.join(devdir, "frags")
    if os.path.isdir(frags):
        import shutil
        for sub in os.listdir(frags):
            shutil.rmtree(os.path.join(frags, sub))
        return
    for name in ("index",) + SPACES:
        os.truncate(os.path.join(devdir, name), 0)


def intact(f: Fragment) -> bool:
    """Whether the fragment's header names it and every block matches its checksum."""
    with open(f.path, "rb") as fh:
        fh.seek(f.offset)
        raw = fh.read(f.length)
    try:
        if len(raw) < fr.HEAD_FIXED:
            return False
        plen = struct.unpack_from("<I", raw, 16)[0]
        geo = fr.geometry(raw[4], plen)
        table = fr.parse_header(raw, f.sid, f.idx, plen, geo.version)
        if len(raw) != geo.data_offset + plen:
            return False
        fr.check_blocks(table, 0, raw[geo.data_offset:], geo.version)
    except fr.CorruptFragment:
        return False
    return True


def intact_keys(devdir: str) -> set[tuple[int, int]]:
    """(stripe, index) of every intact fragment on the device."""
    return {(f.sid, f.idx) for f in on_device(devdir) if intact(f)}
