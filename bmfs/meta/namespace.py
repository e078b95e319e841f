"""The namespace of one tree over the KV: inodes, entries, slices, xattrs, symlinks.

Every function takes the transaction and the tree's chain; nothing here commits. The
POSIX rules (permissions, which errno when) live in vfs/; this module keeps the
invariants of the stored structures: directory entries point at live inodes, stripe
reference counts equal the number of stored slice lists that mention the stripe
(so a stripe nobody references is queued for garbage collection in the same
transaction that dropped its last reference).
"""
from __future__ import annotations

import json
import stat

from ..errors import MetaDamaged
from ..kv import Txn
from . import keys
from .layers import Chain, ldel, lget, lput, lscan, top_value
from ..format.records import (SLICE_SIZE, UNCOUNTED, Inode, Slice, Stripe, compact, pack_dentry,
                      pack_slices, slice_sids, unpack_dentry, unpack_slices)

ROOT = 1


async def get_inode(txn: Txn, chain: Chain, ino: int) -> Inode | None:
    v = await lget(txn, chain, keys.inode(ino))
    return Inode.unpack(v) if v is not None else None


async def put_inode(txn: Txn, chain: Chain, ino: int, inode: Inode) -> None:
    await lput(txn, chain, keys.inode(ino), inode.pack())


async def lookup(txn: Txn, chain: Chain, parent: int, name: bytes) -> tuple[int, int] | None:
    """``(ino, type bits)`` of ``name`` in directory ``parent``, or None."""
    v = await lget(txn, chain, keys.dentry(parent, name))
    return unpack_dentry(v) if v is not None else None


async def link_entry(txn: Txn, chain: Chain, parent: int, name: bytes, ino: int, mode: int):
    await lput(txn, chain, keys.dentry(parent, name), pack_dentry(ino, mode))


async def unlink_entry(txn: Txn, chain: Chain, parent: int, name: bytes):
    await ldel(txn, chain, keys.dentry(parent, name))


async def list_dir(txn: Txn, chain: Chain, parent: int) -> list[tuple[bytes, int, int]]:
    """``(name, ino, type bits)`` of every entry, in name order."""
    plen = len(keys.dir_prefix(parent))
    return [(sub[plen:], *unpack_dentry(v))
            for sub, v in await lscan(txn, chain, keys.dir_prefix(parent))]


async def dir_is_empty(txn: Txn, chain: Chain, parent: int) -> bool:
    return not await lscan(txn, chain, keys.dir_prefix(parent))


# -- slices and stripe references ------------------------------------------------------
async def get_chunk(txn: Txn, chain: Chain, ino: int, index: int) -> list[Slice]:
    v = await lget(txn, chain, keys.chunk(ino, index))
    return unpack_slices(v) if v else []


async def chunk_indexes(txn: Txn, chain: Chain, ino: int) -> list[int]:
    return [keys.chunk_of(sub)[1]
            for sub, _ in await lscan(txn, chain, keys.chunk_prefix(ino))]


async def put_chunk(txn: Txn, chain: Chain, ino: int, index: int, slices: list[Slice]) -> int:
    """Store a chunk's slice list, moving stripe references from the old list to the new;
    returns how the file's count of chunk records changes (+1, -1, 0: the caller
    adds it to the inode's ``chunks``, Inode.count).

    Only a version in the top layer is replaced; a version in a lower (frozen) layer
    keeps its references because it is still part of older trees.
    """
    sub = keys.chunk(ino, index)
    existed = await lget(txn, chain, sub) is not None
    old_sids = await _top_sids(txn, chain, sub)
    new_sids = {s.sid for s in slices}
    if slices:
        await lput(txn, chain, sub, pack_slices(slices))
    else:
        await ldel(txn, chain, sub)
    await adjust_refs(txn, new_sids - old_sids, +1)
    await adjust_refs(txn, old_sids - new_sids, -1)
    return int(bool(slices)) - int(existed)


async def _top_sids(txn: Txn, chain: Chain, sub: bytes) -> set[int]:
    """The stripes the top layer's own version of a chunk refers to."""
    old = await top_value(txn, chain, sub)
    return slice_sids(old[1:]) if old and old[:1] == keys.LIVE else set()


async def append_slice(txn: Txn, chain: Chain, ino: int, index: int, sl: Slice,
                       compact_over: int) -> tuple[int | None, int]:
    """Add ``sl`` (the newest) to a chunk's slice list, as put_chunk would; the list's
    new length if it was compacted (it then held more than ``compact_over``), else
    None, and the change of the file's count of chunk records (as put_chunk). Without
    a compaction the packed list is extended as it is: no Slice objects for the
    slices already there (thousands, in a chunk written in small scattered pieces)."""
    sub = keys.chunk(ino, index)
    cur = await lget(txn, chain, sub)
    created = int(cur is None)
    cur = cur or b""
    if len(cur) // SLICE_SIZE + 1 > compact_over:
        slices = compact(unpack_slices(cur) + [sl], keys.CHUNK_SIZE)
        return len(slices), await put_chunk(txn, chain, ino, index, slices)
    top = await top_value(txn, chain, sub)
    await lput(txn, chain, sub, cur + pack_slices([sl]))
    # the new version refers to what the tree showed (cur) and sl. A live version in
    # the top layer is cur itself: it referred to all of cur already, and nothing it
    # referred to is dropped. Otherwise the top layer's new version adds a reference
    # to each (lower layers keep theirs).
    if top and top[:1] == keys.LIVE:
        await adjust_refs(txn, {sl.sid} - slice_sids(cur), +1)
    else:
        await adjust_refs(txn, slice_sids(cur) | {sl.sid}, +1)
    return None, created


async def adjust_refs(txn: Txn, sids, delta: int) -> None:
    for sid in sids:
        if sid == 0:
            continue
        raw = await txn.get(keys.stripe(sid))
        if raw is None:
            raise MetaDamaged(f"stripe {sid} is missing from the metadata (a slice refers "
                              f"to it)", keys.stripe(sid))
        st = Stripe.unpack(raw)
        st.refs += delta
        if st.refs > 0:
            txn.put(keys.stripe(sid), st.pack())
        else:
            txn.delete(keys.stripe(sid))
            if st.kind != 0:
                txn.put(keys.garbage(sid), raw)


async def drop_file_data(txn: Txn, chain: Chain, ino: int) -> None:
    if len(chain.layers) == 1:
        # a tree of one layer: the scan's values are the top versions that put_chunk
        # would read again, one lookup per chunk (a third of an unlink's reads)
        for sub, v in await lscan(txn, chain, keys.chunk_prefix(ino)):
            await ldel(txn, chain, sub)
            await adjust_refs(txn, {s.sid for s in unpack_slices(v)}, -1)
        return
    for idx in await chunk_indexes(txn, chain, ino):
        await put_chunk(txn, chain, ino, idx, [])


async def delete_inode(txn: Txn, chain: Chain, ino: int, inode: Inode) -> None:
    """Remove an inode and everything hanging off it (slices, xattrs, symlink)."""
    if inode.is_reg():
        await drop_file_data(txn, chain, ino)
    for sub, _ in await lscan(txn, chain, keys.xattr_prefix(ino)):
        await ldel(txn, chain, sub)
    if stat.S_ISLNK(inode.mode):
        await ldel(txn, chain, keys.symlink(ino))
    await ldel(txn, chain, keys.inode(ino))


# -- xattrs and symlinks ----------------------------------------------------------------
async def get_xattr(txn, chain, ino, name: bytes) -> bytes | None:
    return await lget(txn, chain, keys.xattr(ino, name))


async def set_xattr(txn, chain, ino, name: bytes, value: bytes) -> None:
    """(The caller counts a new name in the inode's ``xattrs``.)"""
    await lput(txn, chain, keys.xattr(ino, name), value)


async def remove_xattr(txn, chain, ino, name: bytes) -> None:
    """(The caller counts the name out of the inode's ``xattrs``.)"""
    await ldel(txn, chain, keys.xattr(ino, name))


async def list_xattrs(txn, chain, ino) -> list[bytes]:
    return [keys.xattr_name_of(sub) for sub, _ in await lscan(txn, chain, keys.xattr_prefix(ino))]


# -- record counts: a record missing that the inode counts is damage, not absence --------
_COUNTED = {"chunks": keys.chunk_prefix, "xattrs": keys.xattr_prefix}


async def counted(txn, chain, ino: int, field: str) -> int:
    """How many chunk (``field`` "chunks") or xattr ("xattrs") records ``ino`` has in the
    tree (a scan: every value is checked on the way, so a record moved within the
    file's range fails its checksum here)."""
    return len(await lscan(txn, chain, _COUNTED[field](ino)))


async def check_counts(txn, chain, ino: int, field: str, what: str) -> None:
    """A lookup of ``ino`` found a chunk or xattr record (``what``) absent: that stands
    only if the file has as many such records as its inode counts.

    Raises:
        MetaDamaged: fewer or more records than counted (a key changed on disk, say).
    """
    i = await get_inode(txn, chain, ino)
    want = UNCOUNTED if i is None else getattr(i, field)
    if want == UNCOUNTED:
        return
    n = await counted(txn, chain, ino, field)
    if n != want:
        raise MetaDamaged(f"damaged metadata: inode {ino} counts {want} {field[:-1]} "
                          f"records, {n} found ({what} is missing: a record damaged or "
                          f"moved)", keys.inode(ino))


async def recount(txn, chain, ino: int) -> bool:
    """Set ``ino``'s record counts to the records it has (after a merge); whether the
    inode changed."""
    i = await get_inode(txn, chain, ino)
    if i is None:
        return False
    c, x = await counted(txn, chain, ino, "chunks"), await counted(txn, chain, ino, "xattrs")
    if (i.chunks, i.xattrs) == (c, x):
        return False
    i.chunks, i.xattrs = c, x
    await put_inode(txn, chain, ino, i)
    return True


async def get_symlink(txn, chain, ino) -> bytes | None:
    return await lget(txn, chain, keys.symlink(ino))


async def set_symlink(txn, chain, ino, target: bytes) -> None:
    await lput(txn, chain, keys.symlink(ino), target)


# -- counters ---------------------------------------------------------------------------
async def allocate(kv, name: str, count: int) -> int:
    """Reserve ``count`` consecutive numbers of counter ``name``; returns the first."""
    async def fn(txn):
        v = await txn.get(keys.counter(name))
        first = int(v) if v else 1
        txn.put(keys.counter(name), str(first + count).encode())
        return first
    return await kv.transact(fn)


async def load_json(txn_or_kv, key: bytes):
    v = await txn_or_kv.get(key)
    return json.loads(v) if v is not None else None
