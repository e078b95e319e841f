"""bmfs: an erasure-coded POSIX filesystem with branches and typed views.

``bmfs.mmap(path, Type)``, ``bmfs.mutable_mmap`` and ``bmfs.records`` are the typed
views (bmfs/typed/); they are imported on first use so the mount daemon and the CLI
do not load numpy and protobuf.
"""
import ctypes as _ctypes

# Keep large buffers in malloc's arena: pyeclib allocates each fragment afresh, and
# with glibc's defaults every 1 MiB buffer is mmap'd and returned to the kernel, which
# costs a 16x drop in encode speed on these machines (design.md, "Buffers").
try:
    _libc = _ctypes.CDLL("libc.so.6")
    _libc.mallopt(-3, 64 << 20)   # M_MMAP_THRESHOLD
    _libc.mallopt(-1, 1 << 30)    # M_TRIM_THRESHOLD
except OSError:  # not glibc: nothing to tune
    pass

_TYPED = ("mmap", "mutable_mmap", "records", "get_type", "set_type")


def __getattr__(name):
    if name in _TYPED:
        from . import typed
        return getattr(typed, name)
    raise AttributeError(f"module 'bmfs' has no attribute {name!r}")
