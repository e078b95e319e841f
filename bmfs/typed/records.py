"""Record files, the public module: many protobuf messages in one file, read through a
memory mapping (the format, the writer and the reader: bmfs/typed/recfile.py).

    with bmfs.typed.records.writer("train.rec", Sample) as w:
        w.append(sample)
    for s in bmfs.typed.records.open("train.rec", Sample): ...
"""
from bmfs.typed import registry, views
from bmfs.typed.access import check_mode
from bmfs.typed.errors import TypeMismatch
from bmfs.typed.recfile import RecordFile, RecordWriter, writer

__all__ = ["open", "writer", "RecordFile", "RecordWriter"]


def open(path, Type=None, *, verify=True, strict=True, access="auto"):  # noqa: A001
    """Open a record file as a RecordFile; Type defaults to the recorded type.

    Same as bmfs.typed.mmap(path, Type) but refuses files that are not record files.
    """
    check_mode(access)
    req = registry.request(Type, path=path)
    if req is not None and req.kind == registry.ANY_PROTO:
        req.kind = "proto-records"
    view = views.mmap(path, req, verify=verify, strict=strict, access=access)
    if not isinstance(view, RecordFile):
        raise TypeMismatch(path, "not a record file")
    return view
