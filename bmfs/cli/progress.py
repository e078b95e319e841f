"""Progress bars of long commands (repair, scrub, rebalance, drain, fsck, merge, the
collection of deleted branches), on standard error, and only when it is a terminal:
piped or redirected, a command prints exactly what it printed without them (its
--json output on standard output is never touched).

An operation run inside a mount is followed by reading the mount's ``/.bm/progress``
(the operations under way, vfs/control.py) for the one this process asked for, while
the request itself waits in a thread.
"""
from __future__ import annotations

import json
import os
import sys
import threading

POLL = 0.5  # seconds between a mount's progress requests


class Bar:
    """A ``progress(done, total)`` callback drawing a tqdm bar; nothing off a terminal."""

    def __init__(self, what: str, unit: str = "stripes", stream=None):
        self.stream = stream or sys.stderr
        self.what, self.unit = what, unit
        self.on = _is_terminal(self.stream)
        self._bar = None

    def __call__(self, done: int, total: int) -> None:
        if not self.on:
            return
        if self._bar is None or total != self._bar.total or done < self._bar.n:
            self._new(total)  # (a second pass, e.g. scrub's repair: a bar of its own)
        self._bar.update(done - self._bar.n)

    def _new(self, total: int) -> None:
        from tqdm import tqdm
        if self._bar is not None:
            self._bar.close()
        try:
            size = os.get_terminal_size(self.stream.fileno())
            sized = size.columns > 0 and size.lines > 0
        except (OSError, ValueError, AttributeError):
            sized = False
        # (a terminal that says no size, e.g. a fresh pty: tqdm would draw nothing)
        self._bar = tqdm(total=total, desc=self.what, unit=f" {self.unit}",
                         file=self.stream, leave=False, dynamic_ncols=sized,
                         ncols=None if sized else 80, nrows=None if sized else 24)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # (closed, or not a file)
        return False


def in_mount(mountpoint: str, op: str, bar: Bar, **kw):
    """``control(mountpoint, op, **kw)``, drawing ``bar`` from the mount's progress
    reports meanwhile (when the bar is on: else just the request)."""
    from .common import control
    if not bar.on:
        return control(mountpoint, op, **kw)
    out: dict = {}

    def send():
        try:
            out["result"] = control(mountpoint, op, **kw)
        except BaseException as e:  # (UserError above all: raised in this thread below)
            out["error"] = e
    t = threading.Thread(target=send, daemon=True)
    t.start()
    me = os.getpid()
    try:
        while t.is_alive():
            t.join(POLL)
            if not t.is_alive():
                break
            try:
                with open(os.path.join(mountpoint, ".bm", "progress")) as f:
                    running = json.load(f)
            except (OSError, ValueError):  # (a mount of an older bmfs: no bar)
                continue
            for entry in running:
                if entry.get("pid") == me and entry.get("op") == op and entry["total"]:
                    bar(entry["done"], entry["total"])
    finally:
        bar.close()
    if "error" in out:
        raise out["error"]
    return out["result"]
