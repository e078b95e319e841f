"""A file's type, recorded in its `user.bm.type` xattr, or read from its own header.

    setfattr -n user.bm.type -v proto:bmfs.examples.Sample sample.pb
    bmfs type sample.pb proto:bmfs.examples.Sample        # the same, with checks

Files that describe themselves need no xattr: a .npy file (its magic) and a bmfs record
file (its header names the message) are recognised by sniff(), and so is a flatbuffer
whose file identifier belongs to exactly one known table. A recorded type wins over
what sniffing would say.
"""
import errno
import os

from bmfs.typed import registry
from bmfs.typed.errors import NotSupportedHere, TypeMismatch, from_os_error

XATTR = "user.bm.type"
_NO_XATTR = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)
_SNIFF_BYTES = 16 + 4096  # the record header with the longest name


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


def sniff(path):
    """Guess a Request from the file's first bytes, or None.

    Raises:
        CorruptFile: the file starts like a record file but its header is broken.
    """
    from bmfs.typed import numpy_view, records
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise from_os_error(path, e) from None
    if numpy_view.is_npy(head):
        return registry.Request("npy")
    if head[:len(records.MAGIC)] == records.MAGIC:
        name, _ = records.read_header(head, path, size)
        return registry.Request("proto-records", name)
    if len(head) >= 8:
        matches = [(name, cls) for name, cls in registry.fbs_tables().items()
                   if (check := registry.fbs_identifier_check(cls)) and check(head, 0)]
        if len(matches) == 1:
            return registry.Request("fbs", matches[0][0], cls=matches[0][1])
    return None


def get_type(path, *, guess=True):
    """The file's type string: the recorded one, else (guess=True) a sniffed one, else None."""
    path = os.fspath(path)
    recorded = recorded_type(path)
    if recorded is not None or not guess:
        return recorded
    sniffed = sniff(path)
    return None if sniffed is None else str(sniffed)


def set_type(path, Type, *, check=True):
    """Record the file's type; return the type string recorded.

    Type is a type string or anything bmfs.typed.mmap accepts as a type. With check=True
    (the default) the schema must be registered and the file is opened with that type
    first, so a type that does not fit the content is refused; a protobuf or numpy class
    is turned into the exact type string (proto or proto-records, npy or raw) that way.

    Raises:
        BadTypeString, UnknownSchema, TypeMismatch, CorruptFile: the type does not fit.
        NotSupportedHere: the filesystem does not store user xattrs.
    """
    from bmfs.typed import records, views
    path = os.fspath(path)
    if check:
        req = registry.request(Type, path=path)
        req.instance = None  # check with a fresh object; never fill the caller's
        req = views.decide(path, req, recorded=None)
        view = views.open_decided(path, req)
        if isinstance(view, records.RecordFile):
            view.close()
    elif isinstance(Type, (str, bytes)):
        req = registry.parse(Type, path)
    else:
        raise TypeMismatch(path, "set_type(check=False) takes a type string")
    typestr = str(req)
    if req.kind not in registry.FILE_KINDS:
        raise TypeMismatch(path, f"cannot tell which type string {Type!r} means here")
    record_type(path, typestr)
    return typestr


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
