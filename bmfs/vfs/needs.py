"""What the file layer (files.py, writes.py, reads.py, orphans.py) needs of its
collaborators, declared: the namespace that owns it (vfs/fs.py's FileSystem) and the
data client that stores stripes (data/client.py's DataClient). Either can be
replaced by anything with these members; the transport under the data client is
declared in bmfs/transport (``Transport``)."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Awaitable, Callable, Protocol

from ..format.records import Inode, Stripe

# a transaction body of FileSystem.mutate: (txn, chain) -> result
Mutation = Callable[[Any, Any], Awaitable[Any]]


class Notify(Protocol):
    """The kernel's caches, as the front end (fuse/ops.py KernelNotifier) drops them."""
    async def inode(self, fino: int) -> None: ...
    async def entry(self, parent: int, name: bytes) -> None: ...

    async def attributes(self, fino: int) -> None:
        """Drop the cached attributes of ``fino``, from within the kernel's open of it."""


class Namespace(Protocol):
    """What Files needs of the filesystem that owns it."""
    kv: Any                 # the volume's KV (bmfs.kv.KV)
    views: Any              # vfs/views.py Views: which tree an inode number is in
    mount_id: str           # this mount's id (orphan records name it)
    shared: bool            # other mounts share the volume (etcd)
    notify: Notify | None   # set by the front end; None without a kernel
    orphan_grace: float | None  # Settings.orphan_grace: deferred frees (orphans.py)

    async def mutate(self, view, fn: Mutation) -> Any:
        """Run ``fn(txn, chain)`` as one transaction on ``view``'s tree (retried on
        conflict); its result."""

    def split(self, fino: int) -> tuple[Any, int]:
        """(view, ino) of a kernel inode number."""

    def join(self, view, ino: int) -> int:
        """The kernel inode number of ``ino`` in ``view``."""

    def freed(self, view, ino: int, i: Inode) -> None:
        """Inode ``ino`` (last ``i``) has been freed."""

    async def accessed(self, view, ino: int, i: Inode, tell_kernel: bool = False) -> None:
        """The file was read: its atime moves as the mount's atime mode says."""

    def defers_free(self, view) -> bool:
        """Whether a file of ``view`` whose last name and handle go is left to the
        orphan sweep (deferred frees, orphans.py)."""


class StripeStore(Protocol):
    """What Files needs of the data client."""
    async def write_stripe(self, sid: int, data) -> Stripe: ...
    async def delete_stripe(self, sid: int, st: Stripe) -> None: ...
    async def read(self, sid: int, st: Stripe, offset: int, length: int): ...
    async def sync(self) -> None: ...

    def needs_repair(self, st: Stripe) -> list[int]: ...

    def pending(self, sid: int) -> AbstractContextManager[None]:
        """Around the window in which stripe ``sid``'s fragments are on devices and no
        committed record names them yet."""

    def side_by_side(self) -> AbstractContextManager[None]:
        """Around reads started side by side (the tasks of one nursery)."""
