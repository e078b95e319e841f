"""Read-ahead advice for a typed view's mapping (madvise), picked by how it is read.

A page fault on a mapping makes the kernel read around the page, up to the file's
read-ahead: bmfs sets its mount's ``read_ahead_kb`` to 4096 for sequential readers,
and a fault then brings in about 1 MiB. With MADV_RANDOM a fault reads its own page
only. Which is better depends on whether the file stays in the page cache:

- it fits (the usual dataset of a few GiB read epoch after epoch): reading around
  caches the whole file after about one fault per MiB, and every later access hits.
  A shuffled pass over all 50,000 records of a 100 MiB record file took 0.38 s with
  the kernel's default and 5.5 s with MADV_RANDOM (docs/typed.md).
- it does not (a corpus larger than memory, read at random): nearly every access
  misses either way, and reading around reads ~1 MiB for each record wanted
  (256 times a 4 KiB page). A few accesses of a large file behave alike.

``access`` modes:
  auto        record files: jumps about a file larger than BIG_FILE (a quarter of the
              machine's memory: it will not stay cached) make the mapping random,
              RANDOM_AFTER of them in a row; SEQUENTIAL_AFTER nearby accesses in a row
              or an iteration make it normal again. Smaller files, and arrays (whose
              indexing is numpy's, not seen here), keep the kernel's default
  normal      the kernel's default: read around each fault
  random      MADV_RANDOM: each fault reads its page only (a reader that jumps about
              a file, or many files, larger than memory; or takes a few records only)
  sequential  MADV_SEQUENTIAL: read ahead aggressively, drop pages behind soon
"""
import mmap as _mmap
import os

MODES = ("auto", "normal", "random", "sequential")
_ADVICE = {"normal": getattr(_mmap, "MADV_NORMAL", None),
           "random": getattr(_mmap, "MADV_RANDOM", None),
           "sequential": getattr(_mmap, "MADV_SEQUENTIAL", None)}
RANDOM_AFTER = 8        # jumps in a row that make an auto mapping random
SEQUENTIAL_AFTER = 2    # nearby accesses in a row that make it normal again
NEAR = 128 << 10        # an access within this many bytes of the last one is no jump


def _memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 34


BIG_FILE = _memory() // 4  # auto: files larger than this are read at random when jumped about


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
    __slots__ = ("mm", "mode", "advice", "last", "jumps", "steps", "big")

    def __init__(self, mm, mode="auto", size=0):
        self.mm = mm
        self.big = size > BIG_FILE
        self.advice = "normal"  # what the mapping has now (a fresh one: the default)
        self.set(mode)

    def set(self, mode):
        """Use ``mode`` (one of MODES) from now on."""
        self.mode = check_mode(mode)
        self.last, self.jumps, self.steps = None, 0, 0
        self._advise("normal" if mode == "auto" else mode)

    def _advise(self, advice):
        if advice != self.advice:
            advise(self.mm, advice)
            self.advice = advice

    def touch(self, start, end):
        """An access of bytes [start, end) of the mapping (auto mode, a big file:
        noted)."""
        if self.mode != "auto" or not self.big:
            return
        last, self.last = self.last, end
        if last is not None and -NEAR < start - last < NEAR:
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
