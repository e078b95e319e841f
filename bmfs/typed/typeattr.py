"""A file's type, recorded in its `user.bm.type` xattr (bmfs/typed/xattr.py), or read
from its own header (bmfs/typed/sniff.py).

    setfattr -n user.bm.type -v proto:bmfs.examples.Sample sample.pb
    bmfs type sample.pb proto:bmfs.examples.Sample        # the same, with checks

A recorded type wins over what sniffing would say.
"""
import os

from bmfs.typed import recfile, registry, views
from bmfs.typed.errors import TypeMismatch
from bmfs.typed.sniff import sniff
from bmfs.typed.xattr import record_type, recorded_type


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
    path = os.fspath(path)
    if check:
        req = registry.request(Type, path=path)
        req.instance = None  # check with a fresh object; never fill the caller's
        req = views.decide(path, req, recorded=None)
        view = views.open_decided(path, req)
        if isinstance(view, recfile.RecordFile):
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
