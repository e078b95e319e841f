"""A direct client's volume, opened in this process: the async half of bmfs.connect.

Everything here runs on the client's loop (portal.py). It is the vfs a mount runs
(vfs/fs.py: FileSystem), without FUSE: paths are walked with ``lookup`` from the root
of the branch or snapshot the client opened, files are read and written through
``Files``, and batches of reads go to the transport at once (batch.py).

Metadata and writers:
- etcd: the client is one more writer beside the mounts. A writable one holds a
  mount record (``m/``, volume/session.py keep_alive) while it is open, as a mount does.
- SQLite (one machine): the database has one owner. With ``writable=True`` the
  client takes it as a mount would (nothing else opens the volume meanwhile; a
  forked child cannot use it). Otherwise it reads the database beside other readers
  (SqliteKV.open_shared: a mount cannot start meanwhile; writes raise
  PermissionError). A volume a mount owns is read through that mount: its newest
  commits are in the mount's memory and redo log, not in the database, and the mount
  serves its engine's reads on VOLUME/meta.sock (kv/mountsock.py). Writes are then
  refused (PermissionError, EROFS) naming the mount point to write through; so is
  ``writable=True``. A volume another process owns (fsck, a writing client) is
  refused (PermissionError, EBUSY).
Atimes are left as they are (as on a ``noatime`` mount).
"""
from __future__ import annotations

import errno
import os
import stat

import trio

from ..errors import FsError, InUse, InUseHere, VolumeError
from ..kv.mountsock import SOCKET_NAME, MountSockKV
from ..volume import session, upkeep
from ..vfs.fs import FileSystem
from ..vfs.views import Views
from ..vfs.watch import watch_devices
from ..volume.volume import Volume

ROOT = 1  # the root of the opened tree (view 0), in the vfs's inode numbers
# connections kept open to each storage node (TcpTransport.pool): a batch's small reads
# go out pipelined on tcp.BATCH_CONNS of them; the reads the C path does not take use
# one connection each, and connections beyond the pool are closed once answered
NODE_POOL = 64


def os_error(e: Exception, path: str | None = None) -> OSError:
    """The OSError a program expects for a vfs or volume error (its errno picks
    the subclass: ENOENT -> FileNotFoundError, ...)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]  # (raised through a nursery)
    if isinstance(e, OSError):
        return e
    if isinstance(e, FsError):
        msg = e.args[0] if e.args and e.args[0] else os.strerror(e.errno)
        return OSError(e.errno, msg, path)
    if isinstance(e, VolumeError):
        msg = str(e)
        if isinstance(e, InUseHere):
            return PermissionError(errno.EBUSY, msg, path)
        if "in use by another bmfs process" in msg:
            return PermissionError(errno.EBUSY, f"{msg}; a direct client reads a one-machine "
                                   "volume beside other readers or through its mount, not "
                                   "while another process owns it", path)
        if isinstance(e.__cause__ or e.__context__, PermissionError):
            return PermissionError(errno.EACCES, msg, path)  # (another user's volume)
        if "no such volume directory" in msg or "is not a bmfs volume" in msg:
            return FileNotFoundError(errno.ENOENT, msg, path)
        return OSError(errno.EIO, msg, path)
    return OSError(errno.EIO, str(e), path)


class Session:
    """One process's opened volume and tree. Create with ``await Session.open(...)``."""

    def __init__(self, volume: Volume, fs: FileSystem, writable: bool, nursery):
        self.volume, self.fs, self.writable, self.nursery = volume, fs, writable, nursery
        self.owner = writable and volume.kv.caps.single_writer  # took the SQLite database
        # read through the mount that owns the volume (its writes go there)
        self.mount = volume.kv if isinstance(volume.kv, MountSockKV) else None

    @classmethod
    async def open(cls, path: str, branch: str, snapshot: str | None, writable: bool,
                   nursery) -> "Session":
        try:
            volume = await Volume.open(path, shared=not writable)
        except InUse:
            if writable:
                await _refuse_if_mounted(path)
            raise
        if volume.on_nodes:
            volume.transport.pool = NODE_POOL
        try:
            if writable and volume.kv.caps.single_writer:
                await upkeep.begin(volume)  # as a mount: after a crash
            views = Views(volume.kv)
            kind, name = ("snapshot", snapshot) if snapshot else ("branch", branch)
            await views.add(kind, name, view_id=0)
            fs = FileSystem(volume, views)
            from ..vfs.control import Control
            fs.control = Control(fs)
            fs.atime = "noatime"
            fs.read_only = not writable
            fs.files.nursery = nursery
            s = cls(volume, fs, writable, nursery)
            if writable and not volume.kv.caps.single_writer:
                # as a mount: a record other mounts see (drains wait for its devices
                # to be confirmed), and the device records' changes taken up
                await nursery.start(session.keep_alive, fs, f"/bmfs.connect/{os.getpid()}")
                await volume.refresh_devices()
                volume.devices_confirmed = volume.devices_seq
                volume.confirmed_changed.unpark_all()
                nursery.start_soon(watch_devices, fs)
                nursery.start_soon(session.confirm_devices, fs)
            return s
        except BaseException:
            await volume.aclose()
            raise

    async def aclose(self) -> None:
        try:
            await self.fs.aclose()
            if self.owner:
                await upkeep.end(self.volume)
        finally:
            await self.volume.aclose()

    # -- names ------------------------------------------------------------------------
    async def resolve(self, path: str):
        """The Attr of ``path`` (a path inside the opened tree, "/" its root)."""
        a = await self.fs.getattr(ROOT)
        for part in _parts(path):
            if not stat.S_ISDIR(a.mode):
                raise OSError(errno.ENOTDIR, "Not a directory", path)
            a = await self.fs.lookup(a.ino, part)
        return a

    async def parent_of(self, path: str):
        parts = _parts(path)
        if not parts:
            raise OSError(errno.EINVAL, "the root has no parent", path)
        parent = await self.resolve("/".join(p.decode() for p in parts[:-1]))
        return parent, parts[-1]

    async def close_to_open(self) -> None:
        """What a mount does at open: see every commit made before (other mounts'),
        and the branch's current layers."""
        await self.fs.kv.barrier()
        await self.fs.views.refresh()

    def check_writable(self, path: str) -> None:
        if self.mount is not None:
            raise PermissionError(errno.EROFS, self.mount.refusal(), path)
        if not self.writable:
            raise PermissionError(errno.EROFS, "this client is read-only: "
                                  "bmfs.connect(..., writable=True) writes", path)
        self.fs.check_writable()


async def _refuse_if_mounted(path: str) -> None:
    """Raise PermissionError (EROFS) naming the mount point if a mount owns the
    one-machine volume at ``path`` (a writable client was asked for)."""
    try:
        kv = await MountSockKV.create(os.path.join(path, SOCKET_NAME))
    except (OSError, FsError):
        return  # no mount answers: the owner is another process
    try:
        raise PermissionError(errno.EROFS, kv.refusal(), path)
    finally:
        await kv.aclose()


def _parts(path: str) -> list[bytes]:
    return [os.fsencode(p) for p in path.split("/") if p and p != "."]


async def run_session(path, branch, snapshot, writable, task_status=trio.TASK_STATUS_IGNORED):
    """Open a Session and keep its background tasks running until cancelled; the
    Session (or the error opening it raised) is handed to ``task_status``."""
    async with trio.open_nursery() as nursery:
        s = await Session.open(path, branch, snapshot, writable, nursery)
        try:
            task_status.started(s)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await s.aclose()
