#!/usr/bin/env python3
"""Benchmark a metadata lookup against the depth of a tree's chain of layers (a
benchmark, not a test: it prints numbers).

    tools/bench_layers.py [--depths 1,10,200,2000] [--keys 100] [--rounds 20]

Every snapshot of a branch freezes its top layer and stacks a new one on it, so a
branch snapshotted N times reads through a chain of N+1 layers. A key written before
the first snapshot has its only version in the bottom layer. This times
bmfs.meta.layers.lget of such keys, in one transaction, on the in-memory engine and
on SQLite (a file under /var/tmp): microseconds a lookup, by depth.
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trio  # noqa: E402

from bmfs.kv import open_kv  # noqa: E402
from bmfs.meta import keys  # noqa: E402
from bmfs.meta.layers import Chain, lget, lkey  # noqa: E402

BOTTOM = 1


async def per_lookup(kv, depth: int, nkeys: int, rounds: int) -> float:
    """Microseconds an lget takes of a key whose version is in the bottom layer of a
    chain ``depth`` layers deep."""
    chain = Chain(tuple(range(BOTTOM + depth - 1, BOTTOM - 1, -1)), "main")
    subs = [b"i/%016x" % (depth * 1_000_000 + i) for i in range(nkeys)]
    txn = kv.begin()
    for sub in subs:
        txn.put(lkey(sub, BOTTOM), keys.LIVE + b"v")
    await kv.commit(txn)
    txn = kv.begin()
    t = time.perf_counter()
    for _ in range(rounds):
        for sub in subs:
            if await lget(txn, chain, sub) != b"v":
                raise SystemExit(f"bench_layers: wrong value for {sub!r}")
    return (time.perf_counter() - t) / (rounds * nkeys) * 1e6


async def main(args) -> None:
    depths = [int(d) for d in args.depths.split(",")]
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="bench-layers-") as tmp:
        engines = [("memory", "memory:"), ("sqlite", f"sqlite:{tmp}/meta.db")]
        print(f"lget of a key in the bottom layer, us a lookup ({args.keys} keys x "
              f"{args.rounds} rounds)")
        print(f"{'layers':>8} " + " ".join(f"{name:>8}" for name, _ in engines))
        kvs = [await open_kv(url) for _, url in engines]
        try:
            for depth in depths:
                row = [await per_lookup(kv, depth, args.keys, args.rounds) for kv in kvs]
                print(f"{depth:>8} " + " ".join(f"{us:>8.1f}" for us in row))
        finally:
            for kv in kvs:
                await kv.aclose()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="1,10,200,2000")
    ap.add_argument("--keys", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=20)
    trio.run(main, ap.parse_args())
