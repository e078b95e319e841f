"""A volume: opening it (the composition root: metadata, transport, data client) and
administering it (repair, scrub, drain, devices, fsck, status, membership records,
the upkeep of a mount). Above the vfs, below fuse and the CLI."""
