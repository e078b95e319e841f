"""The whole metadata keyspace, in one place (docs/keyspace.md renders this table).

Layered keys (the namespace of a branch or snapshot) are ``SUB @ LAYER`` where
``LAYER`` is 8 hex digits; a tree is a chain of layers, top first, and a lookup takes
the first version found along the chain (see layers.py). Values of layered keys start
with a tag byte: ``\\x01`` + payload for a value, ``\\x00`` alone for a tombstone that
hides older layers' versions.

Every value below is stored with a checksum of its key and itself after it (format
revision 3, bmfs/kv/seal.py); the table names the value the layers above see.

=====================================  ===============================================
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
                                       claims it (vfs/files.py, docs/etcd.md). A
                                       record whose layer was frozen since (a
                                       snapshot or branch taken) stays when the
                                       mounted tree frees its copy: it goes with
                                       the layer (branches.collect_layers), or with
                                       the inode's version once no tree can see it
                                       (branches.prune_shadowed)
m/<mount id>                           JSON record of a running mount (host, pid,
                                       mount point), attached to an etcd lease: it
                                       vanishes within seconds of the mount's death
=====================================  ===============================================
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
# records on etcd leases, which an upgrade deletes instead of sealing (their owners
# put them again: a mount's m/ record, a storage node's membership record)
LEASED_PREFIXES = (b"m/", b"v/node/")


def counter(name: str) -> bytes:
    return b"v/ctr/" + name.encode()


def device(dev: int) -> bytes:
    return b"v/dev/%04x" % dev


DEVICE_PREFIX = b"v/dev/"


def layer(lay: int) -> bytes:
    return b"y/%08x" % lay


def branch(name: str) -> bytes:
    return b"b/" + name.encode()


def snapshot(name: str) -> bytes:
    return b"n/" + name.encode()


def stripe(sid: int) -> bytes:
    return b"t/%016x" % sid


def garbage(sid: int) -> bytes:
    return b"g/%016x" % sid


def damage(sid: int, index: int) -> bytes:
    return b"h/%016x/%02x" % (sid, index)


def orphan(lay: int, ino: int) -> bytes:
    return b"o/%08x/%016x" % (lay, ino)


def mount(mount_id: str) -> bytes:
    return b"m/" + mount_id.encode()


# -- layered sub-keys (suffix @LAYER added by layers.py) -------------------------------
def inode(ino: int) -> bytes:
    return b"i/%016x" % ino


def inode_of(sub: bytes) -> int | None:
    """The inode number of inode sub-key ``sub`` (``inode(ino)``); None for any other."""
    if len(sub) != 18 or not sub.startswith(b"i/"):
        return None
    try:
        return int(sub[2:], 16)
    except ValueError:
        return None


def dir_prefix(parent: int) -> bytes:
    return b"d/%016x/" % parent


def dentry(parent: int, name: bytes) -> bytes:
    return b"d/%016x/" % parent + name


def chunk_prefix(ino: int) -> bytes:
    return b"c/%016x/" % ino


def chunk(ino: int, index: int) -> bytes:
    return b"c/%016x/%010x" % (ino, index)


def xattr_prefix(ino: int) -> bytes:
    return b"x/%016x/" % ino


def xattr(ino: int, name: bytes) -> bytes:
    return b"x/%016x/" % ino + name


def symlink(ino: int) -> bytes:
    return b"l/%016x" % ino


LAYERED_PREFIXES = (b"i/", b"d/", b"c/", b"x/", b"l/")
