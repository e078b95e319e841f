"""Typed views: protobuf, flatbuffers and numpy files opened as typed objects backed by
the file's memory mapping, without reading or copying the whole file (docs/typed.md).

    a = bmfs.typed.mmap("weights.npy")                     # numpy view of the mapping
    s = Sample(); bmfs.typed.mmap("/test", s); s.label     # one protobuf message
    for s in bmfs.typed.mmap("train.rec", Sample): ...     # a record file, lazily parsed
    frame = bmfs.typed.mmap("f.bmfr", Frame); frame.Id()   # flatbuffers, read in place

    with bmfs.typed.records.writer("train.rec", Sample) as w:
        w.append(sample)

The type is recorded with the file (xattr user.bm.type, see xattr.py) so that mmap(path)
needs no type. The same code works on a local file and inside a bmfs mount.
"""
from bmfs.typed import records
from bmfs.typed.errors import (
    BadTypeString, CorruptFile, MissingIndex, NotSupportedHere, NoType, TypeMismatch,
    UnknownSchema)
from bmfs.typed.numpy_view import MappedArray
from bmfs.typed.recfile import RecordFile, RecordWriter
from bmfs.typed.registry import register
from bmfs.typed.typeattr import get_type, set_type
from bmfs.typed.views import mmap, mutable_mmap
from bmfs.typed.xattr import XATTR, clear_type

__all__ = [
    "mmap", "mutable_mmap", "records", "get_type", "set_type", "clear_type", "register",
    "XATTR", "MappedArray", "RecordFile", "RecordWriter", "TypeMismatch", "CorruptFile",
    "MissingIndex", "NoType", "UnknownSchema", "BadTypeString", "NotSupportedHere",
]
