"""Merges: fast-forward when the target has not changed since the trees forked (the
target moves onto the source's state, O(1)); otherwise three-way over the keys either
side changed since the fork, at file and directory level. A key changed on both sides
to different values is a conflict, except inode attributes changed apart (newest
times; link counts and a directory's parent are recomputed from the merged entries).
The merged namespace is then made whole (``_Merge``). Conflicts are listed by path and
nothing changes unless a strategy (``theirs``/``ours``) says which side wins; an inode
in conflict then comes whole from that side (attributes, data, xattrs, symlink).
"""
from __future__ import annotations

import json
import stat
from collections import Counter

from ..errors import Busy, FsError, Invalid
from . import keys, layer_gc
from .diff import Paths, changed_subs, fork, same_but_read
from .layers import Chain, lget, lput, ldel, lscan
from .namespace import ROOT, put_chunk, recount
from ..format.records import Inode, unpack_dentry, unpack_slices
from .trees import TOUCHED, freeze_head, load_record, new_layer, tree_chain


class MergeConflict(FsError):
    """A three-way merge found paths changed differently on both sides."""
    errno = 17

    def __init__(self, paths, hint: str = "use --theirs or --ours"):
        self.paths = paths
        super().__init__("merge conflicts in: " + ", ".join(paths[:20]) +
                         (f" and {len(paths) - 20} more" if len(paths) > 20 else "") +
                         f"; nothing was changed ({hint})")


# A file whose content (its chunks or size) both sides changed is a conflict, whatever
# the mtimes say; its mtime is the content changer's when one side changed the content,
# the newest when neither did. (An mtime moves without a content change, and a content
# change may keep the base's mtime: under the writeback cache the kernel keeps a file's
# mtime itself and sends it to bmfs when it flushes the inode, at any later time, e.g.
# after a branch was made.)
_OWN_FIELDS = ("mode", "uid", "gid", "size", "rdev", "mtime_ns")
_NEWEST_FIELDS = ("atime_ns", "ctime_ns")


def _merge_inode(s: Inode, b: Inode, t: Inode, s_chunks: bool = False,
                 t_chunks: bool = False) -> tuple[Inode, list[str]]:
    """The target's inode with the source's changes; and the fields both changed.
    ``s_chunks``, ``t_chunks``: whether that side changed a chunk of the file."""
    out, clash = t.copy(), []
    s_data, t_data = s_chunks or s.size != b.size, t_chunks or t.size != b.size
    if s_data and t_data and not t.is_dir():
        # written on both sides, whatever the times say (a write's mtime may be one
        # the kernel kept from before the branch was made: equal to the base's)
        clash.append("data")
    for f in _OWN_FIELDS + _NEWEST_FIELDS:
        sv, bv, tv = getattr(s, f), getattr(b, f), getattr(t, f)
        if sv == bv or sv == tv:
            continue
        if tv == bv:
            setattr(out, f, sv)
        elif f in _NEWEST_FIELDS or (f == "mtime_ns" and (t.is_dir() or not s_data
                                                          and not t_data)):
            setattr(out, f, max(sv, tv))
        elif f == "mtime_ns" and s_data != t_data:
            setattr(out, f, sv if s_data else tv)
        else:
            clash.append(f)
    return out, clash


class _Merge:
    """One three-way merge in one transaction: ``plan`` maps every SUB whose merged value
    differs from the target's to that value (None: deleted).

    Keys are merged one by one (``by_key``), then the namespace is made whole again
    (``settle``), because a key-wise merge of two valid trees need not be one: entries
    and inodes change apart, and link counts and a directory's parent depend on entries
    of both sides. An entry added on one side keeps its inode, and the directory it is
    in, alive even if the other side deleted them (restored from that side whole, data
    included); an inode left without a name is deleted, unless it was in conflict and
    the winning side keeps it (then its names there come back). A directory given two
    places, or moved into itself through moves on both sides, is a conflict: the winning
    side's entries for it are taken, or without a strategy nothing changes.
    """

    def __init__(self, txn, kv, cs: Chain, base: Chain, ct: Chain, strategy, dsubs):
        self.txn, self.kv, self.cs, self.base, self.ct = txn, kv, cs, base, ct
        self.strategy = strategy
        self.dsubs = dsubs  # entries changed on either side since the fork
        self.plan: dict[bytes, bytes | None] = {}
        self.conflicts: set[bytes] = set()
        self.resolved = 0
        self.changes = 0  # plan changes so far (a repair step checks it moved)
        # inode -> SUBs ever planned under it (its own keys; for a directory, also the
        # entries in it): a repair looks at one inode without going through the plan
        self._planned: dict[int, set[bytes]] = {}
        self._vals: dict[tuple[int, bytes], bytes | None] = {}
        self._conflict_inos: set[int] | None = None
        self._naming: dict[int, dict[int, list[bytes]]] = {}  # side -> ino -> entries

    async def val(self, chain: Chain, sub: bytes) -> bytes | None:
        k = (chain.top, sub)
        if k not in self._vals:
            self._vals[k] = await lget(self.txn, chain, sub)
        return self._vals[k]

    async def mval(self, sub: bytes) -> bytes | None:
        """The merged value."""
        return self.plan[sub] if sub in self.plan else await self.val(self.ct, sub)

    def _plan(self, sub: bytes, value: bytes | None) -> None:
        if sub not in self.plan or self.plan[sub] != value:
            self.plan[sub] = value
            self.changes += 1
            self._planned.setdefault(keys.ino_of(sub), set()).add(sub)

    async def take(self, sub: bytes, value: bytes | None) -> None:
        if value == await self.val(self.ct, sub):
            if self.plan.pop(sub, self) is not self:
                self.changes += 1
        else:
            self._plan(sub, value)

    @property
    def winner(self) -> Chain | None:
        return {"theirs": self.cs, "ours": self.ct}.get(self.strategy)

    async def by_key(self, subs, target_subs=(), progress=None) -> None:
        """Merge the keys the source changed (``subs``); ``target_subs``: those the
        target changed (only its chunks are looked at: who rewrote a file).
        ``progress(done, total)`` is told of the keys compared."""
        # files whose chunks each side changed (their mtimes: _merge_inode)
        rewrote: dict[str, set[int]] = {"s": set(), "t": set()}
        for side, chain, changed in (("s", self.cs, subs), ("t", self.ct, target_subs)):
            for sub in changed:
                if sub.startswith(keys.CHUNK_PREFIX) and \
                        await self.val(chain, sub) != await lget(self.txn, self.base, sub):
                    rewrote[side].add(keys.ino_of(sub))
        for n, sub in enumerate(subs, 1):
            if progress and n % 256 == 0:
                progress(n, len(subs))
            sv, bv, tv = (await self.val(self.cs, sub), await lget(self.txn, self.base, sub),
                          await self.val(self.ct, sub))
            if same_but_read(sub, sv, bv) or sv == tv:
                continue
            if same_but_read(sub, tv, bv):
                self._plan(sub, sv)
                continue
            if sub.startswith(keys.INODE_PREFIX) and sv and tv and bv:
                ino = keys.ino_of(sub)
                merged, clash = _merge_inode(Inode.unpack(sv), Inode.unpack(bv),
                                             Inode.unpack(tv), ino in rewrote["s"],
                                             ino in rewrote["t"])
                if clash:  # (taken whole from the winner: _take_conflicted_whole)
                    self.conflicts.add(sub)
                else:
                    await self.take(sub, merged.pack())
                continue
            self.conflicts.add(sub)
            if self.strategy == "theirs":
                self._plan(sub, sv)
        if self.conflicts and self.strategy is None:
            await self.refuse(self.conflicts)
        self.resolved = len(self.conflicts)
        await self._take_conflicted_whole()

    async def _take_conflicted_whole(self) -> None:
        """An inode with a key in conflict comes whole from the winning side: attributes,
        every chunk's slices, xattrs, symlink target (or its absence). Taken key by key,
        a file could get the winner's bytes with the loser's size, or a chunk of each."""
        inos = {keys.ino_of(s) for s in self.conflicts if not s.startswith(keys.DENTRY_PREFIX)}
        for ino in sorted(inos):
            for sub in await self._subs_of(ino):
                await self.take(sub, await self.val(self.winner, sub))

    async def refuse(self, subs, hint: str = "use --theirs or --ours"):
        pt, ps = Paths(self.kv, self.ct), Paths(self.kv, self.cs)
        paths = set()
        for sub in subs:
            p = await pt.of_sub(self.txn, sub)
            if p.startswith((b"?", b"<")):
                p = await ps.of_sub(self.txn, sub)
            paths.add(p.decode(errors="surrogateescape"))
        raise MergeConflict(sorted(paths), hint)

    async def settle(self) -> None:
        for _ in range(2 * len(self.dsubs) + 8):
            if not await self._round():
                return
        await self.refuse(self.dsubs[:20], "the merge did not settle; merge by hand")

    async def _round(self) -> bool:
        """Repair what this pass finds to repair (True: another pass follows, on the
        new plan), or set the derived fields. Repairs are made together, one pass for
        all (a pass per repair made a merge needing many of them quadratic); a repair
        only adds names, entries and keys of the inode it is about, and the counts
        are taken afresh by the next pass."""
        ents = [(sub, v) for sub, v in self.plan.items() if sub.startswith(keys.DENTRY_PREFIX)]
        if await self._keep_needed(ents):
            return True
        names, subdirs, placed = await self._count(ents)
        inos = set(names) | set(subdirs) | {keys.ino_of(s) for s in self.plan
                                             if not s.startswith(keys.DENTRY_PREFIX)}
        fixed, clashes, repaired = {}, [], False
        for ino in sorted(inos):
            mv, tv = await self.mval(keys.inode(ino)), await self.val(self.ct, keys.inode(ino))
            ti = Inode.unpack(tv) if tv else None
            if mv is None:
                named = (ti.nlink if not ti.is_dir() else ino != ROOT) + names[ino] > 0 \
                    if ti is not None else False
                if named or ti is not None and ti.is_dir() and not await self._empty(ino):
                    await self._restore(ino, self.ct)  # names or entries of the target use it
                    repaired = True
                elif await self._set_keys(ino):  # keys left of an inode the merge deletes
                    repaired = True
                continue
            mi = Inode.unpack(mv)
            sv = await self.val(self.cs, keys.inode(ino))
            side = self.ct if sv is None else self.cs
            if (sv is None) != (ti is None) and await self._set_keys(ino, side):
                repaired = True  # one side deleted it, the merge keeps it: whole, data too
                continue
            if mi.is_dir():
                n = (ti is not None and ino != ROOT) + names[ino]
                mi.nlink = (ti.nlink if ti else 2) + subdirs[ino]
                mi.parent = placed.get(ino, ti.parent if ti else 0)
            else:
                n = mi.nlink = (ti.nlink if ti else 0) + names[ino]
            if n == 0 and ino != ROOT and not (ti and ti.nlink == 0 and not names[ino]):
                # no name left (an inode the target holds open unlinked stays so)
                win = self.winner
                if win is not None and await self.val(win, keys.inode(ino)) is not None and \
                        await self._in_conflict(ino):
                    await self._restore(ino, win, names=True)
                elif not mi.is_dir() or await self._empty(ino):
                    await self._set_keys(ino)
                else:
                    await self.refuse([keys.inode(ino)], "cannot be merged automatically")
                repaired = True
                continue
            if mi.is_dir() and n > 1:
                clashes.append(ino)
            fixed[ino] = mi
        if repaired:
            return True
        if not clashes:
            clashes = await self._cycle(fixed, placed)
        if clashes:  # a directory in two places, or in itself
            if self.winner is None:
                await self.refuse([s for s in self.dsubs for ino in clashes
                                   if await self._names(s, ino)])
            for ino in clashes:
                for s in self.dsubs:
                    if await self._names(s, ino):
                        await self.take(s, await self.val(self.winner, s))
            self.resolved += 1
            return True
        for ino, mi in fixed.items():
            await self.take(keys.inode(ino), mi.pack())
        return False

    async def _keep_needed(self, ents) -> bool:
        """An entry needs its directory and its inode: restore those the merge deleted
        (True if any)."""
        restored = False
        for sub, v in ents:
            if v is None:
                continue
            for ino in (keys.ino_of(sub), unpack_dentry(v)[0]):
                if await self.mval(keys.inode(ino)) is None:
                    side = self.cs if v == await self.val(self.cs, sub) else self.ct
                    if await self.val(side, keys.inode(ino)) is None:
                        side = self.ct if side is self.cs else self.cs
                    await self._restore(ino, side)
                    restored = True
        return restored

    async def _count(self, ents):
        """Names and subdirectories gained (lost: negative) against the target, and the
        directory each moved directory is in now."""
        names, subdirs, placed = Counter(), Counter(), {}
        for sub, v in ents:
            parent = keys.ino_of(sub)
            for val, sign in ((await self.val(self.ct, sub), -1), (v, 1)):
                if val is not None:
                    ino, fmt = unpack_dentry(val)
                    names[ino] += sign
                    if stat.S_ISDIR(fmt):
                        subdirs[parent] += sign
                        if sign > 0:
                            placed[ino] = parent
        return names, subdirs, placed

    async def _cycle(self, fixed, placed) -> list[int]:
        """Directories the merge moved that no longer lead up to the root."""
        for ino in placed:
            seen, cur = [ino], ino
            while cur != ROOT:
                if cur in fixed:
                    cur = fixed[cur].parent
                else:
                    v = await self.mval(keys.inode(cur))
                    cur = Inode.unpack(v).parent if v else 0
                if cur in seen or not cur or len(seen) > 100000:
                    return [d for d in seen if d in placed]
                seen.append(cur)
        return []

    async def _names(self, sub: bytes, ino: int) -> bool:
        """Whether entry ``sub`` names ``ino`` in the merge or on the winning side."""
        vals = [await self.mval(sub)]
        if self.winner is not None:
            vals.append(await self.val(self.winner, sub))
        return any(v is not None and unpack_dentry(v)[0] == ino for v in vals)

    async def _in_conflict(self, ino: int) -> bool:
        """Whether a conflicting key is one of the inode's, or an entry naming it."""
        if self._conflict_inos is None:  # (conflicts are all found before settling)
            self._conflict_inos = set()
            for sub in self.conflicts:
                if not sub.startswith(keys.DENTRY_PREFIX):
                    self._conflict_inos.add(keys.ino_of(sub))
                    continue
                for chain in (self.cs, self.ct):
                    v = await self.val(chain, sub)
                    if v is not None:
                        self._conflict_inos.add(unpack_dentry(v)[0])
        return ino in self._conflict_inos

    async def _entries_naming(self, ino: int, side: Chain) -> list[bytes]:
        """The changed entries (``dsubs``) that name ``ino`` on ``side``."""
        index = self._naming.get(side.top)
        if index is None:
            index = self._naming[side.top] = {}
            for sub in self.dsubs:
                v = await self.val(side, sub)
                if v is not None:
                    index.setdefault(unpack_dentry(v)[0], []).append(sub)
        return index.get(ino, [])

    async def _subs_of(self, ino: int) -> set[bytes]:
        """The SUBs of an inode on either side and in the plan (entries not included)."""
        out = {keys.inode(ino), keys.symlink(ino)}
        for chain in (self.cs, self.ct):
            for prefix in (keys.chunk_prefix(ino), keys.xattr_prefix(ino)):
                out.update(sub for sub, _ in await lscan(self.txn, chain, prefix))
        out.update(s for s in self._planned.get(ino, ()) if not s.startswith(keys.DENTRY_PREFIX))
        return out

    async def _restore(self, ino: int, side: Chain, names: bool = False) -> None:
        """Take inode ``ino`` whole from ``side``, with the names it has there (``names``;
        a directory always: it needs its one name, entries of a file have their own)."""
        iv = await self.val(side, keys.inode(ino))
        await self.take(keys.inode(ino), iv)
        await self._set_keys(ino, side)
        if not names and not Inode.unpack(iv).is_dir():
            return
        for sub in await self._entries_naming(ino, side):
            v = await self.val(side, sub)
            mv = await self.mval(sub)
            if mv is not None and unpack_dentry(mv)[0] != ino:
                await self.refuse([sub], "a name was reused; merge by hand")
            await self.take(sub, v)

    async def _set_keys(self, ino: int, side: Chain | None = None) -> bool:
        """Make an inode's data, xattrs and symlink those of ``side``, or delete them and
        the inode (None); True if the plan changed."""
        before = self.changes
        for sub in await self._subs_of(ino):
            if side is None:
                await self.take(sub, None)
            elif not sub.startswith(keys.INODE_PREFIX):
                await self.take(sub, await self.val(side, sub))
        return self.changes != before

    async def _empty(self, ino: int) -> bool:
        p = keys.dir_prefix(ino)
        for sub, _ in await lscan(self.txn, self.ct, p):
            if await self.mval(sub) is not None:
                return False
        return not any(s.startswith(p) and self.plan.get(s) is not None
                       for s in self._planned.get(ino, ()))


async def _source_unchanged(txn, name: str, chain: Chain) -> None:
    """Busy unless snapshot ``name`` still names ``chain``'s top layer (read in the
    transaction: deleted meanwhile, its layer's hidden versions may be pruned)."""
    rec = await load_record(txn, keys.snapshot(name))
    if rec is None or rec["layer"] != chain.top:
        raise Busy(f"snapshot {name!r} changed during the merge; try again")


async def op_merge(kv, source: str, into: str, strategy: str | None = None,
                   progress=None) -> dict:
    """Merge tree ``source`` into branch ``into``; ``progress(done, total)`` is told of
    the changed keys compared (a bar's)."""
    if strategy not in (None, "theirs", "ours"):
        raise Invalid("strategy is theirs or ours")
    if source == into:
        raise Invalid("cannot merge a tree into itself")
    skind, cs = await tree_chain(kv, source)
    tkind, ct = await tree_chain(kv, into)
    if tkind != "branch":
        raise Invalid(f"{into!r} is a snapshot; merge into a branch")
    base, xs, xt = fork(cs, ct)
    if not xs:
        return {"result": "up to date", "applied": 0, "conflicts": []}
    target_changes = await changed_subs(kv, xt)
    if not target_changes:
        async def ff(txn):
            rec = await load_record(txn, keys.branch(into))
            if rec["head"] != ct.top:
                raise Busy(f"branch {into!r} changed during the merge; try again")
            if skind == "branch":
                srec = await load_record(txn, keys.branch(source))
                if srec is None or srec["head"] != cs.top:
                    raise Busy(f"branch {source!r} changed during the merge; try again")
                frozen = await freeze_head(txn, source, srec)
            else:
                await _source_unchanged(txn, source, cs)
                frozen = cs.top
            rec["head"] = await new_layer(txn, frozen)
            txn.put(keys.branch(into), json.dumps(rec).encode())
        touched = await changed_subs(kv, xs)
        await kv.transact(ff)
        await layer_gc.collect_layers(kv)
        return {"result": "fast-forward", "applied": 0, "conflicts": [],
                TOUCHED: (into, touched)}

    subs = sorted(await changed_subs(kv, xs))
    dsubs = sorted({s for s in subs if s.startswith(keys.DENTRY_PREFIX)} |
                   {s for s in target_changes if s.startswith(keys.DENTRY_PREFIX)})
    tchunks = sorted(s for s in target_changes if s.startswith(keys.CHUNK_PREFIX))

    async def three_way(txn):
        rec = await load_record(txn, keys.branch(into))
        if rec["head"] != ct.top:
            raise Busy(f"branch {into!r} changed during the merge; try again")
        if skind == "snapshot":  # (a branch's layers below its head stay as they are)
            await _source_unchanged(txn, source, cs)
        m = _Merge(txn, kv, cs, base, ct, strategy, dsubs)
        await m.by_key(subs, tchunks, progress)
        await m.settle()
        for sub, value in m.plan.items():
            if sub.startswith(keys.CHUNK_PREFIX):
                ino, idx = keys.chunk_of(sub)
                await put_chunk(txn, ct, ino, idx, unpack_slices(value) if value else [])
            elif value is None:
                await ldel(txn, ct, sub)
            else:
                await lput(txn, ct, sub, value)
        # record counts follow the merged records (chunks and xattrs merge key by key)
        planned = list(m.plan)
        for ino in sorted({keys.ino_of(s) for s in planned
                           if not s.startswith(keys.DENTRY_PREFIX)}):
            if await recount(txn, ct, ino):
                planned.append(keys.inode(ino))
        return planned, m.resolved
    plan, nconf = await kv.transact(three_way)
    if progress:
        progress(len(subs), len(subs))
    return {"result": "merged", "applied": len(plan), "conflicts_resolved": nconf,
            "strategy": strategy, TOUCHED: (into, set(plan))}
