"""Several real mounts of one etcd volume, and workload processes for them (level 7).

``etcd_volume(cluster, tmp_path, n)`` wipes the etcd cluster, makes a volume on it and
mounts it ``n`` times (each mount a separate daemon, long kernel cache timeouts so that
only the watch can make other mounts' changes visible quickly); on exit it unmounts,
checks that no daemon logged an error (an internal error is answered EIO) and runs fsck.

``run_worker(kind, mountdir, ...)`` starts this file as a separate process running one
of the workloads below; each prints one JSON line with what it did (the operations that
succeeded, with their completion times), read back by ``Worker.result()``.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import subprocess
import sys
import time

from mountutil import Mounted, assert_fsck_clean, mkfs

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE_TIMEOUT = 30  # kernel entry/attribute timeout of the test mounts (seconds)


@contextlib.contextmanager
def etcd_volume(cluster, tmp_path, n: int = 2, fsck: bool = True):
    """A fresh volume on ``cluster`` mounted ``n`` times; yields the Mounted objects."""
    cluster.wipe()
    vol = tmp_path / "vol"
    mkfs(vol, "--meta", cluster.url)
    with contextlib.ExitStack() as stack:
        mounts = [stack.enter_context(Mounted(vol, tmp_path / f"m{i}", "--timeout",
                                              str(CACHE_TIMEOUT)))
                  for i in range(n)]
        yield mounts
    with open(vol / "mount.log", errors="replace") as f:
        errors = [line for line in f if " ERROR " in line]
    assert not errors, "the mount daemons logged errors:\n" + "".join(errors[:10])
    if fsck:
        assert_fsck_clean(vol)


def wait_until(fn, timeout: float, step: float = 0.002) -> float:
    """Poll ``fn()`` until it is true; returns the seconds it took (raises on timeout)."""
    t0 = time.monotonic()
    while not fn():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not true after {timeout} s: {fn.__doc__ or fn}")
        time.sleep(step)
    return time.monotonic() - t0


class Worker:
    def __init__(self, proc):
        self.proc = proc

    def result(self, timeout: float = 120) -> dict:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, f"worker failed:\n{out}\n{err}"
        return json.loads(out.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_worker(kind: str, directory, ident: str, seconds: float, seed: int = 0,
               stop_file: str | None = None) -> Worker:
    cmd = [sys.executable, os.path.abspath(__file__), kind, str(directory), ident,
           str(seconds), str(seed), stop_file or ""]
    return Worker(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True))


# -- workloads (run in a separate process) ------------------------------------------------
NAMES = [f"n{i:02d}" for i in range(12)]


def _write_new(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def hammer(directory: str, ident: str, seconds: float, seed: int, stop_file: str) -> dict:
    """Creates (unique content), renames and unlinks over a small shared set of names."""
    rng = random.Random(seed)
    done, failed, seq = [], 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        op = rng.choice(("create", "create", "rename", "unlink"))
        a, b = rng.sample(NAMES, 2)
        pa, pb = os.path.join(directory, a), os.path.join(directory, b)
        try:
            if op == "create":
                seq += 1
                token = f"{ident}-{seq}"
                _write_new(pa, token.encode())
                done.append(["create", a, token])
            elif op == "rename":
                os.rename(pa, pb)
                done.append(["rename", a, b])
            else:
                os.unlink(pa)
                done.append(["unlink", a])
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOENT):
                raise
            failed += 1
    return {"done": done, "failed": failed}


def metaload(directory: str, ident: str, seconds: float, seed: int, stop_file: str) -> dict:
    """Metadata-heavy: create a small file, rename it, every 10th a directory; each
    acknowledged (returned) operation is listed with its completion time."""
    base = os.path.join(directory, ident)
    os.makedirs(base, exist_ok=True)
    acks = []
    i = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (stop_file and os.path.exists(stop_file)):
        name = f"f{i:06d}"
        _write_new(os.path.join(base, name + ".tmp"), f"{ident}:{i}".encode())
        os.rename(os.path.join(base, name + ".tmp"), os.path.join(base, name))
        if i % 10 == 0:
            os.mkdir(os.path.join(base, f"d{i:06d}"))
        acks.append([name, time.time()])
        i += 1
    return {"acks": acks}


if __name__ == "__main__":
    kind, directory, ident, seconds, seed, stop_file = sys.argv[1:7]
    fn = {"hammer": hammer, "metaload": metaload}[kind]
    print(json.dumps(fn(directory, ident, float(seconds), int(seed), stop_file)))
