"""Type strings, type requests and the schemas (classes) behind them.

A file's type is a short string, recorded in the `user.bm.type` xattr (see
bmfs.typed.xattr) and accepted wherever a type is:

    npy                          a NumPy .npy file (dtype and shape in its header)
    raw:<dtype>[:<d0>,<d1>,...]  bare array bytes, e.g. 'raw:<f4' or 'raw:<u2:480,640'
    proto:<pkg.Msg>              one serialized protobuf message
    proto-records:<pkg.Msg>      a bmfs record file of that message (bmfs.typed.records)
    fbs:<ns.Table>               a flatbuffers buffer whose root is that table

The API also takes the classes themselves: a protobuf message class or instance, a
flatc-generated table class or instance, numpy.ndarray (npy or raw, the file decides), or
a numpy dtype / scalar type (raw, or npy with that dtype checked). A protobuf class alone
does not say whether the file holds one message or a record file: the recorded type, or
the record file's magic, decides.

Protobuf names resolve through protobuf's default descriptor pool, so any imported _pb2
module is "registered"; the modules generated into bmfs.wire are imported on first need.
Flatbuffers has no runtime registry: tables are found in bmfs.wire.FBS_TABLES or must be
passed to register().
"""
import dataclasses
import importlib
import re

import numpy as np
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message

from bmfs.typed.errors import BadTypeString, TypeMismatch, UnknownSchema

# Kinds a file can have (the part of a type string before the colon).
FILE_KINDS = ("npy", "raw", "proto", "proto-records", "fbs")
# Request kinds that leave the exact layout to the file.
ANY_PROTO = "protobuf"   # proto or proto-records
ANY_ARRAY = "array"      # npy or raw
_COMPATIBLE = {ANY_PROTO: ("proto", "proto-records"), ANY_ARRAY: ("npy", "raw")}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_FBS_PREFIX = "bmfs.wire.fbs."


@dataclasses.dataclass
class Request:
    """What a caller asked for, or what a file is recorded as.

    kind is one of FILE_KINDS, or ANY_PROTO / ANY_ARRAY when the file decides. name is the
    full message or table name (proto and fbs kinds). cls and instance are filled for
    proto and fbs kinds by load_class() or by the caller. dtype and shape belong to the
    array kinds; either may be None (unknown or unchecked).
    """

    kind: str
    name: str = ""
    cls: object = None
    instance: object = None
    dtype: np.dtype = None
    shape: tuple = None

    def __str__(self):
        """The type string (only meaningful for FILE_KINDS)."""
        if self.kind == "raw":
            text = f"raw:{self.dtype.str}"
            if self.shape is not None:
                text += ":" + ",".join(str(d) for d in self.shape)
            return text
        if self.kind == "npy" or not self.name:
            return self.kind
        return f"{self.kind}:{self.name}"

    def compatible_with(self, kind):
        return kind in _COMPATIBLE.get(self.kind, (self.kind,))


def parse(typestr, path=None):
    """Parse a type string into a Request without loading any schema.

    Raises:
        BadTypeString: malformed string, unknown kind, or a dtype a string cannot carry.
    """
    if isinstance(typestr, bytes):
        typestr = typestr.decode("utf-8", "replace")
    text = typestr.strip()
    kind, _, rest = text.partition(":")
    if kind not in FILE_KINDS:
        raise BadTypeString(path, f"bad type {typestr!r}: the kind must be one of "
                                  f"{', '.join(FILE_KINDS)}")
    if kind == "npy":
        if rest:
            raise BadTypeString(path, f"bad type {typestr!r}: 'npy' takes no argument")
        return Request("npy")
    if kind == "raw":
        return _parse_raw(typestr, rest, path)
    if not _NAME.match(rest):
        raise BadTypeString(path, f"bad type {typestr!r}: expected {kind}:<full.Name>")
    return Request(kind, rest)


def _parse_raw(typestr, rest, path):
    dtype_text, _, shape_text = rest.partition(":")
    try:
        if not dtype_text.strip():
            raise TypeError("empty dtype")
        dtype = np.dtype(dtype_text)
    except (TypeError, ValueError, SyntaxError):
        raise BadTypeString(path, f"bad type {typestr!r}: {dtype_text!r} is not a numpy dtype")
    _check_simple_dtype(dtype, path)
    shape = None
    if shape_text:
        try:
            shape = tuple(int(d) for d in shape_text.split(","))
        except ValueError:
            shape = (-1,)
        if any(d < 0 for d in shape):
            raise BadTypeString(path, f"bad type {typestr!r}: the shape must be "
                                      "comma-separated non-negative integers")
    return Request("raw", dtype=dtype, shape=shape)


def _check_simple_dtype(dtype, path):
    if dtype.hasobject:
        raise TypeMismatch(path, "arrays of Python objects cannot be memory-mapped")
    if dtype.fields is not None or dtype.subdtype is not None or dtype.itemsize == 0:
        raise BadTypeString(path, f"a raw type string takes a simple dtype, not {dtype}; "
                                  "pass structured dtypes to mmap(dtype=...) instead")


def request(Type, *, dtype=None, shape=None, path=None):
    """Turn anything the API accepts as a type into a Request (or None for "not given").

    Raises:
        BadTypeString, UnknownSchema: a string that is malformed or names no schema.
        TypeMismatch: a Python object that is not a type bmfs can map.
    """
    req = _request(Type, path)
    if dtype is not None or shape is not None:
        if req is None:
            req = Request(ANY_ARRAY)
        if req.kind not in ("npy", "raw", ANY_ARRAY):
            raise TypeMismatch(path, f"dtype/shape only apply to arrays, not to {req}")
        if dtype is not None:
            req.dtype = np.dtype(dtype)
        if shape is not None:
            req.shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if req is not None and req.kind in ("proto", "proto-records", "fbs") and req.cls is None:
        load_class(req, path)
    return req


def _request(Type, path):
    if Type is None:
        return None
    if isinstance(Type, Request):
        return dataclasses.replace(Type)
    if isinstance(Type, (str, bytes)):
        return parse(Type, path)
    if isinstance(Type, type) and issubclass(Type, Message):
        return Request(ANY_PROTO, Type.DESCRIPTOR.full_name, cls=Type)
    if isinstance(Type, Message):
        return Request(ANY_PROTO, Type.DESCRIPTOR.full_name, cls=type(Type), instance=Type)
    if _is_fbs_class(Type):
        return Request("fbs", fbs_name(Type), cls=Type)
    if _is_fbs_class(type(Type)):
        return Request("fbs", fbs_name(type(Type)), cls=type(Type), instance=Type)
    if Type is np.ndarray or Type is np.memmap:
        return Request(ANY_ARRAY)
    if isinstance(Type, np.dtype) or (isinstance(Type, type) and issubclass(Type, np.generic)):
        return Request(ANY_ARRAY, dtype=np.dtype(Type))
    raise TypeMismatch(path, f"cannot map a file as {Type!r}: expected a type string, a "
                             "protobuf message, a flatbuffers table, numpy.ndarray or a dtype")


def _is_fbs_class(obj):
    return isinstance(obj, type) and hasattr(obj, "GetRootAs") and hasattr(obj, "Init")


# --- protobuf ---------------------------------------------------------------------------

_wire_loaded = False


def _load_wire_protos():
    global _wire_loaded
    if not _wire_loaded:
        import bmfs.wire
        for module in bmfs.wire.PROTO_MODULES:
            importlib.import_module("bmfs.wire." + module)
        _wire_loaded = True


def proto_class(name, path=None):
    """The message class for a full protobuf name.

    Raises:
        UnknownSchema: no loaded _pb2 module defines that message.
    """
    _load_wire_protos()
    try:
        descriptor = descriptor_pool.Default().FindMessageTypeByName(name)
    except KeyError:
        raise UnknownSchema(path, f"protobuf message {name!r} is not registered: no loaded "
                                  "_pb2 module defines it (import it, or add its .proto "
                                  "to schemas/)") from None
    return message_factory.GetMessageClass(descriptor)


# --- flatbuffers ------------------------------------------------------------------------

_fbs_registered = {}


def register(cls, name=None):
    """Make a flatc-generated table class known by its full name (e.g. 'ns.Table').

    The name defaults to the class's module path, which flatc names after the namespace
    and table. Protobuf classes need no registration (their import registers them) and
    are accepted and ignored.
    """
    if isinstance(cls, type) and issubclass(cls, Message):
        return
    if not _is_fbs_class(cls):
        raise TypeMismatch(None, f"{cls!r} is not a flatbuffers table class")
    _fbs_registered[name or fbs_name(cls)] = cls


def fbs_name(cls):
    """The full flatbuffers name of a generated table class."""
    for name, registered in _fbs_registered.items():
        if registered is cls:
            return name
    module = cls.__module__
    if module.startswith(_FBS_PREFIX):
        module = module[len(_FBS_PREFIX):]
    if module.rsplit(".", 1)[-1] == cls.__name__:
        return module
    return f"{module}.{cls.__name__}"


def fbs_tables():
    """{full name: class} of every known table (bmfs.wire's and registered ones)."""
    import bmfs.wire
    tables = {}
    for name, module in bmfs.wire.FBS_TABLES.items():
        tables[name] = getattr(importlib.import_module(module), name.rsplit(".", 1)[-1])
    tables.update(_fbs_registered)
    return tables


def fbs_class(name, path=None):
    """The table class for a full flatbuffers name.

    Raises:
        UnknownSchema: neither bmfs.wire nor register() knows that table.
    """
    cls = _fbs_registered.get(name)
    if cls is None:
        cls = fbs_tables().get(name)
    if cls is None:
        raise UnknownSchema(path, f"flatbuffers table {name!r} is not registered (add its "
                                  ".fbs to schemas/ or call bmfs.typed.register(Table))")
    return cls


def fbs_identifier_check(cls):
    """The generated `<Table>BufferHasIdentifier` classmethod, or None without one."""
    return getattr(cls, cls.__name__ + "BufferHasIdentifier", None)


def load_class(req, path=None):
    """Fill req.cls from req.name for the proto and fbs kinds (a no-op for arrays)."""
    if req.cls is not None or req.kind in ("npy", "raw", ANY_ARRAY):
        return req
    if req.kind == "fbs":
        req.cls = fbs_class(req.name, path)
    else:
        req.cls = proto_class(req.name, path)
    return req
