"""Batched reads: many (file, offset, length) ranges read with every fragment
request sent at once.

A batch is planned from the files' slice maps (one metadata lookup per file, chunk
and stripe, however many ranges share them), then every range of a healthy stripe
that lies in one data fragment becomes one fragment read, and all of them go to
the transport in one ``read_many`` (TcpTransport: every request is sent before any
reply is awaited, to every node at once; small ones sent and taken in C). A read
that fails (a node down, a corrupt block) is done again by the data client's own
path, which decodes the stripe from any k fragments. Replies are handed back as
they came (views of the reply buffers), or copied once into the caller's buffers.
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


async def read_many(files, items) -> list:
    """``items``: (vfs file handle, offset, length). Returns, item by item, the bytes
    read (bytes, or a memoryview of a reply; shorter at the end of the file)."""
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
    if reads:
        got = await data.transport.read_many(
            [(r.dev, r.name, r.ranges, r.verify) for _, r in reads], batch=True)
        for (piece, r), parts in zip(reads, got):
            try:
                piece[4] = r.done(r.outcome(parts))
            except (DeviceError, fr.CorruptFragment) as e:
                piece[4] = e
    out = []
    for pieces in plans:
        bufs = []
        for p in pieces:
            if isinstance(p, list):
                sid, st, off, n, got = p
                if got is None or isinstance(got, Exception):
                    got = await data.read(sid, st, off, n)  # degraded: decoded
                    if len(got) < n:
                        raise IOFailure(f"stripe {sid}: shorter than its slice")
                p = got
            bufs.append(p)
        out.append(bufs[0] if len(bufs) == 1 else b"".join(bufs) if bufs else b"")
    return out


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
