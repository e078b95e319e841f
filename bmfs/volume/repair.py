"""Repair, scrub and rebalance: keep every stripe at full redundancy on distinct devices.

- ``repair`` rebuilds fragments that are missing, corrupt (queued as ``h/`` keys by
  reads, writes and scrub), doubled up on one device (written while nodes were down),
  or on a device being drained: the stripe is read (decoding from any k intact
  fragments), re-encoded, and each bad fragment is written to a live device that holds
  no other fragment of the stripe; then the stripe record is updated in a transaction
  that re-reads it, so concurrent reference changes are kept.
- One repair runs at a time per volume (background repair, ``bmfs repair``, scrub and
  drain of one mount share a lock): two runs would rebuild the same fragment twice
  and one's stale device list could overwrite the other's, pointing a fragment at a
  copy the other had deleted. A run that waited starts from the records as they are
  then. Across mounts (etcd) the commit only moves a fragment whose record still
  names the device it replaced; otherwise its new copy is deleted.
- ``scrub`` reads every fragment in full, checks every block checksum, queues the bad
  ones and repairs them.
- ``rebalance`` moves fragments of older stripes to where placement puts them now.

Device administration (drain, add, remove, addresses) is devices.py; drain empties a
device through ``repair`` here.
"""
from __future__ import annotations

import errno
import logging
import weakref

import trio

from ..format import fragment as fr
from ..data.codec import codec
from ..errors import DeviceError, IOFailure
from ..meta import keys
from ..format.records import EC, NO_DEVICE, Stripe
from .volume import device_records

log = logging.getLogger(__name__)
_locks: "weakref.WeakKeyDictionary[object, trio.Lock]" = weakref.WeakKeyDictionary()


def _lock(volume) -> trio.Lock:
    lock = _locks.get(volume)
    if lock is None:
        lock = _locks[volume] = trio.Lock()
    return lock


def busy(volume) -> bool:
    """Whether a repair, scrub, drain or rebalance of ``volume`` runs in this process."""
    return _lock(volume).locked()


async def _queued(volume) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for k, _ in await volume.kv.range(*keys.span(keys.DAMAGE_PREFIX)):
        sid, index = keys.damage_of(k)
        out.setdefault(sid, set()).add(index)
    return out


async def _stripes(volume):
    for k, v in await volume.kv.range(*keys.span(keys.STRIPE_PREFIX)):
        st = Stripe.unpack(v)
        if st.kind == EC:
            yield keys.stripe_of(k), st


def _bad(volume, st: Stripe, queued: set[int], avoid: set[int]) -> list[int]:
    out = set(queued) | set(volume.data.needs_repair(st))
    for i, d in enumerate(st.devices):
        if d in avoid or not volume.transport.is_up(d):
            out.add(i)
    return sorted(out)


# why a fragment stays short after a repair pass (the keys of its report's "short")
NO_DEVICE_FREE = "no_device"  # no live device in service that holds no other of its stripe
NO_SPACE = "no_space"  # every device it was tried on is full (ENOSPC)
DEVICE_DOWN = "device_down"  # every device it was tried on failed or did not answer
UNREADABLE = "unreadable"  # its stripe could not be read (fewer than k good copies)
WHY = {NO_DEVICE_FREE: "no device to place on", NO_SPACE: "ENOSPC",
       DEVICE_DOWN: "device down", UNREADABLE: "stripe unreadable"}


async def repair_stripe(volume, sid: int, st: Stripe, bad: list[int],
                        avoid: set[int]) -> tuple[int, dict[int, str]]:
    """Rebuild fragments ``bad`` of one stripe; returns how many were moved, and the
    fragments left short: index -> why (NO_DEVICE_FREE, NO_SPACE, DEVICE_DOWN)."""
    with volume.data.pending(sid):  # new fragments not in the record yet: not leaks
        return await _repair_stripe(volume, sid, st, bad, avoid)


def _places(volume, sid: int, i: int, devices: list[int], avoid: set[int]) -> list[int]:
    """The live devices fragment ``i`` may go to, best first: none holding another
    fragment of the stripe (``devices``), those in a new failure domain first, each
    group rotated by the stripe so that rebuilds spread."""
    holding = {d for j, d in enumerate(devices) if j != i}
    candidates = [d for d in volume.data.devices
                  if d not in avoid and d not in holding and volume.transport.is_up(d)]
    doms = volume.data.domains
    used = {doms.get(d, d) for d in holding}
    fresh = [d for d in candidates if doms.get(d, d) not in used]
    out = []
    for group in (fresh, [d for d in candidates if d not in fresh]):
        if group:
            at = (sid + i) % len(group)
            out += group[at:] + group[:at]
    return out


async def _repair_stripe(volume, sid: int, st: Stripe, bad: list[int],
                         avoid: set[int]) -> tuple[int, dict[int, str]]:
    devices = list(st.devices)
    if not any(_places(volume, sid, i, devices, avoid) for i in bad):
        # nowhere to put them (nodes down, too few devices): no read, they stay queued
        log.debug("stripe %d fragments %s: no spare device; stays degraded", sid, bad)
        return 0, {i: NO_DEVICE_FREE for i in bad}
    data = await volume.data.read(sid, st, 0, st.length)
    frags = await trio.to_thread.run_sync(codec(st.k, st.m).encode, data)
    if len(frags[0]) != st.frag_len:
        raise IOFailure(f"stripe {sid}: re-encoding gave another fragment size")
    moved: dict[int, int] = {}  # index -> the device it was moved from
    short: dict[int, str] = {}
    failed: set[int] = set()  # devices a write of this stripe failed on
    for i in bad:
        head = fr.build_header(sid, i, st.k, st.m, frags[i], st.frag_version)
        why = NO_DEVICE_FREE
        # a device that fails (full, say) is not the end: the next one is tried
        for target in _places(volume, sid, i, devices, avoid | failed):
            try:
                await volume.transport.put(target, fr.fragment_name(sid, i), [head, frags[i]])
            except DeviceError as e:
                log.warning("stripe %d fragment %d: %s", sid, i, e)
                failed.add(target)
                why = NO_SPACE if e.errno == errno.ENOSPC else DEVICE_DOWN
                continue
            moved[i], devices[i] = devices[i], target
            break
        else:
            short[i] = why
    return await _commit_moves(volume, sid, moved, devices), short


async def _commit_moves(volume, sid: int, moved: dict[int, int], devices: list[int]) -> int:
    """Point the stripe's record at the fragments written anew (``moved``: index -> the
    device it was on; ``devices``: where each is now), in a transaction that re-reads
    the record (only a fragment nobody moved meanwhile is moved), then delete the
    copies replaced (or ours, where another run won). How many were moved."""
    applied: list[int] = []
    final: list[int] = []  # the device list as committed

    async def fn(txn):
        applied.clear()
        raw = await txn.get(keys.stripe(sid))
        if raw is None:
            return  # freed meanwhile: fsck --repair sweeps the rebuilt fragments
        cur = Stripe.unpack(raw)
        # on a shared volume, targets marked draining or removed since this run chose
        # them (a drain elsewhere, which waits for mounts but not for this process):
        # not moved there (read in the transaction: a mark committed meanwhile makes
        # it conflict). A single-writer engine has no one else to mark them.
        shut = set()
        if not volume.kv.caps.single_writer:
            shut = {d for d, r in (await device_records(txn)).items()
                    if r.get("draining") or r.get("removed")}
        for i, old in moved.items():
            # nobody else moved it meanwhile, nor put another fragment of the stripe
            # on its new device (another mount's repair or rebalance)
            if cur.devices[i] == old and devices[i] not in shut and devices[i] not in \
                    (d for j, d in enumerate(cur.devices) if j != i):
                cur.devices[i] = devices[i]
                applied.append(i)
        final[:] = cur.devices
        txn.put(keys.stripe(sid), cur.pack())
        for i in applied:
            txn.delete(keys.damage(sid, i))
    await volume.kv.transact(fn)
    if applied:  # what reads (this repair's own, of the stripe) found wrong with the
        # copies just replaced, not queued yet: not queued (it would be found intact again)
        volume.damage = [d for d in volume.damage if d[0] != sid or d[1] not in applied]
    if not volume.kv.caps.single_writer:
        # etcd's write-behind may hold the record back: stored before a copy it no
        # longer names is deleted (a crash in between would leave it naming nothing)
        await volume.kv.sync()
    for i, old in moved.items():
        # names are per index, so other fragments stay. The replaced copy goes; so does
        # our new one if another repair moved the fragment elsewhere first.
        gone = old if i in applied else devices[i]
        if final and gone not in (NO_DEVICE, final[i]):
            try:
                await volume.transport.delete(gone, fr.fragment_name(sid, i))
            except DeviceError:
                pass  # gone with its device; fsck --repair sweeps leftovers
    return len(applied)


class _Pace:
    """Keeps an operation's device traffic (bytes read and written on devices) at or
    under ``limit`` bytes a second on average (None: no limit), as HDFS's balancer
    bandwidth or Ceph's recovery throttles do: after each step, it sleeps until the
    bytes moved so far are due."""

    def __init__(self, limit: float | None):
        self.limit = limit
        self.t0: float | None = None
        self.done = 0

    async def spent(self, nbytes: int) -> None:
        if not self.limit or nbytes <= 0:
            return
        if self.t0 is None:
            self.t0 = trio.current_time()
        self.done += nbytes
        wait = self.t0 + self.done / self.limit - trio.current_time()
        if wait > 0:
            await trio.sleep(wait)


async def repair(volume, avoid: set[int] | None = None, progress=None,
                 limit: float | None = None) -> dict:
    """``limit``: device traffic in bytes a second (_Pace), None for none."""
    async with _lock(volume):
        return await _repair(volume, avoid or set(), progress, _Pace(limit))


async def _repair(volume, avoid: set[int], progress, pace) -> dict:
    await volume.record_damage()  # damage seen by reads so far joins the queue first
    # devices that do not answer now (a dead node not tried lately still counts as up
    # in the transport): their fragments are rebuilt elsewhere, as a drained device's
    usage = await volume.device_usage(max_age=0)
    avoid = avoid | {dev for dev, u in usage.items() if isinstance(u, Exception)}
    queued = await _queued(volume)
    todo = []
    async for sid, st in _stripes(volume):
        bad = _bad(volume, st, queued.pop(sid, set()), avoid)
        if bad:
            todo.append((sid, st, bad))
    # queue entries of stripes that no longer exist
    if queued:
        txn = volume.kv.begin()
        for sid, idxs in queued.items():
            for i in idxs:
                txn.delete(keys.damage(sid, i))
        await volume.kv.commit(txn)
    moved = failed = intact = 0
    short: dict[str, int] = {}  # why -> fragments left short
    short_stripes = 0
    for n, (sid, st, bad) in enumerate(todo, 1):
        left: dict[int, str] = {}
        try:
            raw = await volume.kv.get(keys.stripe(sid))
            if raw is not None:  # else freed meanwhile
                st = Stripe.unpack(raw)
                fine = await _intact_again(volume, sid, st, bad, avoid)
                intact += len(fine)
                rest = [i for i in bad if i not in fine]
                if rest:
                    done, left = await repair_stripe(volume, sid, st, rest, avoid)
                    moved += done
        except (IOFailure, DeviceError) as e:
            failed += 1
            left = {i: UNREADABLE for i in bad}
            log.warning("repair of stripe %d failed: %s", sid, e)
        if left:
            short_stripes += 1
            for why in left.values():
                short[why] = short.get(why, 0) + 1
        # what it may have cost, failed or not: each queued fragment read whole (found
        # intact) or written (rebuilt), and k fragments read to rebuild
        await pace.spent(st.frag_len * (st.k + len(bad)))
        if progress:
            progress(n, len(todo))
    swept = 0
    if volume.kv.caps.single_writer:
        # copies a node stored but could not acknowledge before dying (the client put
        # them elsewhere), and what repair moved away from devices that were down
        from ..vfs.gc import sweep_leaked
        swept = await sweep_leaked(volume)
    return {"stripes": len(todo), "fragments_rebuilt": moved, "stripes_failed": failed,
            "fragments_intact_again": intact, "stale_fragments_deleted": swept,
            # stripes still short of full redundancy after this pass, and why: fragments
            # by reason (WHY)
            "stripes_short": short_stripes, "fragments_short": short}


async def _intact_again(volume, sid: int, st: Stripe, bad: list[int], avoid: set[int]) -> set[int]:
    """Of the fragments queued as bad, those that read whole and verify now, on a
    device that is up (a node that was down when a read wanted them is back): their
    queue entries are dropped and they are not rebuilt. Reading one costs a fragment;
    rebuilding it, k fragments read, an encode and a write, and it moved off a node
    that was only restarted."""
    doubled = set(volume.data.needs_repair(st))
    fine = set()
    for i in bad:
        dev = st.devices[i]
        if i in doubled or dev in avoid or not volume.transport.is_up(dev):
            continue
        try:
            await volume.data._read_fragment(sid, st, i, copy=False)
        except (DeviceError, fr.CorruptFragment):
            continue  # bad indeed (queued again by the read): rebuilt below
        fine.add(i)
    if fine:
        txn = volume.kv.begin()
        for i in fine:
            txn.delete(keys.damage(sid, i))
        await volume.kv.commit(txn)
    return fine


async def rebalance(volume, progress=None, limit: float | None = None) -> dict:
    """Move fragments to where placement would put their stripes now: after a device
    was added (or undrained), stripes written before keep their fragments on the old
    devices; this moves each fragment that rendezvous hashing over the devices in
    service (placement.place_available) no longer puts on its device, to one it does
    (~1/n of all fragments when a device is added to n). A fragment is copied as it is
    (read whole and verified, not decoded; a fresh block table), then the record is
    switched and the old copy deleted, as repair does. Stripes with a fragment
    missing, corrupt or on a device that is down are left to repair."""
    from ..data.placement import place_available
    pace = _Pace(limit)
    async with _lock(volume):
        data = volume.data
        stripes = [x async for x in _stripes(volume)]
        moved = failed = examined = nbytes = 0
        for n, (sid, st) in enumerate(stripes, 1):
            if progress:
                progress(n, len(stripes))
            raw = await volume.kv.get(keys.stripe(sid))
            if raw is None:
                continue  # freed meanwhile
            st = Stripe.unpack(raw)
            want = place_available(sid, data.devices, st.k + st.m, data.domains)
            if len(set(want)) < len(want):
                continue  # fewer devices in service than fragments: nothing better
            spare = [d for d in want if d not in st.devices and volume.transport.is_up(d)]
            off = [i for i, d in enumerate(st.devices) if d not in want]
            # all of a stripe's moves or none: part of them could put two fragments
            # in one failure domain
            if not off or len(spare) < len(off) or data.needs_repair(st) or \
                    not all(volume.transport.is_up(d) for d in st.devices):
                continue
            examined += 1
            await pace.spent(2 * st.frag_len * len(off))  # each read, then written
            devices, fresh = list(st.devices), {}
            with volume.data.pending(sid):  # copies not in the record yet: not leaks
                for i, target in zip(off, spare):
                    try:
                        frag = await data._read_fragment(sid, st, i)  # verified
                        head = fr.build_header(sid, i, st.k, st.m, frag, st.frag_version)
                        await volume.transport.put(target, fr.fragment_name(sid, i),
                                                   [head, frag])
                    except (DeviceError, fr.CorruptFragment) as e:
                        log.warning("rebalance: stripe %d fragment %d: %s", sid, i, e)
                        failed += 1
                        break
                    fresh[i], devices[i] = devices[i], target
                else:
                    done = await _commit_moves(volume, sid, fresh, devices)
                    moved += done
                    nbytes += done * st.frag_len
                    continue
                for i in fresh:  # a move failed: the stripe stays as it was
                    try:
                        await volume.transport.delete(devices[i], fr.fragment_name(sid, i))
                    except DeviceError:
                        pass  # its device failed too: swept as a leak later
        await volume.record_damage()
    return {"stripes": len(stripes), "stripes_rebalanced": examined,
            "fragments_moved": moved, "bytes_moved": nbytes, "fragments_failed": failed}


async def scrub(volume, progress=None, limit: float | None = None) -> dict:
    bad = 0
    pace = _Pace(limit)
    stripes = [x async for x in _stripes(volume)]
    for n, (sid, st) in enumerate(stripes, 1):
        for i, dev in enumerate(st.devices):
            if dev == NO_DEVICE:
                continue
            try:
                await volume.data._read_fragment(sid, st, i)
            except (DeviceError, fr.CorruptFragment):
                bad += 1  # _read_fragment queued it through on_damage
            await pace.spent(st.frag_len)
        if progress:
            progress(n, len(stripes))
    await volume.record_damage()
    result = await repair(volume, limit=limit)
    return {"fragments_checked": sum(len(st.devices) for _, st in stripes),
            "bad_fragments": bad, **result}
