"""A device that is a directory holding its fragments in two growing pool files
(format 2, ``bmfs mkfs --layout pool``; docs/formats.md).

A directory of fragment files (``file.py``) makes the device's filesystem create,
allocate and journal a file per fragment; on this VM's disk that writes ~1.3x slower
than writing the same bytes into one new file, and ~3x slower than rewriting blocks
written before (docs/architecture.md). A pool keeps fragments as extents of a file and
reuses freed extents, as 3FS's chunk engine and Ceph's BlueStore do on a raw device.

Layout of the directory:

- ``DEVICE``: JSON, ``{"volume", "device", "format": 2, "layout": "pool"}``.
- ``pool``: the data fragments; ``parity``: the parity fragments (index >= k in the
  fragment header). Apart, so the kernel's read-ahead past a data fragment reads the
  device's next data fragment, which a sequential reader wants, and not parity.
  Extents start on 4 KiB boundaries and take whole 4 KiB pages. A file's length
  grows by ``GROW`` bytes at a time (``ftruncate``: blocks are allocated as fragments
  are written; ``posix_fallocate`` of 256 MiB under the allocation lock would stall
  every writer of the device for seconds). Freed extents are merged with their
  neighbours and used again, best fit first, so a rewrite lands on blocks already
  allocated.
- ``index``: 64-byte slots, the encoding of the pmem pool's index (``slot.py``):
  state (1 = live), name, offset (its top bits: which file), length, crc32c of the
  slot. A fragment is written to its extent first, then its slot; a deleted
  fragment's slot is zeroed. At open the live slots are the whole truth: free space
  is what they leave.

Durability is that of the fragment-file layout: ``write`` returns once the data is
written (O_DIRECT where the filesystem allows it: no page-cache copy) and its slot is
in the page cache; ``sync`` makes every write and delete since the last one durable
(fdatasync of the data files, then of the index, so a slot never reaches the disk
before the data it names). A crash before ``sync`` may leave a slot whose data is
torn, which fails its checksums like a torn fragment file; or, when an extent freed
before the crash was already written again, two live slots on one extent: ``_load``
keeps the one whose header names it and clears the other.

Reads are buffered preads (see ``read_parts``). An extent is given back to the
allocator only once every read that could have looked it up has finished (read
epochs), so a read racing a delete sees the old bytes or no fragment, never another
fragment's.
"""
from __future__ import annotations

import bisect
import errno
import json
import os
import threading

from ..format import fragment as fr
from ..errors import VolumeError
from . import pread_into
from . import file as _file
from ..ownfile import check_own_file
from .slot import SLOT_SIZE, pack_slot, unpack_slot

ALIGN = 4096
GROW = 256 << 20  # the pool file is extended this much at a time
FORMAT = 2
SPACE_SHIFT = 62  # a slot's offset: the space (0 data, 1 parity) above this bit
SPACES = ("pool", "parity")  # their files
_NOLINK = os.O_NOFOLLOW | os.O_CLOEXEC


def _round(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


class _Space:
    """One file of extents and its free space: holes below ``end`` (merged with their
    neighbours; a hole reaching ``end`` moves it down), nothing allocated past ``end``,
    the file ``size`` bytes long. Called with the store's lock held."""

    def __init__(self, store, number: int, path: str, dir_fd: int):
        # (opened relative to the device directory, never through a link)
        self.store, self.number, self.path = store, number, path
        name = os.path.basename(path)
        self.fd = os.open(name, os.O_RDWR | _NOLINK, dir_fd=dir_fd)
        self.dfd = None  # opened O_DIRECT, for large writes
        if hasattr(os, "O_DIRECT"):
            try:
                self.dfd = os.open(name, os.O_RDWR | os.O_DIRECT | _NOLINK, dir_fd=dir_fd)
            except OSError as e:
                if e.errno != errno.EINVAL:  # tmpfs refuses O_DIRECT: buffered then
                    raise
        self.rfd = os.open(name, os.O_RDONLY | _NOLINK, dir_fd=dir_fd)  # small reads, no read-ahead
        for fd in (self.fd, self.dfd, self.rfd):  # (a file put in its place by another
            if fd is not None:  # user, who owns the directory, must not get our data)
                check_own_file(fd, path)
        try:
            os.posix_fadvise(self.rfd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            pass
        self.size = os.fstat(self.fd).st_size
        self.end = 0
        self.by_off: list[int] = []  # offsets of free holes below end, sorted
        self.hole: dict[int, int] = {}  # offset -> length
        self.by_len: list[tuple[int, int]] = []  # (length, offset), sorted

    def rebuild(self, used) -> None:
        """Free space from the extents in use: ``used``, (offset, rounded length),
        sorted and not overlapping."""
        self.end = used[-1][0] + used[-1][1] if used else 0
        pos = 0
        for off, length in used:
            if off > pos:
                self.add_hole(pos, off - pos)
            pos = off + length

    def add_hole(self, off: int, length: int) -> None:
        i = bisect.bisect_left(self.by_off, off)
        if i > 0:
            prev = self.by_off[i - 1]
            if prev + self.hole[prev] == off:
                off, length = prev, length + self.hole[prev]
                self.drop_hole(prev)
                i -= 1
        if i < len(self.by_off):
            nxt = self.by_off[i]
            if off + length == nxt:
                length += self.hole[nxt]
                self.drop_hole(nxt)
        if off + length >= self.end:
            self.end = off
            return
        bisect.insort(self.by_off, off)
        self.hole[off] = length
        bisect.insort(self.by_len, (length, off))

    def drop_hole(self, off: int) -> None:
        length = self.hole.pop(off)
        del self.by_off[bisect.bisect_left(self.by_off, off)]
        del self.by_len[bisect.bisect_left(self.by_len, (length, off))]

    def allocate(self, need: int) -> int:
        """Offset of ``need`` free bytes (whole pages): the smallest hole that fits,
        else the end of the file, lengthened if needed."""
        i = bisect.bisect_left(self.by_len, (need, -1))
        if i < len(self.by_len):
            length, off = self.by_len[i]
            self.drop_hole(off)
            if length > need:
                self.add_hole(off + need, length - need)
            return off
        off = self.end
        if off + need > self.size:  # the file's length only: blocks come as written
            grow = max(GROW, off + need - self.size)
            try:
                os.ftruncate(self.fd, self.size + grow)
            except OSError as e:
                raise OSError(e.errno, f"device {self.store.dev}: pool cannot grow: "
                              f"{os.strerror(e.errno)}") from None
            self.size += grow
        self.end = off + need
        return off

    def close(self) -> None:
        for fd in (self.fd, self.dfd, self.rfd):
            if fd is not None:
                os.close(fd)
        self.fd = self.dfd = self.rfd = None


class PoolStore:
    """Same interface as FileStore (write, write_aligned, read_parts, delete, sync,
    names, usage, check), plus ``extent`` for a storage node's sendfile."""

    def __init__(self, path: str, volume_uuid: str, dev: int):
        self.path, self.dev = path, dev
        self.drop_behind = False  # see file.DROP_BEHIND
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        _file.check_marker(path, volume_uuid, dev, FORMAT)
        try:
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self._ifd = os.open("index", os.O_RDWR | _NOLINK, dir_fd=dfd)
                check_own_file(self._ifd, os.path.join(path, "index"))
                self._spaces = [_Space(self, i, os.path.join(path, name), dfd)
                                for i, name in enumerate(SPACES)]
            finally:
                os.close(dfd)
        except OSError as e:
            raise VolumeError(f"device {dev} at {path}: pool unreadable: {e}")
        self._dirty = False
        self._epoch = 0                    # bumped by each free
        self._reading: dict[int, int] = {}  # epoch -> reads in flight that started in it
        self._limbo: list[tuple[int, int, int]] = []  # (epoch freed, address, length)
        self._load()

    @staticmethod
    def format(path: str, volume_uuid: str, dev: int) -> None:
        marker = os.path.join(path, "DEVICE")
        if os.path.lexists(marker):
            raise VolumeError(f"{path} already belongs to a bmfs volume")
        _file.make_private_dir(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOLINK)
        try:
            # created afresh (O_EXCL, O_NOFOLLOW): a link or file left there is refused
            for name in ("index",) + SPACES:
                _file.write_new_file(fd, name, b"")
            try:  # (a marker half-written by an interrupted format is made again)
                os.unlink("DEVICE.tmp", dir_fd=fd)
            except FileNotFoundError:
                pass
            _file.write_new_file(fd, "DEVICE.tmp", json.dumps(
                {"volume": volume_uuid, "device": dev, "format": FORMAT,
                 "layout": "pool"}).encode())
            os.rename("DEVICE.tmp", "DEVICE", src_dir_fd=fd, dst_dir_fd=fd)
            os.fsync(fd)
        except FileExistsError as e:
            raise VolumeError(f"{path}: {e.filename or 'a file'} is there already: not a "
                              f"new device directory") from None
        finally:
            os.close(fd)

    def _space(self, addr: int) -> tuple[_Space, int]:
        return self._spaces[addr >> SPACE_SHIFT], addr & ((1 << SPACE_SHIFT) - 1)

    # -- the index and free space --------------------------------------------------------
    def _load(self) -> None:
        raw = _pread_all(self._ifd, os.fstat(self._ifd).st_size, 0)
        live = []  # (address, length, slot, name)
        self._free_slots: list[int] = []
        nslots = len(raw) // SLOT_SIZE
        for i in range(nslots):
            ent = unpack_slot(raw[i * SLOT_SIZE:(i + 1) * SLOT_SIZE])
            if ent is None or ent[1] >> SPACE_SHIFT >= len(SPACES):
                self._free_slots.append(i)
            else:
                name, addr, length = ent
                live.append((addr, length, i, name))
        self._nslots = nslots
        live.sort()  # by space, then offset
        self._index: dict[str, tuple[int, int, int]] = {}  # name -> (slot, address, length)
        used = []  # (address, rounded length), in order, not overlapping
        for addr, length, slot, name in live:
            if used and addr < used[-1][0] + used[-1][1] or name in self._index:
                # two slots on one extent (a crash between a free and a reuse), or a
                # name twice (a crash during a rewrite): keep what the data confirms
                if not self._settle(name, addr, length, slot, used):
                    continue
            self._index[name] = (slot, addr, length)
            used.append((addr, _round(length)))
        for sp in self._spaces:
            sp.rebuild([(a & ((1 << SPACE_SHIFT) - 1), n) for a, n in used
                        if a >> SPACE_SHIFT == sp.number])

    def _settle(self, name, addr, length, slot, used) -> bool:
        """A live slot that overlaps an earlier one, or repeats its name: keep the one
        whose fragment header names it (the other's extent was reused, or it was
        replaced); clear the loser's slot. True if the new slot wins."""
        def names_itself(n, a):
            sid_hex, _, idx = n.partition(".")
            sp, off = self._space(a)
            try:
                return fr.header_names(os.pread(sp.fd, fr.HEAD_FIXED, off),
                                       int(sid_hex, 16), int(idx))
            except (ValueError, OSError):
                return False

        if name in self._index:
            rival = (name, self._index[name])
        else:
            prev = used[-1][0]
            rival = next(((n, e) for n, e in self._index.items() if e[1] == prev), None)
        if rival is None:
            return False
        rname, (rslot, raddr, rlen) = rival
        if names_itself(name, addr) and not names_itself(rname, raddr):
            del self._index[rname]
            used.remove((raddr, _round(rlen)))
            self._clear_slot(rslot)
            if not used or addr >= used[-1][0] + used[-1][1]:
                return True
        self._clear_slot(slot)
        return False

    def _clear_slot(self, slot: int) -> None:
        os.pwrite(self._ifd, bytes(SLOT_SIZE), slot * SLOT_SIZE)
        self._free_slots.append(slot)
        self._dirty = True

    def _allocate(self, n: int, parity: bool) -> int:
        """Address of ``n`` free bytes in the data or the parity space. Called with the
        lock held."""
        self._release()
        sp = self._spaces[1 if parity else 0]
        return sp.number << SPACE_SHIFT | sp.allocate(_round(n))

    def _free(self, addr: int, length: int) -> None:
        """Give an extent back once no read that may have looked it up is running."""
        self._limbo.append((self._epoch, addr, length))
        self._epoch += 1
        self._release()

    def _release(self) -> None:
        if not self._limbo:
            return
        oldest = min(self._reading) if self._reading else self._epoch
        keep = []
        for epoch, addr, length in self._limbo:
            if epoch < oldest:
                sp, off = self._space(addr)
                sp.add_hole(off, _round(length))
            else:
                keep.append((epoch, addr, length))
        self._limbo = keep

    def _new_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._nslots += 1
        return self._nslots - 1

    # -- writes -------------------------------------------------------------------------
    def write(self, name: str, parts) -> None:
        total = sum(len(p) for p in parts)
        with self._lock:
            addr = self._allocate(total, fr.is_parity(parts[0] if parts else b""))
        sp, off = self._space(addr)
        try:
            if sp.dfd is not None and total >= _file.DIRECT_MIN:
                with _file.gathered(parts, total) as page:
                    self._pwrite_direct(sp, page, off)
            else:
                pos = off
                for p in parts:
                    _pwrite_all(sp.fd, p, pos)
                    pos += len(p)
        except BaseException:
            with self._lock:
                self._free(addr, total)
            raise
        self._publish(name, addr, total)

    def write_aligned(self, name: str, buf) -> None:
        """``write(name, [buf])`` for a page-aligned buffer (a storage node's receive
        buffer): its whole pages go to the pool with O_DIRECT straight from it."""
        if self._spaces[0].dfd is None:
            return self.write(name, [buf])
        total = len(buf)
        with self._lock:
            addr = self._allocate(total, fr.is_parity(buf))
        sp, off = self._space(addr)
        try:
            with _file.direct_pages(buf) as pages:
                for page in pages:
                    self._pwrite_direct(sp, page, off)
                    off += len(page)
        except BaseException:
            with self._lock:
                self._free(addr, total)
            raise
        self._publish(name, addr, total)

    @staticmethod
    def _pwrite_direct(sp: _Space, view, off: int) -> None:
        try:
            _pwrite_all(sp.dfd, view, off)
        except OSError as e:
            if e.errno != errno.EINVAL:  # a buffer O_DIRECT refuses: through the cache
                raise
            _pwrite_all(sp.fd, view, off)

    def _publish(self, name: str, addr: int, total: int) -> None:
        """Make the fragment written at ``addr`` the one named ``name``: its slot, then
        the index; a fragment it replaces is freed."""
        with self._lock:
            old = self._index.get(name)
            slot = self._new_slot()
            os.pwrite(self._ifd, pack_slot(name, addr, total), slot * SLOT_SIZE)
            self._index[name] = (slot, addr, total)
            if old is not None:
                os.pwrite(self._ifd, bytes(SLOT_SIZE), old[0] * SLOT_SIZE)
                self._free_slots.append(old[0])
                self._free(old[1], old[2])
            self._dirty = True

    def delete(self, name: str) -> None:
        with self._lock:
            ent = self._index.pop(name, None)
            if ent is None:
                return
            slot, addr, length = ent
            os.pwrite(self._ifd, bytes(SLOT_SIZE), slot * SLOT_SIZE)
            self._free_slots.append(slot)
            self._free(addr, length)
            self._dirty = True

    def sync(self, syncfs: bool = False) -> None:
        # one at a time: a sync that finds nothing new to do must still wait for the
        # one running, which covers its caller's writes
        with self._sync_lock:
            with self._lock:
                dirty, self._dirty = self._dirty, False
            if dirty:
                for sp in self._spaces:  # the data first ...
                    os.fdatasync(sp.fd)
                os.fdatasync(self._ifd)  # ... then the slots naming it

    # -- reads --------------------------------------------------------------------------
    def _begin_read(self, name: str):
        with self._lock:
            ent = self._index.get(name)
            if ent is None:
                raise FileNotFoundError(errno.ENOENT, f"no fragment {name}", name)
            epoch = self._epoch
            self._reading[epoch] = self._reading.get(epoch, 0) + 1
        sp, off = self._space(ent[1])
        return epoch, sp, off, ent[2]

    def _end_read(self, epoch: int) -> None:
        with self._lock:
            n = self._reading[epoch] - 1
            if n:
                self._reading[epoch] = n
            else:
                del self._reading[epoch]

    def read_parts(self, name: str, ranges, into=None) -> list:
        """Small reads use one descriptor that asks for no read-ahead (a 4 KiB read
        reads 4 KiB); large ones, sequential readers', open their own, whose
        read-ahead state no other reader disturbs (on one shared descriptor their
        read-ahead mixes, and a cold sequential read loses about a third).
        Read-ahead running past a fragment finds the device's next data fragment,
        which such a reader wants soon:
        parity fragments live in a file of their own."""
        epoch, sp, base, length = self._begin_read(name)
        large = sum(n for _, n in ranges) >= _file.DROP_BEHIND
        fd = os.open(sp.path, os.O_RDONLY | _NOLINK) if large else sp.rfd
        try:
            out = []
            for j, (o, n) in enumerate(ranges):
                o = min(o, length)
                n = max(0, min(n, length - o))
                if into is not None and j == len(ranges) - 1:  # (FileStore.read_parts)
                    view = memoryview(into).cast("B")
                    out.append(pread_into(fd, base + o, view if n >= len(view) else view[:n]))
                else:
                    out.append(os.pread(fd, n, base + o) if n else b"")
            if large and self.drop_behind:
                try:  # only advice, as in FileStore.read_parts
                    for o, n in ranges:
                        os.posix_fadvise(fd, base + o, n, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
            return out
        finally:
            if large:
                os.close(fd)
            self._end_read(epoch)

    def read(self, name: str, offset: int, length: int) -> bytes:
        return self.read_parts(name, [(offset, length)])[0]

    def extent(self, name: str):
        """``(fd, offset, length, release)`` of the fragment, for sendfile: a
        descriptor of its file of its own, and ``release()`` to call when done, which
        closes it and lets the extent be reused (until then it is held, like a read).
        Raises FileNotFoundError if there is no such fragment."""
        epoch, sp, base, length = self._begin_read(name)
        try:
            fd = os.open(sp.path, os.O_RDONLY | _NOLINK)
        except BaseException:
            self._end_read(epoch)
            raise

        def release():
            os.close(fd)
            self._end_read(epoch)
        return fd, base, length, release

    # -- the rest -----------------------------------------------------------------------
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._index)

    names_list = names

    def usage(self) -> dict:
        st = os.statvfs(self.path)
        with self._lock:  # freed extents hold blocks the filesystem counts as used
            reusable = sum(sum(sp.hole.values()) for sp in self._spaces) \
                + sum(n for _, _, n in self._limbo)
        return {"total": st.f_blocks * st.f_frsize,
                "free": st.f_bavail * st.f_frsize + reusable,
                "fsid": os.stat(self.path).st_dev, "layout": "pool"}

    def check(self) -> None:
        if not os.path.exists(os.path.join(self.path, "DEVICE")):
            raise VolumeError(f"device {self.dev} at {self.path} is missing")

    def close(self) -> None:
        if self._ifd is not None:
            os.close(self._ifd)
            self._ifd = None
            for sp in self._spaces:
                sp.close()

    def __del__(self):
        if getattr(self, "_ifd", None) is not None and hasattr(self, "_spaces"):
            try:
                self.close()
            except OSError:
                pass


def is_pool(path: str) -> bool:
    """Whether the device directory ``path`` holds a pool (format 2)."""
    try:
        with open(os.path.join(path, "DEVICE")) as f:
            return json.load(f).get("layout") == "pool"
    except (OSError, ValueError):
        return False


def _pwrite_all(fd: int, data, off: int) -> None:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n


def _pread_all(fd: int, n: int, off: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = os.pread(fd, n - len(out), off + len(out))
        if not b:
            break
        out += b
    return bytes(out)
