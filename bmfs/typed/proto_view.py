"""A file holding one serialized protobuf message.

Caveat first: this is the one typed view that copies. Protobuf's Python runtime has no
message type that reads its fields from a foreign buffer, so the message is parsed from a
memoryview of the mapping (no intermediate bytes object) into the message's own memory,
and the mapping is closed right after. For many messages in one file use a record file
(bmfs.typed.records), which parses one record at a time.
"""
import mmap as _mmap
import os

from google.protobuf.message import DecodeError

from bmfs.typed.errors import CorruptFile, from_os_error

_PARSE_ERRORS = (DecodeError, ValueError, RuntimeError, IndexError, OverflowError)


def open_message(path, message_class, instance=None):
    """Parse the file into `instance` (cleared first) or a new message; return it.

    Raises:
        CorruptFile: the bytes are not a valid message of that type.
    """
    message = message_class() if instance is None else instance
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                message.Clear()  # an empty file is the empty message; mmap refuses size 0
                return message
            mm = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ)
    except OSError as e:
        raise from_os_error(path, e) from None
    with mm:
        view = memoryview(mm)
        try:
            message.ParseFromString(view)
        except _PARSE_ERRORS as e:
            bad = first_bad_field(view)
            raise CorruptFile(path, f"does not parse as {message.DESCRIPTOR.full_name}: {e}",
                              bad) from None
        finally:
            view.release()
    return message


def first_bad_field(buf):
    """Offset of the first top-level field whose framing is broken, or None.

    Protobuf's parser does not say where it failed. This walks the top-level wire format
    (tag, then a varint, fixed-size or length-delimited value) and returns where the
    first field that cannot be framed starts; None when the framing holds and the fault
    is inside a value (bad UTF-8, a broken nested message).
    """
    pos, end = 0, len(buf)
    while pos < end:
        start = pos
        key, pos = read_varint(buf, pos, end)
        if key is None or key >> 3 == 0:
            return start
        wire_type = key & 7
        if wire_type == 0:
            value, pos = read_varint(buf, pos, end)
            if value is None:
                return start
        elif wire_type == 1:
            pos += 8
        elif wire_type == 2:
            length, pos = read_varint(buf, pos, end)
            if length is None:
                return start
            pos += length
        elif wire_type == 5:
            pos += 4
        else:  # groups (3, 4) are framed by tags we do not track; 6, 7 do not exist
            return start
        if pos > end:
            return start
    return None


def read_varint(buf, pos, end):
    """Decode a varint at buf[pos:end]: (value, position after it), or (None, pos)."""
    value = shift = 0
    while pos < end and shift < 64:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    return None, pos
