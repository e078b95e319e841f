"""What the vfs answers about an inode: :class:`Attr`, in the kernel's inode numbers
(``view << 48 | ino``, views.py). The file system (fs.py), its open files (files.py),
the control directory (control.py) and the directories the kernel holds (held.py)
all build or keep them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..format.records import Inode
from .views import INO_MASK


@dataclass(slots=True)
class Attr:
    ino: int
    mode: int
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    rdev: int = 0
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    parent: int = 0  # directories: the one holding it (0: the root of its tree)


def attr_of(fino: int, i: Inode) -> Attr:
    """The Attr of inode record ``i``, numbered ``fino`` (its parent: the same view's)."""
    return Attr(fino, i.mode, i.nlink, i.uid, i.gid, i.rdev, i.size, i.atime_ns, i.mtime_ns,
                i.ctime_ns, fino & ~INO_MASK | i.parent if i.parent else 0)
