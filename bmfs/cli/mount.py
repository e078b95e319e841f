"""bmfs mount / umount / mount-helper (the mount.fuse.bmfs entry point)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

from ..config import MountOptions, default_volume
from .main import UserError
from .common import find_mount, mounts, run_trio

log = logging.getLogger(__name__)


def add_parser(sub):
    p = sub.add_parser("mount", help="mount a volume")
    p.add_argument("mountpoint")
    p.add_argument("--volume", help="volume directory (default: the default volume, "
                   "created on first use)")
    p.add_argument("--branch", default="main", help="branch shown at the root (default main)")
    p.add_argument("--foreground", "-f", action="store_true", help="do not detach")
    p.add_argument("--ec", default="4+2", help="erasure code when creating the default volume")
    p.add_argument("--timeout", type=float, default=1.0, help="kernel attribute cache seconds")
    p.add_argument("--ready-fd", type=int, help=argparse_suppress())
    p.set_defaults(func=run)

    u = sub.add_parser("umount", help="unmount (waits until the data is stored)")
    u.add_argument("mountpoint")
    u.set_defaults(func=run_umount)

    h = sub.add_parser("mount-helper", help="mount.fuse.bmfs: VOLUME MOUNTPOINT [-o OPTS]")
    h.add_argument("volume")
    h.add_argument("mountpoint")
    h.add_argument("-o", dest="options", default="")
    h.set_defaults(func=run_helper)


def argparse_suppress():
    import argparse
    return argparse.SUPPRESS


def _check_mountpoint(mp):
    if not os.path.isdir(mp):
        raise UserError(f"mount point {mp} is not a directory")
    if find_mount(mp):
        raise UserError(f"{mp} is already mounted")


def run(args) -> int:
    mp = os.path.abspath(args.mountpoint)
    volume = args.volume or default_volume()
    if args.volume is None and not os.path.exists(os.path.join(volume, "volume.json")):
        from ..config import parse_ec
        from ..vfs.volume import mkfs
        k, m = parse_ec(args.ec)
        run_trio(mkfs, volume, k, m)
    if args.mountpoint and not os.path.exists(mp) and args.volume is None:
        os.makedirs(mp, exist_ok=True)
    _check_mountpoint(mp)
    from ..vfs.volume import read_volume_file
    read_volume_file(volume)  # a missing or foreign volume fails here, in one line
    opts = MountOptions(branch=args.branch, attr_timeout=args.timeout,
                        entry_timeout=args.timeout)
    if args.foreground:
        return _serve(volume, mp, opts, args.ready_fd)
    return _spawn(volume, mp, args)


def _serve(volume, mp, opts, ready_fd) -> int:
    import logging
    from ..fuse.mount import serve
    if ready_fd is not None:
        logging.basicConfig(filename=os.path.join(volume, "mount.log"), level=logging.INFO,
                            format="%(asctime)s [%(process)d] %(levelname)s %(name)s: "
                                   "%(message)s", force=True)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per etcd request

    def ready(err):
        if ready_fd is not None:
            os.write(ready_fd, (f"error: {err}" if err else "ready").encode() + b"\n")
            os.close(ready_fd)
        elif err is None:
            # in the foreground (a service): what _spawn's parent does once it is ready,
            # from a thread (the stat in it is served by this process's event loop),
            # then tell systemd (Type=notify) the mount is up
            import threading
            from ..proc import notify_ready

            def up():
                try:
                    _raise_read_ahead(mp)
                except OSError as e:  # (the mount is up: only the read-ahead is not)
                    logging.getLogger(__name__).warning("read-ahead of %s: %s", mp, e)
                finally:
                    notify_ready(f"mounted {volume} at {mp}")
            threading.Thread(target=up, daemon=True).start()
    try:
        run_trio(serve, volume, mp, opts, ready)
    except Exception as e:
        if ready_fd is not None:
            try:
                ready(e)
            except OSError:
                pass
        raise
    return 0


def _spawn(volume, mp, args) -> int:
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "bmfs.cli.main", "mount", mp, "--volume", volume,
           "--branch", args.branch, "--timeout", str(args.timeout), "--foreground",
           "--ready-fd", str(w)]
    log = open(os.path.join(volume, "mount.log"), "ab")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            pass_fds=(w,), start_new_session=True)
    os.close(w)
    with os.fdopen(r) as f:
        line = f.readline().strip()
    if line != "ready":
        proc.wait(timeout=30)
        msg = line[len("error: "):] if line.startswith("error: ") else \
            f"the mount daemon exited (status {proc.returncode}); see {volume}/mount.log"
        raise UserError(msg)
    _raise_read_ahead(mp)
    return 0


def _raise_read_ahead(mp, kb: int = 4096) -> None:
    """Reads come in 128 KiB unless the mount's bdi read-ahead is raised.

    The kernel sets the bdi up when the FUSE handshake (INIT) completes, which may be
    after the mount appears: a stat through the mount waits for that, so the value
    written here is not overwritten by the kernel's default."""
    try:
        os.stat(mp)
    except OSError as e:  # e.g. a damaged root record (EIO): mounted, its log says why
        log.warning("%s: %s", mp, e.strerror)
        return
    m = find_mount(mp)
    if not m or not m.get("dev"):
        return
    try:
        with open(f"/sys/class/bdi/{m['dev']}/read_ahead_kb", "w") as f:
            f.write(str(kb))
    except OSError:
        pass


def run_umount(args) -> int:
    mp = os.path.abspath(args.mountpoint)
    m = find_mount(mp)
    if not m:
        raise UserError(f"{mp} is not a bmfs mount")
    pid = None
    volume = m["source"].split(":", 1)[1] if m["source"].startswith("bmfs:") else None
    if volume:
        from ..fuse.mount import pid_file
        for path in (pid_file(volume, mp), os.path.join(volume, "mount.pid")):
            try:
                with open(path) as f:
                    words = f.read().split()
                if words[1:2] == [mp]:  # several mounts of one volume: find this one's
                    pid = int(words[0])
                    break
            except (OSError, ValueError, IndexError):
                pass
    res = subprocess.run(["fusermount3", "-u", mp], capture_output=True, text=True)
    if res.returncode != 0:
        raise UserError(res.stderr.strip() or f"could not unmount {mp}")
    if pid:
        # the daemon stores what was written before it exits: wait for it (a service
        # manager's stop timeout bounds this; the daemon ignores SIGTERM meanwhile).
        # A pid file a killed daemon left names some other process by now, perhaps:
        # only a process whose command line names this mount point is waited for.
        from ..proc import alive
        t0 = time.monotonic()
        said = False
        while alive(pid) and _serves(pid, mp):
            if not said and time.monotonic() - t0 > 10:
                print(f"bmfs umount: the daemon (pid {pid}) is still storing written data; "
                      f"waiting", file=sys.stderr)
                said = True
            time.sleep(0.05)
    return 0


def _serves(pid: int, mp: str) -> bool:
    """Whether process ``pid`` is a mount daemon of ``mp`` (by its command line)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0")]
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return "mount" in args and any(os.path.normpath(os.path.join(cwd, a)) == mp
                                   for a in args if a)


def run_helper(args) -> int:
    """mount(8) calls: mount.fuse.bmfs VOLUME MOUNTPOINT -o opts"""
    branch = "main"
    for o in args.options.split(","):
        if o.startswith("branch="):
            branch = o.split("=", 1)[1]
    cmd = [sys.executable, "-m", "bmfs.cli.main", "mount", args.mountpoint, "--volume",
           args.volume, "--branch", branch]
    return subprocess.call(cmd)


__all__ = ["mounts", "json"]
