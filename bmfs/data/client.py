"""The data path: stripes in, stripes out, over any transport.

Writes encode a stripe into k+m fragments and store them on k+m distinct devices in
parallel; a write succeeds when at least k+1 are stored (all of them when fewer than
k+1 devices exist), and the missing ones are reported so they are recorded for
repair. Reads of a healthy stripe read just the byte ranges they need from the data
fragments and check their block checksums; any failure (device missing, checksum
mismatch) switches to a degraded read that decodes the stripe from any k fragments.
Damage seen on the way is reported through ``on_damage(sid, index, reason)``.

This module holds writes, deletes, syncs and the healthy read path (a read slower
than its node's usual is hedged: decoded from the others); degraded.py the reads
that decode (``DegradedReads``, a part of ``DataClient``); checked.py a fragment
read with its block checksums verified.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time

import trio

from .. import metrics
from ..errors import DeviceError, IOFailure, NoSpace
from ..lru import LRU
from ..format.records import EC, INLINE, NO_DEVICE, Stripe
from ..transport import TooSlow, Transport, run_in_thread
from ..format import fragment as fr
from .checked import CheckedRead, Missing, WholeRead
from .codec import LIB_HEADER, codec, stripe_bytes, stripe_length
from .degraded import STREAMING, Decoding, DegradedReads
from .pending import Pending
from .placement import place_available

log = logging.getLogger(__name__)
_WRITES, _READS = metrics.STRIPE_OPS.labels("write"), metrics.STRIPE_OPS.labels("read")
_WRITE_S = metrics.STRIPE_SECONDS.labels("write")
_READ_S = metrics.STRIPE_SECONDS.labels("read")
_WRITE_B = metrics.STRIPE_BYTES.labels("write")
_READ_B = metrics.STRIPE_BYTES.labels("read")
_HEDGED = metrics.READS.labels("hedged")
DECODED_CACHE = 8  # stripes (up to 8 x 4 MiB)
TABLE_CACHE = 4096  # verified block checksum tables kept (4 bytes per 4 KiB block: ~1 KiB)
HEDGE_MIN = 0.02  # seconds: a read slower than this (and than 4x its node's usual) is hedged
HEDGE_RATE = 50e6  # bytes/s: a large read is given this much more time before a hedge
REBUILT_KEPT = 64  # stripes whose last rebuilt range is remembered (sequential readers)
DISCARD_TIME = 10.0  # seconds a failed write may spend deleting what it stored


class DataClient(DegradedReads):
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
        self._decoding: dict[int, Decoding] = {}  # stripes being decoded right now
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
            except (DeviceError, fr.CorruptFragment, Missing):
                return await self._read_decoded(sid, st, offset, end, wanted)
        # hedge a read slower than 4x its node's usual round trip plus transfer time
        delay = max(HEDGE_MIN, 4 * delay) + (end - offset) / HEDGE_RATE
        return await self._read_hedged(sid, st, offset, end, delay, wanted)

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
        except (DeviceError, fr.CorruptFragment, Missing):
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
        except (DeviceError, fr.CorruptFragment, Missing) as e:
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
            except (DeviceError, fr.CorruptFragment, Missing) as e:
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

    def _range_read(self, sid, st, index, p0, n) -> CheckedRead:
        dev = st.devices[index]
        if dev == NO_DEVICE:
            raise Missing()
        geo = fr.geometry(st.frag_version, st.frag_len)
        b0, start, length = geo.span(p0, n)
        return CheckedRead(self, sid, st, index, dev, geo, b0, length, True,
                            (p0 - start, n))

    async def _read_ranges(self, sid, st, indexes, p0, n) -> dict:
        """The same ``n`` bytes at payload offset ``p0`` of each fragment of
        ``indexes``, verified, asked for together (transport.read_many: one task,
        every request sent before any reply is awaited): index -> bytes, or the
        exception (DeviceError, CorruptFragment, Missing) its read failed with."""
        out, reads = {}, []
        for i in indexes:
            try:
                reads.append(self._range_read(sid, st, i, p0, n))
            except Missing as e:
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
        are bad (WholeRead): (payload, bad block numbers, what is wrong with it or "").
        Its header must verify."""
        dev = st.devices[index]
        if dev == NO_DEVICE:
            raise Missing()
        return await self._read_checked(WholeRead(
            self, sid, st, index, dev, fr.geometry(st.frag_version, st.frag_len)))

    async def _read_checked(self, read: CheckedRead, deadline=math.inf):
        """The payload bytes ``read`` asks for, with their blocks' checksums verified;
        damage is reported, then raised."""
        try:
            parts = await self.transport.read(read.dev, read.name, read.ranges,
                                              read.verify, deadline)
        except (DeviceError, fr.CorruptFragment) as e:
            parts = e
        return read.outcome(parts)

    def _damaged(self, sid, index, why):
        key = "corrupt_fragments" if why.startswith("corrupt") else "missing_fragments"
        self.stats[key] += 1
        metrics.DAMAGE.labels(key.split("_")[0]).inc()
        log.warning("stripe %d fragment %d %s", sid, index, why)
        self.on_damage(sid, index, why)
