"""The data path: stripes in, stripes out, over any transport.

Writes encode a stripe into k+m fragments and store them on k+m distinct devices in
parallel; a write succeeds when at least k+1 are stored (all of them when fewer than
k+1 devices exist), and the missing ones are reported so they are recorded for
repair. Reads of a healthy stripe read just the byte ranges they need from the data
fragments and check their block checksums; any failure (device missing, checksum
mismatch) switches to a degraded read that decodes the stripe from any k fragments.
Damage seen on the way is reported through ``on_damage(sid, index, reason)``.
"""
from __future__ import annotations

import array
import contextlib
import functools
import itertools
import logging
import math
import sys
import time

import trio

from .. import metrics
from ..errors import IOFailure, NoSpace
from ..lru import LRU
from ..meta.records import EC, INLINE, NO_DEVICE, Stripe
from ..transport import DeviceError, TooSlow, Transport, run_in_thread
from ..format import fragment as fr
from .codec import LIB_HEADER, codec, stripe_bytes, stripe_length
from ..native import NATIVE
from .pending import Pending
from .placement import place_available

log = logging.getLogger(__name__)
_WRITES, _READS = metrics.STRIPE_OPS.labels("write"), metrics.STRIPE_OPS.labels("read")
_WRITE_S = metrics.STRIPE_SECONDS.labels("write")
_READ_S = metrics.STRIPE_SECONDS.labels("read")
_WRITE_B = metrics.STRIPE_BYTES.labels("write")
_READ_B = metrics.STRIPE_BYTES.labels("read")
_DEGRADED, _HEDGED = metrics.READS.labels("degraded"), metrics.READS.labels("hedged")
DECODED_CACHE = 8  # stripes (up to 8 x 4 MiB)
TABLE_CACHE = 4096  # verified block checksum tables kept (4 bytes per 4 KiB block: ~1 KiB)
HEDGE_MIN = 0.02  # seconds: a read slower than this (and than 4x its node's usual) is hedged
HEDGE_RATE = 50e6  # bytes/s: a large read is given this much more time before a hedge
STREAMING = 256 << 10  # a read this large of a degraded stripe decodes the whole stripe
REBUILT_KEPT = 64  # stripes whose last rebuilt range is remembered (sequential readers)
DISCARD_TIME = 10.0  # seconds a failed write may spend deleting what it stored


class DataClient:
    def __init__(self, transport: Transport, devices: list[int], k: int, m: int,
                 inline_max: int,
                 on_damage=None, domains: dict[int, str] | None = None):
        self.transport = transport
        self.devices = devices  # where new stripes may go (in service)
        self.sync_devices: list[int] | None = None  # what sync covers (None: devices)
        self.domains = domains or {}
        self.k, self.m = k, m
        self.inline_max = inline_max
        self.on_damage = on_damage or (lambda sid, idx, why: None)
        self.stats = {"degraded_reads": 0, "ranges_rebuilt": 0, "corrupt_fragments": 0,
                      "missing_fragments": 0}
        # the last stripes decoded by degraded reads: a sequential reader asks for the
        # same stripe several times (one request per MiB or less), decode it once
        self._decoded = LRU(DECODED_CACHE)
        self._decoding: dict[int, _Decoding] = {}  # stripes being decoded right now
        # stripe -> where its last range rebuilt by a small read ended (_sequential)
        self._rebuilt_end = LRU(REBUILT_KEPT)
        # block checksum tables of fragments whose header was read and verified: a
        # small read then fetches (and checks) just its blocks
        self._tables = LRU(TABLE_CACHE)
        # stripes whose fragments no committed record names yet: ``with
        # self.pending(sid)`` around the window
        self.pending = Pending()

    # -- writes ---------------------------------------------------------------------------
    async def write_stripe(self, sid: int, data) -> Stripe:
        """Store ``data`` as stripe ``sid``; returns its record (refs 0). ``data``: a
        bytes-like object or a list of them (the stripe's pieces, in order, not joined:
        the encoder reads them in place). The caller holds ``sid`` pending
        (``with self.pending(sid)``) until its record is committed (or dropped)."""
        length = stripe_length(data)
        if length <= self.inline_max:
            return Stripe(INLINE, length, data=stripe_bytes(data))
        k, m = self.k, self.m
        if len(self.devices) <= k:  # (a volume on storage nodes whose devices are not
            # all added yet: fragments would double up on too few of them, or nowhere)
            raise NoSpace(f"the volume has {len(self.devices)} devices in service; writes "
                          f"need at least {k + 1} ({k}+{m}): add devices (bmfs node add)")
        t0 = time.perf_counter()
        cd = codec(k, m)
        version = fr.VERSION
        def encode():  # one hop to a worker thread for the CPU work of a stripe
            frags = cd.encode(data)
            return frags, [fr.build_header(sid, i, k, m, f, version) for i, f in enumerate(frags)]
        frags, headers = await run_in_thread(encode)
        live = [d for d in self.devices if self.transport.is_up(d)] or list(self.devices)
        devs = place_available(sid, live, k + m, self.domains)
        stored = [NO_DEVICE] * (k + m)
        failed: set[int] = set()
        tried: list[tuple[int, int]] = []  # (index, device) of puts that failed

        async def put(i):
            # a fragment whose device fails goes to another live device, preferring one
            # that holds no fragment of this stripe yet
            dev = devs[i]
            for _ in range(3):
                try:
                    await self.transport.put(dev, fr.fragment_name(sid, i),
                                             [headers[i], frags[i]])
                    stored[i] = dev
                    return
                except DeviceError as e:
                    log.warning("stripe %d fragment %d not stored: %s", sid, i, e)
                    failed.add(dev)
                    tried.append((i, dev))
                    spare = [d for d in self.devices if d not in failed
                             and self.transport.is_up(d)]
                    if not spare:
                        return
                    fresh = [d for d in spare if d not in stored and d not in devs]
                    dev = (fresh or spare)[i % len(fresh or spare)]

        try:
            async with trio.open_nursery() as nursery:
                for i in range(k + m):
                    nursery.start_soon(put, i)
            ok = sum(d != NO_DEVICE for d in stored)
            distinct = len({d for d in stored if d != NO_DEVICE})
            need = min(k + 1, k + m)
            if ok < need or distinct < min(k, len(self.devices)):
                raise NoSpace(f"only {ok} of {k + m} fragments of a stripe could be stored, "
                              f"on {distinct} devices (need {need} on {k}); are devices "
                              f"missing or full?")
        except BaseException:
            # no record will own what this stripe stored (a cancelled write's either):
            # deleted now, or it stays on the devices until fsck --repair
            await self._discard(sid, [*enumerate(stored), *tried])
            raise
        # what a failed put left (a file cut short by a full device, say) is nobody's
        await self._discard(sid, tried)
        _WRITES.inc()
        _WRITE_B.inc(length)
        _WRITE_S.observe(time.perf_counter() - t0)
        return Stripe(EC, length, 0, k, m, len(frags[0]), stored, frag_version=version)

    async def _discard(self, sid: int, where) -> None:
        """Delete fragments (index, device) of stripe ``sid`` that no record owns, from
        the devices that are up; shielded from cancellation, for DISCARD_TIME at most
        (a device that does not answer keeps its copy: fsck names it)."""
        where = [(i, d) for i, d in where if d != NO_DEVICE and self.transport.is_up(d)]
        if where:
            with trio.move_on_after(DISCARD_TIME) as scope:
                scope.shield = True
                await self._delete_fragments(sid, where)

    @staticmethod
    def needs_repair(st: Stripe) -> list[int]:
        """Fragment indexes that are missing or share a device with another fragment."""
        seen, out = set(), []
        for i, d in enumerate(st.devices):
            if d == NO_DEVICE or d in seen:
                out.append(i)
            seen.add(d)
        return out

    async def sync(self) -> None:
        """Make every fragment written so far durable on its device."""
        devices = list(self.sync_devices or self.devices)  # (changed while this waits)
        if hasattr(self.transport, "sync_many"):
            try:
                await self.transport.sync_many(devices)
            except DeviceError as e:
                log.warning("sync: %s", e)
            return
        async with trio.open_nursery() as nursery:
            for dev in devices:
                nursery.start_soon(self._sync_one, dev)

    async def _sync_one(self, dev):
        try:
            await self.transport.sync(dev)
        except DeviceError as e:
            log.warning("sync: %s", e)

    async def delete_stripe(self, sid: int, st: Stripe) -> None:
        metrics.STRIPE_OPS.labels("delete").inc()
        await self._delete_fragments(sid, enumerate(st.devices))

    async def _delete_fragments(self, sid: int, where) -> None:
        """Delete fragments (index, device) of stripe ``sid``; one whose device fails
        is left (the leak sweep or fsck --repair finds it)."""
        for i, dev in where:
            if dev != NO_DEVICE:
                try:
                    await self.transport.delete(dev, fr.fragment_name(sid, i))
                except DeviceError:
                    pass

    # -- reads ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def side_by_side(self):
        """Around reads started side by side (the tasks of one nursery): meanwhile the
        transport does not hold the event loop for one of them (TcpTransport's small
        reads in C), which would keep the others from sending theirs until it is
        answered."""
        self.transport.side_by_side += 1
        try:
            yield
        finally:
            self.transport.side_by_side -= 1

    async def read(self, sid: int, st: Stripe, offset: int, length: int):
        """Bytes [offset, offset+length) of the stripe (clipped to its length): bytes,
        or a read-only memoryview (no copy of a large reply) when not clipped."""
        t0 = time.perf_counter()
        data = await self._read(sid, st, offset, length)
        if metrics.ON:
            if st.kind != INLINE:
                _READS.inc()
                _READ_S.observe(time.perf_counter() - t0)
            _READ_B.inc(len(data))
        return bytes(data) if len(data) < length and isinstance(data, memoryview) else data

    async def _read(self, sid: int, st: Stripe, offset: int, length: int):
        end = min(offset + length, st.length)
        if offset >= end:
            return b""
        if st.kind == INLINE:
            return st.data[offset:end]
        if sid in self._decoded or sid in self._decoding:  # decoded (or being) anyway
            return await self._read_decoded(sid, st, offset, end)
        bs = st.frag_len - LIB_HEADER
        first, last = offset // bs, (end - 1) // bs
        delay = 0.0
        for i in range(first, last + 1):
            dev = st.devices[i]
            if dev == NO_DEVICE:
                continue
            if not self.transport.is_up(dev):
                return await self._read_decoded(sid, st, offset, end)
            delay = max(delay, self.transport.expected_latency(dev))
        if end - offset >= STREAMING and any(
                d != NO_DEVICE and not self.transport.is_up(d) for d in st.devices[:st.k]):
            # a large read of a stripe that needs decoding elsewhere: the neighbouring
            # reads (read-ahead) will want the rest, so fetch k fragments once for all
            return await self._read_decoded(sid, st, offset, end)
        wanted = range(first, last + 1)
        if delay <= 0:
            try:
                if first == last:  # the usual small read: one range of one fragment
                    return await self._read_range(sid, st, first,
                                                  LIB_HEADER + offset - first * bs, end - offset)
                return await self._read_direct(sid, st, offset, end)
            except (DeviceError, fr.CorruptFragment, _Missing):
                return await self._read_decoded(sid, st, offset, end, wanted)
        # hedge a read slower than 4x its node's usual round trip plus transfer time
        delay = max(HEDGE_MIN, 4 * delay) + (end - offset) / HEDGE_RATE
        return await self._read_hedged(sid, st, offset, end, delay, wanted)

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

    async def _read_hedged(self, sid, st, offset, end, delay, slow):
        """Read directly; if that fails or takes longer than ``delay``, give up on it and
        decode from the other fragments (those of ``slow`` only if the others are not
        enough).

        Not a race of two tasks: that costs more than a 4 KiB read itself (a nursery,
        two tasks, cancellation) on every read, while the decode is needed rarely. The
        usual read of one fragment is not put in a cancel scope either: the transport
        checks its deadline only if it has to wait (TooSlow): a cancel scope around
        the read is a large share of a node round trip (Connection._wait).
        """
        failed = False
        try:
            if len(slow) == 1:  # the usual case, without _read_direct's machinery
                i = slow[0]
                bs = st.frag_len - LIB_HEADER
                return await self._read_range(sid, st, i, LIB_HEADER + offset - i * bs,
                                              end - offset, trio.current_time() + delay)
            with trio.move_on_after(delay):
                return await self._read_direct(sid, st, offset, end)
        except TooSlow:
            pass
        except (DeviceError, fr.CorruptFragment, _Missing):
            failed = True
        if not failed:
            self.stats["hedged_reads"] = self.stats.get("hedged_reads", 0) + 1
            _HEDGED.inc()
        try:
            return await self._read_decoded(sid, st, offset, end, slow)
        except IOFailure:
            if failed:
                raise
        # fewer than k fragments readable: the slow read is the only way left
        try:
            return await self._read_direct(sid, st, offset, end)
        except (DeviceError, fr.CorruptFragment, _Missing) as e:
            raise IOFailure(f"stripe {sid}: unreadable ({e})") from e

    async def _read_direct(self, sid, st, offset, end):
        bs = st.frag_len - LIB_HEADER
        first, last = offset // bs, (end - 1) // bs
        parts: list[bytes | None] = [None] * (last - first + 1)

        failed: list[Exception] = []

        async def one(i):
            lo, hi = max(offset, i * bs), min(end, (i + 1) * bs)
            try:
                parts[i - first] = await self._read_range(sid, st, i,
                                                          LIB_HEADER + lo - i * bs, hi - lo)
            except (DeviceError, fr.CorruptFragment, _Missing) as e:
                failed.append(e)

        if first == last:
            await one(first)
        else:
            with self.side_by_side():
                async with trio.open_nursery() as nursery:
                    for i in range(first, last + 1):
                        nursery.start_soon(one, i)
        if failed:
            raise failed[0]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _read_range(self, sid, st, index, p0, n, deadline=math.inf):
        """``n`` bytes at payload offset ``p0`` of fragment ``index``, verified; TooSlow
        if the node has not answered by ``deadline`` (trio time)."""
        read = self._range_read(sid, st, index, p0, n)
        return read.done(await self._read_checked(read, deadline))

    def _range_read(self, sid, st, index, p0, n) -> _CheckedRead:
        dev = st.devices[index]
        if dev == NO_DEVICE:
            raise _Missing()
        geo = fr.geometry(st.frag_version, st.frag_len)
        b0, start, length = geo.span(p0, n)
        return _CheckedRead(self, sid, st, index, dev, geo, b0, length, True,
                            (p0 - start, n))

    async def _read_ranges(self, sid, st, indexes, p0, n) -> dict:
        """The same ``n`` bytes at payload offset ``p0`` of each fragment of
        ``indexes``, verified, asked for together (transport.read_many: one task,
        every request sent before any reply is awaited): index -> bytes, or the
        exception (DeviceError, CorruptFragment, _Missing) its read failed with."""
        out, reads = {}, []
        for i in indexes:
            try:
                reads.append(self._range_read(sid, st, i, p0, n))
            except _Missing as e:
                out[i] = e
        got = await self.transport.read_many(
            [(r.dev, r.name, r.ranges, r.verify) for r in reads])
        for r, parts in zip(reads, got):
            try:
                out[r.index] = r.done(r.outcome(parts))
            except (DeviceError, fr.CorruptFragment) as e:
                out[r.index] = e
        return out

    async def _read_fragment(self, sid, st, index, copy=True):
        """The whole fragment (pyeclib's header included), verified: bytes, or with
        ``copy=False`` possibly a view of the reply's buffer. CorruptFragment if any
        block of it is bad."""
        payload, _, damage = await self._read_blocks(sid, st, index)
        if damage:
            raise fr.CorruptFragment(damage)
        return bytes(payload) if copy and not isinstance(payload, bytes) else payload

    async def _read_blocks(self, sid, st, index) -> tuple:
        """The whole fragment as ``_read_fragment`` reads it, and the blocks of it that
        are bad (_WholeRead): (payload, bad block numbers, what is wrong with it or "").
        Its header must verify."""
        dev = st.devices[index]
        if dev == NO_DEVICE:
            raise _Missing()
        return await self._read_checked(_WholeRead(
            self, sid, st, index, dev, fr.geometry(st.frag_version, st.frag_len)))

    async def _read_checked(self, read: _CheckedRead, deadline=math.inf):
        """The payload bytes ``read`` asks for, with their blocks' checksums verified;
        damage is reported, then raised."""
        try:
            parts = await self.transport.read(read.dev, read.name, read.ranges,
                                              read.verify, deadline)
        except (DeviceError, fr.CorruptFragment) as e:
            parts = e
        return read.outcome(parts)

    async def _read_degraded(self, sid, st, avoid=()) -> _Decoded:
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
        mine = self._decoding[sid] = _Decoding()
        try:
            mine.data = await self._decode_stripe(sid, st, avoid)
        except Exception as e:
            mine.error = e
            raise
        finally:
            del self._decoding[sid]
            mine.done.set()
        return mine.data if mine.data.holes else self._decoded.put(sid, mine.data)

    async def _decode_stripe(self, sid, st, avoid=()) -> _Decoded:
        """The stripe from fragments read whole: from k of them that determine it
        (_gather), or where some blocks of them are bad, block row by block row from
        k whose block is good (_decode_rows). With k or more fragments readable but
        some row not determined by them, what the rest determine, and holes where
        the data fragments' own blocks are bad."""
        self.stats["degraded_reads"] += 1
        _DEGRADED.inc()
        k, geo = st.k, fr.geometry(st.frag_version, st.frag_len)
        got, runs = await self._gather(
            sid, st, avoid, lambda i: self._read_blocks(sid, st, i),
            plan=lambda have: _row_plan(st.k, st.m, geo, have),
            last=lambda have: _row_plan(st.k, st.m, geo, have, partial=True))
        holes, why = [], ""
        chosen = runs[0][2] if len(runs) == 1 else None
        if chosen is None or any(got[i][1] for i in chosen):
            payloads, holes = await run_in_thread(_decode_rows, st, geo, got, runs)
            why = _row_shortage(st, geo, got) if holes else ""
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
        return _Decoded(views, holes, why)

    async def _gather(self, sid, st, avoid, fetch, skip=None, fetch_many=None,
                      plan=None, last=None):
        """index -> ``fetch(index)`` for k intact fragments (but ``skip``) that determine
        the stripe: those on devices that are up and not in ``avoid`` first (data
        fragments before parity: the cheapest decode), the others only as replacements
        for failures. k fetched at once: by ``fetch_many(indexes)`` if given (index ->
        result or the exception it failed with; then replacements one at a time),
        else by k tasks; if they do not determine the stripe (see _pick), more one at
        a time until some k do. IOFailure when no k can.

        Returns (index -> result for every fragment fetched, the plan): ``plan``, a
        function of those (called with k or more) that says how they determine the
        stripe, or None if they do not yet (by default the k of them that do, _pick);
        with every fragment fetched and none found, ``last(fetched)`` if given (k or
        more fetched) says what to do instead."""
        if plan is None:
            def plan(have):
                return _pick(st.k, st.m, tuple(sorted(have)))
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
                except (DeviceError, fr.CorruptFragment, _Missing):
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

    def _damaged(self, sid, index, why):
        key = "corrupt_fragments" if why.startswith("corrupt") else "missing_fragments"
        self.stats[key] += 1
        metrics.DAMAGE.labels(key.split("_")[0]).inc()
        log.warning("stripe %d fragment %d %s", sid, index, why)
        self.on_damage(sid, index, why)


class _Decoded(tuple):
    """A decoded stripe: the k data fragments' payloads, trimmed to the stripe's
    length; ``holes``, the stripe ranges [start, end) it could not decode (no k good
    copies of their block rows), and ``why``."""

    def __new__(cls, views, holes=(), why=""):
        self = super().__new__(cls, views)
        self.holes, self.why = holes, why
        return self


class _Decoding:
    """A stripe's decode under way (DataClient._read_degraded): what it came to, for
    the readers that waited for it."""
    __slots__ = ("done", "data", "error")

    def __init__(self):
        self.done = trio.Event()
        self.data = None
        self.error: Exception | None = None


class _CheckedRead:
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


class _WholeRead(_CheckedRead):
    """A whole fragment's read that keeps what verifies: its header must (else
    CorruptFragment, as any read's), its blocks need not. ``bad`` lists those that do
    not, a truncated fragment's missing tail among them, so that a decode can take
    each block row from the fragments whose block is good there (_row_plan). One byte
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
            damage = _describe(self.bad, len(payload), self.frag_len)
            self.client._damaged(self.sid, self.index, "corrupt: " + damage)
        if len(payload) > self.frag_len:
            payload = memoryview(payload)[:self.frag_len]
        return payload, self.bad, damage


def _describe(bad: list[int], length: int, payload_length: int) -> str:
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


def _row_plan(k: int, m: int, geo, got: dict, partial: bool = False) -> list | None:
    """How the fragments ``got`` (index -> (payload, bad blocks)) determine the stripe,
    block row by block row (the code works byte position by byte position, and
    fragments are cut into blocks alike): runs ``[start, end, chosen]`` of payload
    offsets, over the stripe's data (payload offset LIB_HEADER on), each taken from
    ``chosen``, k fragments whose blocks there are good and that determine them
    (_pick: the data fragments where they are good: nothing to rebuild). None if
    some row has no such k, or with ``partial`` a run of that row alone whose
    ``chosen`` is None."""
    order = tuple(sorted(got))
    if not any(b for _, b, _ in got.values()):  # (the usual degraded read: one run)
        chosen = _pick(k, m, order)
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
        chosen = _pick(k, m, good) if len(good) >= k else None
        if chosen is None and not partial:
            return None
        if runs and chosen is not None and runs[-1][2] == chosen:
            runs[-1][1] = end
        else:
            runs.append([start, end, chosen])
    return runs


def _row_shortage(st, geo, got: dict) -> str:
    """Why the fragments ``got`` do not determine the stripe (_row_plan found no plan):
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
        if _pick(k, st.m, good) is None:
            return (f"block {j} intact in {len(good)} of {n} fragments but no {k} of them "
                    f"determine the data")
    return f"{len(got)} of {n} fragments readable"  # (not reached: _row_plan found a plan)


def _decode_rows(st, geo, got: dict, runs: list) -> tuple[dict, list]:
    """The data fragments' payloads (index -> bytes-like, without pyeclib's header)
    from ``got`` (index -> (payload, bad blocks, _)) run by run of ``runs``
    (_row_plan): a data fragment's bytes where it is chosen, rebuilt from the run's k
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
def _pick(k: int, m: int, have: tuple) -> tuple | None:
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


class _Missing(Exception):
    """The stripe record says this fragment was never stored."""
