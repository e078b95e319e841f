"""A file's type as recorded in its ``user.bm.type`` xattr: read, write, remove.

    setfattr -n user.bm.type -v proto:bmfs.examples.Sample sample.pb

No checks here (bmfs/typed/typeattr.py's set_type checks the type against the file).
"""
import errno
import os

from bmfs.typed.errors import NotSupportedHere, from_os_error

XATTR = "user.bm.type"
_NO_XATTR = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)


def recorded_type(path):
    """The type string recorded with the file, or None.

    Raises:
        NotFound (and other FsErrors): the file cannot be reached.
    """
    try:
        value = os.getxattr(path, XATTR)
    except OSError as e:
        if e.errno in _NO_XATTR:
            return None
        raise from_os_error(path, e) from None
    return value.decode("utf-8", "replace")


def record_type(path, typestr, *, missing_ok=False):
    """Write the xattr with no checks. missing_ok: silently skip filesystems without
    user xattrs (for files whose header already carries their type)."""
    try:
        os.setxattr(path, XATTR, typestr.encode())
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            if missing_ok:
                return
            raise NotSupportedHere(path, "the filesystem does not store user xattrs, so "
                                         "the type cannot be recorded; pass the type to "
                                         "bmfs.typed.mmap instead") from None
        raise from_os_error(path, e) from None


def clear_type(path):
    """Remove the recorded type (no error if there was none)."""
    path = os.fspath(path)
    try:
        os.removexattr(path, XATTR)
    except OSError as e:
        if e.errno not in _NO_XATTR:
            raise from_os_error(path, e) from None
