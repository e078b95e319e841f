"""A device that is a directory of fragment files (an NVMe filesystem, or any dir).

Layout: ``DEVICE`` (JSON: volume uuid, device id, format revision) and
``frags/<last two hex digits of the stripe id>/<stripe id>.<index>``. A fragment is
written in place: it is referenced only once the transaction recording its stripe
commits, and a torn one fails its checksums. ``sync()`` makes every fragment written
since the last sync durable: fsync of each file and directory, or one syncfs(2) when
there are many.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import threading

from ..errors import VolumeError

_libc = ctypes.CDLL(None, use_errno=True)
SYNCFS_THRESHOLD = 32
DIRECT_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length in these units
# write() sends fragments at least this large through write_aligned (O_DIRECT): filling
# fresh page cache runs at a few hundred MB/s per core on these machines and competes
# with the FUSE loop for the CPU, and the fsync that follows writes it all out again
DIRECT_MIN = 256 << 10
_tls = threading.local()  # each worker thread's aligned buffer for write()
# With ``drop_behind`` set (the mount reads its own devices: the local transport),
# read_parts drops what a read at least this large read from the page cache. Large
# reads are sequential readers' (the FUSE read-ahead asks for 1 MiB at a time), whose
# data the mount's own page cache now holds: keeping the fragment's copy too doubles
# the memory a file takes in the cache (1 GiB read cold: +2 GiB of cache against
# +1 GiB), for no speed (O_DIRECT reads, which skip the cache too, were ~20% slower on
# this VM's disk). A storage node keeps its cache: it serves other clients.
DROP_BEHIND = 256 << 10


def _aligned_buffer(size: int) -> mmap.mmap:
    """This thread's page-aligned buffer of at least ``size`` bytes, kept and reused
    (touching fresh memory is slow on these machines)."""
    buf = getattr(_tls, "buf", None)
    if buf is None or len(buf) < size:
        buf = _tls.buf = mmap.mmap(-1, max(size, 2 << 20))
    return buf


@contextlib.contextmanager
def gathered(parts, total: int):
    """``parts`` (``total`` bytes) copied into this thread's aligned buffer (warm memory,
    one memcpy) and zero-padded to whole pages: a view of it, for an O_DIRECT write."""
    padded = -(-total // DIRECT_ALIGN) * DIRECT_ALIGN
    view = memoryview(_aligned_buffer(padded))
    try:
        pos = 0
        for p in parts:
            view[pos:pos + len(p)] = p
            pos += len(p)
        view[total:padded] = bytes(padded - total)
        yield view[:padded]
    finally:
        view.release()


@contextlib.contextmanager
def direct_pages(buf):
    """A page-aligned buffer as pages for O_DIRECT: its whole pages in place, then its
    last partial page copied into a zero-padded page of this thread's buffer."""
    whole = len(buf) // DIRECT_ALIGN * DIRECT_ALIGN
    tail = len(buf) - whole
    pages = [buf[:whole]] if whole else []
    page = None
    if tail:
        page = memoryview(_aligned_buffer(DIRECT_ALIGN))[:DIRECT_ALIGN]
        page[:tail] = buf[whole:]
        page[tail:] = bytes(DIRECT_ALIGN - tail)
        pages.append(page)
    try:
        yield pages
    finally:
        if page is not None:
            page.release()


def check_marker(path: str, volume_uuid: str, dev: int, fmt: int) -> dict:
    """The device directory's DEVICE marker, checked: it must exist, name this volume
    and device, and be of format ``fmt``; VolumeError (one line) otherwise."""
    try:
        with open(os.path.join(path, "DEVICE")) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise VolumeError(f"device {dev} at {path} is missing (no DEVICE marker)")
    except (OSError, ValueError) as e:
        raise VolumeError(f"device {dev} at {path} is unreadable: {e}")
    if info.get("volume") != volume_uuid or info.get("device") != dev:
        raise VolumeError(f"{path} belongs to another volume or device")
    if info.get("format") != fmt:
        raise VolumeError(f"device {dev} at {path}: unknown format {info.get('format')}")
    return info


class FileStore:
    def __init__(self, path: str, volume_uuid: str, dev: int):
        self.path = path
        self.dev = dev
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._direct = hasattr(os, "O_DIRECT")  # until the filesystem refuses it
        self.drop_behind = False  # see DROP_BEHIND
        self._frags = os.path.join(path, "frags", "")
        self.volume_uuid = volume_uuid
        check_marker(path, volume_uuid, dev, 1)

    @staticmethod
    def format(path: str, volume_uuid: str, dev: int) -> None:
        for i in range(256):  # all fan-out directories now, not one makedirs per write
            os.makedirs(os.path.join(path, "frags", "%02x" % i), exist_ok=True)
        marker = os.path.join(path, "DEVICE")
        if os.path.exists(marker):
            raise VolumeError(f"{path} already belongs to a bmfs volume")
        with open(marker, "w") as f:
            json.dump({"volume": volume_uuid, "device": dev, "format": 1}, f)
            f.flush()
            os.fsync(f.fileno())

    @property
    def fragment_dir(self) -> str:
        """Where fragment N lies: this + N[14:16] + "/" + N (_file; the node's C path
        for small READs builds the same)."""
        return self._frags

    def _file(self, name: str) -> str:
        sid_hex = name.split(".", 1)[0]  # (os.path.join took ~1 us a read, ~5 cold)
        return f"{self._frags}{sid_hex[-2:]}/{name}"

    def write(self, name: str, parts) -> None:
        # Written in place, not to a temporary name and renamed: a fragment is not
        # referenced until the transaction recording its stripe commits after this, and
        # a torn fragment fails its header or block checksums (and is swept or repaired).
        total = sum(len(p) for p in parts)
        path = self._file(name)
        if self._direct and total >= DIRECT_MIN and self._write_padded(path, parts, total):
            with self._lock:
                self._pending.add(path)
            return
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            n = os.writev(fd, parts)
            if n != total:  # short write: finish it
                os.write(fd, b"".join(bytes(p) for p in parts)[n:])
        finally:
            os.close(fd)
        with self._lock:
            self._pending.add(path)

    def _open_direct(self, path: str) -> int | None:
        """``path`` created or truncated for O_DIRECT writes; None if the filesystem
        refuses O_DIRECT (tmpfs): then ``_direct`` is cleared and writes go buffered."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT
        try:
            try:
                return os.open(path, flags, 0o600)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                return os.open(path, flags, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False
            return None

    def _write_padded(self, path: str, parts, total: int) -> bool:
        """A large fragment gathered (``gathered``) and written with O_DIRECT
        (_write_direct). False (nothing written) where the filesystem refuses O_DIRECT."""
        with gathered(parts, total) as page:
            return self._write_direct(path, [page], total)

    def _write_direct(self, path: str, pages, total: int) -> bool:
        """Write ``pages`` (page-aligned buffers of whole pages, in order, the last one
        zero-padded) with O_DIRECT, then cut the file to ``total`` bytes. All of it
        direct: a tail written through the page cache would be allocated later,
        elsewhere on the disk, and cost every cold read of the fragment a second seek
        (reads were ~20% slower that way). False (nothing written) where the filesystem
        refuses O_DIRECT; from then on writes are buffered. A device that refuses the
        alignment of a write gets the rest through the page cache."""
        fd = self._open_direct(path)
        if fd is None:
            return False
        try:
            pos = 0
            for page in pages:
                done = 0
                while done < len(page):
                    try:
                        done += os.pwrite(fd, page[done:], pos + done)
                    except OSError as e:
                        if e.errno != errno.EINVAL:  # EINVAL: not aligned for this device
                            raise
                        fcntl.fcntl(fd, fcntl.F_SETFL,
                                    fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                pos += len(page)
            if pos != total:
                os.ftruncate(fd, total)
        finally:
            os.close(fd)
        return True

    def write_aligned(self, name: str, buf) -> None:
        """``write(name, [buf])`` for a buffer that starts on a page boundary (a storage
        node receives large PUTs into one): its whole pages go to the device with
        O_DIRECT straight from it, the last partial page through a zero-padded page of
        this thread's buffer. Copying a fragment into the page cache costs a storage
        node more CPU than the rest of a PUT, and the data must reach the device before
        the PUT is acknowledged anyway. Falls back to ``write`` where O_DIRECT is
        refused."""
        path = self._file(name)
        with direct_pages(buf) as pages:
            if not self._write_direct(path, pages, len(buf)):
                return self.write(name, [buf])
        with self._lock:
            self._pending.add(path)

    def read(self, name: str, offset: int, length: int) -> bytes:
        fd = os.open(self._file(name), os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def extent(self, name: str):
        """``(fd, offset, length, release)`` of the fragment, for a storage node to
        send large reads from with sendfile: a read-only descriptor of its file, 0,
        the file's size, and ``release()`` (closes the descriptor) to call when done."""
        fd = os.open(self._file(name), os.O_RDONLY)
        try:
            return fd, 0, os.fstat(fd).st_size, lambda: os.close(fd)
        except BaseException:
            os.close(fd)
            raise

    def read_parts(self, name: str, ranges) -> list[bytes]:
        fd = os.open(self._file(name), os.O_RDONLY)
        try:
            out = [os.pread(fd, length, offset) for offset, length in ranges]
            if self.drop_behind and sum(n for _, n in ranges) >= DROP_BEHIND:
                try:  # only advice: a filesystem that refuses it does not fail the read
                    for offset, length in ranges:
                        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
            return out
        finally:
            os.close(fd)

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._file(name))
        except FileNotFoundError:
            pass

    def pending(self) -> int:
        return len(self._pending)

    def take_pending(self) -> set[str]:
        with self._lock:
            pending, self._pending = self._pending, set()
        return pending

    def fsid(self) -> int:
        return os.stat(self.path).st_dev

    def sync(self, syncfs: bool = False, others=()) -> None:
        """Make the fragments written since the last sync durable. ``syncfs=True``
        syncs the whole filesystem at once (the caller knows many files are pending
        across devices sharing it), and covers ``others``, stores on the same
        filesystem, whose pending files it takes."""
        # one at a time: a sync that finds nothing pending must still wait for the one
        # running, which took its caller's files. The others' files are taken under
        # this lock too, so whoever syncs this store after them waits for the syncfs
        # (sync_many syncs a filesystem's stores in one order, this one first)
        with self._sync_lock:
            for other in others:
                other.take_pending()
            self._sync(syncfs)

    def _sync(self, syncfs: bool) -> None:
        with self._lock:
            pending, self._pending = self._pending, set()
        if not pending and not syncfs:
            return
        if syncfs or len(pending) >= SYNCFS_THRESHOLD:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                if _libc.syncfs(fd) != 0:
                    raise OSError(ctypes.get_errno(), "syncfs failed")
            finally:
                os.close(fd)
            return
        dirs = set()
        for path in pending:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # deleted since
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(os.path.dirname(path))
        for d in dirs:
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def names(self):
        """Every fragment name stored (temporary files of interrupted writes excluded).
        OSError (ESTALE) if the directory is another device's now (formatted anew
        after this one was removed): the leak sweep would take its fragments for
        this device's leaks."""
        try:
            check_marker(self.path, self.volume_uuid, self.dev, 1)
        except VolumeError as e:
            raise OSError(errno.ESTALE, str(e)) from e
        root = os.path.join(self.path, "frags")
        for sub in sorted(os.listdir(root)):
            for name in os.listdir(os.path.join(root, sub)):
                if not name.endswith(".tmp"):
                    yield name

    def names_list(self) -> list[str]:
        return list(self.names())

    def usage(self) -> dict:
        st = os.statvfs(self.path)
        return {"total": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize,
                "fsid": os.stat(self.path).st_dev}

    def check(self) -> None:
        """Raise VolumeError if the device directory vanished or was replaced."""
        self._check_marker_uuid_only()

    def _check_marker_uuid_only(self):
        if not os.path.exists(os.path.join(self.path, "DEVICE")):
            raise VolumeError(f"device {self.dev} at {self.path} is missing")
