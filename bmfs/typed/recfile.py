"""Record files: many protobuf messages in one file, read through a memory mapping (the
format, its writer and reader; bmfs/typed/records.py is the public module).

Caveats first:
- Reading record i parses it from a memoryview slice of the mapping, only when it is
  accessed; the file is never read or copied as a whole. Protobuf itself copies the
  fields of the one message being parsed into the message object: that copy is per
  record, and it is protobuf's, not ours.
- A file whose writer did not finish has no index and does not open (MissingIndex).
- close() drops this view's references; the mapping itself is unmapped when no view or
  slice of the file uses it any more.

Format, version 1. All integers little-endian; offsets are from the start of the file.

    offset        size  field
    0             8     magic b"BMRECS\\r\\n" (the CR LF catches text-mode mangling)
    8             4     format version, uint32 = 1
    12            4     name_len, uint32: length of the message type name
    16            n     message type name, UTF-8 (e.g. b"bmfs.examples.Sample")
    16+n          0-7   zero padding to a multiple of 8; this is header_end
    header_end    ...   records, back to back. Each is protobuf's "delimited" form:
                        a varint byte length, then the serialized message. Read alone,
                        this section is a stream that parseDelimitedFrom understands.
    R             0-7   zero padding to a multiple of 8 (R = end of the last record)
    index_offset  8*(count+1)  index: uint64 offsets. Entry i (i < count) is the offset
                        of record i's length prefix; entry count is R. Record i spans
                        [entry i, entry i+1).
    size-32       8     index_offset, uint64
    size-24       8     count (number of records), uint64
    size-16       4     CRC-32 (zlib) of the index bytes, uint32
    size-12       4     reserved, uint32 = 0
    size-8        8     end magic b"BMRECIDX"

    version  change
    1        first version

On open, the header and footer are checked, the index CRC is computed and every index
entry is checked to lie in the records section in increasing order (all of that skipped
with verify=False, except that each access still checks its own record's bounds). Every
failure is a CorruptFile (or MissingIndex) naming the file and the offset.
"""
import array
import collections.abc
import io
import mmap as _mmap
import operator
import os
import struct
import sys
import zlib

import numpy as np
from google.protobuf.message import DecodeError

from bmfs.typed import registry, xattr
from bmfs.typed.access import Access
from bmfs.typed.errors import (
    CorruptFile, MissingIndex, NotSupportedHere, TypeMismatch, from_os_error)
from bmfs.typed.proto_view import first_bad_field, read_varint

MAGIC = b"BMRECS\r\n"
END_MAGIC = b"BMRECIDX"
VERSION = 1
HEADER = struct.Struct("<8sII")       # magic, version, name_len
FOOTER = struct.Struct("<QQII8s")     # index_offset, count, index_crc32, reserved, end magic
MAX_NAME = 4096
_CHUNK = 1 << 16                      # index entries handled per numpy step
_PARSE_ERRORS = (DecodeError, ValueError, RuntimeError, IndexError, OverflowError,
                 struct.error)
_ONE_BYTE = [bytes((n,)) for n in range(128)]


def _align8(n):
    return n + (-n % 8)


def _varint(n):
    if n < 128:
        return _ONE_BYTE[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# --- writing ----------------------------------------------------------------------------

def writer(path, Type, *, set_type=True, fsync=False):
    """Open a record file for writing; use as a context manager.

        with bmfs.typed.records.writer("data.rec", Sample) as w:
            for s in samples:
                w.append(s)

    Records and then the index are written in one pass; closing writes the index and
    footer and records the type ('proto-records:<name>') in the file's xattr. On a
    filesystem without user xattrs the type is still in the file's header, where
    bmfs.typed.mmap(path) finds it.

    Raises:
        TypeMismatch: Type is not a protobuf message type.
        UnknownSchema: a type string naming no loaded message.
    """
    req = registry.request(Type, path=path)
    if req is None or req.kind not in (registry.ANY_PROTO, "proto", "proto-records"):
        raise TypeMismatch(path, f"record files hold protobuf messages, not {Type!r}")
    return RecordWriter(os.fspath(path), req.cls, set_type=set_type, fsync=fsync)


class RecordWriter:
    """Appends records to a new file; see writer(). Leaving the `with` block by an
    exception leaves the file without an index, so that nobody reads half a data set."""

    def __init__(self, path, message_class, *, set_type=True, fsync=False):
        self.path = path
        self.message_class = message_class
        self.type_name = message_class.DESCRIPTOR.full_name
        self._set_type = set_type
        self._fsync = fsync
        name = self.type_name.encode()
        header = HEADER.pack(MAGIC, VERSION, len(name)) + name
        header += b"\0" * (-len(header) % 8)
        try:
            self._file = io.open(path, "wb", buffering=1 << 20)
            self._file.write(header)
        except OSError as e:
            raise from_os_error(path, e) from None
        self._pos = len(header)
        self._offsets = array.array("Q")
        self.closed = False

    def __len__(self):
        return len(self._offsets)

    def append(self, message):
        """Append one message, which must be of the writer's type."""
        if message.DESCRIPTOR.full_name != self.type_name:
            raise TypeMismatch(self.path, f"this record file holds {self.type_name}, "
                                          f"not {message.DESCRIPTOR.full_name}")
        self.append_serialized(message.SerializeToString())

    def append_serialized(self, data):
        """Append a message already serialized (bytes-like) as the writer's type."""
        if self.closed:
            raise ValueError(f"{self.path}: record writer is closed")
        prefix = _varint(len(data))
        self._offsets.append(self._pos)
        try:
            self._file.write(prefix)
            self._file.write(data)
        except OSError as e:
            raise from_os_error(self.path, e) from None
        self._pos += len(prefix) + len(data)

    def extend(self, messages):
        for message in messages:
            self.append(message)

    def close(self):
        """Write the index and footer, close the file and record its type."""
        if self.closed:
            return
        self.closed = True
        index = self._offsets
        index.append(self._pos)
        if sys.byteorder != "little":
            index.byteswap()
        pad = -self._pos % 8
        index_offset = self._pos + pad
        footer = FOOTER.pack(index_offset, len(index) - 1, zlib.crc32(index), 0, END_MAGIC)
        try:
            with self._file as f:
                f.write(b"\0" * pad)
                f.write(index)
                f.write(footer)
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
        except OSError as e:
            raise from_os_error(self.path, e) from None
        if self._set_type:
            xattr.record_type(self.path, f"proto-records:{self.type_name}",
                                 missing_ok=True)

    def abort(self):
        """Close the file without an index (it will not open as a record file)."""
        if not self.closed:
            self.closed = True
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


# --- reading ----------------------------------------------------------------------------

def read_header(buf, path, size):
    """Parse the fixed header from bytes-like `buf`; return (type name, header_end).

    Raises:
        CorruptFile: bad magic, truncated header, or a name that is not UTF-8.
        NotSupportedHere: a format version this code does not read.
    """
    if len(buf) < HEADER.size:
        if bytes(buf[:8]) != MAGIC[:len(buf[:8])]:
            raise CorruptFile(path, f"not a bmfs record file: bad magic {bytes(buf[:8])!r}", 0)
        raise CorruptFile(path, f"truncated: {size} bytes is shorter than the header", size)
    magic, version, name_len = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptFile(path, f"not a bmfs record file: bad magic {magic!r}", 0)
    if version != VERSION:
        raise NotSupportedHere(path, f"record file format version {version} is not "
                                     f"supported (this bmfs reads version {VERSION})", 8)
    end = HEADER.size + name_len
    if name_len > MAX_NAME or end > len(buf):
        raise CorruptFile(path, f"truncated header: type name of {name_len} bytes runs "
                                f"past the end of the header or file", 12)
    try:
        name = bytes(buf[HEADER.size:end]).decode()
    except UnicodeDecodeError:
        raise CorruptFile(path, "type name in the header is not UTF-8", HEADER.size) from None
    return name, _align8(end)


def open_records(path, message_class, *, verify=True, strict=True, access="auto"):
    """Map a record file of `message_class` (no xattr handling; see bmfs.typed.mmap).
    `access`: read-ahead advice for the mapping (bmfs.typed.access.MODES).

    Raises:
        TypeMismatch: the header names another message (unless strict=False).
        CorruptFile, MissingIndex, NotSupportedHere: see the module docstring.
    """
    try:
        with io.open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise CorruptFile(path, "empty file is not a record file", 0)
            mm = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ)
    except OSError as e:
        raise from_os_error(path, e) from None
    advice = Access(mm, access, size)  # before the header and index are read through it
    name, header_end = read_header(memoryview(mm)[:HEADER.size + MAX_NAME], path, size)
    want = message_class.DESCRIPTOR.full_name
    if strict and name != want:
        raise TypeMismatch(path, f"record file holds {name}, not {want} (pass strict=False "
                                 "to read it with another version of the schema)")
    index_offset, count, crc = read_footer(
        path, size, header_end, mm[max(size - FOOTER.size, 0):])
    offsets = np.frombuffer(mm, dtype="<u8", count=count + 1, offset=index_offset)
    if verify:
        check_index(path, memoryview(mm)[index_offset:size - FOOTER.size], offsets, crc,
                    header_end, index_offset)
    return RecordFile(path, message_class, name, mm, offsets, header_end, index_offset,
                      access=advice)


def read_footer(path, size, header_end, footer):
    """(index_offset, count, index crc32) from the file's last FOOTER.size bytes
    ``footer``, checked against the file's ``size`` and ``header_end``.

    Raises:
        MissingIndex: no footer (the writer did not finish).
        CorruptFile: a footer that does not fit the file.
    """
    if size < header_end + FOOTER.size:
        raise MissingIndex(path, "no index: the file ends before the footer (was the "
                                 "writer closed?)", size)
    index_offset, count, crc, _, end_magic = FOOTER.unpack_from(footer, 0)
    if end_magic != END_MAGIC:
        raise MissingIndex(path, f"no index: the footer magic is {end_magic!r}, not "
                                 f"{END_MAGIC!r} (the writer did not finish)", size - 8)
    footer_at = size - FOOTER.size
    if (index_offset % 8 or index_offset < header_end
            or count >= (footer_at - header_end) // 8
            or index_offset + 8 * (count + 1) != footer_at):
        raise CorruptFile(path, f"footer is inconsistent: an index of {count}+1 entries at "
                                f"offset {index_offset} must end at the footer",
                          footer_at)
    return index_offset, count, crc


def check_index(path, index_bytes, offsets, crc, header_end, index_offset):
    """The index (its bytes, and as ``offsets``) against its checksum, and every
    entry inside the records section, in increasing order (CorruptFile if not)."""
    got = zlib.crc32(index_bytes)
    if got != crc:
        raise CorruptFile(path, f"index checksum mismatch: crc32 {got:#010x}, footer "
                                f"says {crc:#010x}", index_offset)
    _check_index(path, offsets, header_end, index_offset)


def _check_index(path, offsets, header_end, index_offset):
    if offsets[0] < header_end:
        raise CorruptFile(path, f"index entry 0 points to offset {offsets[0]}, inside the "
                                f"header (records start at {header_end})", index_offset)
    for lo in range(0, len(offsets), _CHUNK):
        chunk = offsets[lo:lo + _CHUNK + 1]
        past = np.flatnonzero(chunk > index_offset)
        if past.size:
            i = lo + int(past[0])
            raise CorruptFile(path, f"index entry {i} points to offset {offsets[i]}, past "
                                    f"the records section (which ends at {index_offset})",
                              index_offset + 8 * i)
        back = np.flatnonzero(chunk[1:] <= chunk[:-1])
        if back.size:
            i = lo + int(back[0]) + 1
            raise CorruptFile(path, f"index entry {i} ({offsets[i]}) does not follow entry "
                                    f"{i - 1} ({offsets[i - 1]})", index_offset + 8 * i)


class RecordFile(collections.abc.Sequence):
    """A read-only sequence of the messages in a record file.

    len(), indexing (negative too), slicing (a lazy view sharing the mapping) and
    iteration. Record i is parsed from its own slice of the mapping when accessed; each
    access returns a new message object. raw(i) gives the serialized bytes as a
    memoryview of the mapping, with no copy at all.

    Read-ahead follows the accesses (bmfs.typed.access, "auto"): records taken at
    random from a file too large to stay cached make the mapping random (a fault
    reads its page, not ~1 MiB around it), accesses in order or iteration make it
    normal again; advise() sets it instead.
    """

    def __init__(self, path, message_class, type_name, mapping, offsets, header_end,
                 records_end, starts=None, ends=None, access=None):
        self.path = path
        self.message_class = message_class
        self.type_name = type_name      # the name in the file's header
        self._mm = mapping
        self._mv = memoryview(mapping)
        self._offsets = offsets         # the whole index, count+1 entries
        self._lo = header_end
        self._hi = records_end
        self._starts = offsets[:-1] if starts is None else starts
        self._ends = offsets[1:] if ends is None else ends
        self._from = message_class.FromString
        self._access = Access(mapping) if access is None else access

    def advise(self, access):
        """Read-ahead for the mapping from now on (it and its slices share it):
        "auto", "normal", "random" or "sequential" (bmfs.typed.access)."""
        self._check_open()
        self._access.set(access)

    @property
    def access(self):
        """The access mode ("auto", ...) and the advice the mapping has now."""
        self._check_open()
        return self._access.mode, self._access.advice

    @property
    def mapping(self):
        """The mmap.mmap of the file (for tests and for zero-copy tools)."""
        self._check_open()
        return self._mm

    @property
    def offsets(self):
        """The index as a read-only uint64 numpy view of the mapping (count+1 entries)."""
        self._check_open()
        return self._offsets

    def __len__(self):
        return len(self._starts)

    def __getitem__(self, i):
        self._check_open()
        if isinstance(i, slice):
            return RecordFile(self.path, self.message_class, self.type_name, self._mm,
                              self._offsets, self._lo, self._hi,
                              self._starts[i], self._ends[i], self._access)
        i = self._position(i)
        start, end = int(self._starts[i]), int(self._ends[i])
        self._access.touch(start, end)
        return self._record(start, end)

    def raw(self, i):
        """Record i's serialized message: a memoryview of the mapping, no copy."""
        self._check_open()
        i = self._position(i)
        start, end = int(self._starts[i]), int(self._ends[i])
        self._access.touch(start, end)
        body = self._body(start, end)
        return self._mv[body:end]

    def __iter__(self):
        self._check_open()
        self._access.scan()
        mv, parse, lo, hi = self._mv, self._from, self._lo, self._hi
        for first in range(0, len(self._starts), _CHUNK):
            starts = self._starts[first:first + _CHUNK].tolist()
            ends = self._ends[first:first + _CHUNK].tolist()
            for start, end in zip(starts, ends):
                # Fast path: a record shorter than 128 bytes has a one-byte prefix.
                if lo <= start < end <= hi and start + 1 + mv[start] == end:
                    try:
                        yield parse(mv[start + 1:end])
                        continue
                    except _PARSE_ERRORS:
                        pass
                yield self._record(start, end)

    def close(self):
        """Drop this view's references to the mapping (see the module caveats)."""
        self._mm = self._mv = self._offsets = self._starts = self._ends = None
        self._access = Access(None)  # (the shared one refers to the mapping)

    @property
    def closed(self):
        return self._mm is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"{len(self)} records"
        return f"<RecordFile {self.path!r} of {self.type_name}, {state}>"

    # -- internals

    def _check_open(self):
        if self._mm is None:
            raise ValueError(f"{self.path}: record file is closed")

    def _position(self, i):
        i = operator.index(i)
        n = len(self._starts)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"record index {i} out of range ({n} records)")
        return j

    def _number(self, start):
        """The record's number in the whole file (for messages), from its offset."""
        return int(np.searchsorted(self._offsets[:-1], start))

    def _body(self, start, end):
        """Check a record's bounds and length prefix; return the offset of its body."""
        if not self._lo <= start < end <= self._hi:
            raise CorruptFile(self.path, f"record {self._number(start)} "
                                         f"spans {start}..{end}, outside the records "
                                         f"section {self._lo}..{self._hi}", start)
        length, body = read_varint(self._mv, start, end)
        if length is None or body + length != end:
            said = "an unreadable length" if length is None else f"{length} bytes"
            raise CorruptFile(self.path, f"record {self._number(start)}: its length prefix "
                                         f"says {said} but the index gives it "
                                         f"{end - start} bytes in all", start)
        return body

    def _record(self, start, end):
        body = self._body(start, end)
        data = self._mv[body:end]
        try:
            return self._from(data)
        except _PARSE_ERRORS as e:
            bad = first_bad_field(data)
            where = body if bad is None else body + bad
            raise CorruptFile(self.path, f"record {self._number(start)} does not parse as "
                                         f"{self.message_class.DESCRIPTOR.full_name}: {e}",
                              where) from None

