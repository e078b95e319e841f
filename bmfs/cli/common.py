"""Helpers shared by the commands: finding mounts, talking to a mount's control file."""
from __future__ import annotations

import errno
import json
import os

from .main import UserError


def run_trio(fn, *args):
    """``trio.run(fn, *args)``, trio imported only here: the commands that talk to a
    running mount (branch, snapshot, type, status of a mount...) start without it
    (importing trio is a large part of a command's start)."""
    import trio
    return trio.run(fn, *args)


def metrics_option(p) -> None:
    """--metrics ADDR, for the daemons (mount, node serve)."""
    p.add_argument("--metrics", metavar="ADDR",
                   help="serve Prometheus metrics at PORT or HOST:PORT (the host defaults "
                        "to 127.0.0.1; no authentication: docs/operations.md); off by "
                        "default")


def check_metrics_address(addr: str | None) -> None:
    """A malformed --metrics is the user's mistake, found before anything starts."""
    if addr is not None:
        from ..metrics import parse_address
        try:
            parse_address(addr)
        except ValueError as e:
            raise UserError(str(e))


def start_metrics(addr: str | None):
    """Serve the metrics at ``addr`` (--metrics), or nothing if None; the server.

    Raises:
        UserError: a malformed address, or one that cannot be bound (in use...).
    """
    if addr is None:
        return None
    import errno
    from .. import metrics
    check_metrics_address(addr)
    try:
        return metrics.start(addr)
    except OSError as e:
        why = "in use by another process" if e.errno == errno.EADDRINUSE else \
            (e.strerror or str(e))
        raise UserError(f"--metrics {addr}: cannot listen there: {why}")


def _unescape(field: str) -> str:
    """A field of /proc/self/mountinfo: space, tab, newline and backslash are octal
    escapes there (\\040...)."""
    import re
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts() -> list[dict]:
    """bmfs mounts from /proc/self/mountinfo: mountpoint, source, volume (the source:
    the volume's path; ``bmfs:PATH`` in mounts an older bmfs made), dev (major:minor)
    and options (the mount's own flags: ro, nodev, relatime...)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            lf, rf = left.split(), right.split()
            if rf[0] == "fuse.bmfs":
                source = _unescape(rf[1])
                out.append({"mountpoint": _unescape(lf[4]), "dev": lf[2], "source": source,
                            "volume": source.removeprefix("bmfs:"),
                            "options": lf[5].split(",")})
    return out


def find_mount(path: str) -> dict | None:
    path = os.path.abspath(path)
    for m in mounts():
        if m["mountpoint"] == path:
            return m
    return None


def mount_root_of(path: str) -> str:
    """The bmfs mount point holding ``path``."""
    path = os.path.abspath(path)
    best = None
    for m in mounts():
        mp = m["mountpoint"]
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) > len(best):
                best = mp
    if best is None:
        only = {m["mountpoint"] for m in mounts()}
        if len(only) == 1:  # not inside a mount, but there is just one: use it
            return only.pop()
        raise UserError(f"{path} is not inside a bmfs mount and "
                        f"{'no' if not only else 'more than one'} bmfs mount is up "
                        f"(give -m MOUNTPOINT)")
    return best


class ControlError(UserError):
    """A request the mount refused or failed: ``reply`` is its whole answer (errno,
    and for a merge with conflicts, ``conflicts``: their paths)."""

    def __init__(self, reply: dict):
        super().__init__(reply["error"])
        self.reply = reply


def control(mountpoint: str, op: str, **args):
    """Send one request to the mount's control file; returns the result or raises."""
    path = os.path.join(mountpoint, ".bm", "ctl")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        hint = " (a read-only mount takes no requests: send them through a read-write " \
            "mount of the volume)" if e.errno == errno.EROFS else ""
        raise UserError(f"cannot reach the control file of {mountpoint}: {e.strerror}{hint}")
    try:
        try:
            os.write(fd, json.dumps({"op": op, **args}).encode())
        except PermissionError:
            pass  # refused: the reply says by whom it may be sent
        chunks = []
        off = 0
        while True:
            b = os.pread(fd, 1 << 20, off)
            if not b:
                break
            chunks.append(b)
            off += len(b)
    finally:
        os.close(fd)
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError:
        raise UserError(f"the control file of {mountpoint} gave no answer to {op}")
    if not reply["ok"]:
        raise ControlError(reply)
    return reply["result"]
