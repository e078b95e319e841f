"""Binary encodings of metadata values (inodes, directory entries, slices, stripes).

Each struct is fixed-layout little-endian; the layout is part of FORMAT_REVISION.
"""
from __future__ import annotations

import bisect
import stat
import struct
from dataclasses import dataclass, field

_INODE = struct.Struct("<IIIIQqqqQQII")
_INODE_R3 = struct.Struct("<IIIIQqqqQQ")  # format revisions 1 to 3: no record counts
# ``chunks``/``xattrs`` of an inode whose counts are not known (one written by format
# revision 3 or earlier): nothing is checked against them
UNCOUNTED = 0xFFFFFFFF


@dataclass(slots=True)
class Inode:
    """An inode's attributes, and how many chunk records (``c/``) and xattr records
    (``x/``) the file has in its tree: a read that finds a record missing which the
    count says exists is EIO, not a hole of zeros or a missing attribute (a key
    changed on disk moves its record where no read looks). UNCOUNTED: not known."""
    mode: int
    uid: int = 0
    gid: int = 0
    nlink: int = 1
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    rdev: int = 0
    parent: int = 0  # directories: the directory holding them
    chunks: int = 0
    xattrs: int = 0

    def pack(self) -> bytes:
        return _INODE.pack(self.mode, self.uid, self.gid, self.nlink, self.size,
                           self.atime_ns, self.mtime_ns, self.ctime_ns, self.rdev, self.parent,
                           self.chunks, self.xattrs)

    @classmethod
    def unpack(cls, b: bytes) -> "Inode":
        if len(b) == _INODE_R3.size:
            return cls(*_INODE_R3.unpack(b), UNCOUNTED, UNCOUNTED)
        return cls(*_INODE.unpack(b))

    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    def copy(self) -> "Inode":
        return Inode(self.mode, self.uid, self.gid, self.nlink, self.size,
                     self.atime_ns, self.mtime_ns, self.ctime_ns, self.rdev, self.parent,
                     self.chunks, self.xattrs)

    def count(self, field: str, delta: int) -> None:
        """Add ``delta`` to the count ``field`` ("chunks", "xattrs"), if it is known."""
        n = getattr(self, field)
        if n != UNCOUNTED:
            setattr(self, field, max(n + delta, 0))


_DENTRY = struct.Struct("<QI")


def pack_dentry(ino: int, mode: int) -> bytes:
    return _DENTRY.pack(ino, stat.S_IFMT(mode))


def unpack_dentry(b: bytes) -> tuple[int, int]:
    return _DENTRY.unpack(b)


# A slice: bytes [pos, pos+length) of a chunk come from stripe `sid` at `soff`.
# sid 0 is a hole (zeros). Later slices in the list shadow earlier ones.
_SLICE = struct.Struct("<IIQI")


@dataclass(slots=True)
class Slice:
    pos: int
    length: int
    sid: int
    soff: int


def pack_slices(slices: list[Slice]) -> bytes:
    return b"".join(_SLICE.pack(s.pos, s.length, s.sid, s.soff) for s in slices)


def unpack_slices(b: bytes) -> list[Slice]:
    return [Slice(*t) for t in _SLICE.iter_unpack(b)]


def slice_sids(b: bytes) -> set[int]:
    """The stripe ids a packed slice list refers to (no Slice objects made)."""
    return {t[2] for t in _SLICE.iter_unpack(b)}


SLICE_SIZE = _SLICE.size


def visible(slices: list[Slice], start: int, end: int) -> list[Slice]:
    """The pieces of [start, end) each slice still shows, in offset order.

    Gaps (no slice) are returned as holes (sid 0). Newest slice wins.
    """
    # Paint from newest to oldest. What is still uncovered is a sorted list of
    # disjoint intervals (their starts and ends in two lists); each slice finds the
    # ones it overlaps by bisection. Scanning them all for each slice would be
    # quadratic in Python: a chunk of thousands of small scattered writes would take
    # minutes to compact, on the FUSE loop, and the mount would stop answering. (The
    # splices below still move the lists' tails, but in C: memmoves, cheap next to it.)
    if start >= end:
        return [Slice(start, end - start, 0, 0)]
    us, ue = [start], [end]
    pieces: list[Slice] = []
    for s in reversed(slices):
        if not us:
            break
        lo, hi = s.pos, s.pos + s.length
        i = bisect.bisect_right(ue, lo)  # the first interval ending after lo
        j = bisect.bisect_left(us, hi)   # the first starting at or after hi
        if lo >= hi or i >= j:
            continue
        for a, b in zip(us[i:j], ue[i:j]):
            x, y = max(a, lo), min(b, hi)
            pieces.append(Slice(x, y - x, s.sid, s.soff + (x - lo)))
        # what is left of the first and the last of them
        left_s, left_e = [], []
        if us[i] < lo:
            left_s.append(us[i])
            left_e.append(lo)
        if ue[j - 1] > hi:
            left_s.append(hi)
            left_e.append(ue[j - 1])
        us[i:j], ue[i:j] = left_s, left_e
    pieces.extend(Slice(a, b - a, 0, 0) for a, b in zip(us, ue))
    pieces.sort(key=lambda p: p.pos)
    return pieces


class SliceMap:
    """A chunk's slice list, for reads: ``pieces(start, end)`` is ``visible(slices,
    start, end)``. A list in offset order without overlaps (a file written front to
    back, or compacted: the usual case) is searched by bisection instead of painted
    from its newest slice down: for a 4 KiB read of a 64 MiB chunk of 16 stripes,
    about a third of the time."""
    __slots__ = ("slices", "starts")

    def __init__(self, slices: list[Slice]):
        # a slice of no bytes shows nothing (visible() never returns it): left out, so
        # that it neither breaks the order nor turns up as a piece
        slices = [sl for sl in slices if sl.length > 0]
        self.slices = slices
        starts: list[int] | None = []
        end = 0
        for sl in slices:
            if sl.pos < end:
                starts = None
                break
            starts.append(sl.pos)
            end = sl.pos + sl.length
        self.starts = starts

    def pieces(self, start: int, end: int) -> list[Slice]:
        starts = self.starts
        if starts is None or start >= end:
            return visible(self.slices, start, end)
        slices = self.slices
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        out: list[Slice] = []
        pos = start
        while pos < end and i < len(slices):
            sl = slices[i]
            i += 1
            s_end = sl.pos + sl.length
            if s_end <= pos:
                continue
            if sl.pos >= end:
                break
            if sl.pos > pos:  # a gap before this slice: a hole
                out.append(Slice(pos, sl.pos - pos, 0, 0))
                pos = sl.pos
            hi = min(end, s_end)
            out.append(Slice(pos, hi - pos, sl.sid, sl.soff + (pos - sl.pos)))
            pos = hi
        if pos < end:
            out.append(Slice(pos, end - pos, 0, 0))
        return out


def compact(slices: list[Slice], limit: int) -> list[Slice]:
    """Drop slices fully shadowed by newer ones and cut everything at ``limit``."""
    out = [p for p in visible(slices, 0, limit) if p.sid != 0 or p.length]
    # merge neighbours that continue each other in the same stripe
    merged: list[Slice] = []
    for p in out:
        if p.sid == 0:
            continue
        if merged and merged[-1].sid == p.sid and merged[-1].pos + merged[-1].length == p.pos \
                and merged[-1].soff + merged[-1].length == p.soff:
            merged[-1].length += p.length
        else:
            merged.append(p)
    return merged


INLINE, EC = 0, 1
_STRIPE = struct.Struct("<BBBBII")
NO_DEVICE = 0xFFFF


@dataclass(slots=True)
class Stripe:
    """A stripe: immutable data, either inline in the metadata or erasure-coded.

    ``frag_len`` is the length of each pyeclib fragment (its 80-byte header included);
    ``devices[i]`` holds fragment i (NO_DEVICE if it could not be stored);
    ``frag_version`` is the revision of its fragment files (bmfs/format/fragment.py;
    the record's fourth byte, 0 in records written before revision 2: revision 1).
    """
    kind: int
    length: int
    refs: int = 0
    k: int = 0
    m: int = 0
    frag_len: int = 0
    devices: list[int] = field(default_factory=list)
    data: bytes = b""
    frag_version: int = 1

    def pack(self) -> bytes:
        head = _STRIPE.pack(self.kind, self.k, self.m,
                            self.frag_version if self.kind == EC else 0, self.refs, self.length)
        if self.kind == INLINE:
            return head + self.data
        return head + struct.pack("<I%dH" % len(self.devices), self.frag_len, *self.devices)

    @classmethod
    def unpack(cls, b: bytes) -> "Stripe":
        kind, k, m, fv, refs, length = _STRIPE.unpack_from(b)
        rest = b[_STRIPE.size:]
        if kind == INLINE:
            return cls(INLINE, length, refs, data=bytes(rest))
        n = k + m
        frag_len, *devs = struct.unpack_from("<I%dH" % n, rest)
        return cls(EC, length, refs, k, m, frag_len, list(devs), frag_version=fv or 1)
