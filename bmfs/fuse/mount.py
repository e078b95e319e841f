"""The mount daemon: open the volume, serve FUSE until unmounted, close cleanly.

``bmfs mount`` runs this in a detached child process and waits for it to report
ready (or an error, which it prints as one line). The child logs to
``<volume>/mount.log`` and records its pid in ``<volume>/mounts/<mount point>.pid``
(several mounts of one etcd volume each have theirs) and in ``<volume>/mount.pid``
(the last mount's, for single-mount tools).

Besides serving FUSE the daemon runs the watch that keeps the kernel's caches
coherent with other mounts of an etcd volume (vfs/watch.py) and the volume's upkeep
(volume/upkeep.py: garbage collection, repair, the mount's presence record, device
changes, orphan sweeps), serves volume administration through the control file
(volume/admin.py), and, on a one-machine volume, its metadata's reads to direct
clients (volume/metasock.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import urllib.parse

import pyfuse3
import trio

from .. import metrics
from ..config import MountOptions, get_settings
from ..errors import FsError, VolumeError
from ..vfs.fs import FileSystem
from ..vfs.inode_attrs import ATIME_MODES
from ..vfs.watch import Watcher
from ..volume import admin, metasock, upkeep
from ..volume.volume import Volume
from .ops import Operations

log = logging.getLogger(__name__)


def pid_file(volume_path: str, mountpoint: str) -> str:
    """Where the daemon serving ``mountpoint`` records its pid."""
    name = urllib.parse.quote(os.path.abspath(mountpoint), safe="") + ".pid"
    return os.path.join(volume_path, "mounts", name)


async def serve(volume_path: str, mountpoint: str, opts: MountOptions, ready=None) -> None:
    """Mount and serve until unmounted. ``ready(error_or_None)`` is called once."""
    volume = await Volume.open(volume_path)
    handlers = _handlers()  # put back at the end (SIG_IGN while the data is stored)
    try:
        await upkeep.begin(volume)  # single owner: sweep after a crash
        fs = await FileSystem.create(volume, opts.branch)
        admin.install(fs)
        volume.kv.enable_write_behind()  # etcd: commit behind (docs/etcd.md)
        ops = Operations(fs, opts.attr_timeout, get_settings().idle_spin)
        fs.read_only, fs.atime = opts.read_only, opts.atime
        with libfuse_messages() as said:
            try:
                pyfuse3.init(ops, mountpoint, fuse_options(volume_path, opts))
            except RuntimeError as e:
                # pyfuse3 says only "fuse_session_mount failed": libfuse printed why
                raise MountFailed(f"cannot mount {mountpoint}: {said() or e}") from None
        _watch_requests(volume.transport)
        pidfiles = [pid_file(volume_path, mountpoint), os.path.join(volume_path, "mount.pid")]
        try:
            async with trio.open_nursery() as nursery:
                fs.files.nursery = nursery  # full stripes are stored in the background
                # before the first request: other mounts' changes from now on are seen
                await nursery.start(Watcher(fs).run)
                await nursery.start(upkeep.run, fs, mountpoint)
                await nursery.start(_remounts, fs, remount_file(volume_path, mountpoint))
                if volume.kv.caps.single_writer:
                    # direct clients of this mount's one-owner metadata read it here
                    await nursery.start(metasock.serve, volume.kv, volume_path, mountpoint)
                _write_pid(pidfiles, mountpoint)
                if ready:
                    ready(None)
                nursery.start_soon(_signals)
                if opts.metrics:
                    nursery.start_soon(_sample, fs)
                nursery.start_soon(ops.idle.run)
                await pyfuse3.main(min_tasks=4, max_tasks=64)
                # release what is still open while this mount's m/ record lives: once
                # it is gone, other mounts free the files it holds unlinked
                try:
                    await fs.files.close_all()
                except FsError as e:
                    log.warning("storing the files still open failed: %s", e)
                nursery.cancel_scope.cancel()
        finally:
            pyfuse3.close(unmount=True)
            # what was written is stored now, and the write-behind metadata by
            # volume.aclose: a SIGTERM (a service manager stopping it once unmounted)
            # must not cut that short, so these signals are ignored until the end
            _set_handlers(dict.fromkeys(handlers, signal.SIG_IGN))
            await fs.aclose()
            await upkeep.end(volume)
            _remove_pid(pidfiles)
    finally:
        try:
            await volume.aclose()
        finally:
            _set_handlers(handlers)


SAMPLE_INTERVAL = 5.0  # seconds between the metrics' readings of the volume's state


async def _sample(fs) -> None:
    """Read what metrics.py reports of the volume's state (the repair backlog, the
    devices) every SAMPLE_INTERVAL: a scrape runs in another thread and cannot ask
    the metadata or the devices itself."""
    from ..meta import keys
    volume = fs.volume
    state: list = []
    wb = getattr(volume.kv, "wb", None)

    def rows():
        out = list(state)
        out.append(("bmfs_write_behind_queue", (), len(wb.queue) if wb else 0))
        out.append(("bmfs_open_files_dirty", (),
                    sum(1 for of in list(fs.files.open_files.values()) if of.dirty)))
        return out
    metrics.add_source(rows)
    while True:
        try:
            backlog = len(await volume.kv.range(*keys.span(keys.DAMAGE_PREFIX)))
            new = [("bmfs_repair_backlog_fragments", (), backlog)]
            for dev, u in sorted((await volume.device_usage(max_age=0)).items()):
                healthy = not isinstance(u, Exception) and u is not None
                new.append(("bmfs_device_healthy", (dev,), int(healthy)))
                if healthy:
                    new += metrics.device_rows(dev, u)
            state[:] = new
        except FsError as e:  # (the metadata unreachable for now: the last readings stay)
            log.debug("metrics: %s", e)
        await trio.sleep(SAMPLE_INTERVAL)


class MountFailed(VolumeError):
    """The kernel mount failed (libfuse's reason in the message)."""


@contextlib.contextmanager
def libfuse_messages():
    """Catch what libfuse (and fusermount3, which it runs for a user that is not root)
    prints to stderr while the body runs: yields a function returning that text's
    last line, without libfuse's ``fuse: `` prefix ("" if it said nothing). Then
    stderr is what it was, and what was caught is written to it as well (the log)."""
    import tempfile
    sys.stderr.flush()
    saved = os.dup(2)
    caught = tempfile.TemporaryFile()
    os.dup2(caught.fileno(), 2)

    def said() -> str:
        text = os.pread(caught.fileno(), 1 << 16, 0).decode(errors="replace")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return lines[-1].removeprefix("fuse: ").removeprefix("fusermount3: ") if lines else ""
    try:
        yield said
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        text = os.pread(caught.fileno(), 1 << 16, 0)
        caught.close()
        if text:
            sys.stderr.write(text.decode(errors="replace"))


def fuse_options(volume_path: str, opts: MountOptions) -> set[str]:
    """The options of the kernel mount: the volume's path as its source and ``bmfs``
    as its subtype (``findmnt VOLUME``; type ``fuse.bmfs``), and mount(8)'s flags.
    libfuse mounts nosuid,nodev unless told ``suid``/``dev``, which only root may."""
    # (libfuse splits options at commas: one in the path is escaped)
    source = os.path.abspath(volume_path).replace("\\", "\\\\").replace(",", "\\,")
    out = {f"fsname={source}", "subtype=bmfs", "default_permissions"}
    if opts.allow_other:
        out.add("allow_other")
    if opts.read_only:
        out.add("ro")
    if opts.atime == "noatime":
        out.add("noatime")
    if not opts.exec:
        out.add("noexec")
    if os.geteuid() == 0:
        out |= {"dev"} if opts.dev else set()
        out |= {"suid"} if opts.suid else set()
    return out


def remount_file(volume_path: str, mountpoint: str) -> str:
    """Where ``bmfs mount-helper -o remount,...`` puts the new options for the daemon
    serving ``mountpoint`` (see _remounts)."""
    return pid_file(volume_path, mountpoint)[:-len(".pid")] + ".remount"


async def _remounts(fs, path: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Take up remounts: on SIGUSR1, read the options the mount helper put in ``path``
    (JSON: ``read_only``, ``atime``, either left out if unchanged), apply them, and
    delete the file, which tells the helper they are in force. Only a process allowed
    to signal the daemon (root, or the user who mounted) can ask. The helper checks
    that the daemon catches SIGUSR1 (one that does not would die of it): it is caught
    from before the mount is ready, and ignored once the daemon stops serving. Without
    the main thread (no signals there) it returns at once."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        task_status.started()
        return
    try:
        await _take_remounts(fs, path, task_status)
    finally:  # (a late one must not end the daemon while it stores what it holds)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


async def _take_remounts(fs, path: str, task_status) -> None:
    with trio.open_signal_receiver(signal.SIGUSR1) as sigs:
        task_status.started()
        async for _ in sigs:
            try:
                with open(path) as f:
                    req = json.load(f)
                read_only = bool(req.get("read_only", fs.read_only))
                atime = req.get("atime", fs.atime)
                if atime not in ATIME_MODES:
                    raise ValueError(f"unknown atime mode {atime!r}")
            except FileNotFoundError:
                continue
            except (OSError, ValueError, AttributeError) as e:
                log.warning("remount: unusable request in %s: %s", path, e)
                continue
            fs.read_only, fs.atime = read_only, atime
            log.info("remounted: %s, %s", "ro" if read_only else "rw", atime)
            try:
                os.unlink(path)
            except OSError:
                pass


_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _handlers() -> dict:
    """The handlers of SIGTERM, SIGINT and SIGHUP now; none outside the main thread
    (signal handlers live there, and cannot be set elsewhere)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in _STOPPING}


def _set_handlers(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _watch_requests(transport) -> None:
    """Tell the transport which descriptor is the FUSE device, so it can see requests
    queued behind the current one: LocalTransport reads small requests inline while
    none wait, TcpTransport stops spinning for a node's reply in C when one comes.
    pyfuse3 does not expose it: it is the descriptor open on /dev/fuse."""
    if not hasattr(transport, "watch_requests"):
        return
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                transport.watch_requests(int(name))
                return
        except OSError:
            continue


def _write_pid(paths: list[str], mountpoint: str) -> None:
    os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
    for path in paths:
        with open(path, "w") as f:
            f.write(f"{os.getpid()} {os.path.abspath(mountpoint)}\n")


def _remove_pid(paths: list[str]) -> None:
    """Remove the pid files that still name this process (another mount of the
    volume may have taken over mount.pid)."""
    for path in paths:
        try:
            with open(path) as f:
                mine = f.read().split()[:1] == [str(os.getpid())]
            if mine:
                os.unlink(path)
        except OSError:
            pass


async def _signals():
    # leaving the receiver puts back the handlers it found and delivers to them the
    # signals it still holds: ignored ones, so that a second SIGTERM does not end the
    # process before its data is stored (serve's finally puts the old ones back)
    _set_handlers(dict.fromkeys(_handlers(), signal.SIG_IGN))
    with trio.open_signal_receiver(*_STOPPING) as sigs:
        async for _ in sigs:
            log.info("signal received: unmounting")
            pyfuse3.terminate()
            return
