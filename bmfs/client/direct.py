"""``bmfs.connect``: a volume opened in the calling process, without a mount.

The client is synchronous and safe to share between threads (every call runs on
the client's own event loop: portal.py) and survives fork: a forked child (a
DataLoader worker) opens its own loop and connections on its first call, and its
files opened for reading are opened again by path there. See docs/client.md.
"""
from __future__ import annotations

import errno
import io
import os
import stat
import threading
import weakref

import trio

from .ahead import ReadAhead
from .batch import read_many as _read_many
from .portal import Portal
from .session import Session, os_error, run_session

_CLIENTS: "weakref.WeakSet[Client]" = weakref.WeakSet()
_ABANDONED: list = []  # a forked child's copies of its parent's objects: never closed


def _after_fork() -> None:
    for c in list(_CLIENTS):
        c._forked()


os.register_at_fork(after_in_child=_after_fork)


class StatResult:
    """What ``Client.stat`` returns: os.stat_result's fields that bmfs keeps."""
    __slots__ = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size",
                 "st_atime_ns", "st_mtime_ns", "st_ctime_ns")

    def __init__(self, a):
        self.st_mode, self.st_ino, self.st_nlink = a.mode, a.ino, a.nlink
        self.st_uid, self.st_gid, self.st_size = a.uid, a.gid, a.size
        self.st_atime_ns, self.st_mtime_ns, self.st_ctime_ns = a.atime_ns, a.mtime_ns, a.ctime_ns

    st_atime = property(lambda s: s.st_atime_ns / 1e9)
    st_mtime = property(lambda s: s.st_mtime_ns / 1e9)
    st_ctime = property(lambda s: s.st_ctime_ns / 1e9)

    def __repr__(self):
        return (f"StatResult(mode={oct(self.st_mode)}, size={self.st_size}, "
                f"ino={self.st_ino})")


def connect(volume: str, branch: str = "main", snapshot: str | None = None,
            writable: bool = False) -> "Client":
    """Open the volume in directory ``volume`` (a one-machine volume or a cluster's
    directory) in this process: the tree of ``branch``, or of ``snapshot`` (read-only).

    Raises:
        FileNotFoundError: no volume there, or no such branch or snapshot.
        PermissionError: a one-machine volume another writer (fsck, a writing client)
            owns (EBUSY); ``writable`` on a mounted one-machine volume, which is read
            through its mount (EROFS, naming the mount point); another user's volume.
        OSError: anything else the volume refuses, with its errno.
    """
    return Client(volume, branch, snapshot, writable)


class Client:
    """A volume opened in this process (``bmfs.connect``); close with ``close()`` or
    use as a context manager. Paths are inside the opened tree ("/" its root)."""

    def __init__(self, volume, branch="main", snapshot=None, writable=False):
        self.volume_path = os.path.abspath(volume)
        self.branch, self.snapshot, self.writable = branch, snapshot, writable
        self._lock = threading.Lock()
        self._portal: Portal | None = None
        self._session: Session | None = None
        self._gen = 0  # opens of the session in this process's line (files compare)
        self._closed = False
        self._ensure()
        _CLIENTS.add(self)

    # -- the session ------------------------------------------------------------------
    def _ensure(self) -> Session:
        s = self._session
        if s is not None and self._portal.pid == os.getpid():
            return s
        with self._lock:
            if self._closed:
                raise ValueError("I/O operation on a closed bmfs client")
            if self._session is not None and self._portal.pid == os.getpid():
                return self._session
            if self.writable and self._gen and self._owner:
                raise PermissionError(
                    errno.EBUSY, "a writable client of a one-machine volume is its "
                    "parent's alone: connect read-only in the child", self.volume_path)
            portal = Portal()
            try:
                s = portal.run(portal.nursery.start, run_session, self.volume_path,
                               self.branch, self.snapshot, self.writable)
            except BaseException as e:
                portal.close()
                if isinstance(e, Exception):
                    raise os_error(e, self.volume_path) from None
                raise
            self._portal, self._session = portal, s
            self._owner = s.owner
            self._gen += 1
            return s

    def _forked(self) -> None:
        """In a forked child: the parent's loop is not here; the next call opens anew."""
        _ABANDONED.append((self._portal, self._session))
        self._portal = self._session = None
        self._lock = threading.Lock()

    def _call(self, fn, *args, path=None):
        """Run ``await fn(session, *args)`` on the loop, errors as OSError."""
        s = self._ensure()
        try:
            return self._portal.run(fn, s, *args)
        except (trio.Cancelled, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - translated for the caller
            raise os_error(e, path) from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            portal, self._portal, self._session = self._portal, None, None
        if portal is not None and portal.pid == os.getpid():
            portal.close()

    def __del__(self):
        if getattr(self, "_portal", None) is not None:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- names ------------------------------------------------------------------------
    def stat(self, path: str) -> StatResult:
        async def fn(s):
            return await s.resolve(path)
        return StatResult(self._call(fn, path=path))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except FileNotFoundError:
            return False

    def listdir(self, path: str = "/") -> list[str]:
        return [name for name, _ in self.scandir(path)]

    def scandir(self, path: str = "/", sizes: bool = False) -> list[tuple[str, object]]:
        """(name, StatResult) of each entry; mode's type bits only unless ``sizes``."""
        async def fn(s):
            await s.fs.kv.barrier()
            a = await s.resolve(path)
            ents = await s.fs.readdir(a.ino)
            if sizes:
                ents = [(n, await s.fs.getattr(e.ino)) for n, e in ents]
            return ents
        return [(os.fsdecode(n), StatResult(a)) for n, a in self._call(fn, path=path)]

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        async def fn(s):
            s.check_writable(path)
            parent, name = await s.parent_of(path)
            await s.fs.mkdir(parent.ino, name, mode & ~_umask(), os.geteuid(), os.getegid())
        self._call(fn, path=path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        parts = [p for p in path.split("/") if p]
        for n in range(1, len(parts) + 1):
            sub = "/" + "/".join(parts[:n])
            try:
                self.mkdir(sub)
            except FileExistsError:
                if n == len(parts) and not exist_ok:
                    raise

    def remove(self, path: str) -> None:
        async def fn(s):
            s.check_writable(path)
            parent, name = await s.parent_of(path)
            await s.fs.unlink(parent.ino, name)
        self._call(fn, path=path)

    unlink = remove

    def rmdir(self, path: str) -> None:
        async def fn(s):
            s.check_writable(path)
            parent, name = await s.parent_of(path)
            await s.fs.rmdir(parent.ino, name)
        self._call(fn, path=path)

    def rename(self, src: str, dst: str) -> None:
        async def fn(s):
            s.check_writable(src)
            p1, n1 = await s.parent_of(src)
            p2, n2 = await s.parent_of(dst)
            await s.fs.rename(p1.ino, n1, p2.ino, n2)
        self._call(fn, path=src)

    # -- files ------------------------------------------------------------------------
    def open(self, path: str, mode: str = "rb", buffering: int = -1):
        """A file object: binary modes r, w, a, x, with +; unbuffered (``buffering=0``,
        a File: readinto and pread without copies) or buffered (io.Buffered*)."""
        if "t" in mode or "b" not in mode and mode not in ("r", "w", "a", "x"):
            raise ValueError(f"binary modes only (rb, wb, ab, xb, r+b ...), not {mode!r}")
        f = File(self, path, mode)
        if buffering == 0:
            return f
        size = buffering if buffering > 1 else 1 << 20
        if f.readable() and f.writable():
            return io.BufferedRandom(f, size)
        return io.BufferedReader(f, size) if f.readable() else io.BufferedWriter(f, size)

    def read_file(self, path: str) -> bytes:
        with self.open(path, buffering=0) as f:
            return f.readall()

    def write_file(self, path: str, data) -> None:
        with self.open(path, "wb", buffering=0) as f:
            view = memoryview(data).cast("B")
            while view:
                view = view[f.write(view):]

    def read_many(self, items, out=None) -> list:
        """Read many ranges at once: ``items`` are (path or File, offset, length). Every
        fragment request of the batch is sent at once, to every node. Returns the data
        item by item (bytes or read-only memoryviews; shorter past the end of a file);
        with ``out`` (writable buffers, one per item), reads into them instead and
        returns the byte counts.

        Raises FileNotFoundError for a missing path, OSError (EIO) for data that
        cannot be read or verified."""
        items = list(items)
        if out is not None:
            if len(out) != len(items):
                raise ValueError("read_many: one buffer per item")
            for buf, (_, _, length) in zip(out, items):
                if memoryview(buf).nbytes < length:
                    raise ValueError("read_many: a buffer shorter than its item's length")
        opened: dict[str, File] = {}
        try:
            fhs = []
            for target, offset, length in items:
                if offset < 0 or length < 0:
                    raise ValueError("read_many: negative offset or length")
                if isinstance(target, File):
                    fhs.append((target._handle(), offset, length))
                    continue
                f = opened.get(target)
                if f is None:
                    f = opened[target] = File(self, target, "rb")
                fhs.append((f._handle(), offset, length))

            async def fn(s):
                return await _read_many(s.fs.files, fhs, out)
            return self._call(fn)
        finally:
            for f in opened.values():
                f.close()


    # -- typed views (typed.py) --------------------------------------------------------
    def records(self, path: str, Type=None, *, verify: bool = True, strict: bool = True):
        """A record file (bmfs.typed.records' format) read by batches of ranges:
        a Records sequence (len, [i], get_many, iteration)."""
        from .typed import Records
        return Records(self, path, Type, verify=verify, strict=strict)

    def array(self, path: str, dtype=None, shape=None):
        """A .npy array whose rows are read on demand (Array: [i], [i:j], take, read)."""
        from .typed import Array
        return Array(self, path, dtype, shape)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class File(io.RawIOBase):
    """An open file of a direct client: unbuffered, with ``pread``/``readinto``."""

    def __init__(self, client: Client, path: str, mode: str = "rb"):
        super().__init__()
        self.client, self.path, self.mode = client, path, mode
        base = mode.replace("b", "").replace("t", "")
        plus = "+" in base
        kind = base.replace("+", "")
        if kind not in ("r", "w", "a", "x") or len(kind) != 1:
            raise ValueError(f"invalid mode {mode!r}")
        self._read = kind == "r" or plus
        self._write = kind != "r" or plus
        flags = {"r": 0, "w": os.O_CREAT | os.O_TRUNC, "a": os.O_CREAT | os.O_APPEND,
                 "x": os.O_CREAT | os.O_EXCL}[kind]
        flags |= os.O_RDWR if plus else os.O_WRONLY if kind != "r" else os.O_RDONLY
        self._flags = flags
        self._pos = 0
        self._fh = None
        self._gen = 0
        self._ahead = ReadAhead()
        self._open()
        if kind == "a":
            self._pos = self._size()

    def _open(self) -> None:
        flags, path = self._flags, self.path

        async def fn(s):
            await s.close_to_open()
            if flags & os.O_ACCMODE != os.O_RDONLY:
                s.check_writable(path)
            try:
                a = await s.resolve(path)
            except Exception as e:  # noqa: BLE001
                if not (flags & os.O_CREAT and getattr(e, "errno", None) == errno.ENOENT):
                    raise
                parent, name = await s.parent_of(path)
                mode = 0o666 & ~_umask()
                fh, _ = await s.fs.create_file(parent.ino, name, mode, flags,
                                               os.geteuid(), os.getegid())
                return fh
            if flags & os.O_CREAT and flags & os.O_EXCL:
                raise OSError(errno.EEXIST, "File exists", path)
            if stat.S_ISDIR(a.mode):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
            return await s.fs.open(a.ino, flags & ~os.O_CREAT)
        self._fh = self.client._call(fn, path=path)
        self._gen = self.client._gen

    def _handle(self) -> int:
        """The vfs handle, opened again in a forked child (reads only)."""
        if self.closed:
            raise ValueError("I/O operation on closed file")
        self.client._ensure()
        if self._gen != self.client._gen:
            if self._write:
                raise OSError(errno.EBADF, "a file opened for writing before a fork "
                              "is the parent's", self.path)
            self._flags &= ~(os.O_CREAT | os.O_TRUNC)
            self._open()
        return self._fh

    def readable(self) -> bool:
        return self._read

    def writable(self) -> bool:
        return self._write

    def seekable(self) -> bool:
        return True

    def _size(self) -> int:
        fh = self._handle()

        async def fn(s):
            of = s.fs.files.handles[fh].of
            await s.fs.files.writes.drain(of)
            from ..meta import namespace as ns
            i = await ns.get_inode(s.fs.kv.begin(), of.view.chain, of.ino)
            size = i.size if i else 0
            return max(size, of.size or 0, of.buf_start + len(of.buf) if of.buf else 0)
        return self.client._call(fn, path=self.path)

    @property
    def size(self) -> int:
        return self._size()

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            pos = offset
        elif whence == 1:
            pos = self._pos + offset
        elif whence == 2:
            pos = self._size() + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise OSError(errno.EINVAL, "negative seek position", self.path)
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos

    def pread(self, length: int, offset: int):
        """``length`` bytes at ``offset`` (fewer at the end): bytes or a memoryview."""
        if not self._read:
            raise io.UnsupportedOperation("not readable")
        fh = self._handle()

        async def fn(s):
            return (await _read_many(s.fs.files, [(fh, offset, length)]))[0]
        return self.client._call(fn, path=self.path)

    def readinto(self, buf) -> int:
        """Read into ``buf`` (block-aligned ranges straight from the devices). A file
        opened for reading only reads ahead for a sequential reader (ahead.py)."""
        if self._write:
            n = self.preadinto(buf, self._pos)
        else:
            view = memoryview(buf).cast("B")
            n = self._ahead.readinto(self.client, self._handle(), view, self._pos)
        self._pos += n
        return n

    def preadinto(self, buf, offset: int) -> int:
        """Read ``len(buf)`` bytes at ``offset`` into ``buf``; the count read."""
        if not self._read:
            raise io.UnsupportedOperation("not readable")
        view = memoryview(buf).cast("B")
        fh = self._handle()

        async def fn(s):
            return (await _read_many(s.fs.files, [(fh, offset, len(view))], [view]))[0]
        return self.client._call(fn, path=self.path)

    def read(self, size: int = -1):
        if size is None or size < 0:
            return self.readall()
        data = self.pread(size, self._pos)
        self._pos += len(data)
        return bytes(data) if isinstance(data, memoryview) else data

    def readall(self) -> bytes:
        size = self._size()
        data = self.pread(max(size - self._pos, 0), self._pos)
        self._pos += len(data)
        return bytes(data)

    def write(self, data) -> int:
        if not self._write:
            raise io.UnsupportedOperation("not writable")
        fh = self._handle()
        if self._flags & os.O_APPEND:
            self._pos = self._size()
        pos = self._pos
        data = bytes(data)

        async def fn(s):
            return await s.fs.files.write(fh, pos, data)
        n = self.client._call(fn, path=self.path)
        self._pos += n
        return n

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        fh = self._handle()

        async def fn(s):
            of = s.fs.files.handles[fh].of
            await s.fs.files.truncate(of.view, of.ino, size)
        self.client._call(fn, path=self.path)
        return size

    def flush(self) -> None:
        if self._fh is not None and not self.closed and self._write:
            fh = self._fh

            async def fn(s):
                await s.fs.files.flush(fh)
            self.client._call(fn, path=self.path)

    def close(self) -> None:
        if self.closed:
            return
        fh, self._fh = self._fh, None
        try:
            if fh is not None and self._gen == self.client._gen and \
                    self.client._session is not None and not self.client._closed:
                self._ahead.close(self.client)

                async def fn(s):
                    await s.fs.files.release(fh)  # stores what was written, commits
                self.client._call(fn, path=self.path)
        finally:
            super().close()
