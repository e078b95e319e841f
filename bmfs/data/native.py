"""The optional C helpers (native/bmfs_native.c, built as ``bmfs.data._native``).

``NATIVE`` is the module, or None when it was not built (no compiler or ISA-L headers
at install time) or ``BMFS_NATIVE=0`` is set: callers then take the Python path
(pyeclib, the crc32c package), which gives the same bytes, only slower and holding
the GIL. `bmfs status` and the tests can tell which path runs from ``NATIVE``.
"""
from __future__ import annotations

import os

NATIVE = None
if os.environ.get("BMFS_NATIVE", "1") != "0":
    try:
        from . import _native as NATIVE  # noqa: N811
    except ImportError:
        NATIVE = None
