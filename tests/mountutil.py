"""Real mounts for tests: a volume in a temp dir, mounted through the `bmfs` CLI.

``Mounted`` is a context manager; it unmounts (and, if the daemon hangs, kills it by
pid) on exit, so a failing test never leaves a mount behind.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

BMFS = [sys.executable, "-m", "bmfs.cli.main"]


def bmfs(*args, check=True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(BMFS + [str(a) for a in args], capture_output=True, text=True, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"bmfs {' '.join(map(str, args))} failed ({res.returncode}):\n"
                             f"{res.stdout}\n{res.stderr}")
    return res


def mkfs(volume, *extra):
    return bmfs("mkfs", volume, *extra)


def is_mounted(mp) -> bool:
    mp = os.path.abspath(mp)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == mp for line in f)


def daemon_pid(volume) -> int | None:
    try:
        with open(os.path.join(volume, "mount.pid")) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError):
        return None


class Mounted:
    def __init__(self, volume, mountpoint, *extra):
        self.volume, self.mp, self.extra = str(volume), str(mountpoint), extra

    def __enter__(self):
        os.makedirs(self.mp, exist_ok=True)
        bmfs("mount", self.mp, "--volume", self.volume, *self.extra)
        self.pid = daemon_pid(self.volume)
        return self

    def umount(self):
        if is_mounted(self.mp):
            try:  # (umount waits for the daemon to exit: one that hangs is killed below)
                ok = bmfs("umount", self.mp, check=False, timeout=120).returncode == 0
            except subprocess.TimeoutExpired:
                ok = False
            if not ok and is_mounted(self.mp):
                subprocess.run(["fusermount3", "-uz", self.mp])
        if self.pid:
            from bmfs.proc import alive
            for _ in range(200):
                if not alive(self.pid):
                    break
                time.sleep(0.05)
            else:
                os.kill(self.pid, signal.SIGKILL)

    def kill9(self):
        """Crash the daemon: SIGKILL, then clear the dead mount."""
        from bmfs.proc import alive
        os.kill(self.pid, signal.SIGKILL)
        for _ in range(100):
            if not alive(self.pid):
                break
            time.sleep(0.05)
        subprocess.run(["fusermount3", "-uz", self.mp], capture_output=True)

    def ctl(self, op, **args):
        path = os.path.join(self.mp, ".bm", "ctl")
        fd = os.open(path, os.O_RDWR)
        try:
            os.write(fd, json.dumps({"op": op, **args}).encode())
            return json.loads(os.pread(fd, 1 << 24, 0))
        finally:
            os.close(fd)

    def __exit__(self, *exc):
        self.umount()


def fsck(volume, *extra) -> subprocess.CompletedProcess:
    return bmfs("fsck", volume, *extra, check=False)


def assert_fsck_clean(volume):
    res = fsck(volume)
    assert res.returncode == 0, f"fsck found problems:\n{res.stdout}{res.stderr}"


def fragment_count(volume) -> int:
    """Fragments on the devices inside ``volume`` (those mkfs made there)."""
    from fragments import on_device
    return sum(len(on_device(os.path.dirname(m))) for m in glob.glob(f"{volume}/*/DEVICE"))


def write_stored(path, nbytes):
    """``nbytes`` random bytes written to ``path`` and fsync'ed (stored on the devices)."""
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())


def wait_collected(mp, volume, fragments):
    """Until `bmfs status` shows nothing left to collect and the devices hold
    ``fragments`` fragments again (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        st = json.loads(bmfs("status", "--json", mp).stdout)
        left = fragment_count(volume)
        if (not st["collecting_deleted_trees"] and not st["stripes_awaiting_gc"]
                and left == fragments):
            return
        assert time.monotonic() < deadline, (st["collecting_deleted_trees"],
                                             st["stripes_awaiting_gc"], left, fragments)
        time.sleep(0.2)


def delete_snapshot_left_to_collect(volume, name):
    """Delete snapshot ``name`` of ``volume`` as a mount that went away before freeing
    anything leaves it (op_snapshot_delete with collect=False, in a process of its
    own): its stdout."""
    code = ("import sys, trio\n"
            "from bmfs.volume.volume import Volume\n"
            "from bmfs.meta.branches import op_snapshot_delete\n"
            "async def main():\n"
            "    vol = await Volume.open(sys.argv[1])\n"
            "    try:\n"
            "        print(await op_snapshot_delete(vol.kv, sys.argv[2], collect=False))\n"
            "    finally:\n"
            "        await vol.aclose()\n"
            "trio.run(main)\n")
    return subprocess.run([sys.executable, "-c", code, str(volume), name], check=True,
                          capture_output=True, text=True).stdout


SITTER = """
import json, os, sys
os.chdir(sys.argv[1])
fd = os.open(".", os.O_RDONLY)
sys.stdout.write("in\\n"); sys.stdout.flush()
sys.stdin.readline()  # the directory is removed meanwhile
out = {"nlink": os.stat(".").st_nlink, "fnlink": os.fstat(fd).st_nlink}
os.chdir("..")
out["up"] = os.stat(".").st_ino
print(json.dumps(out))
"""


def sit_in(path) -> subprocess.Popen:
    """A process whose working directory is ``path`` (and which holds it open), waiting
    for a line on stdin; then it prints (JSON) st_nlink of stat(".") and of fstat, and
    the inode number of the directory chdir("..") took it to."""
    p = subprocess.Popen([sys.executable, "-c", SITTER, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "in\n", p.stderr.read()
    return p


def wait_listening(port: int, proc, what: str = "the process", seconds: float = 30) -> None:
    """Wait until something accepts connections on 127.0.0.1:``port``; fails if
    ``proc`` (a Popen) exits first or ``seconds`` pass."""
    import socket
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, f"{what} did not start"
            time.sleep(0.05)
