"""bmfs: an erasure-coded POSIX filesystem with branches and typed views.

``bmfs.mmap(path, Type)``, ``bmfs.mutable_mmap`` and ``bmfs.records`` are the typed
views (bmfs/typed/); they are imported on first use so the mount daemon and the CLI
do not load numpy and protobuf. ``bmfs.connect`` opens a volume in this process, no
mount needed (bmfs/client/, docs/client.md).
"""
_TYPED = ("mmap", "mutable_mmap", "records", "get_type", "set_type")


def __getattr__(name):
    if name == "connect":  # the direct client (bmfs/client/): no mount needed
        from .client import connect
        return connect
    if name in _TYPED:
        from . import typed
        return getattr(typed, name)
    raise AttributeError(f"module 'bmfs' has no attribute {name!r}")
