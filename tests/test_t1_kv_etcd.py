"""Level 1: the KV conformance suite, failover and watch on a real 3-member etcd cluster
(with TLS client certificates and a root password, as `bmfs cluster up` runs it)."""
import contextlib
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
import trio

from bmfs.cluster.etcd import EtcdCluster
from bmfs.errors import Access, IOFailure, Unavailable
from bmfs.kv import open_kv, prefix_end
from bmfs.kv.etcd import REQ_PREFIX, EtcdKV, _b64
from bmfs.kv.etcd_auth import parse_url
from etcd_cluster import etcd_cluster  # noqa: F401  (the fixture)
from kv_conformance import CHECKS


def run(cluster, fn, url=None):
    """trio.run ``fn(kv)`` on a fresh engine connected to ``cluster``."""
    async def main():
        kv = await open_kv(url or cluster.url)
        try:
            return await fn(kv)
        finally:
            await kv.aclose()
    return trio.run(main)


async def _put(kv, key, value):
    txn = kv.begin()
    txn.put(key, value) if value is not None else txn.delete(key)
    await kv.commit(txn)


async def _caches_live(*kvs):
    with trio.fail_after(5):
        while not all(kv.cache.live for kv in kvs):
            await trio.sleep(0.01)


def _count_calls(kv) -> list:
    """The gateway paths ``kv`` requests from now on, in order."""
    sent, real = [], kv._call

    async def counting(path, body, timeout=None):
        sent.append(path)
        return await real(path, body, timeout)
    kv._call = counting
    return sent


@contextlib.asynccontextmanager
async def _writing_behind(cluster, a):
    """``a`` with its cache live and write-behind on, and a second client without a
    cache (it reads etcd itself)."""
    c = await EtcdKV.create(cluster.url, cache=False)
    try:
        await _caches_live(a)
        a.enable_write_behind()
        yield c
    finally:
        await c.aclose()


async def _incr(txn):
    n = int(await txn.get(b"ctr") or b"0") + 1
    txn.put(b"ctr", b"%d" % n)
    return n


@pytest.mark.parametrize("api", ["grpc", "gateway"])
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(etcd_cluster, check, api):
    etcd_cluster.wipe()
    run(etcd_cluster, check, url=etcd_cluster.url + f"&api={api}")


def test_requests_go_over_grpc_unless_the_url_says_gateway(etcd_cluster):
    """The default sends reads and commits over gRPC (the gateway answers watches);
    api=gateway sends everything through the gateway; a wrong api= is refused."""
    etcd_cluster.wipe()

    async def main(kv):
        grpc_before = kv._grpc.calls if kv._grpc is not None else None
        await _put(kv, b"a", b"1")
        assert await kv.get(b"a") == b"1"
        return grpc_before, kv._grpc.calls if kv._grpc is not None else None
    before, after = run(etcd_cluster, main)
    assert after >= before + 2
    assert run(etcd_cluster, main, url=etcd_cluster.url + "&api=gateway") == (None, None)
    with pytest.raises(ValueError, match="api='http'"):
        run(etcd_cluster, main, url=etcd_cluster.url + "&api=http")


def test_request_ids_hidden_and_leased(etcd_cluster):
    etcd_cluster.wipe()

    async def main(kv):
        t = kv.begin()
        t.put(b"a", b"1")
        await kv.commit(t)
        assert await kv.range(b"", b"") == [(b"a", b"1")]
        ids = await kv._call("/v3/kv/range", {"key": _b64(REQ_PREFIX),
                                              "range_end": _b64(prefix_end(REQ_PREFIX))})
        assert int(ids["count"]) == 1 and ids["kvs"][0]["lease"] != "0"
        # the request-id lease vanishes (revoked, backup restored): commits go on
        old = kv._req_lease[0]
        await kv.revoke_lease(old)
        t = kv.begin()
        t.put(b"b", b"2")
        await kv.commit(t)
        assert kv._req_lease[0] != old and await kv.get(b"b") == b"2"
    run(etcd_cluster, main)


def test_lost_answer_retry_is_idempotent(etcd_cluster):
    """The first txn reaches etcd but its answer is 'lost': the retry must not apply twice."""
    etcd_cluster.wipe()

    async def main(kv):
        await kv.transact(_incr)
        real_post, lost = kv._post, []

        async def post(ep, path, body, token, timeout):
            answer = await real_post(ep, path, body, token, timeout)
            if path == "/v3/kv/txn" and not lost:  # applied, but the answer is lost
                lost.append(path)
                return 503, {"code": 14, "message": "connection dropped (simulated)"}
            return answer
        kv._post = post
        assert await kv.transact(_incr) == 2
        assert lost and kv.failovers == 1
        assert await kv.get(b"ctr") == b"2"
    run(etcd_cluster, main)


@pytest.mark.parametrize("talking_to", ["leader", "follower"])
def test_leader_kill_loses_no_acknowledged_increment(etcd_cluster, talking_to):
    etcd_cluster.wipe()
    leader = etcd_cluster.leader_index()
    first = leader if talking_to == "leader" else (leader + 1) % 3
    order = [first] + [i for i in range(3) if i != first]
    url = etcd_cluster.url_of(order)
    acks: list[float] = []
    kill_at = [float("inf")]

    slowest = [0.0]

    async def worker(kv):
        while sum(t > kill_at[0] for t in acks[-100:]) < 100:  # 100 commits after the kill
            t0 = trio.current_time()
            await kv.transact(_incr)
            acks.append(trio.current_time())
            slowest[0] = max(slowest[0], acks[-1] - t0)

    async def main(kv):
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(worker, kv)
                await trio.sleep(0.5)
                etcd_cluster.kill(leader)
                kill_at[0] = trio.current_time()
        after = [kill_at[0]] + [t for t in acks if t > kill_at[0]]
        stall = max(b - a for a, b in zip(after, after[1:]))
        final = int(await kv.get(b"ctr"))
        print(f"\netcd leader SIGKILL while talking to the {talking_to}: no commit for "
              f"{stall:.2f} s, slowest transact {slowest[0]:.2f} s; {len(acks)} acknowledged, "
              f"counter {final}, {kv.failovers} failovers")
        assert final == len(acks)
        assert stall < 8
    try:
        run(etcd_cluster, main, url)
    finally:
        etcd_cluster.restart(leader)


def test_unreachable_endpoints_give_unavailable():
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections into the backlog, never answers
    try:
        hosts = [f"127.0.0.1:{s.getsockname()[1]}" for s in (refused, silent)]
        url = "etcd://" + ",".join(hosts)
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match=hosts[1]) as exc:
            trio.run(EtcdKV.create, url)
        assert time.monotonic() - t0 < 5
        assert hosts[0] in str(exc.value)

        async def cut_off():
            kv = EtcdKV(url, parse_url(url), timeout=1.5, request_timeout=0.5)
            try:
                await kv.get(b"x")
            finally:
                await kv.aclose()
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="etcd cluster unavailable"):
            trio.run(cut_off)
        assert time.monotonic() - t0 < 3
    finally:
        refused.close()
        silent.close()


def test_dead_endpoint_is_skipped(etcd_cluster):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    try:
        url = etcd_cluster.url.replace("etcd://", f"etcd://127.0.0.1:{dead.getsockname()[1]},")
        run(etcd_cluster, lambda kv: kv.get(b"x"), url)
    finally:
        dead.close()


def test_watch_survives_failover(etcd_cluster):
    etcd_cluster.wipe()
    victim = []

    async def put(kv, key, value):
        t = kv.begin()
        if value is None:
            t.delete(key)
        else:
            t.put(key, value)
        await kv.commit(t)

    async def main(kv):
        async with kv.watch(b"w/") as changes:
            await put(kv, b"w/a", b"1")
            await put(kv, b"x", b"outside the prefix")
            await put(kv, b"w/b", b"")
            await put(kv, b"w/a", None)
            with trio.fail_after(5):
                assert [await changes.receive() for _ in range(3)] == [
                    (b"w/a", b"1"), (b"w/b", b""), (b"w/a", None)]
            victim.append(kv._cur)  # the member both the engine and the watch talk to
            etcd_cluster.kill(victim[0])
            for i in range(5):
                await put(kv, b"w/%d" % i, b"v%d" % i)
            with trio.fail_after(15):
                assert [await changes.receive() for _ in range(5)] == [
                    (b"w/%d" % i, b"v%d" % i) for i in range(5)]
            with trio.move_on_after(0.3):
                extra = await changes.receive()
                raise AssertionError(f"unexpected change {extra}")
    try:
        run(etcd_cluster, main)
    finally:
        if victim:
            etcd_cluster.restart(victim[0])


def test_watch_ends_when_quorum_is_lost(etcd_cluster):
    """A watch on a member cut off from the leader ends (hasleader) and gives Unavailable."""
    lone = 2

    async def main():
        kv = await EtcdKV.create(etcd_cluster.url_of([lone]), timeout=1)
        try:
            with trio.fail_after(15):
                with pytest.raises(Unavailable, match="no leader"):
                    async with kv.watch(b"w/") as changes:
                        etcd_cluster.kill(0)
                        etcd_cluster.kill(1)
                        async for change in changes:
                            raise AssertionError(f"unexpected change {change}")
        finally:
            await kv.aclose()
    try:
        trio.run(main)
    finally:
        etcd_cluster.restart(0)
        etcd_cluster.restart(1)


def test_read_cache_two_clients(etcd_cluster):
    """Client A reads through its cache; client B changes what A cached. A's reads are
    never committed on stale values, a barrier makes B's commits visible, and the cache
    keeps up (losslessly) when the member its watch talks to is killed."""
    etcd_cluster.wipe()
    victim = []

    async def main(a):
        b = await EtcdKV.create(etcd_cluster.url, cache=False)
        try:
            await _caches_live(a)
            assert await a.transact(_incr) == 1        # a caches ctr at 1
            t = a.begin()
            assert await t.get(b"ctr") == b"1"
            reads = a.cache.hits
            assert await a.begin().get(b"ctr") == b"1"
            assert a.cache.hits == reads + 1           # answered from the cache
            for _ in range(3):
                await b.transact(_incr)                # b moves ctr to 4 behind a's back
            # a stale read in a transaction cannot commit; transact retries it afresh
            assert await a.transact(_incr) == 5
            await b.transact(_incr)                    # 6
            await a.barrier()                          # close-to-open
            assert await a.begin().get(b"ctr") == b"6"
            assert await a.get(b"ctr") == b"6"         # get outside a txn: always fresh
            # absent keys are cached too, and a creation elsewhere reaches the cache
            assert await a.begin().get(b"new") is None
            t = b.begin()
            t.put(b"new", b"x")
            await b.commit(t)
            await a.barrier()
            assert await a.begin().get(b"new") == b"x"
            # kill the member a's cache watch talks to: the watch resumes elsewhere,
            # later changes by b still reach a's cache
            victim.append(a._cur)
            etcd_cluster.kill(victim[0])
            for _ in range(5):
                await b.transact(_incr)                # 11
            with trio.fail_after(15):
                await a.barrier()
                while (await a.begin().get(b"ctr")) != b"11":
                    await trio.sleep(0.05)
            assert a.cache.live and await a.transact(_incr) == 12
        finally:
            await b.aclose()
    try:
        run(etcd_cluster, main)
    finally:
        if victim:
            etcd_cluster.restart(victim[0])


def test_write_behind_two_clients_serializable(etcd_cluster):
    """Two clients committing behind (bmfs/kv/etcd_writeback.py) increment one counter
    from several tasks each: the token passes between them (recalls), every increment
    sees the one before it (no lost update, no value given twice), and a reader that
    does not hold the token sees everything after a barrier."""
    etcd_cluster.wipe()

    async def main(a):
        b = await EtcdKV.create(etcd_cluster.url)
        c = await EtcdKV.create(etcd_cluster.url)  # a plain reader: never takes the token
        got = []
        try:
            a.enable_write_behind()
            b.enable_write_behind()
            await _caches_live(a, b, c)

            async def worker(kv, n):
                for _ in range(n):
                    got.append(await kv.transact(_incr))
            # a alone first: it takes the token and commits behind
            await worker(a, 100)
            assert a.wb.holding and a.wb.entries + len(a.wb.queue) == 100
            await c.barrier()  # recalls a's token: a commits its queue first
            assert await c.get(b"ctr") == b"100" and not a.wb.holding
            # the queue was sent in batches, not one transaction per increment
            assert a.wb.entries == 100 and a.wb.batches < 50
            # both now contend: the token goes back and forth (a short quiet time after a
            # recall, so that both take it many times)
            a.wb.quiet = b.wb.quiet = 0.02
            before = a.wb.entries
            with trio.fail_after(120):
                async with trio.open_nursery() as n:
                    for kv in (a, b, a, b):
                        n.start_soon(worker, kv, 100)
            await a.sync()
            await b.sync()
            assert sorted(got) == list(range(1, 501))
            await c.barrier()
            assert await c.get(b"ctr") == b"500"
            assert a.wb.lost == b.wb.lost == 0
            assert a.wb.entries > before and b.wb.entries > 0  # both decided locally
        finally:
            await b.aclose()
            await c.aclose()
    run(etcd_cluster, main)


def test_complete_prefixes(etcd_cluster):
    """A prefix read whole (or declared empty) answers lookups and ranges under it from
    the cache, kept current by the watch; a wrong hint only costs a conflict."""
    etcd_cluster.wipe()

    async def main(a):
        b = await EtcdKV.create(etcd_cluster.url, cache=False)
        try:
            await _caches_live(a)
            for i in range(3):
                await _put(b, b"d/%d" % i, b"v%d" % i)
            await a.prefetch(b"d/")
            assert a.cache.covers(b"d/")
            real = a._call
            calls = _count_calls(a)
            t = a.begin()
            assert await t.get(b"d/9") is None                   # absent: known locally
            assert [k for k, _ in await t.range(b"d/", b"d0")] == [b"d/0", b"d/1", b"d/2"]
            assert calls == []
            await _put(b, b"d/5", b"new")                       # elsewhere: the watch brings it
            await _put(b, b"d/1", None)
            await a.barrier()
            calls.clear()
            t = a.begin()
            assert await t.range(b"d/", b"d0") == [(b"d/0", b"v0"), (b"d/2", b"v2"),
                                                   (b"d/5", b"new")]
            assert await t.get(b"d/5") == b"new" and calls == []
            # a false "empty" hint: the commit compares, conflicts, and the retry reads afresh
            await _put(b, b"e/x", b"there")
            await a.barrier()
            a.known_empty([b"e/"])

            async def create_once(txn):
                if await txn.get(b"e/x") is not None:
                    return "exists"
                txn.put(b"e/x", b"mine")
                return "created"
            a._call = real
            assert await a.transact(create_once) == "exists"
            assert await a.get(b"e/x") == b"there"
        finally:
            await b.aclose()
    run(etcd_cluster, main)


def test_write_behind_limited_ranges_page_exactly(etcd_cluster):
    """Ranges with a limit (paging, as layer GC and branch diffs do) over keys this
    client has queued deletes and additions for: pages join up to exactly the state
    with the queue applied, in and outside transactions."""
    etcd_cluster.wipe()

    async def main(a):
        for i in range(0, 20, 2):
            await _put(a, b"p/%02d" % i, b"etcd")
        await _caches_live(a)
        a.enable_write_behind()
        hold = trio.Event()
        real = a.wb._commit_batch

        async def stalled():  # keep the queue (and so the overlay) until released
            await hold.wait()
            await real()
        a.wb._commit_batch = stalled

        async def change(txn):
            for i in (0, 2, 4, 6):
                txn.delete(b"p/%02d" % i)
            txn.put(b"p/07", b"queued")
            txn.put(b"p/99", b"queued")
        await a.transact(change)
        assert a.wb.holding and a.wb.queue
        want = [b"p/07"] + [b"p/%02d" % i for i in range(8, 20, 2)] + [b"p/99"]

        async def paged(get, limit):
            got, start = [], b"p/"
            while True:
                rows = await get(start, limit)
                got += [k for k, _ in rows]
                if len(rows) < limit:
                    return got
                start = rows[-1][0] + b"\0"
        for limit in (1, 2, 3, 5):
            assert await paged(lambda s, n: a.range(s, b"p0", n), limit) == want, limit
            assert await paged(lambda s, n: a.begin().range(s, b"p0", n), limit) == want, limit
        hold.set()
        await a.sync()
        assert [k for k, _ in await a.range(b"p/", b"p0")] == want
    run(etcd_cluster, main)


def test_write_behind_sync_under_load(etcd_cluster):
    """sync() (fsync) waits for what was queued before it, not for a queue that other
    tasks keep filling: it returns while they go on, and what it waited for is in etcd."""
    etcd_cluster.wipe()

    async def main(a):
        async with _writing_behind(etcd_cluster, a) as c:
            stop = False

            async def busy():
                while not stop:
                    await a.transact(_incr)
            async with trio.open_nursery() as n:
                for _ in range(3):
                    n.start_soon(busy)
                await trio.sleep(1)
                assert a.wb.holding
                before = int(await a.begin().get(b"ctr"))
                with trio.fail_after(5):
                    await a.sync()
                committed = int(await c.get(b"ctr"))  # etcd itself, not a's queue
                still_busy = a.wb.queue or int(await a.begin().get(b"ctr")) > before
                stop = True
            assert committed >= before and still_busy
    run(etcd_cluster, main)


def test_write_behind_groups_operations_into_few_transactions(etcd_cluster):
    """Operations queued one at a time, each a moment after the last (as FUSE requests
    come), reach etcd in one transaction per batch, not one each; a sync (fsync) sends
    the batch at once instead of letting it gather."""
    etcd_cluster.wipe()

    async def main(a):
        async with _writing_behind(etcd_cluster, a) as c:
            await a.transact(_incr)  # takes the token
            await a.sync()
            assert a.wb.holding
            a.wb.group_wait = 60.0  # longer than the test: only sync sends the batch
            sent = _count_calls(a)
            for i in range(50):
                async def put(txn, i=i):
                    txn.put(b"g/%02d" % i, b"v")
                await a.transact(put)
                await trio.sleep(0.002)
            assert sent.count("/v3/kv/txn") == 0 and len(a.wb.queue) == 50
            with trio.fail_after(30):
                await a.sync()
            assert sent.count("/v3/kv/txn") == 1
            assert [k for k, _ in await c.range(b"g/", b"g0")] == [b"g/%02d" % i
                                                                for i in range(50)]
    run(etcd_cluster, main)


# -- authentication (certificates and a root password: bmfs/kv/etcd_auth.py) -------------
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _curl(*args, user=()):
    r = subprocess.run([*user, "curl", "-s", "-m", "5", *args], capture_output=True)
    return r.returncode, r.stdout.decode(errors="replace")


def test_unauthenticated_requests_get_nothing(etcd_cluster):
    """What a local user (nobody), or anyone who reaches the members' ports, gets from
    each member: no TLS without a certificate of the cluster's CA (and they cannot read
    the CA's, the client's or the password's files); and even with the client
    certificate but no password, etcd reads and writes nothing."""
    etcd_cluster.wipe()
    secret = b"the content of root's 0600 file"
    run(etcd_cluster, lambda kv: _put(kv, b"t/0000000000000002@00000001", secret))
    key = _b64(b"t/0000000000000002@00000001")
    every = {"key": _b64(b"\0"), "range_end": _b64(b"\0")}
    creds = etcd_cluster.creds
    for f in (creds.ca, creds.cert, creds.key, creds.password_file):
        assert subprocess.run([*NOBODY, "cat", f], capture_output=True).returncode != 0
    for i, ep in enumerate(etcd_cluster.endpoints):
        http = ep.replace("https://", "http://")
        for path, body in [("/v3/kv/range", every), ("/v3/kv/put", {"key": key, "value": "eA=="}),
                           ("/v3/kv/deleterange", every)]:
            for args in ([http + path, "-d", json.dumps(body)],          # plain http
                         ["-k", ep + path, "-d", json.dumps(body)]):   # https, no certificate
                code, out = _curl(*args, user=NOBODY)
                assert _b64(secret) not in out and '"kvs"' not in out and '"header"' not in out, \
                    (args, code, out)
            # the client certificate without the password (as root, who can read it)
            code, out = _curl("--cacert", creds.ca, "--cert", creds.cert, "--key", creds.key,
                              ep + path, "-d", json.dumps(body))
            assert code == 0 and "permission denied" in out or "user name is empty" in out, out
            assert _b64(secret) not in out
    # nothing was written or deleted
    assert run(etcd_cluster, lambda kv: kv.range(b"", b"")) == [
        (b"t/0000000000000002@00000001", secret)]


def test_wrong_credentials_are_clear_errors(etcd_cluster, tmp_path):
    """A wrong password, a missing client certificate, a URL without the CA or without
    a user: each fails at once with one error saying what to fix, through the engine
    and through the CLI (exit 2, one line)."""
    creds = etcd_cluster.creds
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not the password\n")
    wrong.chmod(0o600)
    url = etcd_cluster.url
    no_opts = url.split("?")[0]
    cases = {
        url.replace(creds.password_file, str(wrong)): "authentication failed",
        url.replace(f"&cert={creds.cert}&key={creds.key}", ""): "TLS refused",
        f"{no_opts}?cacert={creds.ca}&cert={creds.cert}&key={creds.key}":
            "requires authentication",
        no_opts: "speaks https",
        url.replace(creds.key, str(tmp_path / "missing.key")): "cannot use the client cert",
        url + "&colour=blue": "unknown etcd URL option",
        url.replace(f"cacert={creds.ca}", "cacert=ca.crt"): "absolute path",
    }
    for bad, says in cases.items():
        t0 = time.monotonic()
        with pytest.raises((Access, ValueError), match=says):
            trio.run(EtcdKV.create, bad)
        print(f"{says}: {time.monotonic() - t0:.2f} s")
        assert time.monotonic() - t0 < 6, (bad, time.monotonic() - t0)  # (connect timeout 3 s)
    for bad, says in list(cases.items())[:2]:
        r = subprocess.run([sys.executable, "-m", "bmfs.cli.main", "mkfs", str(tmp_path / "v"),
                            "--meta", bad], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and says in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_expired_token_is_renewed():
    """etcd forgets a token unused for --auth-token-ttl: the engine authenticates again
    and its requests, and a watch it starts afterwards, go on (also once the member
    has restarted)."""
    cluster = EtcdCluster(size=1, flags=("--auth-token-ttl", "1"))
    try:
        async def main():
            kv = await EtcdKV.create(cluster.url, cache=False)
            try:
                await _put(kv, b"a", b"1")
                await trio.sleep(2.5)  # the token expires
                assert await kv.get(b"a") == b"1"
                assert kv.authentications == 2
                await trio.sleep(2.5)
                async with kv.watch(b"w/") as changes:
                    await _put(kv, b"w/x", b"2")
                    with trio.fail_after(5):
                        assert await changes.receive() == (b"w/x", b"2")
                assert kv.authentications == 3
                cluster.restart(0)
                assert await kv.get(b"a") == b"1"
            finally:
                await kv.aclose()
        trio.run(main)
    finally:
        cluster.stop()


def test_a_password_alone_over_http(tmp_path):
    """Authentication without certificates (plain http, a user and a password file):
    the engine works with its token; without the user it is refused in one line."""
    from bmfs.cluster.etcd import _post
    cluster = EtcdCluster(size=1, secure=False)
    try:
        ep = cluster.endpoints[0]
        (tmp_path / "pw").write_text("a password\n")
        _post(ep, "/v3/auth/user/add", {"name": "root", "password": "a password"})
        _post(ep, "/v3/auth/role/add", {"name": "root"})
        _post(ep, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        _post(ep, "/v3/auth/enable", {})

        async def main(kv):
            await _put(kv, b"a", b"1")
            return await kv.get(b"a"), kv.authentications
        assert run(cluster, main, f"{cluster.url}?user=root&password-file={tmp_path}/pw") \
            == (b"1", 1)
        with pytest.raises(Access, match="requires authentication"):
            run(cluster, main)
    finally:
        cluster.stop()


# -- history compaction (bmfs/kv/etcd_compact.py) ------------------------------------------
def test_a_watch_resuming_from_compacted_history_says_so(etcd_cluster):
    """A watch whose connection breaks resumes after the last change it delivered; if
    the history it needs was compacted meanwhile, it fails (IOFailure) instead of
    skipping changes silently, and the read cache, whose own watch fails the same
    way, starts afresh: it never answers with a value from before the gap."""
    etcd_cluster.wipe()

    async def main(kv):
        other = await open_kv(etcd_cluster.url)
        real_stream, broken, gate = kv._client.stream, [False], trio.Event()

        @contextlib.asynccontextmanager
        async def stream(*args, **kw):  # the network: cut when told, back at the gate
            if broken[0]:
                await gate.wait()
            async with real_stream(*args, **kw) as resp:
                real_lines = resp.aiter_lines

                async def lines():
                    async for line in real_lines():
                        if broken[0] and '"events"' in line:
                            raise httpx.ReadError("connection dropped (simulated)")
                        yield line
                resp.aiter_lines = lines
                yield resp
        kv._client.stream = stream
        kv._cache_watch_scope.cancel()  # the cache's watch starts again, through it
        await trio.sleep(0.1)
        try:
            await _put(kv, b"w/a", b"1")
            await _caches_live(kv)
            with pytest.raises(IOFailure, match="compacted"):
                async with kv.watch(b"w/") as changes:
                    await _put(other, b"w/a", b"2")
                    with trio.fail_after(5):
                        assert await changes.receive() == (b"w/a", b"2")
                    assert await kv.begin().get(b"w/a") == b"2"
                    assert kv.unseal(b"w/a", kv.cache.lookup(b"w/a")[0]) == b"2"  # (from the cache, stored sealed)
                    broken[0] = True
                    await _put(other, b"w/a", b"3")  # cuts both watches' connections
                    await _put(other, b"w/b", b"4")
                    assert await other.compact(await other.revision())
                    assert not await other.compact(await other.revision() - 1)
                    broken[0] = False
                    gate.set()
                    with trio.fail_after(10):
                        async for change in changes:  # nothing after the gap
                            raise AssertionError(f"a change after a gap: {change}")
            await _caches_live(kv)
            assert kv.cache.lookup(b"w/a") is None  # the cache started afresh
            txn = kv.begin()
            assert (await txn.get(b"w/a"), await txn.get(b"w/b")) == (b"3", b"4")
        finally:
            await other.aclose()
    run(etcd_cluster, main)
