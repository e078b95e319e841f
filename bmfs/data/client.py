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

import collections
import logging

import trio

from ..errors import IOFailure, NoSpace
from ..meta.records import EC, INLINE, NO_DEVICE, Stripe
from ..transport import DeviceError
from . import fragment as fr
from .codec import LIB_HEADER, codec
from .placement import place_available

log = logging.getLogger(__name__)
DECODED_CACHE = 8  # stripes (up to 8 x 4 MiB)


class DataClient:
    def __init__(self, transport, devices: list[int], k: int, m: int, inline_max: int,
                 on_damage=None, domains: dict[int, str] | None = None):
        self.transport = transport
        self.devices = devices
        self.domains = domains or {}
        self.k, self.m = k, m
        self.inline_max = inline_max
        self.on_damage = on_damage or (lambda sid, idx, why: None)
        self.stats = {"degraded_reads": 0, "corrupt_fragments": 0, "missing_fragments": 0}
        # the last stripes decoded by degraded reads: a sequential reader asks for the
        # same stripe several times (one request per MiB or less), decode it once
        self._decoded: "collections.OrderedDict[int, bytes]" = collections.OrderedDict()
        self._decoding: dict[int, trio.Event] = {}  # stripes being decoded right now
        # stripes whose fragments are being written or whose record is not committed
        # yet (the writer discards them after its commit): the leak sweep skips them
        self.uncommitted: set[int] = set()

    # -- writes ---------------------------------------------------------------------------
    async def write_stripe(self, sid: int, data) -> Stripe:
        """Store ``data`` as stripe ``sid``; returns its record (refs 0). The caller
        discards ``sid`` from ``uncommitted`` once the record is committed (or dropped)."""
        if len(data) <= self.inline_max:
            return Stripe(INLINE, len(data), data=bytes(data))
        k, m = self.k, self.m
        self.uncommitted.add(sid)
        cd = codec(k, m)
        def encode():  # one hop to a worker thread for the CPU work of a stripe
            frags = cd.encode(data)
            return frags, [fr.build_header(sid, i, k, m, f) for i, f in enumerate(frags)]
        frags, headers = await trio.to_thread.run_sync(encode)
        live = [d for d in self.devices if self.transport.is_up(d)] or list(self.devices)
        devs = place_available(sid, live, k + m, self.domains)
        stored = [NO_DEVICE] * (k + m)
        failed: set[int] = set()

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
                    spare = [d for d in self.devices if d not in failed
                             and self.transport.is_up(d)]
                    if not spare:
                        return
                    fresh = [d for d in spare if d not in stored and d not in devs]
                    dev = (fresh or spare)[i % len(fresh or spare)]

        async with trio.open_nursery() as nursery:
            for i in range(k + m):
                nursery.start_soon(put, i)
        ok = sum(d != NO_DEVICE for d in stored)
        distinct = len({d for d in stored if d != NO_DEVICE})
        need = min(k + 1, k + m)
        if ok < need or distinct < min(k, len(self.devices)):
            raise NoSpace(f"only {ok} of {k + m} fragments of a stripe could be stored, on "
                          f"{distinct} devices (need {need} on {k}); are devices missing?")
        return Stripe(EC, len(data), 0, k, m, len(frags[0]), stored)

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
        if hasattr(self.transport, "sync_many"):
            try:
                await self.transport.sync_many(self.devices)
            except DeviceError as e:
                log.warning("sync: %s", e)
            return
        async with trio.open_nursery() as nursery:
            for dev in self.devices:
                nursery.start_soon(self._sync_one, dev)

    async def _sync_one(self, dev):
        try:
            await self.transport.sync(dev)
        except DeviceError as e:
            log.warning("sync: %s", e)

    async def delete_stripe(self, sid: int, st: Stripe) -> None:
        for i, dev in enumerate(st.devices):
            if dev != NO_DEVICE:
                try:
                    await self.transport.delete(dev, fr.fragment_name(sid, i))
                except DeviceError:
                    pass

    # -- reads ----------------------------------------------------------------------------
    async def read(self, sid: int, st: Stripe, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of the stripe (clipped to its length)."""
        end = min(offset + length, st.length)
        if offset >= end:
            return b""
        if st.kind == INLINE:
            return st.data[offset:end]
        bs = st.frag_len - LIB_HEADER
        wanted = range(offset // bs, (end - 1) // bs + 1)
        if any(not self.transport.is_up(st.devices[i]) for i in wanted
               if st.devices[i] != NO_DEVICE):
            return (await self._read_degraded(sid, st))[offset:end]
        delay = max((self.transport.expected_latency(st.devices[i]) for i in wanted
                     if st.devices[i] != NO_DEVICE), default=0.0)
        if delay <= 0:
            try:
                return await self._read_direct(sid, st, offset, end)
            except (DeviceError, fr.CorruptFragment, _Missing):
                return (await self._read_degraded(sid, st))[offset:end]
        return await self._read_hedged(sid, st, offset, end, max(0.005, 4 * delay))

    async def _read_hedged(self, sid, st, offset, end, delay):
        """Read directly; if that is slower than ``delay``, also decode from the other
        fragments, and take whichever answers first (the straggler is cancelled)."""
        result: list[bytes] = []
        errors: list[Exception] = []
        started = trio.Event()

        async def direct(nursery):
            try:
                data = await self._read_direct(sid, st, offset, end)
            except (DeviceError, fr.CorruptFragment, _Missing) as e:
                errors.append(e)
                started.set()  # start the degraded read at once
                return
            result.append(data)
            nursery.cancel_scope.cancel()

        async def hedge(nursery):
            with trio.move_on_after(delay):
                await started.wait()
            self.stats["hedged_reads"] = self.stats.get("hedged_reads", 0) + 1
            try:
                data = await self._read_degraded(sid, st)
            except IOFailure as e:
                errors.append(e)
                return
            result.append(data[offset:end])
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(direct, nursery)
            nursery.start_soon(hedge, nursery)
        if result:
            return result[0]
        raise next((e for e in errors if isinstance(e, IOFailure)), None) or \
            IOFailure(f"stripe {sid}: unreadable")

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
            async with trio.open_nursery() as nursery:
                for i in range(first, last + 1):
                    nursery.start_soon(one, i)
        if failed:
            raise failed[0]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _read_range(self, sid, st, index, p0, n):
        """``n`` bytes at payload offset ``p0`` of fragment ``index``, verified."""
        dev = st.devices[index]
        if dev == NO_DEVICE:
            raise _Missing()
        hlen = fr.header_length(st.frag_len)
        b0 = p0 // fr.BLOCK
        b1 = min((p0 + n + fr.BLOCK - 1) // fr.BLOCK * fr.BLOCK, st.frag_len)
        blocks = await self._read_checked(sid, st, index, dev, hlen, b0,
                                          b1 - b0 * fr.BLOCK)
        off = p0 - b0 * fr.BLOCK
        out = blocks[off:off + n]
        return out if isinstance(out, bytes) else bytes(out)

    async def _read_fragment(self, sid, st, index) -> bytes:
        dev = st.devices[index]
        if dev == NO_DEVICE:
            raise _Missing()
        payload = await self._read_checked(sid, st, index, dev,
                                           fr.header_length(st.frag_len), 0, st.frag_len)
        return payload if isinstance(payload, bytes) else bytes(payload)

    async def _read_checked(self, sid, st, index, dev, hlen, first_block, length):
        """``length`` payload bytes of a fragment from block ``first_block`` on, with its
        header and those blocks' checksums verified; damage is reported, then raised."""
        try:
            head, data = await self.transport.read(
                dev, fr.fragment_name(sid, index),
                [(0, hlen), (hlen + first_block * fr.BLOCK, length)])
            table = fr.parse_header(head, sid, index, st.frag_len)
            if len(data) != length:
                raise fr.CorruptFragment("truncated payload")
            fr.check_blocks(table, first_block, data)
            return data
        except fr.CorruptFragment as e:
            self._damaged(sid, index, f"corrupt: {e}")
            raise
        except DeviceError as e:
            self._damaged(sid, index, f"unreadable: {e}")
            raise

    async def _read_degraded(self, sid, st) -> bytes:
        """Decode the whole stripe from the first k intact fragments (cached: stripes
        are immutable, so a decoded stripe stays right until its id is reused, never)."""
        cached = self._decoded.get(sid)
        if cached is not None:
            self._decoded.move_to_end(sid)
            return cached
        busy = self._decoding.get(sid)
        if busy is not None:  # read-ahead asks for the same stripe concurrently: wait
            await busy.wait()
            if sid in self._decoded:
                return self._decoded[sid]
        done = self._decoding[sid] = trio.Event()
        try:
            data = await self._decode_stripe(sid, st)
        finally:
            del self._decoding[sid]
            done.set()
        self._decoded[sid] = data
        if len(self._decoded) > DECODED_CACHE:
            self._decoded.popitem(last=False)
        return data

    async def _decode_stripe(self, sid, st) -> bytes:
        self.stats["degraded_reads"] += 1
        k = st.k
        got: dict[int, bytes] = {}

        async def one(i, cancel_scope):
            try:
                got[i] = await self._read_fragment(sid, st, i)
            except (DeviceError, fr.CorruptFragment, _Missing):
                return
            if len(got) >= k:
                cancel_scope.cancel()  # the first k intact fragments are enough

        async with trio.open_nursery() as nursery:
            for i in range(st.k + st.m):
                nursery.start_soon(one, i, nursery.cancel_scope)
        if len(got) < k:
            raise IOFailure(f"stripe {sid}: only {len(got)} of {st.k + st.m} fragments "
                            f"readable, {k} needed")
        frags = [got[i] for i in sorted(got)[:k]]
        return await trio.to_thread.run_sync(codec(st.k, st.m).decode, frags)

    def _damaged(self, sid, index, why):
        key = "corrupt_fragments" if why.startswith("corrupt") else "missing_fragments"
        self.stats[key] += 1
        log.warning("stripe %d fragment %d %s", sid, index, why)
        self.on_damage(sid, index, why)


class _Missing(Exception):
    """The stripe record says this fragment was never stored."""
