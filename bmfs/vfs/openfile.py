"""The state of open files: handles, write buffers, lost ranges, and what the kernel
holds of each file (close-to-open).

Close-to-open across mounts (etcd): the kernel's writeback cache keeps its own size
and times of a cached regular file whatever our replies say. ``KernelCopies.client``
records, per file the kernel holds, the stored (size, mtime, ctime) the kernel's copy
reflects: set when the kernel gets the inode, moved on by this mount's own changes,
dropped when the kernel forgets it. ``Files.open`` compares it with the stored inode;
a difference means another mount changed the file, and the front end drops the
kernel's pages and fixes its size (see ``Files.client_stale``).
"""
from __future__ import annotations

import errno

import trio

from ..errors import FsError
from ..format.records import Inode, Stripe

PIPELINE = 2  # full stripes of one file stored in the background at once


class WriteBuffer:
    """Bytes written but not stored yet, kept as the pieces the kernel sent: no copy
    until a stripe is cut out of them (fresh memory is slow to touch on these VMs)."""

    __slots__ = ("pieces", "length")

    def __init__(self):
        self.pieces: list[bytes] = []
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def append(self, data) -> None:
        self.pieces.append(data if isinstance(data, bytes) else bytes(data))
        self.length += len(data)

    def take(self, n: int) -> list:
        """Remove and return the first ``n`` bytes, as a list of pieces: not joined
        (the encoder reads them in place; a join is a 4 MiB copy per stripe on the
        event loop's thread)."""
        out, got = [], 0
        while got < n:
            p = self.pieces[0]
            if got + len(p) <= n:
                out.append(p)
                got += len(p)
                self.pieces.pop(0)
            else:
                cut = n - got
                out.append(p[:cut])
                self.pieces[0] = p[cut:]
                got = n
        self.length -= n
        return out


class Lost:
    """Bytes [start, end) of a file, written here, that could not be stored: what the
    devices or the metadata said (``errno``, ``why``). Until they are written again or
    cut off, reads of them fail (EIO) and so do fsync and close of the file's writable
    handles: the kernel may still show the file's size with them (its writeback cache
    keeps its own), and a read it sent here must never find them as a hole of zeros."""
    __slots__ = ("start", "end", "errno", "why")

    def __init__(self, start: int, end: int, e: BaseException):
        self.start, self.end = start, end
        self.errno = e.errno if isinstance(e, FsError) else errno.EIO
        self.why = str(e)

    def error(self, ino: int) -> FsError:
        return FsError(f"bytes {self.start}-{self.end} of inode {ino} were not stored: "
                       f"{self.why}", self.errno)


class OpenFile:
    """A file open through one view: its handles share it."""
    __slots__ = ("view", "ino", "opens", "lock", "buf", "buf_start", "size", "mtime_ns",
                 "dirty", "stripes", "inflight", "last_commit", "failures", "read_cache")

    def __init__(self, view, ino):
        self.view, self.ino = view, ino
        self.opens = 0
        self.lock = trio.Lock()
        self.buf = WriteBuffer()
        self.buf_start = 0
        self.size: int | None = None     # in-memory size while dirty
        self.mtime_ns: int | None = None
        self.dirty = False
        self.stripes: dict[int, Stripe] = {}  # stripe records seen (immutable but refs)
        # write pipeline: stripes being stored in the background, committed in order
        self.inflight = trio.Semaphore(PIPELINE)
        self.last_commit: trio.Event | None = None
        # stores that failed so far: a stripe taken from the buffer before the last
        # failure is not committed (Writes._lose)
        self.failures = 0
        # what reads looked up: [kv commit count, chain, inode, {chunk index: slices}]
        self.read_cache: list | None = None


class Handle:
    __slots__ = ("of", "flags", "stale", "state")

    def __init__(self, of: OpenFile, flags: int):
        self.of, self.flags = of, flags
        self.stale: tuple[int | None, int] | None = None  # see Files.client_stale
        self.state: tuple[int, int, int] | None = None    # the stored state at open


def state(i: Inode) -> tuple[int, int, int]:
    """What the kernel's copy of a regular file reflects: (size, mtime, ctime)."""
    return i.size, i.mtime_ns, i.ctime_ns


class KernelCopies:
    """What the kernel may show of each file: the stored state its copy reflects
    (``client``), and the range written here that could not be stored (``lost``: kept
    while a handle is open or the kernel holds the inode). Keys: (view id, ino)."""

    def __init__(self):
        self.client: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.lost: dict[tuple[int, int], Lost] = {}

    def moved(self, view, ino: int, before: tuple, i: Inode) -> None:
        """This mount changed the file from ``before`` to ``i``: the kernel did it (or
        was told), so its copy moves on, unless it was already behind someone else."""
        key = (view.id, ino)
        if self.client.get(key) == before:
            self.client[key] = state(i)
