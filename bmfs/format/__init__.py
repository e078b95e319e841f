"""On-device formats that every floor shares: leaves, importing nothing of bmfs above
them (the data client writes fragments; stores, nodes, fsck and repair read them)."""
