"""Diff of two trees: the keys either side changed since they forked, reported as paths
(an inode whose atime alone moved was read, not changed)."""
from __future__ import annotations

from ..kv import prefix_end
from . import keys
from .layers import Chain, lget
from ..format.records import Inode, unpack_dentry
from .trees import tree_chain

async def changed_subs(kv, layers: set[int]) -> set[bytes]:
    """Every SUB with a version in one of ``layers``."""
    out = set()
    if not layers:
        return out
    for prefix in keys.LAYERED_PREFIXES:
        start = prefix
        while True:
            rows = await kv.range(start, prefix_end(prefix), 10000)
            for k, _ in rows:
                if k[-9:-8] == b"@" and int(k[-8:], 16) in layers:
                    out.add(k[:-9])
            if len(rows) < 10000:
                break
            start = rows[-1][0] + b"\x00"
    return out


def fork(a: Chain, b: Chain) -> tuple[Chain, set[int], set[int]]:
    """The common base of two chains and the layers each has on top of it."""
    in_a = set(a.layers)
    base_i = next(i for i, lay in enumerate(b.layers) if lay in in_a)
    base = b.layers[base_i]
    a_i = a.layers.index(base)
    return Chain(b.layers[base_i:], None), set(a.layers[:a_i]), set(b.layers[:base_i])


class Paths:
    """Resolves inode numbers and entry keys to paths within one tree (for reports)."""

    def __init__(self, kv, chain: Chain):
        self.kv, self.chain = kv, chain
        self._names: dict[int, bytes] | None = None

    async def dir_path(self, txn, ino: int) -> bytes:
        parts = []
        seen = 0
        while ino != 1 and seen < 4096:
            i = await lget(txn, self.chain, keys.inode(ino))
            if i is None:
                return b"?"
            parent = Inode.unpack(i).parent
            name = await self._name_in(txn, parent, ino)
            parts.append(name)
            ino = parent
            seen += 1
        return b"/" + b"/".join(reversed(parts))

    async def _name_in(self, txn, parent, ino) -> bytes:
        from .namespace import list_dir
        for name, cino, _ in await list_dir(txn, self.chain, parent):
            if cino == ino:
                return name
        return b"?"

    async def file_path(self, txn, ino: int) -> bytes:
        if self._names is None:
            from .layers import lscan
            self._names = {}
            for sub, v in await lscan(txn, self.chain, keys.DENTRY_PREFIX):
                cino = unpack_dentry(v)[0]
                self._names.setdefault(cino, sub)
        sub = self._names.get(ino)
        if sub is None:
            return b"<inode %d>" % ino
        return await self.entry_path(txn, sub)

    async def entry_path(self, txn, sub: bytes) -> bytes:
        parent, name = keys.dentry_of(sub)
        d = await self.dir_path(txn, parent)
        return (d.rstrip(b"/") + b"/" + name)

    async def of_sub(self, txn, sub: bytes) -> bytes:
        if sub.startswith(keys.DENTRY_PREFIX):
            return await self.entry_path(txn, sub)
        return await self.file_path(txn, keys.ino_of(sub))


def same_but_read(sub: bytes, a: bytes | None, b: bytes | None) -> bool:
    """Whether two versions of a key are the same, or, for an inode record, differ in
    their atime alone: the file was read (relatime), not changed. Diffs and merges
    take such an inode for unchanged."""
    if a == b:
        return True
    if a is None or b is None or not sub.startswith(keys.INODE_PREFIX):
        return False
    ia, ib = Inode.unpack(a), Inode.unpack(b)
    ib.atime_ns = ia.atime_ns
    return ia == ib


async def op_diff(kv, a: str, b: str) -> dict:
    """Paths added, removed and changed going from tree ``a`` to tree ``b``."""
    _, ca = await tree_chain(kv, a)
    _, cb = await tree_chain(kv, b)
    _, xa, xb = fork(ca, cb)
    subs = await changed_subs(kv, xa | xb)
    txn = kv.begin()
    pa, pb = Paths(kv, ca), Paths(kv, cb)
    added, removed, changed = set(), set(), set()
    for sub in sorted(subs):
        va, vb = await lget(txn, ca, sub), await lget(txn, cb, sub)
        if same_but_read(sub, va, vb):
            continue
        if sub.startswith(keys.DENTRY_PREFIX):
            if va is None:
                added.add(await pb.of_sub(txn, sub))
            elif vb is None:
                removed.add(await pa.of_sub(txn, sub))
            else:
                changed.add(await pb.of_sub(txn, sub))
        else:
            ino = keys.ino_of(sub)
            ia = await lget(txn, ca, keys.inode(ino))
            ib = await lget(txn, cb, keys.inode(ino))
            if ia is None or ib is None or Inode.unpack(ib).is_dir():
                continue  # created/removed (seen through entries) or directory times
            changed.add(await pb.of_sub(txn, sub))
    changed -= added | removed
    dec = lambda s: sorted(p.decode(errors="surrogateescape") for p in s)  # noqa: E731
    return {"added": dec(added), "removed": dec(removed), "changed": dec(changed)}


# Inode fields in a three-way merge. nlink and a directory's parent are not merged: they
# follow from the merged entries. A name or xattr change moves ctime, so times take the
# newest (a directory's mtime too: entries added on both sides); any other field, and a
# file's mtime (its content), changed differently on both sides is a conflict.
