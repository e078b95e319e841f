#!/usr/bin/env python3
"""Benchmark typed views (a benchmark, not a test: it prints numbers and ratios).

    tools/bench_typed.py --dir DIR [--compare-dir DIR2] [--cold] [--json FILE]

1. Iterate N small protobuf records (default 1,000,000) three ways:
   - bmfs.typed.mmap of one record file (each record parsed from its slice on access);
   - one file per message, open + read + ParseFromString: timed on --files files (default
     100,000) and scaled to N, since creating a million files would dominate the run;
   - read the whole file and parse it all: one SampleList message holding every sample
     (protobuf's C parser does it in one call, but the process holds all N at once).
2. Random access to 10,000 records: bmfs.typed.mmap vs one file per message.
3. A 1 GiB float32 .npy array mapped with bmfs.typed.mmap and summed, in DIR and, with
   --compare-dir, in a second directory (e.g. DIR a bmfs mount, DIR2 a local disk).
4. Shuffled reads (a data loader's), each cold with the kernel's read-ahead
   (access="normal") and with access="random" (bmfs.typed.access): --shuffled records
   taken at random from a record file of --big-records records of 2 KiB; every record
   of one of --epoch-records, in shuffled order (an epoch); --shuffled random elements
   of the .npy of 3. The bytes read are what the page cache of the file gained. The
   scattered records are read a third time with access="auto" as it does for a file
   larger than memory ("auto*": bmfs.typed.access.BIG_FILE set to 0 for it). Needs --cold.

Caveats: numbers are for a warm page cache (the files were just written) unless --cold
is given, which drops the kernel's caches before each read phase (needs root; it slows
everything else on the machine for a moment). RssAnon growth is the anonymous memory a
method leaves the process with while it runs; mapped file pages are not in it.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bmfs import typed  # noqa: E402
from bmfs.wire.examples_pb2 import Sample, SampleList  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="directory to benchmark in (e.g. a bmfs mount)")
    p.add_argument("--compare-dir", help="second directory for the numpy comparison")
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--files", type=int, default=100_000)
    p.add_argument("--random", type=int, default=10_000)
    p.add_argument("--array-mib", type=int, default=1024)
    p.add_argument("--big-records", type=int, default=200_000)
    p.add_argument("--shuffled", type=int, default=2000)
    p.add_argument("--epoch-records", type=int, default=50_000)
    p.add_argument("--cold", action="store_true", help="drop page caches before reads")
    p.add_argument("--keep", action="store_true", help="keep the files written")
    p.add_argument("--json", metavar="FILE",
                   help="also write the timings as JSON (tools/bench reads it)")
    args = p.parse_args(argv)
    work = os.path.join(args.dir, f"bench-typed-{os.getpid()}")
    os.makedirs(work)
    try:
        print(f"bench_typed: dir={args.dir}, protobuf {protobuf_version()}, "
              f"numpy {np.__version__}, {'cold' if args.cold else 'warm'} page cache")
        bench_records(work, args)
        bench_shuffled_records(work, args)
        bench_numpy(args)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        RESULTS["params"] = {"records": args.records, "files": min(args.files, args.records),
                             "random": args.random, "array_mib": args.array_mib,
                             "big_records": args.big_records, "shuffled": args.shuffled,
                             "epoch_records": args.epoch_records,
                             "cold": args.cold, "dir": args.dir,
                             "compare_dir": args.compare_dir,
                             "protobuf": protobuf_version(), "numpy": np.__version__}
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=2)
    return 0


RESULTS = {}  # what --json writes: seconds per phase
BIG_FILE = typed.access.BIG_FILE


def protobuf_version():
    import google.protobuf
    from google.protobuf.internal import api_implementation
    return f"{google.protobuf.__version__} ({api_implementation.Type()})"


def make_sample(i):
    return Sample(id=i, label=f"s{i}", score=i * 0.5, tags=[i % 100, 1, 2])


def rss_anon_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def drop_caches(args):
    if args.cold:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError as e:
            sys.exit(f"bench_typed: --cold needs root ({e.strerror})")


class Timer:
    def __enter__(self):
        self.rss0 = rss_anon_mib()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.rss = rss_anon_mib() - self.rss0


def line(label, seconds, count=None, unit="rec", extra=""):
    rate = f"{count / seconds / 1e6:8.2f} M{unit}/s" if count else " " * 14
    print(f"  {label:<42} {seconds:8.3f} s {rate} {extra}")


def bench_records(work, args):
    n, nfiles = args.records, min(args.files, args.records)
    rec_path = os.path.join(work, "samples.rec")
    list_path = os.path.join(work, "samples.list.pb")
    print(f"\nrecords: {n:,} small Sample messages")
    with Timer() as t:
        with typed.records.writer(rec_path, Sample) as w:
            for i in range(n):
                w.append(make_sample(i))
    line("write one record file", t.seconds, n,
         extra=f"({os.path.getsize(rec_path) / 1e6:.1f} MB)")
    with Timer() as t:
        with open(list_path, "wb") as f:
            f.write(SampleList(samples=[make_sample(i) for i in range(n)]).SerializeToString())
    line("write one SampleList message", t.seconds, n)
    files_dir = os.path.join(work, "files")
    with Timer() as t:
        for i in range(nfiles):
            sub = os.path.join(files_dir, f"{i // 1000:04d}")
            if i % 1000 == 0:
                os.makedirs(sub)
            with open(os.path.join(sub, f"{i:07d}.pb"), "wb") as f:
                f.write(make_sample(i).SerializeToString())
    line(f"write {nfiles:,} files, one message each", t.seconds, nfiles)

    drop_caches(args)
    with Timer() as t:
        total = 0
        recs = typed.mmap(rec_path, Sample)
        for m in recs:
            total += m.id
        recs.close()
    assert total == n * (n - 1) // 2
    mmap_s = t.seconds
    RESULTS["iter_mmap_s"] = t.seconds
    line("bmfs.typed.mmap, iterate all", t.seconds, n, extra=f"RssAnon {t.rss:+.1f} MiB")

    drop_caches(args)
    with Timer() as t:
        total = 0
        for i in range(nfiles):
            with open(os.path.join(files_dir, f"{i // 1000:04d}", f"{i:07d}.pb"), "rb") as f:
                total += Sample.FromString(f.read()).id
    files_s = t.seconds * n / nfiles
    RESULTS["iter_files_s"] = t.seconds  # for nfiles files, not scaled
    line(f"one file per message ({nfiles:,} files, x{n / nfiles:g})", files_s, n,
         extra=f"RssAnon {t.rss:+.1f} MiB")

    drop_caches(args)
    with Timer() as t:
        with open(list_path, "rb") as f:
            everything = SampleList.FromString(f.read())
        total = 0
        for m in everything.samples:
            total += m.id
    whole_s = t.seconds
    RESULTS["iter_whole_s"] = t.seconds
    line("read whole file + parse all (SampleList)", t.seconds, n,
         extra=f"RssAnon {t.rss:+.1f} MiB (holds all {n:,})")
    del everything
    print(f"  ratio: mmap is {files_s / mmap_s:.1f}x one-file-per-message, "
          f"{whole_s / mmap_s:.2f}x read-and-parse-all (>1 means mmap is faster)")

    k = args.random
    rng = random.Random(1)
    picks = [rng.randrange(n) for _ in range(k)]
    file_picks = [rng.randrange(nfiles) for _ in range(k)]
    print(f"\nrandom access: {k:,} records")
    drop_caches(args)
    with Timer() as t:
        recs = typed.mmap(rec_path, Sample)
        opened = time.perf_counter() - t.t0
        total = sum(recs[i].id for i in picks)
        recs.close()
    assert total == sum(picks)
    mmap_s = t.seconds
    RESULTS["random_mmap_s"] = t.seconds
    line("bmfs.typed.mmap (open + index + parse)", t.seconds, k,
         extra=f"(open and verify the index: {opened * 1e3:.1f} ms)")
    drop_caches(args)
    with Timer() as t:
        for i in file_picks:
            with open(os.path.join(files_dir, f"{i // 1000:04d}", f"{i:07d}.pb"), "rb") as f:
                Sample.FromString(f.read())
    line("one file per message", t.seconds, k)
    RESULTS["random_files_s"] = t.seconds
    print(f"  ratio: mmap is {t.seconds / mmap_s:.1f}x one-file-per-message")


def bench_numpy(args):
    dirs = [args.dir] + ([args.compare_dir] if args.compare_dir else [])
    nbytes = args.array_mib << 20
    print(f"\nnumpy: {args.array_mib} MiB float32 .npy, mapped and summed")
    results = []
    for d in dirs:
        path = os.path.join(d, f"bench-typed-{os.getpid()}.npy")
        try:
            with Timer() as t:
                out = np.lib.format.open_memmap(path, mode="w+", dtype="<f4",
                                                shape=(nbytes // 4,))
                step = 16 << 20
                for lo in range(0, out.size, step):
                    out[lo:lo + step] = 1.0
                out.flush()
                del out
            line(f"write  {d}", t.seconds, nbytes, unit="B")
            write_s = t.seconds
            drop_caches(args)
            with Timer() as t:
                arr = typed.mmap(path)
                total = float(arr.sum(dtype=np.float64))
                del arr
            assert total == nbytes // 4
            line(f"mmap + sum  {d}", t.seconds, nbytes, unit="B")
            results.append(t.seconds)
            RESULTS.setdefault("numpy", []).append({"dir": d, "bytes": nbytes,
                                                    "write_s": write_s,
                                                    "read_s": t.seconds})
            if d == args.dir:
                shuffled_elements(path, args)
        finally:
            if os.path.exists(path):
                os.remove(path)
    if len(results) == 2:
        print(f"  ratio: {dirs[0]} reads at {results[1] / results[0]:.2f}x the speed of "
              f"{dirs[1]}")


def cached_bytes(path):
    """Bytes of ``path`` in the page cache (fincore(1)), or None without fincore."""
    try:
        out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", path], check=True,
                             capture_output=True, text=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def shuffled(label, key, path, open_view, picks, args, modes=("normal", "random")):
    """Read ``picks`` of the view ``open_view(access)`` opens, cold, with the kernel's
    read-ahead (access="normal") and with access="random" (and any other ``modes``;
    "auto*": auto, the file taken for larger than memory)."""
    rates = {}
    for access in modes:
        drop_caches(args)
        before = cached_bytes(path)
        typed.access.BIG_FILE = 0 if access == "auto*" else BIG_FILE
        view, get = open_view(access.rstrip("*"))
        with Timer() as t:
            for i in picks:
                get(view, i)
        after = cached_bytes(path)
        read = None if before is None or after is None else after - before
        rates[access] = len(picks) / t.seconds
        RESULTS[f"{key}_{access}_s"] = t.seconds
        RESULTS[f"{key}_{access}_read"] = read
        print(f"  {label + ', access ' + access:<58} {t.seconds:8.3f} s "
              f"{rates[access]:8,.0f}/s" + ("" if read is None else
                                           f"  (read {read / 2**20:.1f} MiB)"))
        del view
    typed.access.BIG_FILE = BIG_FILE
    for access in modes[1:]:
        print(f"  ratio: {access} reads at {rates[access] / rates['normal']:.2f}x the rate")


def record_file(path, n):
    payload = os.urandom(2048)
    with Timer() as t:
        with typed.records.writer(path, Sample) as w:
            for i in range(n):
                w.append(Sample(id=i, payload=payload))
    line(f"write {n:,} records of 2 KiB", t.seconds, n,
         extra=f"({os.path.getsize(path) / 1e6:.1f} MB)")


def bench_shuffled_records(work, args):
    """A few records at random of a large file, then a whole shuffled pass over a
    smaller one (a data loader's epoch over a dataset that stays cached)."""
    n, k = args.big_records, args.shuffled
    print("\nshuffled reads of record files (bmfs.typed.mmap)")
    if not args.cold:
        print("  skipped: only cold reads (--cold) say what read-ahead costs")
        return
    path = os.path.join(work, "big.rec")
    record_file(path, n)
    rng = random.Random(2)
    picks = [rng.randrange(n) for _ in range(k)]

    def open_view(access):
        return typed.mmap(path, Sample, access=access), lambda view, i: view[i].id
    shuffled(f"{k:,} records at random of {n:,}", "shuffled_records", path, open_view,
             picks, args, ("normal", "random", "auto*"))
    os.remove(path)
    n = args.epoch_records
    path = os.path.join(work, "epoch.rec")
    record_file(path, n)
    order = list(range(n))
    random.Random(3).shuffle(order)
    shuffled(f"all {n:,} records, shuffled", "epoch_records", path, open_view, order, args)
    os.remove(path)


def shuffled_elements(path, args):
    if not args.cold:
        return
    rng = random.Random(3)
    picks = [rng.randrange((args.array_mib << 20) // 4) for _ in range(args.shuffled)]

    def open_view(access):
        return typed.mmap(path, access=access), lambda view, i: float(view[i])
    shuffled(f"{args.shuffled:,} .npy elements at random", "shuffled_numpy", path,
             open_view, picks, args)


if __name__ == "__main__":
    sys.exit(main())
