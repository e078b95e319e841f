"""A device that is one preallocated pool file, memory-mapped (pmem or any file).

Where libpmem (Debian libpmem1) is present the pool is mapped with
``pmem_map_file`` and made durable with ``pmem_persist`` (true persistent memory) or
``pmem_msync``; otherwise Python's mmap and msync are used. Fragments are copied into
the mapping; a fragment becomes visible only when its index slot is written and made
durable, after its data, so a crash leaves either the whole fragment or nothing.

On-media layout (revision 1), little-endian:

=================  ==========  ================================================
offset             size        content
=================  ==========  ================================================
0                  4096        superblock: magic ``BMPMEM01`` (8), revision u32,
                               device id u32, pool size u64, slot count u32,
                               data start u64, volume uuid (36 ASCII), crc32c u32
                               of everything before it
4096               64 x N      index slots (``slot.py``: name, data offset, length,
                               crc32c)
4096 + 64 N        rest        data extents, 4 KiB aligned, placed first-fit
=================  ==========  ================================================

Free space is rebuilt at open from the live slots; there is no other allocator state
to keep consistent.
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import os
import stat
import struct
import threading

from crc32c import crc32c

from ..config import LAYOUTS  # noqa: F401 (of a device directory: pool.py, file.py)
from ..errors import VolumeError
from ..ownfile import check_own_file
from .slot import SLOT_SIZE, pack_slot, unpack_slot

MAGIC = b"BMPMEM01"
REVISION = 1
SUPER = struct.Struct("<8sIIQIQ36s")
ALIGN = 4096
DEFAULT_SIZE = 1 << 30


def _libpmem():
    name = ctypes.util.find_library("pmem")
    if not name:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.pmem_map_file.restype = ctypes.c_void_p
    lib.pmem_map_file.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_uint, ctypes.POINTER(ctypes.c_size_t),
                                  ctypes.POINTER(ctypes.c_int)]
    lib.pmem_persist.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.pmem_msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.pmem_unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


class PmemStore:
    """Same interface as FileStore (write, read_parts, delete, sync, names, usage)."""

    def __init__(self, path: str, volume_uuid: str, dev: int):
        self.path, self.dev = path, dev
        self._lock = threading.Lock()
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise VolumeError(f"device {dev} at {path} is missing (no pool file)")
        if not stat.S_ISREG(st.st_mode):  # (a link is not followed: see format)
            raise VolumeError(f"device {dev} at {path} is not a regular file")
        size = st.st_size
        self._map = None
        lib = _libpmem()
        if lib is not None:
            mapped, is_pmem = ctypes.c_size_t(), ctypes.c_int()
            addr = lib.pmem_map_file(path.encode(), 0, 0, 0, ctypes.byref(mapped),
                                     ctypes.byref(is_pmem))
            if not addr:
                raise VolumeError(f"device {dev}: libpmem cannot map {path}")
            self._lib, self._addr, size = lib, addr, mapped.value
            self._mv = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
            persist = lib.pmem_persist if is_pmem.value else lib.pmem_msync
            self._flush = lambda off, n: persist(addr + off, n)
            self.mapping = "libpmem (persistent memory)" if is_pmem.value else "libpmem (msync)"
        else:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                check_own_file(fd, path)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self._mv = memoryview(self._map)
            self.mapping = "mmap (msync)"
        self._load(volume_uuid, size)

    @staticmethod
    def format(path: str, volume_uuid: str, dev: int, size: int = DEFAULT_SIZE) -> None:
        """Make a pool file at ``path``: a new one (never through a link), or an empty
        regular file of ours already there; anything else is refused."""
        slots = max(1024, size // (256 << 10))  # one slot per 256 KiB of pool
        data_start = (ALIGN + slots * SLOT_SIZE + ALIGN - 1) // ALIGN * ALIGN
        if size < data_start + (1 << 20):
            raise VolumeError(f"pmem pool {path}: {size} bytes is too small")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = _new_pool_file(path)
        try:
            os.posix_fallocate(fd, 0, size)
            head = SUPER.pack(MAGIC, REVISION, dev, size, slots, data_start,
                              volume_uuid.encode()[:36].ljust(36))
            os.pwrite(fd, head + struct.pack("<I", crc32c(head)), 0)
            os.pwrite(fd, bytes(slots * SLOT_SIZE), ALIGN)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _load(self, volume_uuid, size):
        head = bytes(self._mv[:SUPER.size + 4])
        magic, rev, dev, psize, slots, data_start, uuid = SUPER.unpack_from(head)
        if magic != MAGIC or crc32c(head[:SUPER.size]) != struct.unpack_from("<I", head, SUPER.size)[0]:
            raise VolumeError(f"{self.path} is not a bmfs pmem pool (or its superblock is damaged)")
        if rev != REVISION or uuid.decode().strip() != volume_uuid or dev != self.dev \
                or psize != size:
            raise VolumeError(f"{self.path} belongs to another volume or device")
        self._slots, self._data_start, self._size = slots, data_start, size
        self._index: dict[str, tuple[int, int, int]] = {}  # name -> (slot, offset, length)
        self._free_slots = []
        for i in range(slots):
            ent = unpack_slot(bytes(self._mv[ALIGN + i * SLOT_SIZE:
                                              ALIGN + (i + 1) * SLOT_SIZE]))
            if ent is not None:
                self._index[ent[0]] = (i, ent[1], ent[2])
            else:
                self._free_slots.append(i)
        self._free_slots.reverse()
        self._extents = sorted((off, _round(length)) for _, off, length in self._index.values())
        self._dirty: list[tuple[int, int]] = []

    def _allocate(self, n: int) -> int:
        need = _round(n)
        pos = self._data_start
        for off, length in self._extents:
            if off - pos >= need:
                break
            pos = max(pos, off + length)
        if pos + need > self._size:
            raise OSError(28, f"pmem pool {self.path} is full")
        bisect.insort(self._extents, (pos, need))
        return pos

    def write(self, name: str, parts) -> None:
        total = sum(len(p) for p in parts)
        body = pack_slot(name, 0, 0)  # checks the name before anything is allocated
        with self._lock:
            if name in self._index:
                self._delete_locked(name)
            if not self._free_slots:
                raise OSError(28, f"pmem pool {self.path}: no free index slot")
            off = self._allocate(total)
            slot = self._free_slots.pop()
        pos = off
        for p in parts:
            self._mv[pos:pos + len(p)] = p
            pos += len(p)
        self._flush(off, total)          # data first ...
        body = pack_slot(name, off, total)
        at = ALIGN + slot * SLOT_SIZE
        self._mv[at:at + SLOT_SIZE] = body
        self._flush(at, SLOT_SIZE)       # ... then the slot that makes it visible
        with self._lock:
            self._index[name] = (slot, off, total)

    def _flush(self, off: int, n: int) -> None:  # replaced by libpmem's when mapped by it
        start = off // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.flush(start, off + n - start)

    def read_parts(self, name: str, ranges, into=None) -> list:
        """FileStore.read_parts, copied out of the mapping."""
        with self._lock:
            ent = self._index.get(name)
        if ent is None:
            raise FileNotFoundError(2, f"no fragment {name}", name)
        _, off, length = ent
        out = []
        for j, (o, n) in enumerate(ranges):
            o = min(o, length)
            n = max(0, min(n, length - o))
            if into is not None and j == len(ranges) - 1:
                view = memoryview(into).cast("B")[:n]
                view[:] = self._mv[off + o: off + o + len(view)]
                out.append(view)
            else:
                out.append(bytes(self._mv[off + o: off + o + n]))
        return out

    def read(self, name: str, offset: int, length: int) -> bytes:
        return self.read_parts(name, [(offset, length)])[0]

    def _delete_locked(self, name):
        slot, off, length = self._index.pop(name)
        at = ALIGN + slot * SLOT_SIZE
        self._mv[at:at + SLOT_SIZE] = bytes(SLOT_SIZE)
        self._flush(at, SLOT_SIZE)
        self._extents.remove((off, _round(length)))
        self._free_slots.append(slot)

    def delete(self, name: str) -> None:
        with self._lock:
            if name in self._index:
                self._delete_locked(name)

    def sync(self) -> None:
        pass  # every write is flushed (msync) before it returns

    def names(self):
        with self._lock:
            return sorted(self._index)

    def names_list(self) -> list[str]:
        return self.names()

    def usage(self) -> dict:
        with self._lock:
            used = sum(length for _, length in self._extents)
        total = self._size - self._data_start
        return {"total": total, "free": total - used, "fsid": None}

    def check(self) -> None:
        if not os.path.exists(self.path):
            raise VolumeError(f"device {self.dev} at {self.path} is missing")


def _new_pool_file(path: str) -> int:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags)
    except OSError as e:  # ELOOP: a link
        raise VolumeError(f"{path} is there already and is not a file bmfs may use "
                          f"({e.strerror})") from None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_uid == os.geteuid():
        return fd
    head = os.pread(fd, len(MAGIC), 0)
    os.close(fd)
    if head == MAGIC:
        raise VolumeError(f"{path} already belongs to a bmfs volume")
    raise VolumeError(f"{path} is there already and holds other data (a new pmem pool is "
                      f"a new or empty file)")


def _round(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


def open_store(path: str, volume_uuid: str, dev: int):
    """A PmemStore for ``pmem:PATH[:SIZE_IN_MIB]``; for a directory, a PoolStore or a
    FileStore, as its DEVICE marker says."""
    if path.startswith("pmem:"):
        return PmemStore(path[5:].partition(":")[0], volume_uuid, dev)
    from .pool import PoolStore, is_pool
    if is_pool(path):
        return PoolStore(path, volume_uuid, dev)
    from .file import FileStore
    return FileStore(path, volume_uuid, dev)


def _marker(path: str) -> dict:
    """The DEVICE marker of device directory ``path``; VolumeError if unreadable."""
    import json
    try:
        with open(os.path.join(path, "DEVICE")) as f:
            info = json.load(f)
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
        return info
    except FileNotFoundError:
        raise VolumeError(f"{path} is not a formatted device directory (no DEVICE marker)")
    except (OSError, ValueError) as e:
        raise VolumeError(f"{path}: unreadable DEVICE marker: {e}")


def marker_device(path: str) -> int:
    """The device id the DEVICE marker of the formatted directory ``path`` names.
    Raises VolumeError if it has none (not formatted) or it is unreadable."""
    dev = _marker(path).get("device")
    if not isinstance(dev, int) or isinstance(dev, bool) or dev < 0:
        raise VolumeError(f"{path}: its DEVICE marker names no device id")
    return dev


def marker_matches(path: str, volume_uuid: str, dev: int) -> None:
    """VolumeError unless the device directory ``path`` is formatted as device ``dev``
    of volume ``volume_uuid`` (its DEVICE marker read; the store is not opened, which
    for a pool would load and settle its index under a node that serves it). A pmem
    pool file is checked when it is opened to be served."""
    if path.startswith("pmem:"):
        return
    info = _marker(path)
    if info.get("volume") != volume_uuid or info.get("device") != dev:
        raise VolumeError(f"{path} is device {info.get('device')} of volume "
                          f"{info.get('volume')}, not device {dev} of {volume_uuid}")


def lock_device(path: str, wait: float = 5.0) -> int:
    """Hold device ``path`` for this process (an exclusive flock on its directory, or
    on a pmem pool's file) and return the descriptor, kept open for as long as the
    device is served: two storage nodes serving one device would each write it
    without the other (a pool's allocations, fragments both think are theirs).
    A holder that is still exiting gets ``wait`` seconds to let go; then
    VolumeError. Where the filesystem has no such locks, -1 (served unlocked, with a
    warning). Only processes of one machine see each other's locks."""
    import fcntl
    import logging
    import time
    target = path[5:].partition(":")[0] if path.startswith("pmem:") else path
    try:
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise VolumeError(f"{path}: {e.strerror}")
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise VolumeError(f"{path} is served by another process already (it "
                                      f"holds the device's lock): stop that one first")
                time.sleep(0.1)
    except OSError as e:  # no flock here (some network filesystems)
        os.close(fd)
        logging.getLogger(__name__).warning("%s: cannot be locked (%s); served without the "
                                            "lock", path, e.strerror)
        return -1
    except BaseException:
        os.close(fd)
        raise


def check_device_path(path: str) -> None:
    """VolumeError (one line) unless ``path`` may become a device: a directory (or, for
    ``pmem:FILE``, a file) that is not a symbolic link, not another user's, not the
    directory of a bmfs volume, and not inside a bmfs mount (the mount would store its fragments in
    itself). What is not there yet is checked where it would be made."""
    file = path[5:].partition(":")[0] if path.startswith("pmem:") else None
    target = os.path.abspath(file or path)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise VolumeError(f"{target} is a symbolic link: give the path it names "
                              f"({os.path.realpath(target)})")
        if file is None and not stat.S_ISDIR(st.st_mode):
            raise VolumeError(f"{target} is not a directory (a device is a directory, or "
                              f"pmem:FILE for a pool file)")
        if file is not None and not stat.S_ISREG(st.st_mode):
            raise VolumeError(f"{target} is not a regular file (a pmem pool is a file)")
        if file is None and os.path.lexists(os.path.join(target, "volume.json")):
            raise VolumeError(f"{target} is the directory of a bmfs volume: a device "
                              f"needs a directory of its own")
        if st.st_uid != os.geteuid():  # (its owner could swap what we make in it)
            raise VolumeError(f"{target} belongs to uid {st.st_uid}: a device must be "
                              f"owned by the user that serves it (uid {os.geteuid()})")
    mount = _bmfs_mount_holding(target)
    if mount is not None:
        raise VolumeError(f"{target} is inside the bmfs mount {mount}: a device must be "
                          f"on a local filesystem")


def _bmfs_mount_holding(path: str) -> str | None:
    """The bmfs mount point whose filesystem holds ``path`` (or its nearest existing
    parent), by device number against /proc/self/mountinfo; None if none does."""
    probe = path
    while True:
        try:
            st = os.stat(probe)
            break
        except OSError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return None
            probe = parent
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if right.split()[:1] == ["fuse.bmfs"] and fields[2] == dev:
                    return fields[4].replace("\\040", " ")
    except OSError:
        pass
    return None


def format_if_new(path: str, volume_uuid: str, dev: int, layout: str = "files") -> bool:
    """Format ``path`` (format_store) if it is a new or empty directory, or a pmem pool
    file not made yet; False if it is formatted already (opening it checks whose it
    is). VolumeError for a directory holding other files: they are not ours; and for
    a path check_device_path refuses."""
    check_device_path(path)
    if path.startswith("pmem:"):
        if os.path.exists(path[5:].partition(":")[0]):
            return False
    elif os.path.exists(os.path.join(path, "DEVICE")):
        return False
    elif os.path.isdir(path) and os.listdir(path):
        raise VolumeError(f"{path} is not empty and not a bmfs device (a new device is "
                          f"an empty or new directory)")
    format_store(path, volume_uuid, dev, layout)
    return True


def make_private(path: str, mode: int, changed: list[str]) -> None:
    """Take group and other bits off ``path`` (to ``mode``: 0700 or 0600) if it has
    any; a link or a missing path is left alone. What changed is added to
    ``changed``. The mode is changed through a descriptor opened without following a
    link: a path checked, then changed by name, could be swapped for a link in between
    by whoever may write its directory (root would chmod the file it names)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # missing, a link (ELOOP), or not ours to open
        return
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)) or \
                not st.st_mode & 0o077:
            return
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    changed.append(path)


def tighten_device(path: str, changed: list[str]) -> None:
    """Make a device private: its directory and fragment folders 0700, its own files
    (marker, pool files) 0600; or a pmem pool file 0600. Fragment files are not
    visited (millions, perhaps): the folders above them keep everyone else out."""
    if path.startswith("pmem:"):
        make_private(path[5:].partition(":")[0], 0o600, changed)
        return
    if not os.path.isdir(path) or os.path.islink(path):
        return
    make_private(path, 0o700, changed)
    for name in ("DEVICE", "index", "pool", "parity"):
        make_private(os.path.join(path, name), 0o600, changed)
    make_private_folder(os.path.join(path, "frags"), 0o700, changed)


def make_private_folder(path: str, inner: int, changed: list[str]) -> None:
    """``make_private`` for directory ``path`` (0700) and each entry in it (``inner``);
    nothing if it is missing or a link."""
    if os.path.isdir(path) and not os.path.islink(path):
        make_private(path, 0o700, changed)
        for name in os.listdir(path):
            make_private(os.path.join(path, name), inner, changed)


def layout_of(path: str) -> str:
    """The layout of a formatted device directory: ``pool`` or ``files``."""
    from .pool import is_pool
    return "pool" if is_pool(path) else "files"


def format_store(path: str, volume_uuid: str, dev: int, layout: str = "files") -> None:
    """Format a device: ``pmem:PATH[:SIZE_IN_MIB]`` is a pool file; anything else a
    directory holding a pool (``layout="pool"``) or fragment files."""
    if path.startswith("pmem:"):
        p, _, size = path[5:].partition(":")
        PmemStore.format(p, volume_uuid, dev, int(size) << 20 if size else DEFAULT_SIZE)
    elif layout == "pool":
        from .pool import PoolStore
        PoolStore.format(path, volume_uuid, dev)
    elif layout == "files":
        from .file import FileStore
        FileStore.format(path, volume_uuid, dev)
    else:
        raise VolumeError(f"unknown device layout {layout!r} (one of {', '.join(LAYOUTS)})")
