#!/usr/bin/env python3
"""bench_etcd_client: the etcd engine's requests over gRPC against etcd's JSON gateway.

    .venv/bin/python tools/bench_etcd_client.py [--n 400] [--concurrency 16]

Starts a 3-member etcd cluster on loopback as `bmfs cluster up` runs it (TLS client
certificates and a root password), opens the etcd engine twice on it, once with
``api=grpc`` and once with ``api=gateway`` (bmfs/kv/etcd_auth.py), and times through
the engine (failover, token, metrics included) in one run, alternating the two:
- a one-key read (``/v3/kv/range``), sequential: median and p90;
- a one-key transaction (compare the key's revision, put 200 bytes): median and p90;
- an engine commit (``_commit``: compares, the request id, its lease), sequential;
- ``--concurrency`` tasks reading at once: reads per second (CPU-bound on a small
  machine: it shows the client's CPU per request).
Prints one table with gateway/grpc ratios. The members are stopped by pid at the end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trio  # noqa: E402

from bmfs.cluster.etcd import EtcdCluster  # noqa: E402
from bmfs.kv.etcd import EtcdKV  # noqa: E402
from bmfs.kv.etcd_wire import b64  # noqa: E402

KEY = b"bench/key"


async def _timed(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


async def measure(kv: EtcdKV, n: int, concurrency: int) -> dict:
    await kv._call("/v3/kv/put", {"key": b64(KEY), "value": b64(b"x")})

    async def read():
        await kv._call("/v3/kv/range", {"key": b64(KEY)})

    async def txn():
        data = await kv._call("/v3/kv/range", {"key": b64(KEY)})
        rev = data["kvs"][0]["mod_revision"]
        t0 = time.perf_counter()
        out = await kv._call("/v3/kv/txn", {
            "compare": [{"key": b64(KEY), "target": "MOD", "result": "EQUAL",
                         "mod_revision": rev}],
            "success": [{"request_put": {"key": b64(KEY), "value": b64(b"v" * 200)}}]})
        assert out.get("succeeded"), out
        return time.perf_counter() - t0

    seq = [0]

    async def commit():
        seq[0] += 1
        await kv._commit({}, {b"bench/c%d" % seq[0]: b"v" * 200})

    res = {"read": await _timed(read, n),
           "txn": [await txn() for _ in range(n // 2)],
           "commit": await _timed(commit, n // 2)}
    t0 = time.perf_counter()
    per = max(1, n // 4)
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            async def worker():
                for _ in range(per):
                    await read()
            nursery.start_soon(worker)
    res["concurrent"] = concurrency * per / (time.perf_counter() - t0)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=400, help="requests per sequential row")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two apis")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as d:
        cluster = EtcdCluster(d)
        try:
            async def run():
                out: dict[str, list[dict]] = {"grpc": [], "gateway": []}
                for _ in range(args.rounds):
                    for api in ("gateway", "grpc"):
                        kv = await EtcdKV.create(cluster.url + f"&api={api}", cache=False)
                        try:
                            out[api].append(await measure(kv, args.n, args.concurrency))
                        finally:
                            await kv.aclose()
                return out
            out = trio.run(run)
        finally:
            cluster.stop()

    def pooled(api, row):
        return sorted(t for r in out[api] for t in r[row])

    print(f"{'request':34s} {'gateway':>16s} {'grpc':>16s} {'gateway/grpc':>13s}")
    for row in ("read", "txn", "commit"):
        g, r = pooled("gateway", row), pooled("grpc", row)
        for q, name in ((0.5, "median"), (0.9, "p90")):
            a, b = g[int(len(g) * q)] * 1e3, r[int(len(r) * q)] * 1e3
            print(f"{row + ' ' + name + ' (ms)':34s} {a:16.2f} {b:16.2f} {a / b:12.2f}x")
    g = statistics.mean(r["concurrent"] for r in out["gateway"])
    r = statistics.mean(r["concurrent"] for r in out["grpc"])
    print(f"{f'{args.concurrency} readers (reads/s)':34s} {g:16.0f} {r:16.0f} {g / r:12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
