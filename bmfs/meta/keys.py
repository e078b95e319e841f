"""The whole metadata keyspace, in one place: every key's builder and parser.

Layered keys (the namespace of a branch or snapshot) are ``SUB @ LAYER`` where
``LAYER`` is 8 hex digits; a tree is a chain of layers, top first, and a lookup takes
the first version found along the chain (see layers.py). Values of layered keys start
with a tag byte: ``\\x01`` + payload for a value, ``\\x00`` alone for a tombstone that
hides older layers' versions.

key                                    value
=====================================  ===============================================
v/settings                             JSON volume settings: format revision, uuid,
                                       k, m, fragment size, inline limit, admin
                                       group (optional: who manages branches)
v/ctr/<name>                           next free number (ino, stripe, layer) in decimal
v/sealing                              while a volume of revision 1 or 2 is upgraded to 3:
                                       the last key sealed so far (unsealed)
v/dev/<dev:04x>                        JSON device record: path, uuid, node
y/<layer:08x>                          JSON layer record: parent layer, frozen flag
b/<branch name>                        JSON branch: head layer, created, from
n/<snapshot name>                      JSON snapshot: layer, created, branch
t/<stripe:016x>                        stripe record (records.Stripe): refs, length,
                                       inline data or fragment size, revision +
                                       device per index
g/<stripe:016x>                        stripe whose fragments are to be deleted (GC queue)
h/<stripe:016x>/<index:02x>            fragment known missing/corrupt, awaiting repair
i/<ino:016x>@L                         inode attributes (records.Inode)
d/<parent ino:016x>/<name>@L           directory entry: child ino and type
c/<ino:016x>/<chunk index:010x>@L      slice list of one 64 MiB chunk (records.Slices)
x/<ino:016x>/<xattr name>@L            extended attribute value
l/<ino:016x>@L                         symlink target
o/<layer:08x>/<ino:016x>               inode whose last name went while it may be
                                       open: the ids of the mounts holding it, comma-
                                       separated (freed on the last release, or once no
                                       m/ key of those ids is left); on etcd volumes
                                       with BMFS_ORPHAN_GRACE set (opt-in), also
                                       "?<mount id>": unclaimed, freed by a sweep after
                                       the grace unless a mount that holds it open
                                       claims it (vfs/orphans.py, docs/etcd.md). A
                                       record whose layer was frozen since (a
                                       snapshot or branch taken) stays when the
                                       mounted tree frees its copy: it goes with
                                       the layer (layer_gc.collect_layers), or with
                                       the inode's version once no tree can see it
                                       (layer_gc.prune_shadowed)
m/<mount id>                           JSON record of a running mount (host, pid,
                                       mount point), attached to an etcd lease: it
                                       vanishes within seconds of the mount's death
=====================================  ===============================================
=======
Every value is stored with a checksum of its key and itself after it (format revision
3, bmfs/kv/seal.py). KEYSPACE below lists every key; docs/keyspace.md renders it with
the values (tests/test_t0_keys.py checks that they agree, and that no other module
spells a key prefix).
"""
# the revision of this keyspace, and those opened (keys.FORMAT_REVISION to the vfs)
from ..format.revision import FORMAT_REVISION, OPENS_REVISIONS, SEALED_REVISION  # noqa: F401

CHUNK_SIZE = 64 << 20
LIVE = b"\x01"
TOMBSTONE = b"\x00"

SETTINGS = b"v/settings"
# present while branches or snapshots deleted by a mount have layers still to collect
# (branches.collect_pending): a count of such deletes, so a collection that started
# before the latest one does not clear it
COLLECT_LAYERS = b"v/collect-layers"
# while an upgrade to SEALED_REVISION runs: the last key sealed (bmfs/kv/seal.py)
SEALING = b"v/sealing"
# present while a single-owner volume is mounted (vfs/gc.py)
MOUNTED = b"v/mounted"


def span(prefix: bytes) -> tuple[bytes, bytes]:
    """The range (start, end) of the keys under ``prefix``, a prefix ending in "/"."""
    return prefix, prefix[:-1] + b"0"


COUNTER_PREFIX = b"v/ctr/"


def counter(name: str) -> bytes:
    return COUNTER_PREFIX + name.encode()


DEVICE_PREFIX = b"v/dev/"


def device(dev: int) -> bytes:
    return b"v/dev/%04x" % dev


def device_of(key: bytes) -> int:
    return int(key[len(DEVICE_PREFIX):], 16)


NODE_PREFIX = b"v/node/"


def node(name: str) -> bytes:
    return NODE_PREFIX + name.encode()


def node_of(key: bytes) -> str:
    return key[len(NODE_PREFIX):].decode()


LAYER_PREFIX = b"y/"


def layer(lay: int) -> bytes:
    return b"y/%08x" % lay


def layer_of(key: bytes) -> int:
    return int(key[2:], 16)


BRANCH_PREFIX = b"b/"
SNAPSHOT_PREFIX = b"n/"


def branch(name: str) -> bytes:
    return BRANCH_PREFIX + name.encode()


def snapshot(name: str) -> bytes:
    return SNAPSHOT_PREFIX + name.encode()


def tree_name_of(key: bytes) -> str:
    """The name in a branch or snapshot key."""
    return key[2:].decode()


STRIPE_PREFIX = b"t/"
GARBAGE_PREFIX = b"g/"


def stripe(sid: int) -> bytes:
    return b"t/%016x" % sid


def garbage(sid: int) -> bytes:
    return b"g/%016x" % sid


def stripe_of(key: bytes) -> int:
    """The stripe id in a stripe or garbage (GC queue) key."""
    return int(key[2:], 16)


DAMAGE_PREFIX = b"h/"


def damage(sid: int, index: int) -> bytes:
    return b"h/%016x/%02x" % (sid, index)


def damage_prefix(sid: int) -> bytes:
    return b"h/%016x/" % sid


def damage_of(key: bytes) -> tuple[int, int]:
    """(stripe id, fragment index) of a damage key."""
    return int(key[2:18], 16), int(key[19:], 16)


ORPHAN_PREFIX = b"o/"


def orphan(lay: int, ino: int) -> bytes:
    return b"o/%08x/%016x" % (lay, ino)


def orphan_prefix(lay: int) -> bytes:
    return b"o/%08x/" % lay


def orphan_of(key: bytes) -> tuple[int, int]:
    """(layer, ino) of an orphan key."""
    lay, ino = key[2:].split(b"/")
    return int(lay, 16), int(ino, 16)


MOUNT_PREFIX = b"m/"


def mount(mount_id: str) -> bytes:
    return MOUNT_PREFIX + mount_id.encode()


def mount_id_of(key: bytes) -> str:
    return key[len(MOUNT_PREFIX):].decode(errors="replace")


# records on etcd leases, which an upgrade deletes instead of sealing (their owners
# put them again: a mount's m/ record, a storage node's membership record)
LEASED_PREFIXES = (MOUNT_PREFIX, NODE_PREFIX)


# -- layered sub-keys (suffix @LAYER added by layers.py) -------------------------------
# Each parser below takes a sub-key with or without its @LAYER suffix.
INODE_PREFIX = b"i/"
DENTRY_PREFIX = b"d/"
CHUNK_PREFIX = b"c/"
XATTR_PREFIX = b"x/"
SYMLINK_PREFIX = b"l/"
LAYERED_PREFIXES = (INODE_PREFIX, DENTRY_PREFIX, CHUNK_PREFIX, XATTR_PREFIX, SYMLINK_PREFIX)


def kind(key: bytes) -> bytes:
    """The prefix naming which table ``key`` is in (``b"d/"`` for a dentry, ...)."""
    return key[:2]


def ino_of(sub: bytes) -> int:
    """The inode a layered sub-key is about: its own for i/ c/ x/ l/, the directory's
    for d/."""
    return int(sub[2:18], 16)


def inode(ino: int) -> bytes:
    return b"i/%016x" % ino


def inode_of(sub: bytes) -> int | None:
    """The inode number of inode sub-key ``sub`` (``inode(ino)``); None for any other."""
    if len(sub) != 18 or not sub.startswith(INODE_PREFIX):
        return None
    try:
        return int(sub[2:], 16)
    except ValueError:
        return None


def dir_prefix(parent: int) -> bytes:
    return b"d/%016x/" % parent


def dentry(parent: int, name: bytes) -> bytes:
    return b"d/%016x/" % parent + name


def dentry_of(sub: bytes) -> tuple[int, bytes]:
    """(parent ino, name) of a dentry sub-key (without its @LAYER)."""
    return int(sub[2:18], 16), sub[19:]


def chunk_prefix(ino: int) -> bytes:
    return b"c/%016x/" % ino


def chunk(ino: int, index: int) -> bytes:
    return b"c/%016x/%010x" % (ino, index)


def chunk_of(sub: bytes) -> tuple[int, int]:
    """(ino, chunk index) of a chunk sub-key (without its @LAYER)."""
    return int(sub[2:18], 16), int(sub[19:], 16)


def xattr_prefix(ino: int) -> bytes:
    return b"x/%016x/" % ino


def xattr(ino: int, name: bytes) -> bytes:
    return b"x/%016x/" % ino + name


def xattr_name_of(sub: bytes) -> bytes:
    """The attribute name of an xattr sub-key (without its @LAYER)."""
    return sub[19:]


def symlink(ino: int) -> bytes:
    return b"l/%016x" % ino


# Every key: (its prefix, or the whole key; the builder; what it holds). The table in
# docs/keyspace.md has one row for each, with its value's format.
KEYSPACE = (
    (SETTINGS, None, "volume settings"),
    (COUNTER_PREFIX, counter, "next free number of a kind (ino, stripe, layer)"),
    (SEALING, None, "the last key sealed while an upgrade to revision 3 runs"),
    (COLLECT_LAYERS, None, "deleted trees whose layers are still to collect"),
    (MOUNTED, None, "present while a single-owner volume is mounted"),
    (DEVICE_PREFIX, device, "device record"),
    (NODE_PREFIX, node, "storage node membership record (leased)"),
    (LAYER_PREFIX, layer, "layer record"),
    (BRANCH_PREFIX, branch, "branch"),
    (SNAPSHOT_PREFIX, snapshot, "snapshot"),
    (STRIPE_PREFIX, stripe, "stripe record"),
    (GARBAGE_PREFIX, garbage, "stripe whose fragments are to be deleted"),
    (DAMAGE_PREFIX, damage, "fragment awaiting repair"),
    (INODE_PREFIX, inode, "inode attributes (layered)"),
    (DENTRY_PREFIX, dentry, "directory entry (layered)"),
    (CHUNK_PREFIX, chunk, "slice list of one chunk (layered)"),
    (XATTR_PREFIX, xattr, "extended attribute (layered)"),
    (SYMLINK_PREFIX, symlink, "symlink target (layered)"),
    (ORPHAN_PREFIX, orphan, "inode unlinked while it may be open"),
    (MOUNT_PREFIX, mount, "running mount (leased)"),
)
