"""A file's type read from its own first bytes: files that describe themselves need no
xattr. A .npy file (its magic) and a bmfs record file (its header names the message)
are recognised, and so is a flatbuffer whose file identifier belongs to exactly one
known table.
"""
import os

from bmfs.typed import numpy_view, recfile, registry
from bmfs.typed.errors import from_os_error

_SNIFF_BYTES = 16 + 4096  # the record header with the longest name


def sniff(path):
    """Guess a Request from the file's first bytes, or None.

    Raises:
        CorruptFile: the file starts like a record file but its header is broken.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise from_os_error(path, e) from None
    if numpy_view.is_npy(head):
        return registry.Request("npy")
    if head[:len(recfile.MAGIC)] == recfile.MAGIC:
        name, _ = recfile.read_header(head, path, size)
        return registry.Request("proto-records", name)
    if len(head) >= 8:
        matches = [(name, cls) for name, cls in registry.fbs_tables().items()
                   if (check := registry.fbs_identifier_check(cls)) and check(head, 0)]
        if len(matches) == 1:
            return registry.Request("fbs", matches[0][0], cls=matches[0][1])
    return None
