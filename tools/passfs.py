#!/usr/bin/env python3
"""passfs: memfs with its file data in files on a local disk, a reference for what a
Python FUSE daemon gets from this machine's disk.

memfs (tools/memfs.py) answers reads from memory, so its "cold" reads never touch a
disk; a filesystem that keeps data on the disk pays the disk's latency and bandwidth
on top of the FUSE round trip. passfs shows that cost: the namespace is memfs's (a
dict of inodes, nothing persistent), and each regular file's bytes are one file
``DATA/<inode>`` on the disk, read and written with pread/pwrite, fsync'ed on fsync.
No erasure coding, checksums, metadata store or placement: where bmfs is behind
passfs, that is the cost of those. Not a strict ceiling: bmfs reads a large file from
four fragment files at once, passfs from one (so bmfs can read faster than passfs).

Like bmfs, small reads (up to 64 KiB) are done on the event loop and larger I/O in
worker threads (12 at most), so concurrent large requests overlap.

    python tools/passfs.py MOUNTPOINT --data DIR [--timeout SECONDS]

DIR must exist (put it on the disk the compared filesystem uses); passfs deletes a
file's data when the file is gone, and leaves DIR empty when it exits.
"""
from __future__ import annotations

import argparse
import os
import sys

import trio

from memfs import MemFS, Node, serve

INLINE_MAX = 64 << 10  # as bmfs's local transport: smaller reads on the event loop


class DiskNode(Node):
    __slots__ = ("size", "fd")

    def __init__(self, *args):
        super().__init__(*args)
        self.size = 0
        self.fd = -1


class PassFS(MemFS):
    node_class = DiskNode

    def __init__(self, data_dir: str, timeout: float = 1.0):
        super().__init__(timeout)
        self.data_dir = data_dir
        self._limiter = trio.CapacityLimiter(12)

    def _path(self, n: Node) -> str:
        return os.path.join(self.data_dir, str(n.ino))

    def _fd(self, n: DiskNode) -> int:
        if n.fd < 0:
            n.fd = os.open(self._path(n), os.O_RDWR | os.O_CREAT, 0o600)
        return n.fd

    def _size(self, n: DiskNode) -> int:
        return n.size

    def _resize(self, n: DiskNode, size: int) -> None:
        os.ftruncate(self._fd(n), size)
        n.size = size

    def _maybe_free(self, n: DiskNode) -> None:
        super()._maybe_free(n)
        if n.ino not in self.nodes:
            if n.fd >= 0:
                os.close(n.fd)
                n.fd = -1
            try:
                os.unlink(self._path(n))
            except FileNotFoundError:
                pass

    async def _io(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def read(self, fh, off, size):
        n = self.nodes[fh]
        size = max(0, min(size, n.size - off))
        if size <= INLINE_MAX:
            return os.pread(self._fd(n), size, off)
        return await self._io(os.pread, self._fd(n), size, off)

    async def write(self, fh, off, buf):
        n = self.nodes[fh]
        fd = self._fd(n)
        if len(buf) <= INLINE_MAX:
            done = os.pwrite(fd, buf, off)
        else:
            done = await self._io(os.pwrite, fd, buf, off)
        n.size = max(n.size, off + done)
        return done

    async def fsync(self, fh, datasync):
        n = self.nodes[fh]
        await self._io(os.fdatasync if datasync else os.fsync, self._fd(n))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="memfs with file data on a local disk")
    ap.add_argument("mountpoint")
    ap.add_argument("--data", required=True, help="existing directory for the file data")
    ap.add_argument("--timeout", type=float, default=1.0,
                    help="kernel attribute/entry cache seconds (default 1, as bmfs)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.data):
        ap.error(f"--data {args.data}: not a directory")
    fs = PassFS(args.data, args.timeout)
    try:
        return serve(fs, args.mountpoint, "passfs")
    finally:
        for n in list(fs.nodes.values()):  # nothing is kept: leave DIR as it was
            n.nlink = n.lookups = n.opens = 0
            fs._maybe_free(n)


if __name__ == "__main__":
    sys.exit(main())
