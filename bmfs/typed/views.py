"""mmap() and mutable_mmap(): pick the view for a file from the type asked for, the type
recorded with the file and the file's own header, then open it."""
import dataclasses
import os

from bmfs.typed import access as _access
from bmfs.typed import fbs_view, numpy_view, proto_view, recfile, registry
from bmfs.typed.sniff import sniff
from bmfs.typed.xattr import XATTR, recorded_type
from bmfs.typed.errors import (
    BadTypeString, NoType, NotSupportedHere, TypeMismatch, from_os_error)


def mmap(path, Type=None, *, strict=True, verify=True, dtype=None, shape=None, offset=0,
         access="auto"):
    """A read-only typed view of the file at `path`, backed by its memory mapping.

    Type may be a type string ('npy', 'raw:<f4:10,3', 'proto:pkg.Msg',
    'proto-records:pkg.Msg', 'fbs:ns.Table'), a protobuf message class or instance, a
    flatbuffers table class or instance, numpy.ndarray, or a numpy dtype; None uses the
    type recorded with the file, or the one its header shows (.npy, record files).

    Returns, by the file's type:
      npy / raw      a read-only MappedArray (numpy.memmap) sharing the mapping;
                     dtype= and shape= describe raw files (offset= skips a prefix)
      proto          the message, parsed from a memoryview of the mapping (a copy:
                     protobuf cannot read in place); into the instance if one was given
      proto-records  a RecordFile: len, index, slices, iteration, parsing each record
                     from its own slice when accessed (verify=False skips the index CRC
                     and the up-front index scan)
      fbs            the root table, whose buffer is the mapping (into the instance if
                     given)

    strict=False lets a protobuf or flatbuffers type other than the recorded one read
    the file (e.g. a newer version of the schema under another name).

    access= is the read-ahead the mapping gets (bmfs.typed.access): "auto" (record
    files larger than memory go random when read at random; other files keep the
    kernel's default), "normal", "random" (a page fault reads its page only: for
    readers that jump about a file larger than memory, or take a few pieces of a big
    one; on a bmfs mount a fault otherwise reads ~1 MiB) or "sequential". A protobuf
    message is parsed at once: access does not apply.

    Raises:
        NoType: no Type given and none recorded or readable from the file.
        TypeMismatch: the type asked for is not the file's.
        BadTypeString, UnknownSchema: a malformed type or a schema nobody registered.
        CorruptFile, MissingIndex: damaged content, naming the offset.
        NotFound and other FsErrors: the file cannot be opened.
        ValueError: an access= that is not one of the modes.
    """
    path = os.fspath(path)
    _access.check_mode(access)
    req = registry.request(Type, dtype=dtype, shape=shape, path=path)
    req = decide(path, req, recorded_type(path), strict=strict)
    return open_decided(path, req, verify=verify, strict=strict, offset=offset,
                        access=access)


def mutable_mmap(path, Type=None, *, strict=True, dtype=None, shape=None, offset=0,
                 access="auto"):
    """A writable view of an array file (npy or raw), mapped with ACCESS_WRITE.

    Stores go straight to the mapping; flush(), close() or leaving a `with` block writes
    them back (msync), after which other readers of the file see them. Inside a bmfs
    branch checkout the writes go to that branch only, because the path is inside that
    branch's directory. Protobuf and flatbuffers files are not mutable in place (a
    protobuf message does not live in the file; rewrite such files instead).

    access= as for mmap().

    Raises: as mmap(), and NotSupportedHere for a type that is not an array.
    """
    path = os.fspath(path)
    _access.check_mode(access)
    req = registry.request(Type, dtype=dtype, shape=shape, path=path)
    req = decide(path, req, recorded_type(path), strict=strict)
    if req.kind not in ("npy", "raw"):
        raise NotSupportedHere(path, f"mutable_mmap maps arrays only, and this file is {req}")
    return _advised(numpy_view.open_array(path, req, writable=True, offset=offset), access)


def decide(path, req, recorded, strict=True):
    """The exact Request to open `path` with (kind in registry.FILE_KINDS).

    req is what the caller asked for (or None), recorded the recorded type string (or
    None). The recorded type is checked against the request and narrows it; without
    either, the file's header decides.
    """
    if recorded is not None:
        try:
            recorded = registry.parse(recorded, path)
        except BadTypeString as e:
            raise BadTypeString(path, f"the recorded type ({XATTR}) is "
                                      f"malformed: {str(e).split(': ', 1)[-1]}") from None
    if req is None:
        req = recorded or sniff(path)
        if req is None:
            raise NoType(path, f"no type given, none recorded ({XATTR}) and none "
                               "in the file's header: pass one, or set it with "
                               "`bmfs type PATH TYPE`")
        return registry.load_class(req, path)
    if recorded is not None:
        return _narrow(path, req, recorded, strict)
    if req.kind == registry.ANY_PROTO:
        magic = _head(path, len(recfile.MAGIC))
        kind = "proto-records" if magic == recfile.MAGIC else "proto"
        return dataclasses.replace(req, kind=kind)
    if req.kind == registry.ANY_ARRAY:
        kind = "npy" if numpy_view.is_npy(_head(path, 8)) else "raw"
        return dataclasses.replace(req, kind=kind)
    return req


def _narrow(path, req, recorded, strict):
    if not req.compatible_with(recorded.kind):
        raise TypeMismatch(path, f"the file's recorded type is {recorded}, not {_show(req)}")
    if strict and recorded.name and req.name and recorded.name != req.name:
        raise TypeMismatch(path, f"the file's recorded type is {recorded}, not {_show(req)} "
                                 "(pass strict=False to read it with another version of "
                                 "the schema)")
    narrowed = dataclasses.replace(req, kind=recorded.kind)
    if recorded.kind == "raw":
        if req.dtype is None:
            narrowed.dtype = recorded.dtype
        elif strict and req.dtype != recorded.dtype:
            raise TypeMismatch(path, f"the file's recorded type is {recorded}, not an array "
                                     f"of {req.dtype}")
        if req.shape is None:
            narrowed.shape = recorded.shape
        elif strict and recorded.shape is not None and req.shape != recorded.shape:
            raise TypeMismatch(path, f"the file's recorded type is {recorded}, not shape "
                                     f"{req.shape}")
    return narrowed


def _show(req):
    if req.kind == registry.ANY_PROTO:
        return f"protobuf {req.name}"
    if req.kind == registry.ANY_ARRAY:
        return "an array" if req.dtype is None else f"an array of {req.dtype}"
    return str(req)


def _head(path, n):
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as e:
        raise from_os_error(path, e) from None


def open_decided(path, req, *, verify=True, strict=True, offset=0, access="auto"):
    """Open `path` with an exact Request from decide()."""
    if req.kind in ("npy", "raw"):
        return _advised(numpy_view.open_array(path, req, offset=offset), access)
    if req.kind == "proto":
        return proto_view.open_message(path, req.cls, req.instance)
    if req.kind == "proto-records":
        if req.instance is not None:
            raise TypeMismatch(path, "a record file holds many messages: pass the message "
                                     "class, not an instance")
        return recfile.open_records(path, req.cls, verify=verify, strict=strict,
                                    access=access)
    if req.kind == "fbs":
        table = fbs_view.open_table(path, req.cls, req.instance)
        if access != "auto":
            _access.advise(table._tab.Bytes, access)
        return table
    raise TypeMismatch(path, f"cannot open a file as {_show(req)}")


def _advised(array, access):
    """``array`` with its mapping advised as ``access`` says ("auto": as it is)."""
    if access != "auto" and isinstance(array, numpy_view.MappedArray):
        array.advise(access)
    return array
