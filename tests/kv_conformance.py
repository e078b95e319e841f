"""The conformance suite every KV engine must pass (run by tests/test_t1_kv.py).

``open_engine`` is an async context manager factory yielding a fresh, empty KV.
"""
import trio

from bmfs.errors import Conflict
from bmfs.kv import prefix_end


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


CHECKS = [check_basic, check_txn_sees_own_writes, check_conflict, check_transact_counter,
          check_large_and_many, check_error_on_stale_reads_is_retried]
