"""The optional C helpers (native/), each with a Python fallback.

``NATIVE`` is ``bmfs.data._native`` (native/bmfs_native.c: checksums, encode,
rebuild), or None when it was not built (no compiler or ISA-L headers at install
time) or ``BMFS_NATIVE=0`` is set: callers then take the Python path (pyeclib, the
crc32c package), which gives the same bytes, only slower and holding the GIL.
`bmfs status` and the tests can tell which path runs from ``NATIVE``. optional()
loads the others the same way (bmfs.node._native: a node's small READs).
"""
from __future__ import annotations

import importlib

from .config import get_settings


def optional(module: str):
    """The C helper ``module``, or None if it was not built or BMFS_NATIVE=0 is set."""
    if not get_settings().native:
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


NATIVE = optional("bmfs.data._native")
