#!/usr/bin/env python3
"""The direct client's side of tools/bench (its ``direct`` workload): one phase per
run, its figures as one line of JSON on stdout.

  bench_client.py rand VOLUME PATH --size N --reads R --batch 64 [--procs 4] [--seconds S]
      random 4 KiB reads (the bench's offsets: seed 42, 4 KiB aligned), read_many in
      batches; with --procs, forked workers (DataLoader-style) share the reads
  bench_client.py seq VOLUME PATH --size N [--depth 8] [--threads 2] [--batches]
      the file read with File.readinto into one reused buffer of --depth MiB (the
      client reads ahead); with --batches, in 1 MiB ranges instead, --depth ranges
      per read_many batch, into reused buffers, --threads batches in flight
  bench_client.py records VOLUME PATH --count 10000 [--batch 64]
      random records of a record file through Client.records (batches of ranges)
  bench_client.py mount-records MOUNTED_PATH --count 10000
      the same records through bmfs.typed.mmap on a mount (access="random")
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

MiB = 1 << 20


def _offsets(size: int, n: int) -> list[int]:
    rng = random.Random(42)
    return [rng.randrange(size // 4096) * 4096 for _ in range(n)]


def _cpu_ticks() -> list[int]:
    """The machine's CPU time so far by kind (/proc/stat: user, nice, system, idle,
    iowait, ...), in clock ticks."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _busy(c0: list[int], c1: list[int]) -> float | None:
    """The share of the machine's CPU time between two _cpu_ticks() that was busy
    (neither idle nor waiting for the disk), every process's."""
    total = sum(c1) - sum(c0)
    return round(1 - (c1[3] + c1[4] - c0[3] - c0[4]) / total, 2) if total else None


def rand(a) -> dict:
    """Each process connects (a forked one opens its own connections on its first
    call) before the clock starts: a DataLoader worker connects once."""
    import bmfs
    c = bmfs.connect(a.volume)
    offsets = _offsets(a.size, a.reads)
    shares = [offsets[i::a.procs] for i in range(a.procs)]
    c0 = _cpu_ticks()
    if a.procs == 1:
        t0 = time.perf_counter()
        done = _rand_worker(c, a.path, shares[0], a.batch, t0 + a.seconds)
    else:
        pids, go_r, go_w = [], *os.pipe()
        for share in shares:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                c.stat(a.path)  # (connected)
                os.write(w, b"r")
                os.read(go_r, 1)
                n = _rand_worker(c, a.path, share, a.batch, time.perf_counter() + a.seconds)
                os.write(w, b"%d" % n)
                os._exit(0)
            os.close(w)
            pids.append((pid, r))
        for _, r in pids:
            os.read(r, 1)
        c0 = _cpu_ticks()
        t0 = time.perf_counter()
        os.write(go_w, b"g" * len(pids))
        done = 0
        for pid, r in pids:
            done += int(os.read(r, 64) or b"0")
            os.waitpid(pid, 0)
    seconds = time.perf_counter() - t0
    return {"reads": done, "seconds": seconds, "iops": done / seconds,
            "machine_busy": _busy(c0, _cpu_ticks())}


def _rand_worker(c, path, offsets, batch, deadline) -> int:
    bufs = [bytearray(4096) for _ in range(batch)]
    done = 0
    with c.open(path, buffering=0) as f:
        for i in range(0, len(offsets), batch):
            part = offsets[i:i + batch]
            got = c.read_many([(f, off, 4096) for off in part], bufs[:len(part)])
            if any(n != 4096 for n in got):
                raise SystemExit("short read")
            done += len(part)
            if time.perf_counter() > deadline:
                break
    return done


def seq(a) -> dict:
    """readinto a buffer of --depth MiB until the end; or (--batches) batches of
    --depth 1 MiB ranges, --threads of them in flight (each thread its own buffers,
    taking every --threads-th batch: a loader reading ahead)."""
    import bmfs
    c = bmfs.connect(a.volume)
    step = a.depth * MiB
    totals = [0] * a.threads
    t0 = time.perf_counter()
    if not a.batches:
        buf = bytearray(step)
        with c.open(a.path, buffering=0) as f:
            while n := f.readinto(buf):
                totals[0] += n
    else:
        _seq_batches(c, a, step, totals)
    seconds = time.perf_counter() - t0
    total = sum(totals)
    if total != a.size:
        raise SystemExit(f"read {total} bytes, expected {a.size}")
    return {"bytes": total, "seconds": seconds, "mbps": total / seconds / 1e6}


def _seq_batches(c, a, step, totals) -> None:
    import threading
    with c.open(a.path, buffering=0) as f:
        def reader(k):
            bufs = [bytearray(MiB) for _ in range(a.depth)]
            for off in range(k * step, a.size, a.threads * step):
                n = min(a.depth, (a.size - off + MiB - 1) // MiB)
                totals[k] += sum(c.read_many([(f, off + j * MiB, MiB) for j in range(n)],
                                             bufs[:n]))
        threads = [threading.Thread(target=reader, args=(k,)) for k in range(a.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _picks(n: int, count: int) -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(n) for _ in range(count)]


def records(a) -> dict:
    import bmfs
    c = bmfs.connect(a.volume)
    t0 = time.perf_counter()
    with c.records(a.path) as recs:
        picks = _picks(len(recs), a.count)
        got = 0
        for i in range(0, len(picks), a.batch):
            got += len(recs.get_many(picks[i:i + a.batch]))
    seconds = time.perf_counter() - t0
    return {"records": got, "seconds": seconds, "rate": got / seconds}


def mount_records(a) -> dict:
    import bmfs.typed
    t0 = time.perf_counter()
    recs = bmfs.typed.mmap(a.volume, access="random")  # (the mounted path)
    picks = _picks(len(recs), a.count)
    got = sum(1 for i in picks if recs[i] is not None)
    seconds = time.perf_counter() - t0
    return {"records": got, "seconds": seconds, "rate": got / seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=("rand", "seq", "records", "mount-records"))
    ap.add_argument("volume")
    ap.add_argument("path", nargs="?", default="/")
    ap.add_argument("--size", type=int, default=0)
    ap.add_argument("--reads", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", action="store_true")
    ap.add_argument("--count", type=int, default=10000)
    a = ap.parse_args(argv)
    fn = {"rand": rand, "seq": seq, "records": records, "mount-records": mount_records}
    print(json.dumps(fn[a.phase](a)))
    sys.stdout.flush()
    os._exit(0)  # (the clients' loop threads are daemons: no wait for them)


if __name__ == "__main__":
    sys.exit(main())
