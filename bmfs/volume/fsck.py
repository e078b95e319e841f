"""fsck: check a volume's metadata and fragments; name every problem found.

First every metadata record's checksum (bmfs/kv/seal.py), whatever its key, and the
engine's own store (SQLite: its quick check, ``full=True`` its integrity check); a
check below that meets a damaged record reports it and stops there. Then, per live
tree (every branch and snapshot): each entry points at an inode; every inode is
reachable; link counts match entries (files) and 2 + subdirectories (directories);
directories know their parent; slices point at stripes. Across trees:
each stripe's reference count equals the number of stored slice lists that mention
it; every fragment of an erasure-coded stripe is on its device with a valid header
(``full=True`` also verifies every block checksum); no device holds fragment files
no stripe owns. ``repair=True`` deletes leaked fragments and empties the GC queue,
after collecting the layers of deleted branches and snapshots still to collect.
"""
from __future__ import annotations

import json
import stat
from collections import Counter, defaultdict

from ..format import fragment as fr
from ..errors import DeviceError, MetaDamaged
from ..kv import seal
from ..meta import keys
from ..meta.layers import Chain, lscan, split
from ..format.records import (EC, NO_DEVICE, UNCOUNTED, Inode, Stripe, unpack_dentry,
                            unpack_slices)
from ..meta.namespace import ROOT
from ..vfs.gc import collect

RECORDS_PAGE = 1000  # records read at a time by check_records


async def live_trees(kv, views) -> list[tuple[str, Chain]]:
    trees = []
    for prefix, kind in ((keys.BRANCH_PREFIX, "branch"), (keys.SNAPSHOT_PREFIX, "snapshot")):
        for k, v in await kv.range(*keys.span(prefix)):
            name = keys.tree_name_of(k)
            rec = json.loads(v)
            top = rec["head"] if kind == "branch" else rec["layer"]
            trees.append((f"{kind} {name}", await views.chain_from(top, name if kind == "branch" else None)))
    return trees


async def check_tree(kv, label: str, chain: Chain, problems: list[str]) -> None:
    txn = kv.begin()
    inodes = {keys.ino_of(sub): Inode.unpack(v)
              for sub, v in await lscan(txn, chain, keys.INODE_PREFIX)}
    entries = await lscan(txn, chain, keys.DENTRY_PREFIX)
    names = Counter()
    subdirs = Counter()
    children = defaultdict(list)
    for sub, v in entries:
        parent, name = keys.dentry_of(sub)
        ino, fmt = unpack_dentry(v)
        children[parent].append(ino)
        if parent not in inodes:
            problems.append(f"{label}: entry {name!r} in missing directory {parent}")
        if ino not in inodes:
            problems.append(f"{label}: entry {name!r} in directory {parent} points at "
                            f"missing inode {ino}")
            continue
        names[ino] += 1
        if stat.S_IFMT(inodes[ino].mode) != fmt:
            problems.append(f"{label}: entry {name!r} type differs from inode {ino}")
        if inodes[ino].is_dir():
            subdirs[parent] += 1
            if inodes[ino].parent != parent:
                problems.append(f"{label}: directory {ino} records parent "
                                f"{inodes[ino].parent}, is in {parent}")
    orphans = {keys.orphan_of(k)[1] for k, _ in await kv.range(*keys.span(keys.ORPHAN_PREFIX))}
    for ino, i in inodes.items():
        if ino == ROOT:
            continue
        if names[ino] == 0 and not (ino in orphans and i.nlink == 0):
            problems.append(f"{label}: inode {ino} is not in any directory")
        if i.is_dir():
            if names[ino] > 1:
                problems.append(f"{label}: directory {ino} has {names[ino]} names")
            if i.nlink != 2 + subdirs[ino]:
                problems.append(f"{label}: directory {ino} nlink {i.nlink}, expected "
                                f"{2 + subdirs[ino]}")
        elif i.nlink != names[ino]:
            problems.append(f"{label}: inode {ino} nlink {i.nlink}, has {names[ino]} names")
    if ROOT not in inodes:
        problems.append(f"{label}: the root directory is missing")
    elif inodes[ROOT].nlink != 2 + subdirs[ROOT]:
        problems.append(f"{label}: root nlink {inodes[ROOT].nlink}, expected {2 + subdirs[ROOT]}")
    have = {"chunks": Counter(), "xattrs": Counter()}
    for sub, _ in await lscan(txn, chain, keys.XATTR_PREFIX):
        have["xattrs"][keys.ino_of(sub)] += 1
    for sub, v in await lscan(txn, chain, keys.CHUNK_PREFIX):
        ino, index = keys.chunk_of(sub)
        if ino not in inodes:
            problems.append(f"{label}: slices of missing inode {ino}")
            continue
        have["chunks"][ino] += 1
        # writes grow the size with the data and truncates cut the slices with it, so
        # data past the size is a file put together from two states (data short of
        # the size is not: a sparse file looks the same)
        end = max((s.pos + s.length for s in unpack_slices(v) if s.sid and s.length),
                  default=0)
        if end and index * keys.CHUNK_SIZE + end > inodes[ino].size:
            problems.append(f"{label}: inode {ino} has data past its size "
                            f"{inodes[ino].size}")
    # (reads trust the counts: a record missing that its inode counts is EIO)
    for ino, i in inodes.items():
        for field, n in have.items():
            want = getattr(i, field)
            if want != UNCOUNTED and want != n[ino]:
                problems.append(f"{label}: inode {ino} counts {want} {field[:-1]} "
                                f"records, has {n[ino]}")


async def check_refs(kv, live_layers: set[int], problems: list[str],
                     collecting: bool = False) -> dict[int, Stripe]:
    """Reference counts against the slice lists that hold them. ``collecting``: deleted
    trees' layers are still to collect (v/collect-layers): their slice lists still
    hold their references, and are not a problem."""
    counts = Counter()
    for k, v in await kv.range(*keys.span(keys.CHUNK_PREFIX)):
        lay = split(k)[1]
        if lay not in live_layers and not collecting:
            problems.append(f"slice list {k!r} belongs to a layer no tree uses")
            continue
        if v[:1] == keys.LIVE:
            for sid in {s.sid for s in unpack_slices(v[1:])} - {0}:
                counts[sid] += 1
    stripes = {}
    for k, v in await kv.range(*keys.span(keys.STRIPE_PREFIX)):
        sid = keys.stripe_of(k)
        st = Stripe.unpack(v)
        stripes[sid] = st
        if st.refs != counts.get(sid, 0):
            problems.append(f"stripe {sid}: reference count {st.refs}, "
                            f"referenced {counts.get(sid, 0)} times")
    for sid in counts:
        if sid not in stripes:
            problems.append(f"stripe {sid} is referenced but has no record")
    return stripes


async def check_fragments(volume, stripes: dict[int, Stripe], full: bool, repair: bool,
                          problems: list[str], notes: list[str], progress=None) -> None:
    data = volume.data
    expected = defaultdict(set)
    queued = {keys.stripe_of(k): Stripe.unpack(v)
              for k, v in await volume.kv.range(*keys.span(keys.GARBAGE_PREFIX))}
    damaged = {keys.damage_of(k) for k, _ in await volume.kv.range(*keys.span(keys.DAMAGE_PREFIX))}
    for sid, st in list(stripes.items()) + list(queued.items()):
        if st.kind != EC:
            continue
        for i, dev in enumerate(st.devices):
            if dev != NO_DEVICE:
                expected[dev].add(fr.fragment_name(sid, i))
    for n, (sid, st) in enumerate(stripes.items(), 1):
        if progress and (n % 64 == 0 or n == len(stripes)):
            progress(n, len(stripes))
        if st.kind != EC:
            continue
        for i, dev in enumerate(st.devices):
            if dev == NO_DEVICE:
                if (sid, i) not in damaged:
                    problems.append(f"stripe {sid} fragment {i} was never stored and is not "
                                    f"queued for repair")
                else:
                    notes.append(f"stripe {sid} fragment {i} awaits repair")
                continue
            try:
                if full:
                    await data._read_fragment(sid, st, i)
                else:
                    geo = fr.geometry(st.frag_version, st.frag_len)
                    (head,) = await volume.transport.read(dev, fr.fragment_name(sid, i),
                                                          [(0, geo.table_end)])
                    fr.parse_header(head, sid, i, st.frag_len, geo.version)
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                problems.append(f"stripe {sid} fragment {i} on device {dev}: {e}")
    for dev in sorted(volume.device_paths):
        if dev in volume.removed:  # forgotten: it holds nothing, and may be gone
            continue
        try:
            names = set(await volume.transport.names(dev))
        except DeviceError as e:
            problems.append(f"device {dev}: {e}")
            continue
        leaked = names - expected[dev]
        if leaked:
            if repair:
                for n in leaked:
                    await volume.transport.delete(dev, n)
                notes.append(f"device {dev}: deleted {len(leaked)} leaked fragment files")
            else:
                problems.append(f"device {dev}: {len(leaked)} fragment files no stripe owns, "
                                f"e.g. {sorted(leaked)[0]}")
    if queued:
        if repair:
            await collect(volume, limit=len(queued) + 1)
            notes.append(f"collected {len(queued)} queued stripes")
        else:
            notes.append(f"{len(queued)} stripes queued for garbage collection")


async def check_records(kv, full: bool, problems: list[str], notes: list[str]) -> None:
    """Every record's checksum, and the engine's check of its store."""
    problems.extend(kv.check_store(full))
    if not kv.sealed:
        notes.append("the volume's records carry no checksums (an older format revision: "
                     "a mount or fsck --repair upgrades it)")
        return
    start, bad = b"", 0
    while True:
        rows = await kv.raw_range(start, b"", RECORDS_PAGE)
        for k, v in rows:
            if k == keys.SEALING:
                continue  # (unsealed by design: see _upgrade in volume.py)
            if not seal.is_sealed(k, v):
                bad += 1
                problems.append(f"metadata record {k!r} fails its checksum")
        if len(rows) < RECORDS_PAGE:
            break
        start = rows[-1][0] + b"\0"
    if bad:
        notes.append(f"{bad} damaged metadata records: whatever reads one gets EIO "
                     "(fsck --repair does not mend them)")


async def fsck_records(path: str, full: bool) -> tuple[list[str], list[str]]:
    """The record checks alone, for a volume that cannot be opened because a record
    it needs to open (settings aside: those are refused by name) is damaged."""
    from ..kv import open_kv
    from .volume import read_settings, read_volume_file
    info = read_volume_file(path)
    kv = await open_kv(info["meta"])
    try:
        await read_settings(kv, path, info["meta"])
        problems: list[str] = []
        notes = ["the volume cannot be opened: only its records were checked"]
        await check_records(kv, full, problems, notes)
        return problems, notes
    finally:
        await kv.aclose()


async def fsck(volume, full: bool = False, repair: bool = False,
               progress=None) -> tuple[list[str], list[str]]:
    """Returns (problems, notes). The volume is consistent when problems is empty.
    ``progress(done, total)``: told of the collection of deleted trees (with
    ``repair``), then of the stripes whose fragments are checked."""
    problems: list[str] = []
    notes: list[str] = []
    try:
        await check_records(volume.kv, full, problems, notes)
    except MetaDamaged as e:
        problems.append(str(e))
    try:
        await _check_namespace(volume, full, repair, problems, notes, progress)
    except MetaDamaged as e:
        problems.append(f"checks stopped at a damaged record: {e}")
    return problems, notes


async def _check_namespace(volume, full: bool, repair: bool, problems: list[str],
                           notes: list[str], progress=None) -> None:
    from ..vfs.views import Views
    views = Views(volume.kv)
    collecting = await volume.kv.get(keys.COLLECT_LAYERS) is not None
    if collecting and repair:
        from ..meta.branches import collect_pending
        freed = await collect_pending(volume.kv, progress)
        notes.append(f"collected {freed} layers of deleted branches and snapshots")
        collecting = await volume.kv.get(keys.COLLECT_LAYERS) is not None
    if collecting:
        notes.append("deleted branches or snapshots are still to collect: the next mount "
                     "(or fsck --repair) frees what only they used")
    trees = await live_trees(volume.kv, views)
    live = set()
    for label, chain in trees:
        live.update(chain.layers)
        await check_tree(volume.kv, label, chain, problems)
    stripes = await check_refs(volume.kv, live, problems, collecting)
    await check_fragments(volume, stripes, full, repair, problems, notes, progress)
