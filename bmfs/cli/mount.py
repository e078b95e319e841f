"""bmfs mount / umount / mount-helper (the mount.fuse.bmfs entry point)."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time

from ..config import MountOptions, default_volume
from .main import UserError
from .common import (check_metrics_address, find_mount, metrics_option, mounts, run_trio,
                     start_metrics)

log = logging.getLogger(__name__)


def add_parser(sub):
    p = sub.add_parser("mount", help="mount a volume",
                       description="Mount a volume at MOUNTPOINT (made if missing). The "
                       "mount daemon detaches once the mount is up; it logs to "
                       "VOLUME/mount.log.")
    p.add_argument("mountpoint", help="an empty directory (made if missing)")
    p.add_argument("--volume", help="volume directory (default: the default volume, "
                   "created on first use)")
    p.add_argument("--branch", default="main", help="branch shown at the root (default "
                   "main), or a snapshot's name: the snapshot, read-only")
    p.add_argument("--foreground", "-f", action="store_true", help="do not detach")
    p.add_argument("--ec", default="4+2", help="erasure code K+M when creating the "
                   "default volume (default 4+2)")
    p.add_argument("--timeout", type=cache_seconds, default=1.0,
                   help="kernel attribute cache seconds (0 to 3600, default 1)")
    p.add_argument("--read-only", action="store_true", help="mount read-only (as -o ro): "
                   "writes fail with EROFS")
    p.add_argument("--nonempty", action="store_true", help="mount over a directory that "
                   "holds files (as -o nonempty; they are hidden while mounted)")
    p.add_argument("-o", dest="options", default="",
                   help="mount options, comma-separated: ro, rw, relatime (default), "
                   "strictatime, noatime, dev, nodev, suid, nosuid, exec, noexec, "
                   "nonempty, branch=NAME, metrics=ADDR (docs/operations.md)")
    metrics_option(p)
    p.add_argument("--ready-fd", type=int, help=argparse_suppress())
    p.set_defaults(func=run)

    u = sub.add_parser("umount", help="unmount (waits until the data is stored)",
                       description="Unmount MOUNTPOINT and wait until its daemon has "
                       "stored what was written. Exit status 1 if the daemon is still "
                       "storing when the timeout ends (it goes on; nothing is lost).")
    u.add_argument("mountpoint", help="a bmfs mount point")
    u.add_argument("--timeout", type=float, default=UMOUNT_WAIT, metavar="SECONDS",
                   help=f"how long to wait for the daemon (default {UMOUNT_WAIT:g})")
    u.set_defaults(func=run_umount)

    h = sub.add_parser("mount-helper", help="mount.fuse.bmfs: VOLUME MOUNTPOINT [-o OPTS]")
    h.add_argument("volume", help="the volume directory (fstab's first field)")
    h.add_argument("mountpoint", help="the mount point (fstab's second field)")
    h.add_argument("-o", dest="options", default="", help="mount options (as bmfs mount -o)")
    h.set_defaults(func=run_helper)


UMOUNT_WAIT = 600.0  # seconds bmfs umount waits for the daemon to store what was written


def argparse_suppress():
    import argparse
    return argparse.SUPPRESS


def cache_seconds(text: str) -> float:
    """argparse type of --timeout: seconds the kernel may cache attributes and names."""
    import argparse
    import math
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0 <= v <= 3600:  # (nan fails both)
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds from 0 to 3600")
    return v


def _make_mountpoint(mp) -> list[str]:
    """mkdir -p ``mp``: the directories made, outermost first."""
    made = []
    d = mp
    while True:
        try:
            os.lstat(d)
        except FileNotFoundError:
            made.insert(0, d)
            d = os.path.dirname(d)
            continue
        except OSError:  # there but not usable (a dead FUSE mount): said by the check
            pass
        break
    for d in made:
        try:
            os.mkdir(d, 0o755)
        except OSError as e:
            _unmake(made)
            raise UserError(f"cannot make the mount point {mp}: {e.strerror}")
    return made


def _unmake(made: list[str]) -> None:
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            break


def _check_mountpoint(mp, nonempty: bool = False):
    import stat
    try:
        # statfs is never answered from the kernel's caches: a mount whose daemon is
        # gone fails it with ENOTCONN even while its root's attributes are cached
        os.statvfs(mp)
        st = os.stat(mp)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise UserError(f"{mp} is a dead FUSE mount (its daemon is gone): unmount it "
                            f"first (bmfs umount {mp}, or umount -l {mp} while it is busy)")
        raise UserError(f"mount point {mp}: {e.strerror}")
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"mount point {mp} is not a directory")
    if find_mount(mp):
        raise UserError(f"{mp} is already mounted")
    if not nonempty:
        try:
            held = os.listdir(mp)
        except OSError as e:
            raise UserError(f"mount point {mp}: {e.strerror}")
        if held:
            raise UserError(f"{mp} is not empty (it holds {sorted(held)[0]!r}"
                            f"{f' and {len(held) - 1} more' if len(held) > 1 else ''}): "
                            f"mounting would hide them; give --nonempty (-o nonempty) "
                            f"to mount over them")


def run(args) -> int:
    if args.read_only:
        if "rw" in args.options.split(","):
            raise UserError("contradictory mount options: --read-only and rw")
        args.options = ",".join(filter(None, [args.options, "ro"]))
    if args.nonempty:
        args.options = ",".join(filter(None, [args.options, "nonempty"]))
    flags, remount, branch = parse_options(args.options)
    if remount:
        raise UserError("bmfs mount does not remount: use mount -o remount,... MOUNTPOINT")
    nonempty = flags.pop("nonempty", False)
    args.metrics = flags.pop("metrics", None) or args.metrics
    args.branch = branch or args.branch
    mp = os.path.abspath(args.mountpoint)
    check_metrics_address(args.metrics)
    volume = args.volume or default_volume()
    if args.volume is None and not os.path.exists(os.path.join(volume, "volume.json")):
        _make_default_volume(volume, args.ec)
    from ..volume.volume import read_volume_file
    read_volume_file(volume)  # a missing or foreign volume fails here, in one line
    opts = MountOptions(branch=args.branch, attr_timeout=args.timeout,
                        entry_timeout=args.timeout, metrics=args.metrics, **flags)
    if args.ready_fd is not None:  # the detached daemon: its parent checked
        return _serve(volume, mp, opts, args.ready_fd)
    made = _make_mountpoint(mp)
    try:
        _check_mountpoint(mp, nonempty)
        code = _serve(volume, mp, opts, None) if args.foreground else _spawn(volume, mp, args)
    except BaseException:
        _unmake(made)  # (a mount point made for a mount that failed goes again)
        raise
    if made:
        print(f"bmfs: made the mount point {mp}", file=sys.stderr)
    return code


def _make_default_volume(volume: str, ec: str) -> None:
    """mkfs the default volume at ``volume`` (first use of bmfs mount without
    --volume); a place this user cannot make it is a one-line error saying what to do."""
    from ..config import parse_ec
    from ..volume.volume import mkfs
    k, m = parse_ec(ec)
    try:
        os.makedirs(os.path.dirname(volume), 0o700, exist_ok=True)
        run_trio(mkfs, volume, k, m)
    except OSError as e:
        raise UserError(f"cannot make the default volume {volume}: {e.strerror} (give "
                        f"--volume DIR, a volume made with bmfs mkfs DIR, or set "
                        f"XDG_DATA_HOME or BMFS_DEFAULT_VOLUME to a place of yours)")


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
        start_metrics(opts.metrics)  # (first: an address in use fails before the mount)
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
           "--branch", args.branch, "--timeout", str(args.timeout), "-o", args.options,
           "--foreground", "--ready-fd", str(w)]
    if args.metrics:
        cmd += ["--metrics", args.metrics]
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
    pid = _daemon_pid(m["volume"], mp)
    res = subprocess.run(["fusermount3", "-u", mp], capture_output=True, text=True)
    if res.returncode != 0:
        why = res.stderr.strip().removeprefix("fusermount3: ") or f"could not unmount {mp}"
        holders = holders_of(mp)
        if holders:
            why += "; open in it: " + ", ".join(f"{name} (pid {p})" for p, name in
                                                 holders[:10])
            why += f" and {len(holders) - 10} more" if len(holders) > 10 else ""
        raise UserError(why)
    if pid:
        # the daemon stores what was written before it exits: wait for it (a service
        # manager's stop timeout bounds this; the daemon ignores SIGTERM meanwhile).
        # A pid file a killed daemon left names some other process by now, perhaps:
        # only a process whose command line names this mount point is waited for.
        from ..proc import alive
        t0 = time.monotonic()
        said = False
        while alive(pid) and _serves(pid, mp):
            waited = time.monotonic() - t0
            if waited > args.timeout:
                print(f"bmfs umount: unmounted, but the daemon (pid {pid}) is still "
                      f"storing written data after {args.timeout:g} s; it goes on (see "
                      f"{m['volume']}/mount.log)", file=sys.stderr)
                return 1
            if not said and waited > 10:
                print(f"bmfs umount: waiting for the daemon (pid {pid}) to store the "
                      f"data written (at most {args.timeout:g} s)", file=sys.stderr)
                said = True
            time.sleep(0.05)
    return 0


def holders_of(mp: str) -> list[tuple[int, str]]:
    """(pid, command name) of the processes with a file, directory or working
    directory inside ``mp`` (from /proc/*/fd, cwd and root; those this user may see)."""
    inside = mp.rstrip("/") + "/"
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        links = []
        try:
            links = [os.path.join("fd", f) for f in os.listdir(f"/proc/{name}/fd")]
        except OSError:
            pass
        for link in links + ["cwd", "root"]:
            try:
                target = os.readlink(f"/proc/{name}/{link}")
            except OSError:
                continue
            if target == mp or target.startswith(inside):
                try:
                    with open(f"/proc/{name}/comm") as f:
                        comm = f.read().strip()
                except OSError:
                    comm = "?"
                out.append((int(name), comm))
                break
    return out


def _daemon_pid(volume: str, mp: str) -> int | None:
    """The pid the daemon serving ``mp`` recorded in the volume (None if none)."""
    from ..fuse.mount import pid_file
    for path in (pid_file(volume, mp), os.path.join(volume, "mount.pid")):
        try:
            with open(path) as f:
                words = f.read().split()
            if words[1:2] == [mp]:  # several mounts of one volume: find this one's
                return int(words[0])
        except (OSError, ValueError, IndexError):
            pass
    return None


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


# mount(8)'s options that bmfs takes: option -> (MountOptions field, value)
_FLAGS = {"ro": ("read_only", True), "rw": ("read_only", False),
          "relatime": ("atime", "relatime"), "strictatime": ("atime", "strictatime"),
          "noatime": ("atime", "noatime"),
          "dev": ("dev", True), "nodev": ("dev", False),
          "suid": ("suid", True), "nosuid": ("suid", False),
          "exec": ("exec", True), "noexec": ("exec", False),
          "nonempty": ("nonempty", True)}
# options for mount(8), fstab or systemd (x-*, comment=* too), or that mount(8) hands
# back from the mount table at a remount (libfuse's: user_id=, group_id=...)
_NOT_OURS = {"defaults", "auto", "noauto", "user", "nouser", "users", "owner", "group",
             "_netdev", "nofail", "async", "default_permissions", "allow_other"}
_NOT_OURS_PREFIXES = ("x-", "comment=", "user_id=", "group_id=", "fsname=", "subtype=")


def parse_options(text: str) -> tuple[dict, bool, str | None]:
    """``-o`` options: (MountOptions fields they set, whether it is a remount, the
    branch= given or None).

    At a remount mount(8) puts the mount's current options before ``remount`` (ro
    or rw merged with the one asked for) and the others asked for after it: those
    win. An atime rule is taken only from after it: the mount table shows relatime
    for a strictatime mount (libfuse cannot ask the kernel for strictatime).

    Raises:
        UserError: an unknown option, or two asked for that contradict each other
        (ro,rw).
    """
    flags, said, remount, branch = {}, {}, False, None
    for o in filter(None, text.split(",")):
        if o == "remount":
            remount, said = True, {}
            flags.pop("atime", None)
        elif o.startswith("branch="):
            branch = o.split("=", 1)[1]
        elif o.startswith("metrics="):  # (fstab: --metrics ADDR)
            if remount:
                raise UserError("metrics= is set when mounting, not at a remount")
            flags["metrics"] = o.split("=", 1)[1]
        elif o in _FLAGS:
            field, value = _FLAGS[o]
            if field in said and flags[field] != value:
                raise UserError(f"contradictory mount options: {said[field]} and {o}")
            flags[field], said[field] = value, o
        elif o not in _NOT_OURS and not o.startswith(_NOT_OURS_PREFIXES):
            raise UserError(f"unknown mount option {o!r} (bmfs takes: "
                            f"{', '.join(_FLAGS)}, branch=NAME, metrics=ADDR)")
    return flags, remount, branch


def run_helper(args) -> int:
    """mount(8) calls: mount.fuse.bmfs VOLUME MOUNTPOINT -o opts"""
    flags, remount, branch = parse_options(args.options)
    if remount:
        return _remount(os.path.abspath(args.mountpoint), flags)
    cmd = [sys.executable, "-m", "bmfs.cli.main", "mount", args.mountpoint, "--volume",
           args.volume, "--branch", branch or "main", "-o",
           ",".join(o for o in args.options.split(",") if o in _FLAGS)]
    if flags.get("metrics"):
        cmd += ["--metrics", flags["metrics"]]
    return subprocess.call(cmd)


# mount(2) flags (linux/mount.h)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
REMOUNT_WAIT = 10.0  # seconds the daemon has to take a remount up


def _remount(mp: str, flags: dict) -> int:
    """``mount -o remount,...``: change a live mount's flags (the kernel's, with
    mount(2) MS_REMOUNT) and tell its daemon (read-only, atime rule). To rw the
    daemon is told first, to ro last: the kernel stores what it caches (syncfs) as it
    turns read-only, which the daemon must still take."""
    m = find_mount(mp)
    if m is None:
        raise UserError(f"{mp} is not a bmfs mount")
    pid = _daemon_pid(m["volume"], mp)
    if pid is None or not _serves(pid, mp):
        raise UserError(f"no running bmfs daemon serves {mp}")
    if not _catches(pid, signal.SIGUSR1):
        raise UserError(f"the daemon serving {mp} (pid {pid}) cannot take a remount up "
                        f"(it is stopping, or of an older bmfs): unmount and mount again")
    cur = set(m["options"])
    told = {k: v for k, v in flags.items() if k in ("read_only", "atime")}
    to_rw = "ro" in cur and flags.get("read_only") is False
    if to_rw:
        _tell(m["volume"], mp, pid, told)
    try:
        _kernel_remount(mp, _mount_flags(cur, flags))
    except UserError:
        if to_rw:
            _tell(m["volume"], mp, pid, {"read_only": True})
        raise
    if told and not to_rw:
        _tell(m["volume"], mp, pid, told)
    return 0


def _mount_flags(cur: set, flags: dict) -> int:
    """mount(2) flags of a remount: ``flags`` (MountOptions fields) over the mount's
    current ones ``cur`` (its options in mountinfo), which a remount would reset."""
    out = MS_REMOUNT
    if flags.get("read_only", "ro" in cur):
        out |= MS_RDONLY
    for field, bit, off in (("suid", MS_NOSUID, "nosuid"), ("dev", MS_NODEV, "nodev"),
                            ("exec", MS_NOEXEC, "noexec")):
        if not flags.get(field, off not in cur):
            out |= bit
    atime = flags.get("atime") or ("noatime" if "noatime" in cur else
                                   "relatime" if "relatime" in cur else "strictatime")
    out |= {"noatime": MS_NOATIME, "relatime": MS_RELATIME,
            "strictatime": MS_STRICTATIME}[atime]
    if "nodiratime" in cur:
        out |= MS_NODIRATIME
    return out


def _kernel_remount(mp: str, flags: int) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(None, mp.encode(), None, ctypes.c_ulong(flags), None) != 0:
        err = ctypes.get_errno()
        hint = " (a file is open for writing)" if err == errno.EBUSY else \
            " (only root can remount)" if err == errno.EPERM else ""
        raise UserError(f"cannot remount {mp}: {os.strerror(err)}{hint}")


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for signal ``sig`` (/proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _tell(volume: str, mp: str, pid: int, told: dict) -> None:
    """Give the daemon serving ``mp`` its new options (fuse/mount.py _remounts) and
    wait until it has taken them up."""
    from ..fuse.mount import remount_file
    path = remount_file(volume, mp)
    with open(path + ".tmp", "w") as f:
        json.dump(told, f)
    os.replace(path + ".tmp", path)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + REMOUNT_WAIT
    while os.path.exists(path):
        if time.monotonic() > deadline:
            os.unlink(path)
            raise UserError(f"the daemon serving {mp} (pid {pid}) did not take the "
                            f"remount up in {REMOUNT_WAIT:g} s; see {volume}/mount.log")
        time.sleep(0.01)


__all__ = ["mounts", "json"]
