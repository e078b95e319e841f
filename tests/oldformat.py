"""Volumes in the encodings of earlier format revisions, for upgrade tests.

Revisions 1 and 2 stored every metadata value as its payload alone; revision 3 appends
a crc32c of key and payload (bmfs/kv/seal.py); revision 4 adds two counts to the end
of every inode record (records.Inode). So a volume of revision 4, cleanly unmounted
(its redo log empty), becomes the volume an earlier bmfs would have written by cutting
the counts off every inode, and below revision 3 the checksum off every value, in
meta.db, and writing the earlier revision number into the settings.
"""
from __future__ import annotations

import json
import os
import sqlite3

from bmfs.kv.seal import SEAL_BYTES, is_sealed, seal
from bmfs.meta import keys
from bmfs.format.records import Inode

_INODE_BYTES = len(Inode(0).pack())
_COUNTS_BYTES = 8  # revision 4's chunks and xattrs counts, two u32


def _previous(k: bytes, v: bytes, fmt: int) -> bytes:
    """Sealed value ``v`` of key ``k`` as revision ``fmt`` stored it."""
    assert is_sealed(k, v), k
    raw = v[:-SEAL_BYTES]
    if k == keys.SETTINGS:
        d = json.loads(raw)
        d["format"] = fmt
        raw = json.dumps(d).encode()
    elif k.startswith(keys.INODE_PREFIX) and raw[:1] == keys.LIVE and fmt < 4:
        assert len(raw) == 1 + _INODE_BYTES, k
        raw = raw[:-_COUNTS_BYTES]  # (a tombstone is the tag alone)
    return seal(k, raw) if fmt >= keys.SEALED_REVISION else raw


def to_previous_format(volume, fmt: int = 2) -> int:
    """Rewrite the SQLite metadata of ``volume`` (not mounted) as revision ``fmt``
    wrote it; returns the number of records."""
    path = os.path.join(volume, "meta.db")
    assert os.path.getsize(path + "-redo") == 0, "the volume was not unmounted cleanly"
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT k, v FROM kv").fetchall()
        for k, v in rows:
            db.execute("UPDATE kv SET v=? WHERE k=?", (_previous(k, v, fmt), k))
        db.commit()
    finally:
        db.close()
    return len(rows)


def stored_format(volume) -> tuple[int, bool]:
    """The format revision in the settings of ``volume`` and whether the record is
    sealed (read with sqlite3: no bmfs code in between)."""
    db = sqlite3.connect(os.path.join(volume, "meta.db"))
    try:
        (v,) = db.execute("SELECT v FROM kv WHERE k=?", (keys.SETTINGS,)).fetchone()
    finally:
        db.close()
    sealed = is_sealed(keys.SETTINGS, v)
    return json.loads(v[:-SEAL_BYTES] if sealed else v)["format"], sealed


def etcd_to_previous_format(cluster, fmt: int = 2) -> int:
    """The same for a volume whose metadata is in etcd (no mount of it running),
    through the JSON gateway of the EtcdCluster's first member (with its credentials);
    the engine's private keys (four 0xFF bytes first) are left alone. Returns the
    number of records."""
    import base64

    def b64(b: bytes) -> str:
        return base64.b64encode(b).decode()
    every = b64(b"\0")
    kvs = cluster.post(0, "/v3/kv/range", {"key": every, "range_end": every}).get("kvs", [])
    n = 0
    for r in kvs:
        k, v = base64.b64decode(r["key"]), base64.b64decode(r.get("value", ""))
        if k.startswith(b"\xff\xff\xff\xff"):
            continue
        cluster.post(0, "/v3/kv/put", {"key": b64(k), "value": b64(_previous(k, v, fmt))})
        n += 1
    return n
