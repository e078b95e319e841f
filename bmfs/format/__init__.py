"""On-disk formats that several floors share, as leaves that import nothing of bmfs
above them: fragment.py (the data client writes fragments; stores, nodes, fsck and
repair read them), records.py (the binary metadata records: inodes, directory
entries, slices, stripes; the namespace writes them, the data client, the vfs,
fsck and repair read stripes and inodes), revision.py (the volume format revision:
mkfs, config, meta)."""
