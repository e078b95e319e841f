"""Degraded reads: a stripe's bytes from any k of its fragments.

A small range of one fragment is rebuilt from the same range of k others (in C); a
larger read, or a sequential reader's, decodes the stripe whole and keeps the last
few decoded; where some blocks of the fragments read are bad, the stripe is decoded
block row by block row from k fragments whose block is good there. ``DegradedReads``
is a part of :class:`~bmfs.data.client.DataClient`, which provides the healthy read
path (``_read_range``, ``_read_ranges``, ``_read_blocks``), ``transport``, ``stats``
and the caches ``_decoded``, ``_decoding``, ``_rebuilt_end``.
"""
from __future__ import annotations

import functools
import itertools

import trio

from .. import metrics
from ..errors import DeviceError, IOFailure
from ..format import fragment as fr
from ..format.records import NO_DEVICE
from ..native import NATIVE
from ..transport import run_in_thread
from .checked import Missing
from .codec import LIB_HEADER, codec

_DEGRADED = metrics.READS.labels("degraded")
STREAMING = 256 << 10  # a read this large of a degraded stripe decodes the whole stripe


class DegradedReads:
    """Reads that decode (a part of DataClient)."""

    async def _read_decoded(self, sid, st, offset, end, avoid=()):
        """Bytes [offset, end) without the fragments in ``avoid`` or on devices that are
        down: a small range of one fragment rebuilt from the same range of k others
        (_read_rebuilt), anything else from the stripe decoded as a whole
        (_read_degraded, which keeps the last few for the reads that follow), as is a
        small read that follows the last one rebuilt of this stripe (_sequential)."""
        if (end - offset < STREAMING and sid not in self._decoded and sid not in self._decoding
                and not self._sequential(sid, offset, end)):
            out = await self._read_rebuilt(sid, st, offset, end, avoid)
            if out is not None:
                return out
        parts = await self._read_degraded(sid, st, avoid)
        if parts.holes and any(a < end and offset < b for a, b in parts.holes):
            raise IOFailure(f"stripe {sid}: {parts.why}")
        bs = st.frag_len - LIB_HEADER
        first, last = offset // bs, (end - 1) // bs
        if first == last:
            out = parts[first][offset - first * bs:end - first * bs]
        else:
            out = b"".join(parts[i][max(offset, i * bs) - i * bs:min(end, (i + 1) * bs) - i * bs]
                           for i in range(first, last + 1))
        return out if len(out) > 4096 else bytes(out)

    def _sequential(self, sid, offset, end) -> bool:
        """Whether this small read starts where the last small read of this stripe that
        needed a rebuild ended: a sequential reader, who will want the rest of the
        stripe, so it is decoded once (k fragments) rather than each request rebuilt
        from k ranges (in 128 KiB requests: 1.6x the bytes in 5x the device reads).
        Noted when the read starts, so concurrent read-ahead requests count too."""
        last = self._rebuilt_end.get(sid)
        self._rebuilt_end.put(sid, end)
        return last == offset

    async def _read_rebuilt(self, sid, st, offset, end, avoid):
        """Bytes [offset, end) of one data fragment rebuilt from the same payload range
        of k other fragments (the code works byte position by byte position), each read
        and checked as a small read is; None where this does not apply (the range spans
        fragments, no C helper, no k others readable that determine the data): the
        caller decodes the stripe whole, which also says why it failed.

        A random 4 KiB read of a fragment on a dead or slow node costs k reads of 4 KiB
        this way, where decoding the stripe read k whole fragments (4 MiB)."""
        bs = st.frag_len - LIB_HEADER
        i = offset // bs
        if NATIVE is None or (end - 1) // bs != i:
            return None
        p0, n = LIB_HEADER + offset - i * bs, end - offset
        try:
            got, chosen = await self._gather(
                sid, st, avoid, lambda j: self._read_range(sid, st, j, p0, n), skip=i,
                fetch_many=lambda js: self._read_ranges(sid, st, js, p0, n))
        except IOFailure:
            return None
        # rs_rebuild takes whole fragments: the range behind a stand-in library header
        survivors = [(j, bytes(LIB_HEADER) + bytes(got[j])) for j in chosen]
        (out,) = NATIVE.rs_rebuild(st.k, st.m, n, survivors, [i])
        self.stats["degraded_reads"] += 1
        _DEGRADED.inc()
        self.stats["ranges_rebuilt"] += 1
        return bytes(out)

    async def _read_degraded(self, sid, st, avoid=()) -> Decoded:
        """The stripe decoded from k intact fragments, as the k data fragments' payloads
        (views, trimmed to the stripe's length), with the ranges it could not decode.
        Cached if whole: stripes are immutable, so a decoded stripe stays right until
        its id is reused, never. (One with holes is not: its devices may be back.)"""
        while True:
            cached = self._decoded.hit(sid)
            if cached is not None:
                return cached
            busy = self._decoding.get(sid)
            if busy is None:
                break
            # read-ahead asks for the same stripe concurrently: the decode under way
            # answers them all, its stripe or its failure (IOFailure); if it was
            # cancelled instead, look again (one of the waiters decodes)
            await busy.done.wait()
            if busy.error is not None:
                raise busy.error
            if busy.data is not None:
                return busy.data
        mine = self._decoding[sid] = Decoding()
        try:
            mine.data = await self._decode_stripe(sid, st, avoid)
        except Exception as e:
            mine.error = e
            raise
        finally:
            del self._decoding[sid]
            mine.done.set()
        return mine.data if mine.data.holes else self._decoded.put(sid, mine.data)

    async def _decode_stripe(self, sid, st, avoid=()) -> Decoded:
        """The stripe from fragments read whole: from k of them that determine it
        (_gather), or where some blocks of them are bad, block row by block row from
        k whose block is good (decode_rows). With k or more fragments readable but
        some row not determined by them, what the rest determine, and holes where
        the data fragments' own blocks are bad."""
        self.stats["degraded_reads"] += 1
        _DEGRADED.inc()
        k, geo = st.k, fr.geometry(st.frag_version, st.frag_len)
        got, runs = await self._gather(
            sid, st, avoid, lambda i: self._read_blocks(sid, st, i),
            plan=lambda have: row_plan(st.k, st.m, geo, have),
            last=lambda have: row_plan(st.k, st.m, geo, have, partial=True))
        holes, why = [], ""
        chosen = runs[0][2] if len(runs) == 1 else None
        if chosen is None or any(got[i][1] for i in chosen):
            payloads, holes = await run_in_thread(decode_rows, st, geo, got, runs)
            why = row_shortage(st, geo, got) if holes else ""
        else:
            got = {i: got[i][0] for i in chosen}  # k whole fragments, one plan
            payloads = {i: memoryview(got[i])[LIB_HEADER:] for i in range(k) if i in got}
            missing = [i for i in range(k) if i not in got]
            if missing:  # rebuild just the missing data fragments (a full decode: 4x)
                rebuilt = await run_in_thread(codec(st.k, st.m).rebuild_data, got, missing)
                payloads.update(zip(missing, rebuilt))
        # the code is systematic: the stripe is the data fragments' payloads in order
        bs, left, views = st.frag_len - LIB_HEADER, st.length, []
        for i in range(k):
            views.append(memoryview(payloads[i])[:min(bs, left)])
            left -= len(views[-1])
        return Decoded(views, holes, why)

    async def _gather(self, sid, st, avoid, fetch, skip=None, fetch_many=None,
                      plan=None, last=None):
        """index -> ``fetch(index)`` for k intact fragments (but ``skip``) that determine
        the stripe: those on devices that are up and not in ``avoid`` first (data
        fragments before parity: the cheapest decode), the others only as replacements
        for failures. k fetched at once: by ``fetch_many(indexes)`` if given (index ->
        result or the exception it failed with; then replacements one at a time),
        else by k tasks; if they do not determine the stripe (see pick), more one at
        a time until some k do. IOFailure when no k can.

        Returns (index -> result for every fragment fetched, the plan): ``plan``, a
        function of those (called with k or more) that says how they determine the
        stripe, or None if they do not yet (by default the k of them that do, pick);
        with every fragment fetched and none found, ``last(fetched)`` if given (k or
        more fetched) says what to do instead."""
        if plan is None:
            def plan(have):
                return pick(st.k, st.m, tuple(sorted(have)))
        up, rest = [], []
        for i, dev in enumerate(st.devices):
            if i != skip and dev != NO_DEVICE:
                (up if self.transport.is_up(dev) and i not in avoid else rest).append(i)
        candidates = iter(up + rest)
        got: dict[int, bytes] = {}

        async def fetch_one():  # the next candidate that reads intact
            for i in candidates:
                try:
                    got[i] = await fetch(i)
                    return True
                except (DeviceError, fr.CorruptFragment, Missing):
                    continue
            return False

        if fetch_many is not None:
            first = list(itertools.islice(candidates, st.k))
            got.update((i, v) for i, v in (await fetch_many(first)).items()
                       if not isinstance(v, Exception))
            while len(got) < st.k and await fetch_one():
                pass
        else:
            async with trio.open_nursery() as nursery:
                for _ in range(st.k):
                    nursery.start_soon(fetch_one)
        while True:
            found = plan(got) if len(got) >= st.k else None
            if found is not None:
                return got, found
            if not await fetch_one():
                if len(got) < st.k:
                    raise IOFailure(f"stripe {sid}: only {len(got)} of {st.k + st.m} "
                                    f"fragments readable, {st.k} needed")
                if last is not None:
                    return got, last(got)
                raise IOFailure(f"stripe {sid}: {len(got)} of {st.k + st.m} fragments "
                                f"readable but no {st.k} of them determine the data")


class Decoded(tuple):
    """A decoded stripe: the k data fragments' payloads, trimmed to the stripe's
    length; ``holes``, the stripe ranges [start, end) it could not decode (no k good
    copies of their block rows), and ``why``."""

    def __new__(cls, views, holes=(), why=""):
        self = super().__new__(cls, views)
        self.holes, self.why = holes, why
        return self


class Decoding:
    """A stripe's decode under way (DataClient._read_degraded): what it came to, for
    the readers that waited for it."""
    __slots__ = ("done", "data", "error")

    def __init__(self):
        self.done = trio.Event()
        self.data = None
        self.error: Exception | None = None

def row_plan(k: int, m: int, geo, got: dict, partial: bool = False) -> list | None:
    """How the fragments ``got`` (index -> (payload, bad blocks)) determine the stripe,
    block row by block row (the code works byte position by byte position, and
    fragments are cut into blocks alike): runs ``[start, end, chosen]`` of payload
    offsets, over the stripe's data (payload offset LIB_HEADER on), each taken from
    ``chosen``, k fragments whose blocks there are good and that determine them
    (pick: the data fragments where they are good: nothing to rebuild). None if
    some row has no such k, or with ``partial`` a run of that row alone whose
    ``chosen`` is None."""
    order = tuple(sorted(got))
    if not any(b for _, b, _ in got.values()):  # (the usual degraded read: one run)
        chosen = pick(k, m, order)
        if chosen is not None:
            return [[LIB_HEADER, geo.payload_length, chosen]]
        if not partial:
            return None
    bad = {i: frozenset(b) for i, (_, b, _) in got.items()}
    runs: list = []
    for j in range(geo.blocks):
        start, end = max(geo.block_start(j), LIB_HEADER), geo.block_start(j + 1)
        if start >= end:
            continue  # revision 2's block 0: pyeclib's header, no data
        good = tuple(i for i in order if j not in bad[i])
        chosen = pick(k, m, good) if len(good) >= k else None
        if chosen is None and not partial:
            return None
        if runs and chosen is not None and runs[-1][2] == chosen:
            runs[-1][1] = end
        else:
            runs.append([start, end, chosen])
    return runs


def row_shortage(st, geo, got: dict) -> str:
    """Why the fragments ``got`` do not determine the stripe (row_plan found no plan):
    the first block row that no k good blocks determine."""
    k, n = st.k, st.k + st.m
    if not any(bad for _, bad, _ in got.values()):
        return f"{len(got)} of {n} fragments readable but no {k} of them determine the data"
    for j in range(geo.blocks):
        if geo.block_start(j + 1) <= LIB_HEADER:
            continue
        good = tuple(i for i in sorted(got) if j not in got[i][1])
        if len(good) < k:
            return (f"block {j} intact in only {len(good)} of {n} fragments ({len(got)} "
                    f"readable), {k} needed")
        if pick(k, st.m, good) is None:
            return (f"block {j} intact in {len(good)} of {n} fragments but no {k} of them "
                    f"determine the data")
    return f"{len(got)} of {n} fragments readable"  # (not reached: row_plan found a plan)


def decode_rows(st, geo, got: dict, runs: list) -> tuple[dict, list]:
    """The data fragments' payloads (index -> bytes-like, without pyeclib's header)
    from ``got`` (index -> (payload, bad blocks, _)) run by run of ``runs``
    (row_plan): a data fragment's bytes where it is chosen, rebuilt from the run's k
    where not; in a row no k determine, its own where good. And the holes: the
    stripe ranges [start, end) of the rest. Runs in a worker thread."""
    k, n, bs = st.k, st.frag_len, st.frag_len - LIB_HEADER
    holes = []
    out = {i: bytearray(n) for i in range(k)}
    for i in range(k):
        if i in got:  # (what was read of it: a truncated one is shorter)
            out[i][:len(got[i][0])] = got[i][0]
    cd = codec(st.k, st.m)
    for start, end, chosen in runs:
        if chosen is None:  # one row
            j = geo.block_of(start)
            holes += [(i * bs + start - LIB_HEADER, i * bs + end - LIB_HEADER)
                      for i in range(k) if i not in got or j in got[i][1]]
            continue
        missing = [i for i in range(k) if i not in chosen]
        if missing:
            rebuilt = cd.rebuild_range({i: got[i][0] for i in chosen}, missing, start, end,
                                       st.length)
            for i, piece in zip(missing, rebuilt):
                out[i][start:end] = piece
    return {i: memoryview(b)[LIB_HEADER:] for i, b in out.items()}, holes


def _gf_tables():
    """exp and log tables of GF(2^8) with ISA-L's polynomial x^8+x^4+x^3+x^2+1."""
    exp, log, x = [0] * 510, [0] * 256, 1
    for i in range(255):
        exp[i] = exp[i + 255] = x
        log[x] = i
        x = (x << 1) ^ (0x11D if x & 0x80 else 0)
    return exp, log


_EXP, _LOG = _gf_tables()


@functools.lru_cache(maxsize=1024)
def pick(k: int, m: int, have: tuple) -> tuple | None:
    """The first k fragments of ``have`` whose rows of the encode matrix are
    independent, so that they determine the stripe; None when no k are.

    The matrix is ISA-L's gf_gen_rs_matrix, as pyeclib's isa_l_rs_vand and
    rs_rebuild use it: the identity for data fragments, row 2^(a*j) for parity
    fragment k+a. Such a Vandermonde code is not MDS over GF(2^8): with m > 4 some
    choices of k fragments are singular (8 of the 924 of 6+6), and both decoders then
    fail. Data fragments plus one parity fragment never are (its row has no zero)."""
    if len(have) == k and sum(i >= k for i in have) < 2:
        return have  # the usual degraded read
    basis: dict[int, list[int]] = {}  # pivot column -> reduced row, pivot 1
    chosen = []
    for i in have:
        row = [int(i == j) for j in range(k)] if i < k else \
            [_EXP[(i - k) * j % 255] for j in range(k)]
        for c, b in basis.items():  # clear the pivots, in the order chosen: each row
            # chosen was cleared of the pivots before it, so none comes back
            if row[c]:
                f = _LOG[row[c]]
                row = [x ^ (_EXP[f + _LOG[y]] if y else 0) for x, y in zip(row, b)]
        pivot = next((c for c, x in enumerate(row) if x), None)
        if pivot is None:
            continue  # a combination of those already chosen
        inv = 255 - _LOG[row[pivot]]
        basis[pivot] = [_EXP[inv + _LOG[x]] if x else 0 for x in row]
        chosen.append(i)
        if len(chosen) == k:
            return tuple(chosen)
    return None
