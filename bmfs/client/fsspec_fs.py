"""fsspec filesystem ``bm`` over the direct client: pandas, pyarrow, dask and torch
read bmfs without a mount.

``fsspec.filesystem("bm", volume=DIR)``; URLs are ``bm://BRANCH/path`` (paths without
the protocol are ``BRANCH/path`` too; ``/path`` names the instance's own branch, the
``branch`` argument, "main" by default). Snapshots: ``snapshot=NAME`` makes the
instance's tree that snapshot (read-only). Writes need ``writable=True``
(bmfs.connect's rules: docs/client.md). ``cat_ranges`` reads all its ranges in one
batch (Client.read_many).
"""
from __future__ import annotations

import errno
import stat

from fsspec import AbstractFileSystem

from .direct import Client


class BmFileSystem(AbstractFileSystem):
    protocol = "bm"
    root_marker = ""

    def __init__(self, volume: str, branch: str = "main", snapshot: str | None = None,
                 writable: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.volume, self.branch, self.snapshot = str(volume), branch, snapshot
        self.writable = writable
        self._clients: dict[str, Client] = {}

    def close(self) -> None:
        """Close the clients this instance opened (a writable one on a one-machine
        volume owns it until then)."""
        clients, self._clients = self._clients, {}
        for c in clients.values():
            c.close()

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith("bm://"):
            path = path[5:]
        return path.rstrip("/") or "/"

    def _split(self, path: str) -> tuple[Client, str]:
        """The client of the path's branch and the path inside it."""
        path = self._strip_protocol(path)
        if path.startswith("/"):
            tree, rest = None, path
        else:
            tree, _, rest = path.partition("/")
            rest = "/" + rest
        if tree is None:
            key = ("snapshot", self.snapshot) if self.snapshot else ("branch", self.branch)
        else:
            key = ("branch", tree)
        c = self._clients.get(key)
        if c is None:
            snap = key[1] if key[0] == "snapshot" else None
            c = self._clients[key] = Client(self.volume, key[1] if not snap else "main",
                                            snap, self.writable)
        return c, rest

    def _parents_made(self, path: str) -> tuple[Client, str]:
        """_split, with the directories above the path made (as object stores have
        them: a file written under a new directory makes it)."""
        c, p = self._split(path)
        parent = p.rsplit("/", 1)[0]
        if parent:
            c.makedirs(parent, exist_ok=True)
        return c, p

    @staticmethod
    def _join(path: str, name: str) -> str:
        path = path.rstrip("/")
        return f"{path}/{name}" if path else name

    def _entry(self, name: str, st) -> dict:
        kind = "directory" if stat.S_ISDIR(st.st_mode) else \
            "link" if stat.S_ISLNK(st.st_mode) else "file"
        return {"name": name, "size": st.st_size if kind == "file" else 0, "type": kind,
                "mode": st.st_mode, "mtime": st.st_mtime, "ino": st.st_ino}

    # -- names ------------------------------------------------------------------------
    def info(self, path, **kwargs):
        c, p = self._split(path)
        return self._entry(self._strip_protocol(path), c.stat(p))

    def ls(self, path, detail=True, **kwargs):
        c, p = self._split(path)
        st = c.stat(p)
        base = self._strip_protocol(path)
        if not stat.S_ISDIR(st.st_mode):
            out = [self._entry(base, st)]
        else:
            out = [self._entry(self._join(base, n), s) for n, s in c.scandir(p, sizes=True)]
        return out if detail else [e["name"] for e in out]

    def mkdir(self, path, create_parents=True, **kwargs):
        c, p = self._split(path)
        if create_parents:
            c.makedirs(p, exist_ok=True)
        else:
            c.mkdir(p)

    def makedirs(self, path, exist_ok=False):
        c, p = self._split(path)
        c.makedirs(p, exist_ok=exist_ok)

    def rmdir(self, path):
        c, p = self._split(path)
        c.rmdir(p)

    def rm_file(self, path):
        c, p = self._split(path)
        c.remove(p)

    def _rm(self, path):
        if self.isdir(path):
            self.rmdir(path)
        else:
            self.rm_file(path)

    def rm(self, path, recursive=False, maxdepth=None):
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        for p in reversed(paths):  # (deepest first: a directory after what it holds)
            self._rm(p)

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        c1, p1 = self._split(path1)
        c2, p2 = self._split(path2)
        if c1 is not c2:
            return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth)
        c1.rename(p1, p2)

    def cp_file(self, path1, path2, **kwargs):
        """A copy through this process (8 MiB at a time): bmfs has no server-side copy.
        A directory is made (fsspec's recursive copies pass them too)."""
        c1, p1 = self._split(path1)
        c2, p2 = self._parents_made(path2)
        if stat.S_ISDIR(c1.stat(p1).st_mode):  # (a recursive copy's directories)
            c2.makedirs(p2, exist_ok=True)
            return
        with c1.open(p1, "rb", buffering=0) as src, c2.open(p2, "wb", buffering=0) as dst:
            while chunk := src.read(8 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[dst.write(view):]

    def created(self, path):
        import datetime
        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], datetime.timezone.utc)

    modified = created

    # -- data -------------------------------------------------------------------------
    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None,
              **kwargs):
        c, p = self._parents_made(path) if mode[0] in "wax" else self._split(path)
        return c.open(p, mode, buffering=block_size if block_size and block_size > 1 else -1)

    def cat_file(self, path, start=None, end=None, **kwargs):
        return self.cat_ranges([path], [start], [end], on_error="raise")[0]

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        c, p = self._parents_made(path)
        if mode == "create" and c.exists(p):
            raise FileExistsError(errno.EEXIST, "File exists", path)
        c.write_file(p, value)

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        """Every range read in one batch per branch (Client.read_many)."""
        if not isinstance(starts, list):
            starts = [starts] * len(paths)
        if not isinstance(ends, list):
            ends = [ends] * len(paths)
        if len(starts) != len(paths) or len(ends) != len(paths):
            raise ValueError("cat_ranges: paths, starts and ends differ in length")
        by_client: dict[int, tuple[Client, list]] = {}
        out: list = [None] * len(paths)
        for n, (path, start, end) in enumerate(zip(paths, starts, ends)):
            c, p = self._split(path)
            try:
                start, end = self._bounds(c, p, start, end)
            except OSError as e:
                if on_error != "return":
                    raise
                out[n] = e
                continue
            by_client.setdefault(id(c), (c, []))[1].append((n, p, start, end))
        for c, items in by_client.values():
            try:
                got = c.read_many([(p, s, max(e - s, 0)) for _, p, s, e in items])
            except OSError as e:
                if on_error != "return" or len(items) == 1:
                    if on_error != "return":
                        raise
                    got = [e]
                else:  # (which one failed: each on its own)
                    got = []
                    for _, p, s, e2 in items:
                        try:
                            got.append(c.read_many([(p, s, max(e2 - s, 0))])[0])
                        except OSError as err:
                            got.append(err)
            for (n, *_), data in zip(items, got):
                out[n] = data if isinstance(data, (bytes, Exception)) else bytes(data)
        return out

    @staticmethod
    def _bounds(c: Client, p: str, start, end) -> tuple[int, int]:
        start = start or 0
        if end is None or start < 0 or end < 0:
            size = c.stat(p).st_size
            end = size if end is None else end + size if end < 0 else end
            start = start + size if start < 0 else start
        return max(start, 0), max(end, 0)
