"""The volume format revision: the one mkfs writes (``v/settings``), and those this
bmfs opens.

- 1: the first.
- 2: stripe records may name fragments of revision 2 (their fourth byte, see
  format/fragment.py), which bmfs of revision 1 would take for corrupt (and,
  rewriting such a record, reset to 1, which makes the stripe unreadable).
- 3: every value carries a checksum of its key and itself (kv/seal.py), which bmfs
  of revisions 1 and 2 would take for part of the value.

Opening an older volume for writing (a mount, repair, fsck --repair) upgrades it to 3
first (volume/volume.py), so older bmfs refuses it from then on. The keyspace
(meta/keys.py) and the records (meta/records.py) are those of FORMAT_REVISION.
"""
FORMAT_REVISION = 3
OPENS_REVISIONS = (1, 2, 3)
SEALED_REVISION = 3  # the first revision whose values carry checksums
