"""The volume format revision: the one mkfs writes (``v/settings``), and those this
bmfs opens.

- 1: the first.
- 2: stripe records may name fragments of revision 2 (their fourth byte, see
  format/fragment.py), which bmfs of revision 1 would take for corrupt (and,
  rewriting such a record, reset to 1, which makes the stripe unreadable).
- 3: every value carries a checksum of its key and itself (kv/seal.py), which bmfs
  of revisions 1 and 2 would take for part of the value.
- 4: an inode record counts its file's chunk and xattr records (records.Inode), so a
  read that finds one missing which the inode counts is EIO, not a hole or a missing
  attribute; bmfs of revision 3 cannot read the longer inode records. Inodes of
  revision 3 read as uncounted (nothing checked against them); files made since are
  counted, and an older file's chunks once it is truncated to zero (a rewrite).

Opening an older volume for writing (a mount, repair, fsck --repair) upgrades it to 4
first (volume/volume.py), so older bmfs refuses it from then on. The keyspace
(meta/keys.py) and the records (format/records.py) are those of FORMAT_REVISION.
"""
FORMAT_REVISION = 4
OPENS_REVISIONS = (1, 2, 3, 4)
SEALED_REVISION = 3  # the first revision whose values carry checksums
