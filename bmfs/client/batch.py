"""Batched reads: many (file, offset, length) ranges read with every fragment
request sent at once.

A batch is planned from the files' slice maps (one metadata lookup per file, chunk
and stripe, however many ranges share them), then every range of a healthy stripe
that lies in one data fragment becomes one fragment read, and all of them go to
the transport in one ``read_many`` (TcpTransport: every request is sent before any
reply is awaited, to every node at once; small ones sent and taken in C). A read
that fails (a node down, a corrupt block) is done again by the data client's own
path, which decodes the stripe from any k fragments. Replies are handed back as
they came (views of the reply buffers), or put in the caller's buffers (``out``):
a fragment range that is exactly a piece of the caller's range (block-aligned, as
a sequential reader's 1 MiB reads are) is read straight into its place (local
devices: a preadv into the caller's buffer, verified there), anything else is
copied in once.
"""
from __future__ import annotations

from ..data.checked import Missing as _Missing
from ..data.codec import LIB_HEADER
from ..errors import DeviceError, IOFailure, NotFound
from ..format import fragment as fr
from ..meta import keys
from ..meta import namespace as ns
from ..meta.keys import CHUNK_SIZE
from ..format.records import EC, INLINE, NO_DEVICE, SliceMap, Stripe


async def read_many(files, items, out=None) -> list:
    """``items``: (vfs file handle, offset, length). Returns, item by item, the bytes
    read (bytes, or a memoryview of a reply; shorter at the end of the file); with
    ``out`` (one writable buffer per item, each at least its item's length), the
    bytes are put there instead and their counts returned."""
    plans = []  # per item: list of pieces: bytes, or [sid, st, off, n, result]
    reads = []  # (piece, CheckedRead)
    data = files.data
    txn = files.kv.begin()
    inodes, chunks = {}, {}
    for fh, offset, length in items:
        h = files.handles.get(fh)
        if h is None:
            raise OSError(9, "Bad file descriptor")
        of = h.of
        if of.buf or of.lock.locked() or (of.last_commit is not None
                                          and not of.last_commit.is_set()):
            plans.append([await files.read(fh, offset, length)])  # written here, not stored
            continue
        key = (of.view.id, of.ino)
        i = inodes.get(key)
        if i is None:
            i = inodes[key] = await ns.get_inode(txn, of.view.chain, of.ino)
            if i is None:
                raise NotFound()
        fsize = i.size if of.size is None else max(i.size, of.size)
        end = min(offset + length, fsize)
        pieces = []
        pos = offset
        while pos < end:
            idx, cpos = divmod(pos, CHUNK_SIZE)
            cend = min(end - idx * CHUNK_SIZE, CHUNK_SIZE)
            smap = chunks.get((key, idx))
            if smap is None:
                smap = chunks[(key, idx)] = SliceMap(
                    await ns.get_chunk(txn, of.view.chain, of.ino, idx))
            for p in smap.pieces(cpos, cend):
                pieces.extend(await _plan(files, txn, of, p, reads))
            pos = idx * CHUNK_SIZE + cend
        plans.append(pieces)
    into, into_of = _places(plans, reads, out) if out is not None else (None, None)
    if reads:
        got = await data.transport.read_many(
            [(r.dev, r.name, r.ranges, r.verify) for _, r in reads], batch=True, into=into)
        for (piece, r), parts in zip(reads, got):
            try:
                piece[4] = r.done(r.outcome(parts))
            except (DeviceError, fr.CorruptFragment) as e:
                piece[4] = e
    results = []
    for k, pieces in enumerate(plans):
        bufs = []  # (bytes, whether it is in the caller's buffer already)
        for p in pieces:
            placed = False
            if isinstance(p, list):
                sid, st, off, n, got = p
                if got is None or isinstance(got, Exception):
                    got = await data.read(sid, st, off, n)  # degraded: decoded
                    if len(got) < n:
                        raise IOFailure(f"stripe {sid}: shorter than its slice")
                placed = into is not None and got is into_of.get(id(p))
                p = got
            bufs.append((p, placed))
        if out is None:
            results.append(bufs[0][0] if len(bufs) == 1 else
                           b"".join(b for b, _ in bufs) if bufs else b"")
            continue
        dest, pos = memoryview(out[k]).cast("B"), 0
        for b, placed in bufs:
            n = len(b)
            if not placed:
                dest[pos:pos + n] = b
            pos += n
        results.append(pos)
    return results


def _places(plans, reads, out) -> tuple[list, dict]:
    """Per read of ``reads``, the part of the caller's buffer (``out``) its payload is
    read into, or None: where the read's payload is exactly its piece (it starts on a
    block and ends on one, or at the payload's end); and id(piece) -> that part."""
    where = {}
    for pieces, buf in zip(plans, out):
        dest, pos = memoryview(buf).cast("B"), 0
        for p in pieces:
            n = p[3] if isinstance(p, list) else len(p)
            if isinstance(p, list) and pos + n <= len(dest):
                where[id(p)] = dest[pos:pos + n]
            pos += n
    into, into_of = [], {}
    for piece, r in reads:
        view = where.get(id(piece))
        if view is not None and r.cut == (0, r.length) and len(view) == r.length:
            into_of[id(piece)] = view
        else:
            view = None
        into.append(view)
    return into, into_of


async def _plan(files, txn, of, p, reads) -> list:
    """The pieces of slice ``p``: bytes where nothing is fetched (holes, inline
    data), else [sid, stripe, offset, length, None] whose last item the batch's
    fragment read fills in (one per data fragment the range spans)."""
    if p.sid == 0:
        return [bytes(p.length)]
    st = of.stripes.get(p.sid)
    if st is None:
        raw = await txn.get(keys.stripe(p.sid))
        if raw is None:
            raise IOFailure(f"stripe {p.sid} of inode {of.ino} is missing from the metadata")
        st = of.stripes[p.sid] = Stripe.unpack(raw)
    if st.kind == INLINE:
        data = st.data[p.soff:p.soff + p.length]
        return [data + bytes(p.length - len(data))]
    out = []
    data = files.data
    bs = st.frag_len - LIB_HEADER
    pos, end = p.soff, min(p.soff + p.length, st.length)
    while pos < end:
        i = pos // bs
        stop = min(end, (i + 1) * bs)
        piece = [p.sid, st, pos, stop - pos, None]
        dev = st.devices[i] if st.kind == EC else NO_DEVICE
        if dev != NO_DEVICE and data.transport.is_up(dev) and p.sid not in data._decoded:
            try:
                reads.append((piece, data._range_read(p.sid, st, i,
                                                      LIB_HEADER + pos - i * bs, stop - pos)))
            except _Missing:
                pass
        out.append(piece)
        pos = stop
    if p.soff + p.length > end:
        out.append(bytes(p.soff + p.length - max(end, p.soff)))
    return out
