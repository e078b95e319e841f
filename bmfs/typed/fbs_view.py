"""Flatbuffers tables read in place from the mapped file.

The root table's buffer (`table._tab.Bytes`) is the mmap.mmap of the file itself: scalars
are unpacked from the mapping on each access, and `<Field>AsNumpy()` vectors are numpy
views of it. Caveats: strings come back as small bytes copies (flatbuffers' Python
runtime slices them), and that runtime has no verifier, so only the root table's framing
is checked here; a field corrupted deeper raises struct.error or IndexError on access (a
Python exception, never a crash, since all reads go through bounds-checked buffers).
"""
import inspect
import mmap as _mmap
import os
import struct

import numpy as np

from bmfs.typed import registry
from bmfs.typed.errors import CorruptFile, TypeMismatch, from_os_error


def open_table(path, table_class, instance=None):
    """Map `path` and return its root table (in `instance` if given).

    Raises:
        CorruptFile: the root offset or the root table's vtable lie outside the file.
        TypeMismatch: the file identifier is not the one the table's schema declares.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CorruptFile(path, f"{size} bytes is too short for a flatbuffer "
                                        "(at least 8)", 0)
            mm = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ)
    except OSError as e:
        raise from_os_error(path, e) from None
    name = registry.fbs_name(table_class)
    has_identifier = registry.fbs_identifier_check(table_class)
    if has_identifier is not None and not has_identifier(mm, 0):
        raise TypeMismatch(path, f"file identifier {mm[4:8]!r} is not the one of {name}", 4)
    _check_root(path, mm, size)
    table = table_class() if instance is None else instance
    table.Init(mm, struct.unpack_from("<I", mm, 0)[0])
    return table


def _check_root(path, buf, size):
    (root,) = struct.unpack_from("<I", buf, 0)
    if root + 4 > size:
        raise CorruptFile(path, f"root table offset {root} points past the end of the "
                                f"file ({size} bytes)", 0)
    (back,) = struct.unpack_from("<i", buf, root)
    vtable = root - back
    if not 0 <= vtable <= size - 4:
        raise CorruptFile(path, f"root table's vtable offset {vtable} is outside the file",
                          root)
    vt_size, table_size = struct.unpack_from("<HH", buf, vtable)
    if vt_size < 4 or vt_size % 2 or vtable + vt_size > size:
        raise CorruptFile(path, f"root table's vtable has a bad size {vt_size}", vtable)
    if root + table_size > size:
        raise CorruptFile(path, f"root table of {table_size} bytes runs past the end of "
                                "the file", root)


# --- generic dump (for `bmfs cat`) -----------------------------------------------------

_SKIP_SUFFIXES = ("AsNumpy", "Length", "IsNone", "BufferHasIdentifier")


def to_dict(obj, *, path=None, max_items=16, _depth=0):
    """Fields of a flatc-generated table or struct object as a dict, for display.

    Flatbuffers' Python runtime has no reflection, so the generated accessor methods are
    used: a method `F` with `FLength` is a vector, other argument-less methods are fields.
    Vectors longer than max_items are summarized.
    """
    if _depth > 32:
        return "<nested too deep>"
    methods = type(obj).__dict__
    out = {}
    for name, fn in methods.items():
        if (name.startswith("_") or name == "Init" or name.startswith("GetRootAs")
                or name.endswith(_SKIP_SUFFIXES) or not callable(fn)):
            continue
        try:
            if name + "Length" in methods:
                out[name] = _vector(obj, name, methods, path, max_items, _depth)
            elif _positional_params(fn) == 1:
                out[name] = _value(getattr(obj, name)(), path, max_items, _depth)
        except (struct.error, IndexError, ValueError, TypeError) as e:
            raise CorruptFile(path, f"field {name} cannot be read: {e}") from None
    return out


def _positional_params(fn):
    try:
        return len([p for p in inspect.signature(fn).parameters.values()
                    if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD])
    except (TypeError, ValueError):
        return -1


def _vector(obj, name, methods, path, max_items, depth):
    n = getattr(obj, name + "Length")()
    if name + "AsNumpy" in methods:
        arr = getattr(obj, name + "AsNumpy")()
        if isinstance(arr, np.ndarray):
            if n <= max_items:
                return arr.tolist()
            return np.array2string(arr, threshold=max_items, edgeitems=3) + f" ({n} items)"
    items = [_value(getattr(obj, name)(j), path, max_items, depth)
             for j in range(min(n, max_items))]
    if n > max_items:
        items.append(f"... ({n} items)")
    return items


def _value(value, path, max_items, depth):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if hasattr(value, "_tab"):
        return to_dict(value, path=path, max_items=max_items, _depth=depth + 1)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"<{type(value).__name__}>"
