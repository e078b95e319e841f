"""Reads of a fragment's payload with its block checksums verified, as the data
client makes them (DataClient, the degraded reads and the direct client's batched
reads): the request a transport sends and verifies where the data is read, and what
becomes of its outcome (damage reported, the table of a verified header kept).
"""
from __future__ import annotations

import array
import sys

from ..errors import DeviceError
from ..format import fragment as fr


class CheckedRead:
    """One read of a fragment's payload blocks with their checksums verified: the
    request (``name``, ``ranges``, ``verify``, run where the data was read) and what
    becomes of its outcome (``outcome``). ``length`` payload bytes from block
    ``first_block`` on; the fragment's header (with its block checksum table) is read
    and verified too, unless ``cached_table`` allows the table of an earlier verified
    read of this fragment (stripes are immutable: a fragment's table never changes).
    ``cut``: (offset, n), the bytes of the blocks that done() returns."""
    __slots__ = ("client", "sid", "index", "dev", "name", "ranges", "key", "table",
                 "read_table", "geo", "first_block", "length", "frag_len", "cut")

    def __init__(self, client, sid, st, index, dev, geo, first_block, length,
                 cached_table=False, cut=None):
        self.client, self.sid, self.index, self.dev = client, sid, index, dev
        self.key = (sid, index)
        self.table = client._tables.hit(self.key) if cached_table else None
        self.read_table = self.table is None
        self.name = fr.fragment_name(sid, index)
        self.geo, self.first_block, self.length = geo, first_block, length
        self.frag_len, self.cut = st.frag_len, cut
        at = (geo.data_offset + geo.block_start(first_block), length)
        # the header with the zeros that pad it to the payload (parse_header checks
        # them: no byte of the file goes unchecked)
        self.ranges = [(0, geo.data_offset), at] if self.read_table else [at]

    def verify(self, parts) -> None:
        """Runs where the data was read (a worker thread, locally)."""
        if self.table is None:
            self._take_table(parts[0])
        if len(parts[-1]) != self.length:
            raise fr.CorruptFragment("truncated payload")
        fr.check_blocks(self.table, self.first_block, parts[-1], self.geo.version)

    def _take_table(self, head) -> None:
        """Check the header read (and its padding) and keep its block table."""
        fr.parse_header(head, self.sid, self.index, self.frag_len, self.geo.version)
        table = array.array("I", bytes(head[fr.HEAD_FIXED:self.geo.table_end]))
        if sys.byteorder != "little":
            table.byteswap()
        self.table = table

    def outcome(self, parts):
        """The verified payload of a read that returned ``parts``; if it failed
        instead (``parts`` is the DeviceError or CorruptFragment), the damage is
        reported and the error raised."""
        client = self.client
        if isinstance(parts, fr.CorruptFragment):
            client._tables.pop(self.key, None)
            client._damaged(self.sid, self.index, f"corrupt: {parts}")
            raise parts
        if isinstance(parts, DeviceError):
            client._damaged(self.sid, self.index, f"unreadable: {parts}")
            raise parts
        if isinstance(parts, BaseException):  # TooSlow: not the fragment's fault
            raise parts
        if self.read_table:
            client._tables.put(self.key, self.table)
        return parts[-1]

    def done(self, blocks):
        """The ``cut`` of the verified blocks: bytes for a small one, else a view (no
        copy of a large read, as a bytes slice would make)."""
        off, n = self.cut
        if n <= 4096:
            return bytes(blocks[off:off + n])
        if off == 0 and len(blocks) == n:
            return blocks
        return memoryview(blocks)[off:off + n]


class WholeRead(CheckedRead):
    """A whole fragment's read that keeps what verifies: its header must (else
    CorruptFragment, as any read's), its blocks need not. ``bad`` lists those that do
    not, a truncated fragment's missing tail among them, so that a decode can take
    each block row from the fragments whose block is good there (row_plan). One byte
    past the payload is asked for too: a fragment longer than its header says is
    damaged (its bytes past the end are covered by nothing) and reported, though its
    blocks are used. outcome() returns (payload, bad, what is wrong with it or "")."""
    __slots__ = ("bad", "longer")

    def __init__(self, client, sid, st, index, dev, geo):
        super().__init__(client, sid, st, index, dev, geo, 0, st.frag_len + 1)
        self.bad, self.longer = [], False

    def verify(self, parts) -> None:
        self._take_table(parts[0])  # (a whole read reads its header)
        payload = parts[-1]
        self.longer = len(payload) > self.frag_len
        self.bad = fr.bad_blocks(self.table, payload, self.frag_len, self.geo.version)

    def outcome(self, parts):
        payload = super().outcome(parts)
        damage = ""
        if self.bad or self.longer:
            damage = describe(self.bad, len(payload), self.frag_len)
            self.client._damaged(self.sid, self.index, "corrupt: " + damage)
        if len(payload) > self.frag_len:
            payload = memoryview(payload)[:self.frag_len]
        return payload, self.bad, damage


def describe(bad: list[int], length: int, payload_length: int) -> str:
    """What is wrong with a fragment whose blocks ``bad`` are bad and of whose payload
    (``payload_length`` bytes) ``length`` bytes were read."""
    out = []
    if length < payload_length:
        out.append(f"truncated payload ({length} of {payload_length} bytes)")
    if bad:
        shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
        out.append(f"block{'s' if len(bad) > 1 else ''} {shown} bad"
                   if length < payload_length else
                   f"block{'s' if len(bad) > 1 else ''} {shown} checksum mismatch")
    if length > payload_length:
        out.append("longer than its header says")
    return "; ".join(out)


class Missing(Exception):
    """The stripe record says this fragment was never stored."""
