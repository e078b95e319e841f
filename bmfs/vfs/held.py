"""Directories the kernel holds, and what this mount last answered for each.

A directory removed while a process still sits in it (its working directory, an open
descriptor) is empty and nameless, but on a local disk it keeps answering: ``stat``
shows ``st_nlink`` 0, ``..`` is the directory it was in, its mode can still be
changed, and it goes when the last user lets go. The kernel asks the daemon again for
its attributes once they time out (and checks them before every path walk from it),
so the daemon must answer for it until the kernel forgets it (FUSE forget).

A removed directory holds nothing, so nothing of it needs to stay in the metadata:
its last attributes are kept here, in memory, from the replies that gave the
directory to the kernel until the kernel forgets it. The same record answers for a
directory removed through another mount of an etcd volume (this mount did not see
the removal: its record is the last state this mount answered). Nothing is stored,
so a crash leaves nothing to sweep and fsck nothing to find.
"""
from __future__ import annotations

import dataclasses
import time

from ..format.records import Inode
from .attr import Attr


class HeldDirs:
    """``fino -> Attr`` of the directories the kernel holds (a reply gave it and the
    kernel has not forgotten it). ``saw``/``forgot`` come from the front end's lookup
    counting; ``answered`` and ``removed`` from the vfs."""

    def __init__(self):
        self.attrs: dict[int, Attr] = {}

    def saw(self, a: Attr) -> None:
        """A reply gave the kernel directory ``a`` (an Attr)."""
        self.attrs[a.ino] = a

    def answered(self, a: Attr) -> None:
        """The current attributes of a directory: kept if the kernel holds it."""
        if a.ino in self.attrs:
            self.attrs[a.ino] = a

    def removed(self, fino: int, i: Inode) -> None:
        """This mount removed directory ``fino`` (its last state ``i``)."""
        a = self.attrs.get(fino)
        if a is not None:
            self.attrs[fino] = dataclasses.replace(a, mode=i.mode, uid=i.uid, gid=i.gid,
                                                   nlink=0, atime_ns=i.atime_ns,
                                                   mtime_ns=i.mtime_ns, ctime_ns=i.ctime_ns)

    def forgot(self, fino: int) -> None:
        self.attrs.pop(fino, None)

    def dead(self, fino: int) -> Attr | None:
        """The attributes of held directory ``fino``, found gone: as it was last, with
        no link left (None if the kernel does not hold it)."""
        a = self.attrs.get(fino)
        if a is None:
            return None
        if a.nlink:
            a = self.attrs[fino] = dataclasses.replace(a, nlink=0)
        return a

    def change(self, fino: int, **kw) -> Attr | None:
        """setattr of a removed held directory (fchmod on a descriptor, say): the
        change is kept with it; the Attr, or None if it is not held."""
        a = self.dead(fino)
        if a is None:
            return None
        kw = {k: v for k, v in kw.items() if v is not None}
        if "mode" in kw:
            kw["mode"] = a.mode & ~0o7777 | kw["mode"] & 0o7777
        kw.setdefault("ctime_ns", time.time_ns())
        a = self.attrs[fino] = dataclasses.replace(a, **kw)
        return a
