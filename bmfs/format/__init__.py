"""On-disk formats that several floors share, as leaves that import nothing of bmfs
above them: fragment.py (the data client writes fragments; stores, nodes, fsck and
repair read them), revision.py (the volume format revision: mkfs, config, meta)."""
