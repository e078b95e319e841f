"""The mount daemon: open the volume, serve FUSE until unmounted, close cleanly.

``bmfs mount`` runs this in a detached child process and waits for it to report
ready (or an error, which it prints as one line). The child logs to
``<volume>/mount.log`` and records its pid in ``<volume>/mount.pid``.
"""
from __future__ import annotations

import logging
import os
import signal

import pyfuse3
import trio

from ..config import MountOptions
from ..vfs.fs import FileSystem
from ..vfs.volume import Volume
from .ops import Operations

log = logging.getLogger(__name__)
GC_INTERVAL = 5.0


async def serve(volume_path: str, mountpoint: str, opts: MountOptions, ready=None) -> None:
    """Mount and serve until unmounted. ``ready(error_or_None)`` is called once."""
    volume = await Volume.open(volume_path)
    try:
        fs = await FileSystem.create(volume, opts.branch)
        ops = Operations(fs, opts.attr_timeout)
        fuse_options = set(pyfuse3.default_options)
        fuse_options.discard("default_permissions")
        fuse_options |= {f"fsname=bmfs:{os.path.abspath(volume_path)}", "subtype=bmfs",
                         "default_permissions"}
        if opts.allow_other:
            fuse_options.add("allow_other")
        pyfuse3.init(ops, mountpoint, fuse_options)
        try:
            with open(os.path.join(volume_path, "mount.pid"), "w") as f:
                f.write(f"{os.getpid()} {os.path.abspath(mountpoint)}\n")
            if ready:
                ready(None)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_gc_loop, fs)
                nursery.start_soon(_signals)
                await pyfuse3.main(min_tasks=4, max_tasks=64)
                nursery.cancel_scope.cancel()
        finally:
            pyfuse3.close(unmount=True)
            await fs.aclose()
            try:
                os.unlink(os.path.join(volume_path, "mount.pid"))
            except OSError:
                pass
    finally:
        await volume.aclose()


async def _gc_loop(fs):
    while True:
        await trio.sleep(GC_INTERVAL)
        try:
            await fs.volume.record_damage()
            await fs.volume_gc()
        except Exception:
            log.exception("garbage collection failed; will retry")


async def _signals():
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
        async for _ in sigs:
            log.info("signal received: unmounting")
            pyfuse3.terminate()
            return
