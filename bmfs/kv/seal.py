"""Checksums of stored values: every value ends in a crc32c of its key and itself.

A sealed value is ``payload | u32 crc32c(key + payload)`` (little-endian). The key is
part of the sum, so a value copied or moved under another key, or a key whose bytes
changed on disk, fails the check as surely as a changed payload does. The engines
store sealed values as they are; the KV interface (bmfs/kv/__init__.py) seals on
``put`` and checks on every read, so the layers above see payloads only.

Caveats: a checksum cannot tell that a whole record vanished, or that an older
version of a record (sealed under the same key) came back; and a key changed so that
it no longer falls in the range a reader scans is found only by a scan of every
record (``bmfs fsck``), not by that reader.

Volumes of format revisions before keys.SEALED_REVISION hold unsealed values:
``seal_all`` rewrites them in bounded transactions, resumably (docs/formats.md).
"""
from __future__ import annotations

import random
import struct

import trio
from crc32c import crc32c

from ..errors import Conflict, MetaDamaged, Unavailable

_CRC = struct.Struct("<I")
SEAL_BYTES = _CRC.size
_RESIDUE = 0x48674BC7  # crc32c of any data followed by its own crc32c, little-endian
# bounds of one upgrade transaction (etcd's default --max-txn-ops is 128: a row costs
# a compare and a put) and of its bytes (--max-request-bytes 1.5 MiB)
BATCH_KEYS = 50
BATCH_BYTES = 512 << 10


def seal(key: bytes, value) -> bytes:
    v = bytes(value)
    return v + _CRC.pack(crc32c(v, crc32c(key)))


def is_sealed(key: bytes, raw: bytes) -> bool:
    """Whether ``raw`` is a value sealed under ``key``: the crc32c of key, payload and
    the payload's little-endian crc32c is the CRC's fixed residue (one pass, no copy)."""
    return len(raw) >= SEAL_BYTES and crc32c(raw, crc32c(key)) == _RESIDUE


def unseal(key: bytes, raw: bytes) -> bytes:
    """The payload of sealed value ``raw`` of ``key``.

    Raises:
        MetaDamaged: the checksum does not match.
    """
    if crc32c(raw, crc32c(key)) != _RESIDUE or len(raw) < SEAL_BYTES:
        raise damaged(key)
    return raw[:-SEAL_BYTES]


def damaged(key: bytes) -> MetaDamaged:
    # (not logged here: the operation that fails says it, in the mount's log through
    # fuse/ops.py, on stderr as one line in a command)
    return MetaDamaged(f"damaged metadata record {key!r}: it fails its checksum", key)


async def seal_all(kv, progress: bytes, guard: bytes, drop: tuple[bytes, ...] = ()) -> int:
    """Seal every value of an unsealed store (a format upgrade); returns how many
    records this call rewrote. ``guard`` (the volume settings) is left as it is, for
    ``finish`` to seal; each transaction compares its revision, so once another
    process finished, this one stops. ``progress`` holds the last key sealed, so an
    upgrade cut short resumes where it stopped. Keys under ``drop`` (records on etcd
    leases, which a rewrite would detach from their lease) are deleted instead.

    Raises:
        Unavailable: a batch kept conflicting.
    """
    done = 0
    while True:
        for attempt in range(64):
            guard_raw, guard_rev = await kv._get_fresh(guard)
            if guard_raw is None or is_sealed(guard, guard_raw):
                return done  # finished by another process
            cur, cur_rev = await kv._get_fresh(progress)
            rows = await kv._range(cur + b"\0" if cur else b"", b"", BATCH_KEYS)
            size, n = 0, 0
            for _, v, _ in rows:
                size += len(v)
                n += 1
                if size > BATCH_BYTES:
                    break
            rows = rows[:n]
            if not rows:
                return done
            writes: dict[bytes, bytes | None] = {}
            for k, v, _ in rows:
                if k in (guard, progress):
                    continue
                writes[k] = None if k.startswith(drop) else seal(k, v)
            writes[progress] = rows[-1][0]
            reads = {k: rev for k, _, rev in rows}
            reads.update({progress: cur_rev, guard: guard_rev})
            try:
                await kv._commit(reads, writes)
                done += len(writes) - 1
                break
            except Conflict:
                await trio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        else:
            raise Unavailable("sealing the metadata records kept conflicting")


async def finish(kv, progress: bytes, guard: bytes, value: bytes) -> bool:
    """End an upgrade: ``guard`` becomes ``value`` sealed, the progress record goes.
    False if another process finished it first."""
    for attempt in range(64):
        guard_raw, guard_rev = await kv._get_fresh(guard)
        if guard_raw is None or is_sealed(guard, guard_raw):
            return False
        _, cur_rev = await kv._get_fresh(progress)
        try:
            await kv._commit({guard: guard_rev, progress: cur_rev},
                             {guard: seal(guard, value), progress: None})
            return True
        except Conflict:
            await trio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
    raise Unavailable("sealing the volume settings kept conflicting")
