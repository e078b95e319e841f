"""Typed views through the direct client, for processes without a mount: record
files (bmfs.typed.records' format) and .npy arrays.

Nothing is mapped: a record file's header, footer and index are read once at open,
then records are fetched by batches of ranges (Client.read_many: every fragment
request of a batch sent at once) and parsed from the bytes received; an array's rows
are read straight into the numpy array's memory (no copy past the reply's). The
file's type comes from the argument or the file's header (the recorded xattr is a
mount's business).
"""
from __future__ import annotations

import collections.abc
import math
import operator

import numpy as np

from ..typed import registry
from ..typed.errors import CorruptFile, TypeMismatch
from ..typed.numpy_view import NPY_MAGIC, _check_npy_against, _npy_header, is_npy
from ..typed.proto_view import first_bad_field, read_varint
from ..typed.recfile import (FOOTER, HEADER, MAX_NAME, _PARSE_ERRORS, check_index,
                             read_footer, read_header)

BATCH = 1024  # records fetched per batch when iterating


class Records(collections.abc.Sequence):
    """A record file read through a direct client: len, indexing, ``get_many``
    (one batch), iteration (batches of BATCH records). Open with
    ``Client.records(path, Type)``."""

    def __init__(self, client, path: str, Type=None, *, verify: bool = True,
                 strict: bool = True):
        self.client, self.path = client, path
        self._file = client.open(path, buffering=0)
        try:
            size = self._file.size
            head, foot = client.read_many([(self._file, 0, HEADER.size + MAX_NAME),
                                           (self._file, max(size - FOOTER.size, 0),
                                            FOOTER.size)])
            self.type_name, header_end = read_header(head, path, size)
            self.message_class = _message_class(Type, self.type_name, path, strict)
            index_offset, count, crc = read_footer(path, size, header_end, bytes(foot))
            (raw,) = client.read_many([(self._file, index_offset, 8 * (count + 1))])
            offsets = np.frombuffer(raw, dtype="<u8")
            if verify:
                check_index(path, raw, offsets, crc, header_end, index_offset)
        except BaseException:
            self._file.close()
            raise
        self._starts, self._ends = offsets[:-1], offsets[1:]
        self._lo, self._hi = header_end, index_offset
        self._parse = self.message_class.FromString

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.get_many(range(*i.indices(len(self))))
        return self.get_many([i])[0]

    def raw_many(self, indexes) -> list:
        """The serialized messages of records ``indexes``, fetched in one batch."""
        n = len(self._starts)
        spans = []
        for i in indexes:
            i = operator.index(i)
            j = i + n if i < 0 else i
            if not 0 <= j < n:
                raise IndexError(f"record index {i} out of range ({n} records)")
            spans.append((int(self._starts[j]), int(self._ends[j]), j))
        got = self.client.read_many([(self._file, s, e - s) for s, e, _ in spans])
        return [self._body(buf, s, e, j) for buf, (s, e, j) in zip(got, spans)]

    def get_many(self, indexes) -> list:
        """Records ``indexes`` parsed, fetched in one batch."""
        out = []
        for body, i in zip(self.raw_many(indexes), indexes):
            try:
                out.append(self._parse(body))
            except _PARSE_ERRORS as e:
                bad = first_bad_field(body)
                raise CorruptFile(self.path, f"record {i} does not parse as "
                                  f"{self.message_class.DESCRIPTOR.full_name}: {e}"
                                  + ("" if bad is None else f" (field at +{bad})"),
                                  int(self._starts[i])) from None
        return out

    def __iter__(self):
        for first in range(0, len(self), BATCH):
            yield from self.get_many(range(first, min(first + BATCH, len(self))))

    def _body(self, buf, start: int, end: int, i: int):
        if not self._lo <= start < end <= self._hi or len(buf) != end - start:
            raise CorruptFile(self.path, f"record {i} spans {start}..{end}, outside the "
                              f"records section {self._lo}..{self._hi}", start)
        length, body = read_varint(buf, 0, len(buf))
        if length is None or body + length != len(buf):
            raise CorruptFile(self.path, f"record {i}: its length prefix does not match "
                              f"the {end - start} bytes the index gives it", start)
        return memoryview(buf)[body:]

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _message_class(Type, name: str, path: str, strict: bool):
    if Type is None:
        return registry.proto_class(name, path)
    req = registry.request(Type, path=path)
    if req.kind not in ("proto", "proto-records", registry.ANY_PROTO):
        raise TypeMismatch(path, f"a record file holds protobuf messages, not {req}")
    cls = req.cls or registry.load_class(req, path).cls
    if strict and cls.DESCRIPTOR.full_name != name:
        raise TypeMismatch(path, f"record file holds {name}, not "
                           f"{cls.DESCRIPTOR.full_name} (pass strict=False to read it "
                           "with another version of the schema)")
    return cls


class Array:
    """A .npy array read through a direct client: ``shape``, ``dtype``, rows by
    index or slice (``a[i]``, ``a[i:j]``), ``take(rows)`` (one batch) and
    ``read()`` (the whole array), each read into a new numpy array's memory.
    Open with ``Client.array(path)``."""

    def __init__(self, client, path: str, dtype=None, shape=None):
        self.client, self.path = client, path
        with client.open(path, buffering=1 << 16) as f:
            head = f.read(len(NPY_MAGIC))
            if not is_npy(head):
                raise TypeMismatch(path, f"not a .npy file: magic is {head!r}", 0)
            f.seek(0)
            self.dtype, self.shape, order, self._offset = _npy_header(f, path)
        req = registry.request(np.ndarray, dtype=dtype, shape=shape, path=path)
        _check_npy_against(path, req, self.dtype, self.shape)
        if order == "F" and len(self.shape) > 1:
            raise TypeMismatch(path, "a Fortran-ordered .npy has no contiguous rows: "
                                     "read it through a mount")
        self._row = math.prod(self.shape[1:]) * self.dtype.itemsize
        size = client.stat(path).st_size
        need = self._offset + self._row * (self.shape[0] if self.shape else 1)
        if not self.shape:
            need = self._offset + self.dtype.itemsize
        if size < need:
            raise CorruptFile(path, f"truncated: the array needs {need} bytes, the file "
                                    f"has {size}", size)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def read(self) -> np.ndarray:
        if not self.shape:
            out = np.empty((), self.dtype)
            self._row = self.dtype.itemsize
            self._into([(0, 1)], [out.reshape(1)])
            return out
        return self[:]

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return self.take(range(start, stop, step))
            n = max(stop - start, 0)
            out = np.empty((n,) + tuple(self.shape[1:]), self.dtype)
            if n:
                self._into([(start, n)], [out])
            return out
        i = operator.index(i)
        j = i + len(self) if i < 0 else i
        if not 0 <= j < len(self):
            raise IndexError(f"index {i} is out of bounds for axis 0 with size {len(self)}")
        return self[j:j + 1][0]

    def take(self, rows) -> np.ndarray:
        """Rows ``rows`` (in that order), fetched in one batch."""
        rows = [operator.index(r) for r in rows]
        out = np.empty((len(rows),) + tuple(self.shape[1:]), self.dtype)
        for r in rows:
            if not -len(self) <= r < len(self):
                raise IndexError(f"index {r} is out of bounds for axis 0 with size {len(self)}")
        self._into([(r % len(self), 1) for r in rows], [out[k:k + 1] for k in range(len(rows))])
        return out

    def _into(self, spans, outs) -> None:
        counts = self.client.read_many(
            [(self.path, self._offset + r * self._row, n * self._row) for r, n in spans],
            [o.reshape(-1).view(np.uint8) for o in outs])
        for (r, n), got in zip(spans, counts):
            if got != n * self._row:
                raise CorruptFile(self.path, f"rows {r}..{r + n}: short read", self._offset)
