#!/usr/bin/env python3
"""memfs: a minimal in-memory pyfuse3 filesystem, the ceiling for a Python FUSE daemon.

Used by tools/bench as the reference target: it does the least work a pyfuse3 + trio
daemon can do per request (a dict of inodes, one bytearray per file), with the same
kernel-side settings as a bmfs mount (writeback cache, default_permissions, allow_other,
1 s attribute/entry timeouts), and it stays awake between back-to-back requests as a
bmfs mount does (bmfs/fuse/idle.py, BMFS_IDLE_SPIN_US: the same code and setting).
Whatever bmfs loses against it is bmfs's own cost.

    python tools/memfs.py MOUNTPOINT [--timeout SECONDS]

Runs in the foreground until unmounted (fusermount3 -u MOUNTPOINT) or sent SIGTERM /
SIGINT, then exits. Everything is lost when it exits.

Supports: lookup, getattr, setattr (size, mode, owner, times), create, open, read,
write, flush, fsync, release, unlink, mkdir, rmdir, opendir/readdir/releasedir, statfs,
forget. No links, renames, symlinks or xattrs.
"""
from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

ROOT = pyfuse3.ROOT_INODE
BLOCK = 4096


class Node:
    __slots__ = ("ino", "mode", "uid", "gid", "nlink", "atime", "mtime", "ctime", "data",
                 "children", "lookups", "opens")

    def __init__(self, ino, mode, uid, gid):
        now = time.time_ns()
        self.ino, self.mode, self.uid, self.gid = ino, mode, uid, gid
        self.nlink = 2 if stat.S_ISDIR(mode) else 1
        self.atime = self.mtime = self.ctime = now
        self.data = bytearray()
        self.children: dict[bytes, int] | None = {} if stat.S_ISDIR(mode) else None
        self.lookups = 0
        self.opens = 0


class MemFS(pyfuse3.Operations):
    enable_writeback_cache = True
    node_class = Node

    def __init__(self, timeout: float = 1.0):
        super().__init__()
        self.supports_dot_lookup = False
        self.timeout = timeout
        self.nodes: dict[int, Node] = {}
        self.next_ino = ROOT + 1
        root = self.node_class(ROOT, stat.S_IFDIR | 0o755, os.getuid(), os.getgid())
        root.lookups = 1
        self.nodes[ROOT] = root
        self.dirs: dict[int, list] = {}
        self.next_dh = 1

    # -- helpers ----------------------------------------------------------------------------
    def _node(self, ino) -> Node:
        n = self.nodes.get(ino)
        if n is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return n

    def _attr(self, n: Node) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = n.ino
        e.generation = 0
        e.entry_timeout = self.timeout
        e.attr_timeout = self.timeout
        e.st_mode = n.mode
        e.st_nlink = n.nlink
        e.st_uid = n.uid
        e.st_gid = n.gid
        e.st_rdev = 0
        size = self._size(n)
        e.st_size = size
        e.st_blksize = 1 << 20
        e.st_blocks = (size + 511) // 512
        e.st_atime_ns = n.atime
        e.st_mtime_ns = n.mtime
        e.st_ctime_ns = n.ctime
        return e

    def _size(self, n: Node) -> int:
        return len(n.data)

    def _resize(self, n: Node, size: int) -> None:
        if size < len(n.data):
            del n.data[size:]
        else:
            n.data.extend(bytes(size - len(n.data)))

    def _new(self, parent_inode, name, mode, ctx) -> Node:
        p = self._node(parent_inode)
        if p.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if name in p.children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        n = self.node_class(self.next_ino, mode, ctx.uid, ctx.gid)
        self.next_ino += 1
        self.nodes[n.ino] = n
        p.children[name] = n.ino
        p.mtime = p.ctime = n.ctime
        if n.children is not None:
            p.nlink += 1
        n.lookups += 1
        return n

    def _maybe_free(self, n: Node) -> None:
        if n.nlink == 0 and n.lookups == 0 and n.opens == 0 and n.ino != ROOT:
            self.nodes.pop(n.ino, None)

    # -- names ------------------------------------------------------------------------------
    async def lookup(self, parent_inode, name, ctx=None):
        p = self._node(parent_inode)
        if p.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        ino = p.children.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        n = self.nodes[ino]
        n.lookups += 1
        return self._attr(n)

    async def forget(self, inode_list):
        for ino, nlookup in inode_list:
            n = self.nodes.get(ino)
            if n is not None:
                n.lookups = max(0, n.lookups - nlookup)
                self._maybe_free(n)

    async def getattr(self, inode, ctx=None):
        return self._attr(self._node(inode))

    async def setattr(self, inode, attr, fields, fh, ctx):
        n = self._node(inode)
        now = time.time_ns()
        if fields.update_size:
            self._resize(n, attr.st_size)
            n.mtime = now
        if fields.update_mode:
            n.mode = (n.mode & ~0o7777) | (attr.st_mode & 0o7777)
        if fields.update_uid:
            n.uid = attr.st_uid
        if fields.update_gid:
            n.gid = attr.st_gid
        if fields.update_atime:
            n.atime = attr.st_atime_ns
        if fields.update_mtime:
            n.mtime = attr.st_mtime_ns
        n.ctime = now
        return self._attr(n)

    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._attr(self._new(parent_inode, name, stat.S_IFDIR | (mode & 0o7777), ctx))

    async def rmdir(self, parent_inode, name, ctx):
        p = self._node(parent_inode)
        ino = p.children.get(name) if p.children is not None else None
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        n = self.nodes[ino]
        if n.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if n.children:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        del p.children[name]
        p.nlink -= 1
        p.mtime = p.ctime = time.time_ns()
        n.nlink = 0
        self._maybe_free(n)

    async def unlink(self, parent_inode, name, ctx):
        p = self._node(parent_inode)
        ino = p.children.get(name) if p.children is not None else None
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        n = self.nodes[ino]
        if n.children is not None:
            raise pyfuse3.FUSEError(errno.EISDIR)
        del p.children[name]
        p.mtime = p.ctime = n.ctime = time.time_ns()
        n.nlink -= 1
        if n.nlink == 0:
            n.data = bytearray()
        self._maybe_free(n)

    # -- files ------------------------------------------------------------------------------
    async def create(self, parent_inode, name, mode, flags, ctx):
        n = self._new(parent_inode, name, stat.S_IFREG | (mode & 0o7777), ctx)
        n.opens += 1
        return pyfuse3.FileInfo(fh=n.ino), self._attr(n)

    async def open(self, inode, flags, ctx):
        n = self._node(inode)
        if n.children is not None:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_TRUNC:
            self._resize(n, 0)
            n.mtime = n.ctime = time.time_ns()
        n.opens += 1
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        data = self.nodes[fh].data
        return bytes(memoryview(data)[off:off + size])

    async def write(self, fh, off, buf):
        n = self.nodes[fh]
        data = n.data
        end = off + len(buf)
        if off == len(data):
            data += buf
        else:
            if off > len(data):
                data.extend(bytes(off - len(data)))
            data[off:end] = buf
        n.mtime = n.ctime = time.time_ns()
        return len(buf)

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        pass

    async def release(self, fh):
        n = self.nodes.get(fh)
        if n is not None:
            n.opens -= 1
            self._maybe_free(n)

    # -- directories ------------------------------------------------------------------------
    async def opendir(self, inode, ctx):
        n = self._node(inode)
        if n.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        dh = self.next_dh
        self.next_dh += 1
        self.dirs[dh] = list(n.children.items())
        return dh

    async def readdir(self, fh, start_id, token):
        entries = self.dirs.get(fh, [])
        for i in range(start_id, len(entries)):
            name, ino = entries[i]
            n = self.nodes.get(ino)
            if n is None or n.nlink == 0:
                continue
            if not pyfuse3.readdir_reply(token, name, self._attr(n), i + 1):
                break
            n.lookups += 1  # a READDIRPLUS entry takes a lookup reference

    async def releasedir(self, fh):
        self.dirs.pop(fh, None)

    async def fsyncdir(self, fh, datasync):
        pass

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = BLOCK
        used = sum(self._size(n) for n in self.nodes.values()) // BLOCK
        s.f_blocks = max(used * 2, 1 << 24)
        s.f_bfree = s.f_bavail = s.f_blocks - used
        s.f_files = 1 << 24
        s.f_ffree = s.f_favail = s.f_files - len(self.nodes)
        s.f_namemax = 255
        return s


async def _serve(idle):
    async with trio.open_nursery() as nursery:
        async def on_signal():
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as s:
                async for _ in s:
                    pyfuse3.terminate()
                    return
        nursery.start_soon(on_signal)
        nursery.start_soon(idle.run)
        await pyfuse3.main(min_tasks=4, max_tasks=64)
        nursery.cancel_scope.cancel()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="minimal in-memory pyfuse3 filesystem")
    ap.add_argument("mountpoint")
    ap.add_argument("--timeout", type=float, default=1.0,
                    help="kernel attribute/entry cache seconds (default 1, as bmfs)")
    args = ap.parse_args(argv)
    return serve(MemFS(args.timeout), args.mountpoint, "memfs")


def serve(fs, mountpoint: str, name: str) -> int:
    """Mount ``fs`` with bmfs's mount options and serve it until unmounted, staying
    awake between back-to-back requests as a bmfs mount does (BMFS_IDLE_SPIN_US:
    bmfs/fuse/idle.py), so that neither gains on the other by it."""
    from bmfs.config import get_settings
    from bmfs.fuse.idle import IdleSpin, watch_handlers
    idle = IdleSpin(get_settings().idle_spin)
    watch_handlers(fs, idle)
    options = set(pyfuse3.default_options)
    options |= {f"fsname={name}", f"subtype={name}", "default_permissions", "allow_other"}
    pyfuse3.init(fs, mountpoint, options)
    try:
        trio.run(_serve, idle)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
