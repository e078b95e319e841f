"""The conformance suite every KV engine must pass (run by tests/test_t1_kv.py on
memory and sqlite, and tests/test_t1_kv_etcd.py on a real etcd cluster).

Each check takes a fresh, empty engine and may close it (closing twice is harmless).
"""
import pytest
import trio

from bmfs.errors import Conflict, MetaDamaged, NotFound, NotSupported
from bmfs.kv import prefix_end
from bmfs.kv.seal import seal


async def check_basic(kv):
    assert await kv.get(b"a") is None
    t = kv.begin()
    t.put(b"a", b"1")
    t.put(b"b", b"2")
    t.put(b"c\x00\xff", b"\x00binary\xff")
    await kv.commit(t)
    assert await kv.get(b"a") == b"1"
    assert await kv.get(b"c\x00\xff") == b"\x00binary\xff"
    assert await kv.range(b"a", b"c") == [(b"a", b"1"), (b"b", b"2")]
    assert await kv.range(b"", b"") == [(b"a", b"1"), (b"b", b"2"), (b"c\x00\xff", b"\x00binary\xff")]
    assert await kv.range(b"a", b"", limit=2) == [(b"a", b"1"), (b"b", b"2")]
    t = kv.begin()
    t.delete(b"a")
    await kv.commit(t)
    assert await kv.get(b"a") is None
    assert await kv.range(b"", b"") == [(b"b", b"2"), (b"c\x00\xff", b"\x00binary\xff")]


async def check_txn_sees_own_writes(kv):
    t = kv.begin()
    t.put(b"p/1", b"x")
    assert await t.get(b"p/1") == b"x"
    assert await t.range(b"p/", prefix_end(b"p/")) == [(b"p/1", b"x")]
    t.delete(b"p/1")
    assert await t.get(b"p/1") is None
    assert await t.range(b"p/", prefix_end(b"p/")) == []
    await kv.commit(t)
    assert await kv.get(b"p/1") is None


async def check_conflict(kv):
    t0 = kv.begin()
    t0.put(b"k", b"0")
    await kv.commit(t0)
    t1, t2 = kv.begin(), kv.begin()
    assert await t1.get(b"k") == b"0"
    assert await t2.get(b"k") == b"0"
    t1.put(b"k", b"1")
    t2.put(b"k", b"2")
    await kv.commit(t1)
    try:
        await kv.commit(t2)
    except Conflict:
        pass
    else:
        raise AssertionError("second writer of a read key must conflict")
    assert await kv.get(b"k") == b"1"
    # absent keys conflict too: two creators of one name
    t1, t2 = kv.begin(), kv.begin()
    assert await t1.get(b"new") is None and await t2.get(b"new") is None
    t1.put(b"new", b"a")
    t2.put(b"new", b"b")
    await kv.commit(t1)
    try:
        await kv.commit(t2)
        raise AssertionError("create race must conflict")
    except Conflict:
        pass
    # a failed commit wrote nothing
    t = kv.begin()
    await t.get(b"k")
    t.put(b"side", b"effect")
    t3 = kv.begin()
    t3.put(b"k", b"9")
    await kv.commit(t3)
    try:
        await kv.commit(t)
    except Conflict:
        pass
    assert await kv.get(b"side") is None


async def check_transact_counter(kv):
    async def incr(txn):
        v = await txn.get(b"ctr")
        n = int(v or b"0") + 1
        await trio.sleep(0)  # let others interleave between read and commit
        txn.put(b"ctr", str(n).encode())
        return n
    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(kv.transact, incr)
    assert await kv.get(b"ctr") == b"20"


async def check_large_and_many(kv):
    big = bytes(range(256)) * 1024  # 256 KiB value
    t = kv.begin()
    t.put(b"big", big)
    for i in range(500):
        t.put(b"m/%05d" % i, b"%d" % i)
    await kv.commit(t)
    assert await kv.get(b"big") == big
    rows = await kv.range(b"m/", prefix_end(b"m/"))
    assert len(rows) == 500 and rows[0] == (b"m/00000", b"0") and rows[-1][0] == b"m/00499"
    page = await kv.range(b"m/00100", prefix_end(b"m/"), limit=10)
    assert [k for k, _ in page] == [b"m/%05d" % i for i in range(100, 110)]
    await kv.sync()


async def check_error_on_stale_reads_is_retried(kv):
    """An error raised by a transaction body stands only if what it read is still
    current: here the first run reads ``a`` and, after a concurrent commit changes it,
    raises; the second run must happen and succeed."""
    t = kv.begin()
    t.put(b"a", b"1")
    await kv.commit(t)
    runs = []

    async def body(txn):
        runs.append(await txn.get(b"a"))
        if len(runs) == 1:
            other = kv.begin()
            other.put(b"a", b"2")
            await kv.commit(other)
            raise ValueError("a verdict on a state that no longer is")
        txn.put(b"b", runs[-1])
    await kv.transact(body)
    assert runs == [b"1", b"2"] and await kv.get(b"b") == b"2"

    async def fails(txn):  # an error on reads that are still current stands
        await txn.get(b"a")
        raise ValueError("genuine")
    try:
        await kv.transact(fails)
        raise AssertionError("the error was swallowed")
    except ValueError as e:
        assert str(e) == "genuine"


async def check_damaged_values_are_errors(kv):
    """Values are stored sealed (bmfs/kv/seal.py): one changed in the store, or sealed
    under another key, fails every read path with MetaDamaged (EIO), never content;
    the others around it still read."""
    t = kv.begin()
    for k in (b"p/a", b"p/b", b"p/c"):
        t.put(k, b"value of " + k)
    await kv.commit(t)
    stored = dict(await kv.raw_range(b"p/", b"p0"))
    assert stored[b"p/b"] == seal(b"p/b", b"value of p/b")  # the format, byte for byte
    changed = bytearray(stored[b"p/b"])
    changed[0] ^= 0x20
    # written through the engine's own primitive, as damage on its disk would be
    await kv._commit({}, {b"p/b": bytes(changed), b"p/c": stored[b"p/a"]})

    async def reads(key):
        yield kv.get(key)
        yield kv.range(b"p/", b"p0")
        yield kv.begin().get(key)
        yield kv.begin().range(b"p/", b"p0")

        async def fn(txn):  # a transaction's error stands (nothing changed meanwhile)
            return await txn.get(key)
        yield kv.transact(fn)
    for key in (b"p/b", b"p/c"):
        async for read in reads(key):
            with pytest.raises(MetaDamaged) as e:
                await read
            assert e.value.key in (b"p/b", b"p/c")
    assert await kv.get(b"p/a") == b"value of p/a"
    assert await kv.range(b"p/", b"p/b") == [(b"p/a", b"value of p/a")]
    t = kv.begin()  # rewriting a damaged record mends it
    t.put(b"p/b", b"new")
    await kv.commit(t)
    assert await kv.get(b"p/b") == b"new"


async def _receive(changes, n: int) -> list:
    """The next ``n`` changes of a watch (failing after a generous wait)."""
    got = []
    with trio.fail_after(20):
        while len(got) < n:
            got.append(await changes.receive())
    return got


async def check_watch(kv):
    """A watch delivers the committed changes of its range from when it began, in
    commit order, checked (values unsealed, deletions as None), nothing outside."""
    assert kv.caps.watch
    t = kv.begin()
    t.put(b"w/before", b"0")  # before the watch: not delivered
    await kv.commit(t)
    async with kv.watch(b"w/") as changes, kv.watch(b"r/b", b"r/d") as ranged:
        t = kv.begin()
        t.put(b"w/a", b"1")
        t.put(b"x", b"outside")
        t.put(b"r/a", b"no")
        t.put(b"r/b", b"yes")
        await kv.commit(t)
        t = kv.begin()
        t.delete(b"w/a")
        t.put(b"w/b", b"2")
        t.put(b"r/c", b"yes too")
        t.put(b"r/d", b"no")
        await kv.commit(t)
        got = await _receive(changes, 3)
        assert got[0] == (b"w/a", b"1")
        assert sorted(got[1:], key=lambda c: c[0]) == [(b"w/a", None), (b"w/b", b"2")]
        assert await _receive(ranged, 2) == [(b"r/b", b"yes"), (b"r/c", b"yes too")]
        t = kv.begin()  # a marker: nothing else came before it
        t.put(b"w/z", b"end")
        await kv.commit(t)
        assert await _receive(changes, 1) == [(b"w/z", b"end")]


async def check_leases(kv):
    """Keys put with a lease vanish when it is revoked or expires; renewing an expired
    one is NotFound. Engines without leases say so (NotSupported), never pretend."""
    if not kv.caps.leases:
        for call in (kv.grant_lease(5), kv.keepalive(1), kv.revoke_lease(1),
                     kv.put_with_lease(b"n/1", b"up", 1)):
            with pytest.raises(NotSupported):
                await call
        return
    lease = await kv.grant_lease(5)
    await kv.put_with_lease(b"n/1", b"up", lease)
    assert await kv.keepalive(lease) == 5
    assert await kv.get(b"n/1") == b"up"
    await kv.revoke_lease(lease)
    assert await kv.get(b"n/1") is None
    with pytest.raises(NotFound):
        await kv.keepalive(lease)
    short = await kv.grant_lease(2)  # (etcd's shortest)
    await kv.put_with_lease(b"n/2", b"up", short)
    assert await kv.get(b"n/2") == b"up"
    with trio.fail_after(30):  # not renewed: it expires, and its key goes with it
        while await kv.get(b"n/2") is not None:
            await trio.sleep(0.2)
    with pytest.raises(NotFound):
        await kv.keepalive(short)


async def check_close(kv):
    """After aclose every read and commit raises ClosedResourceError ("you closed
    it", not "it broke"); closing again is harmless."""
    t = kv.begin()
    t.put(b"a", b"1")
    await kv.commit(t)
    pending = kv.begin()
    pending.put(b"b", b"2")
    await kv.aclose()
    assert kv.closed
    for call in (kv.get(b"a"), kv.range(b"", b""), kv.commit(pending),
                 kv.transact(lambda txn: txn.get(b"a"))):
        with pytest.raises(trio.ClosedResourceError):
            await call
    with pytest.raises(trio.ClosedResourceError):
        kv.begin()
    await kv.aclose()


async def _cancelled_after(checkpoints: int, fn) -> bool:
    """Run ``fn()`` and cancel it after ``checkpoints`` scheduling points of a task
    beside it (0: before it starts its first wait): whether it finished first."""
    done = False
    async with trio.open_nursery() as nursery:
        async def canceller():
            for _ in range(checkpoints):
                await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()

        async def run():
            nonlocal done
            await fn()
            done = True
            nursery.cancel_scope.cancel()
        nursery.start_soon(run)
        nursery.start_soon(canceller)
    return done


async def check_cancelled_commits_are_all_or_nothing(kv):
    """A commit cancelled at any point (trio cancel) leaves all of its writes or none,
    and the engine goes on working: later transactions read and commit as usual."""
    for n in range(16):
        prefix = b"c/%02d/" % n
        t = kv.begin()
        for i in range(5):
            t.put(prefix + b"%d" % i, b"v%d" % n)

        async def commit():
            await kv.commit(t)
        finished = await _cancelled_after(n, commit)
        rows = await kv.range(prefix, prefix_end(prefix))
        assert len(rows) in (0, 5), (n, rows)
        if finished:
            assert len(rows) == 5
    await check_transact_counter(kv)


async def check_maybe_committed_retry_applies_once(kv):
    """A commit whose caller never learnt the outcome (cancelled while under way:
    maybe committed) is retried through a request key the mutation writes: the retry
    finds it if the first attempt landed, so each mutation applies exactly once."""
    async def mutation(rid):
        async def fn(txn):
            if await txn.get(rid) is not None:
                return False  # (the first attempt committed)
            n = int(await txn.get(b"ctr") or b"0")
            txn.put(b"ctr", b"%d" % (n + 1))
            txn.put(rid, b"1")
            return True
        return await kv.transact(fn)
    for n in range(16):
        rid = b"req/%02d" % n

        async def attempt():
            await mutation(rid)
        await _cancelled_after(n, attempt)
        await mutation(rid)  # the retry: applies it, or finds it applied
    assert await kv.get(b"ctr") == b"16"
    assert len(await kv.range(b"req/", b"req0")) == 16


CHECKS = [check_basic, check_txn_sees_own_writes, check_conflict, check_transact_counter,
          check_large_and_many, check_error_on_stale_reads_is_retried,
          check_damaged_values_are_errors, check_watch, check_leases, check_close,
          check_cancelled_commits_are_all_or_nothing, check_maybe_committed_retry_applies_once]
