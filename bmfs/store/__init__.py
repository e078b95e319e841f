"""Fragment stores: where a device keeps fragments. Blocking calls, run in threads.

Interface (duck-typed; see file.py): ``write(name, parts)``, ``read(name, offset,
length)``, ``read_parts(name, ranges, into=None)``, ``delete(name)``, ``sync()``,
``names()``, ``usage()``, ``check()``.
"""
from __future__ import annotations

import os


def pread_into(fd: int, offset: int, into) -> memoryview:
    """Read ``len(into)`` bytes at ``offset`` of ``fd`` into the writable buffer
    ``into`` (read_parts' last range, for a caller that reads into its own buffers):
    ``into`` itself, or a view of the part read where the file ends sooner."""
    view = into if isinstance(into, memoryview) else memoryview(into).cast("B")
    n = os.preadv(fd, [view], offset) if len(view) else 0
    return view if n == len(view) else view[:n]

