"""The mount daemon: open the volume, serve FUSE until unmounted, close cleanly.

``bmfs mount`` runs this in a detached child process and waits for it to report
ready (or an error, which it prints as one line). The child logs to
``<volume>/mount.log`` and records its pid in ``<volume>/mounts/<mount point>.pid``
(several mounts of one etcd volume each have theirs) and in ``<volume>/mount.pid``
(the last mount's, for single-mount tools).

Besides serving FUSE the daemon runs: garbage collection of unreferenced stripes;
on etcd volumes, the watch that keeps the kernel's caches coherent with other mounts
(vfs/watch.py) and one taking up other mounts' device changes, this mount's leased
presence record (which confirms device changes to drain), and a sweep freeing files
that dead mounts held unlinked-but-open (vfs/session.py).
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

from ..config import MountOptions
from ..errors import FsError, VolumeError
from ..vfs import gc, session
from ..vfs.fs import ATIME_MODES, FileSystem
from ..vfs.volume import Volume
from ..vfs.watch import Watcher, watch_devices
from .idle import idle_spin_setting
from .ops import Operations

log = logging.getLogger(__name__)
GC_INTERVAL = 5.0
REPAIR_EVERY = int(os.environ.get("BMFS_REPAIR_ROUNDS", 6))  # GC rounds between repairs


def pid_file(volume_path: str, mountpoint: str) -> str:
    """Where the daemon serving ``mountpoint`` records its pid."""
    name = urllib.parse.quote(os.path.abspath(mountpoint), safe="") + ".pid"
    return os.path.join(volume_path, "mounts", name)


async def serve(volume_path: str, mountpoint: str, opts: MountOptions, ready=None) -> None:
    """Mount and serve until unmounted. ``ready(error_or_None)`` is called once."""
    volume = await Volume.open(volume_path)
    handlers = _handlers()  # put back at the end (SIG_IGN while the data is stored)
    try:
        swept = await gc.begin_session(volume)  # single owner: sweep after a crash
        if swept:
            log.warning("the last mount crashed: deleted %d fragment files of writes it "
                        "never committed", swept)
        fs = await FileSystem.create(volume, opts.branch)
        shared = hasattr(volume.kv, "grant_lease")  # etcd: other mounts change devices
        volume.kv.enable_write_behind()  # etcd: commit behind (docs/etcd.md)
        ops = Operations(fs, opts.attr_timeout, idle_spin_setting())
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
                await nursery.start(session.keep_alive, fs, mountpoint)
                await nursery.start(_remounts, fs, remount_file(volume_path, mountpoint))
                if shared:
                    # a drain that looked for mounts before this one's record was put
                    # did not wait for it: take up any mark it made, now that drains
                    # see the record (nothing is placed yet, so it is confirmed too)
                    await volume.refresh_devices()
                    volume.devices_confirmed = volume.devices_seq
                    volume.confirmed_changed.unpark_all()
                _write_pid(pidfiles, mountpoint)
                if ready:
                    ready(None)
                nursery.start_soon(_gc_loop, fs)
                if shared:
                    nursery.start_soon(watch_devices, fs)
                    nursery.start_soon(session.confirm_devices, fs)
                    nursery.start_soon(volume.kv.upkeep, lambda: session.leads_repair(fs))
                nursery.start_soon(_signals)
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
            await gc.end_session(volume)
            _remove_pid(pidfiles)
    finally:
        try:
            await volume.aclose()
        finally:
            _set_handlers(handlers)


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


async def _gc_loop(fs):
    """Background upkeep: take up device changes made elsewhere (Volume.refresh_devices),
    record damage seen by reads, delete garbage stripes, free orphans of dead mounts
    (etcd), and every REPAIR_EVERY rounds repair the fragments queued as missing or
    corrupt. On a shared (etcd) volume only one mount repairs in the background (the
    oldest live one, session.leads_repair), so fragments are not rebuilt twice."""
    shared = hasattr(fs.kv, "grant_lease")  # other mounts may die holding orphans
    rounds = 0
    while True:
        with trio.move_on_after(GC_INTERVAL):
            await fs.collect_now.wait()  # a tree deleted here: its layers at once
        asked, fs.collect_now = fs.collect_now.is_set(), trio.Event()
        rounds += not asked  # (repairs come every REPAIR_EVERY timed rounds)
        try:
            await fs.volume.refresh_devices()  # devices added or drained elsewhere
            await fs.volume.record_damage()
            await _collect_layers(fs, asked, shared)
            await fs.volume_gc()
            if shared:
                await session.sweep_orphans(fs)
            from ..meta import keys
            from ..vfs import repair
            # (not while a repair, scrub, drain or rebalance of this mount runs: that
            # would hold the rest of the upkeep up until it ends)
            if rounds % REPAIR_EVERY == 0 and not repair.busy(fs.volume) and \
                    await fs.kv.range(*keys.span(keys.DAMAGE_PREFIX), 1) and \
                    (not shared or await session.leads_repair(fs)):
                result = await repair.repair(fs.volume)
                if result["fragments_rebuilt"] or result["stripes_failed"]:
                    log.warning("background repair: %s", result)
        except FsError as e:  # e.g. the metadata store is unreachable: no traceback
            log.warning("garbage collection failed (%s); will retry", e)
        except Exception:
            log.exception("garbage collection failed; will retry")


async def _collect_layers(fs, asked: bool, shared: bool) -> None:
    """Collect the layers of deleted branches and snapshots (branches.collect_pending),
    then delete the fragments of the stripes that freed, all of them: if a tree was
    deleted through this mount, or another mount's delete left them (it was unmounted
    or crashed first) and this mount leads the upkeep of a shared volume."""
    from ..meta import branches, keys
    if not asked and (await fs.kv.get(keys.COLLECT_LAYERS) is None
                      or (shared and not await session.leads_repair(fs))):
        return
    freed = await branches.collect_pending(fs.kv)
    if freed is None:
        return
    while await fs.volume_gc() >= gc.BATCH:
        pass
    log.info("collected %d layers of deleted branches and snapshots", freed)


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
