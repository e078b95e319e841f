"""A file bmfs keeps a volume's data or metadata in (a store's pool or index, the
metadata database and its redo log) is checked, once opened, to be its own: a file
another user put in its place (who owns the directory, say) must not receive them."""
from __future__ import annotations

import os
import stat

from .errors import VolumeError


def check_own_file(fd: int, path: str) -> None:
    """VolumeError unless ``fd`` (opened) is a regular file of ours with no other name."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        raise VolumeError(f"{path} is not a file of bmfs's (owner uid {st.st_uid}, "
                          f"{st.st_nlink} links): not used")
