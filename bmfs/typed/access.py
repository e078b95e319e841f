"""Read-ahead advice for a typed view's mapping (madvise), picked by how it is read.

A page fault on a mapping makes the kernel read around the page, up to the file's
read-ahead: bmfs sets its mount's ``read_ahead_kb`` to 4096 for sequential readers,
and a fault then brings in about 1 MiB. With MADV_RANDOM a fault reads its own page
only. Which is better depends on whether the file stays in the page cache:

- it fits (the usual dataset of a few GiB read epoch after epoch): reading around
  caches the whole file after about one fault per MiB, and every later access hits.
  A shuffled pass over a record file that fits is ~15x slower with MADV_RANDOM
  than with the kernel's default (docs/typed.md).
- it does not (a corpus larger than memory, read at random): nearly every access
  misses either way, and reading around reads ~1 MiB for each record wanted
  (256 times a 4 KiB page). A few accesses of a large file behave alike: 2,000
  elements at random of a 1 GiB array, 2.7-2.8x the rate with MADV_RANDOM.

Taking random advice for a file that would have stayed cached costs more (every epoch
~15x slower) than keeping read-around for one that does not (~3x), so auto goes random
only for a file larger than the memory the process may use.

``access`` modes:
  auto        record files: jumps about a file larger than BIG_FILE (the memory this
              process may use: it cannot stay cached) make the mapping random,
              RANDOM_AFTER of them in a row; SEQUENTIAL_AFTER nearby accesses in a row
              (near one of the last NEAR_TRACKED accesses: a few readers in order
              interleaved are no jumps) or an iteration make it normal again. Smaller
              files, and arrays (whose indexing is numpy's, not seen here), keep the
              kernel's default; for them auto is normal
  normal      the kernel's default: read around each fault
  random      MADV_RANDOM: each fault reads its page only (a reader that jumps about
              a file, or many files, larger than memory; or takes a few records only).
              A record of more than a page is still read in one go (MADV_WILLNEED on
              its bytes when it is accessed)
  sequential  MADV_SEQUENTIAL: read ahead aggressively, drop pages behind soon
"""
import mmap as _mmap
import os

MODES = ("auto", "normal", "random", "sequential")
_ADVICE = {"normal": getattr(_mmap, "MADV_NORMAL", None),
           "random": getattr(_mmap, "MADV_RANDOM", None),
           "sequential": getattr(_mmap, "MADV_SEQUENTIAL", None)}
_WILLNEED = getattr(_mmap, "MADV_WILLNEED", None)
PAGE = _mmap.PAGESIZE
RANDOM_AFTER = 8        # jumps in a row that make an auto mapping random
SEQUENTIAL_AFTER = 2    # nearby accesses in a row that make it normal again
NEAR = 128 << 10        # an access within this many bytes of a recent one is no jump
NEAR_TRACKED = 4        # recent accesses an access may be near


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max, v1
    memory.limit_in_bytes), or None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            where = f"/sys/fs/cgroup{path}/memory.max"
        elif "memory" in controllers.split(","):
            where = f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"
        else:
            continue
        try:
            with open(where) as f:
                return int(f.read().strip())
        except (OSError, ValueError):  # "max", no such file: no limit there
            continue
    return None


def memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 1 << 34
    limit = _cgroup_limit()
    return min(total, limit) if limit else total


BIG_FILE = memory()  # auto: files larger than this are read at random when jumped about


def check_mode(mode):
    """``mode`` if it is one of MODES; else ValueError saying which there are."""
    if mode not in MODES:
        raise ValueError(f"access must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def advise(mm, advice):
    """madvise the whole of ``mm`` (advice: normal, random or sequential). Only advice:
    where the platform has no madvise, or the mapping is gone, nothing happens."""
    flag = _ADVICE[advice]
    if flag is None or mm is None:
        return
    try:
        mm.madvise(flag)
    except (AttributeError, OSError, ValueError):
        pass


class Access:
    """The advice of one mapping and, in auto mode, the accesses seen (shared by the
    views of one file: a record file and its slices). ``size``: the file's."""
    __slots__ = ("mm", "mode", "advice", "recent", "jumps", "steps", "big")

    def __init__(self, mm, mode="auto", size=0):
        self.mm = mm
        self.big = size > BIG_FILE
        self.advice = "normal"  # what the mapping has now (a fresh one: the default)
        self.set(mode)

    def set(self, mode):
        """Use ``mode`` (one of MODES) from now on."""
        self.mode = check_mode(mode)
        self.recent, self.jumps, self.steps = [], 0, 0
        self._advise("normal" if mode == "auto" else mode)

    def _advise(self, advice):
        if advice != self.advice:
            advise(self.mm, advice)
            self.advice = advice

    def touch(self, start, end):
        """An access of bytes [start, end) of the mapping: in auto mode, of a big file,
        noted; under random advice, a record of more than a page is asked for whole."""
        if self.advice == "random" and end - start > PAGE and _WILLNEED is not None:
            first = start - start % PAGE
            try:
                self.mm.madvise(_WILLNEED, first, end - first)
            except (AttributeError, OSError, ValueError):
                pass
        if self.mode != "auto" or not self.big:
            return
        recent = self.recent
        near = any(-NEAR < start - e < NEAR for e in recent)
        recent.append(end)
        if len(recent) > NEAR_TRACKED:
            del recent[0]
        if near:
            self.jumps = 0
            self.steps += 1
            if self.steps >= SEQUENTIAL_AFTER and self.advice == "random":
                self._advise("normal")
        else:
            self.steps = 0
            self.jumps += 1
            if self.jumps >= RANDOM_AFTER and self.advice == "normal":
                self._advise("random")

    def scan(self):
        """A pass in order over the mapping begins (auto mode: normal advice)."""
        if self.mode == "auto":
            self.jumps = 0
            self._advise("normal")
