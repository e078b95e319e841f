"""A device that is a directory of fragment files (an NVMe filesystem, or any dir).

Layout: ``DEVICE`` (JSON: volume uuid, device id, format revision) and
``frags/<last two hex digits of the stripe id>/<stripe id>.<index>``. A fragment is
written in place: it is referenced only once the transaction recording its stripe
commits, and a torn one fails its checksums. ``sync()`` makes every fragment written
since the last sync durable: fsync of each file and directory, or one syncfs(2) when
there are many.

Nothing is written through a link or into a file the store did not make (see
``create_new``): fragments are created afresh (``O_CREAT|O_EXCL|O_NOFOLLOW``)
under the ``frags`` directory opened once, each fan-out folder opened without
following a link. Directories are made 0700 and files 0600, whatever the umask.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import mmap
import os
import stat
import threading

from ..errors import VolumeError
from . import pread_into

log = logging.getLogger(__name__)
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


_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnexpectedEntry(OSError):
    """Something the store did not make is where it would create a file: a link, a
    directory, another's file. It is left as it is; nothing is written through it."""


def unexpected(store, where: str, st: os.stat_result | None = None) -> UnexpectedEntry:
    """Log and count (``store.unexpected``) an entry found where a new file goes; the
    error to raise."""
    store.unexpected += 1
    what = "an entry" if st is None else "a link" if stat.S_ISLNK(st.st_mode) else \
        "a directory" if stat.S_ISDIR(st.st_mode) else \
        f"a file of uid {st.st_uid}" if st.st_uid != os.geteuid() else \
        f"a file with {st.st_nlink} links" if stat.S_ISREG(st.st_mode) else "a special file"
    msg = f"device {store.dev}: {where} is {what}, not made by bmfs: left alone, not written"
    log.warning("%s", msg)
    return UnexpectedEntry(errno.EEXIST, msg)


def create_new(store, dir_fd: int, name: str, flags: int = os.O_WRONLY, where: str = "") -> int:
    """A descriptor of a new file ``name`` (mode 0600) in directory ``dir_fd``, created
    with O_EXCL and O_NOFOLLOW: never a file that was there, never through a link. A
    regular file of ours already there (a PUT written again after a lost answer, a
    rewrite) is unlinked and made afresh; anything else (a link, a directory, a file
    of another user or with other hard links) is left as it is.

    Raises:
        UnexpectedEntry: the latter (logged and counted, see ``unexpected``).
    """
    try:
        return os.open(name, flags | _NEW, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        pass
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        raise unexpected(store, where or name, st)
    os.unlink(name, dir_fd=dir_fd)
    try:
        return os.open(name, flags | _NEW, 0o600, dir_fd=dir_fd)
    except FileExistsError:  # made again in between: not by us
        raise unexpected(store, where or name)


def write_new_file(dir_fd: int, name: str, data: bytes) -> None:
    """Write a file that must not exist yet (a device's marker, a pool file) in
    directory ``dir_fd``, 0600, and fsync it. FileExistsError if anything is there."""
    fd = os.open(name, os.O_WRONLY | _NEW, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_dir(path: str) -> None:
    """``path`` and missing parents made; ``path`` itself mode 0700 (whatever the umask,
    and if it was there already: it is bmfs's). The mode is set through a descriptor
    opened without following a link: a link put there meanwhile is refused, never
    followed."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, _DIR)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise VolumeError(f"{path} is a symbolic link, not a directory") from None
        raise
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


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
        self.unexpected = 0  # entries found where a new fragment goes (see unexpected)
        self._frags_fd = None
        check_marker(path, volume_uuid, dev, 1)
        try:  # opened once: new fragments are made relative to it
            self._frags_fd = os.open(os.path.join(path, "frags"), _DIR)
        except OSError as e:
            raise VolumeError(f"device {dev} at {path}: no fragment directory: {e}")

    @staticmethod
    def format(path: str, volume_uuid: str, dev: int) -> None:
        marker = os.path.join(path, "DEVICE")
        if os.path.lexists(marker):
            raise VolumeError(f"{path} already belongs to a bmfs volume")
        make_private_dir(path)
        for i in range(256):  # all fan-out directories now, not one makedirs per write
            make_private_dir(os.path.join(path, "frags", "%02x" % i))
        make_private_dir(os.path.join(path, "frags"))
        fd = os.open(path, _DIR)
        try:
            write_new_file(fd, "DEVICE", json.dumps(
                {"volume": volume_uuid, "device": dev, "format": 1}).encode())
        except FileExistsError:
            raise VolumeError(f"{path} already belongs to a bmfs volume")
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._frags_fd is not None:
            os.close(self._frags_fd)
            self._frags_fd = None

    def __del__(self):
        if getattr(self, "_frags_fd", None) is not None:
            try:
                self.close()
            except OSError:
                pass

    @property
    def fragment_dir(self) -> str:
        """Where fragment N lies: this + N[14:16] + "/" + N (_file; the node's C path
        for small READs builds the same)."""
        return self._frags

    def path_of(self, name: str) -> str:
        """The file fragment ``name`` is read from (transport/local.py's batches read
        it in C: open without following a link, read, close, as read_parts does)."""
        return self._file(name)

    def _file(self, name: str) -> str:
        sid_hex = name.split(".", 1)[0]  # (an f-string: os.path.join is slower per read)
        return f"{self._frags}{sid_hex[-2:]}/{name}"

    def _create(self, name: str, flags: int = os.O_WRONLY) -> int:
        """A descriptor of fragment ``name`` made afresh (create_new) in its fan-out
        folder, which is opened (made, 0700, if missing) without following a link.

        Raises:
            UnexpectedEntry: a link, a directory or a foreign file at the fragment's
                path or as its folder (left alone, logged and counted).
        """
        sub = name.split(".", 1)[0][-2:]
        try:
            sfd = os.open(sub, _DIR, dir_fd=self._frags_fd)
        except FileNotFoundError:
            try:
                os.mkdir(sub, 0o700, dir_fd=self._frags_fd)
            except FileExistsError:
                pass
            sfd = os.open(sub, _DIR, dir_fd=self._frags_fd)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise unexpected(self, f"frags/{sub}",
                             os.stat(sub, dir_fd=self._frags_fd, follow_symlinks=False))
        try:
            return create_new(self, sfd, name, flags, where=f"frags/{sub}/{name}")
        finally:
            os.close(sfd)

    def write(self, name: str, parts) -> None:
        # Written in place, not to a temporary name and renamed: a fragment is not
        # referenced until the transaction recording its stripe commits after this, and
        # a torn fragment fails its header or block checksums (and is swept or repaired).
        total = sum(len(p) for p in parts)
        path = self._file(name)
        if self._direct and total >= DIRECT_MIN and self._write_padded(name, parts, total):
            with self._lock:
                self._pending.add(path)
            return
        fd = self._create(name)
        try:
            n = os.writev(fd, parts)
            if n != total:  # short write: finish it
                os.write(fd, b"".join(bytes(p) for p in parts)[n:])
        finally:
            os.close(fd)
        with self._lock:
            self._pending.add(path)

    def _open_direct(self, name: str) -> int | None:
        """Fragment ``name`` created afresh (``_create``) for O_DIRECT writes; None if
        the filesystem refuses O_DIRECT (tmpfs): then ``_direct`` is cleared and writes
        go buffered."""
        try:
            return self._create(name, os.O_WRONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False
            return None

    def _write_padded(self, name: str, parts, total: int) -> bool:
        """A large fragment gathered (``gathered``) and written with O_DIRECT
        (_write_direct). False (nothing written) where the filesystem refuses O_DIRECT."""
        with gathered(parts, total) as page:
            return self._write_direct(name, [page], total)

    def _write_direct(self, name: str, pages, total: int) -> bool:
        """Write ``pages`` (page-aligned buffers of whole pages, in order, the last one
        zero-padded) with O_DIRECT, then cut the file to ``total`` bytes. All of it
        direct: a tail written through the page cache would be allocated later,
        elsewhere on the disk, and cost every cold read of the fragment a second seek
        (reads were ~20% slower that way). False (nothing written) where the filesystem
        refuses O_DIRECT; from then on writes are buffered. A device that refuses the
        alignment of a write gets the rest through the page cache."""
        fd = self._open_direct(name)
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
            if not self._write_direct(name, pages, len(buf)):
                return self.write(name, [buf])
        with self._lock:
            self._pending.add(path)

    def read(self, name: str, offset: int, length: int) -> bytes:
        fd = os.open(self._file(name), _READ)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def extent(self, name: str):
        """``(fd, offset, length, release)`` of the fragment, for a storage node to
        send large reads from with sendfile: a read-only descriptor of its file, 0,
        the file's size, and ``release()`` (closes the descriptor) to call when done."""
        fd = os.open(self._file(name), _READ)
        try:
            return fd, 0, os.fstat(fd).st_size, lambda: os.close(fd)
        except BaseException:
            os.close(fd)
            raise

    def read_parts(self, name: str, ranges, into=None) -> list:
        """The byte ranges ((offset, length) pairs) of fragment ``name``. ``into``: a
        writable buffer of the last range's length that range is read into (the
        part returned for it is a view of it, shorter where the file ends sooner)."""
        fd = os.open(self._file(name), _READ)
        try:
            if into is None:
                out = [os.pread(fd, length, offset) for offset, length in ranges]
            else:
                out = [os.pread(fd, length, offset) for offset, length in ranges[:-1]]
                out.append(pread_into(fd, ranges[-1][0], into))
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
        try:  # (unlink removes a link itself, never what it names)
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
                fd = os.open(path, _READ)
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
                "fsid": os.stat(self.path).st_dev, "unexpected_entries": self.unexpected}

    def check(self) -> None:
        """Raise VolumeError if the device directory vanished or was replaced."""
        self._check_marker_uuid_only()

    def _check_marker_uuid_only(self):
        if not os.path.exists(os.path.join(self.path, "DEVICE")):
            raise VolumeError(f"device {self.dev} at {self.path} is missing")
