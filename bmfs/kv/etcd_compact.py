"""Keeping etcd's history bounded: compaction by the mount that leads the upkeep, and
defragmentation of members whose database is mostly free space.

Why: etcd keeps every revision of every key until its history is compacted. bmfs
changes keys all the time (every create, write and unlink writes inodes, entries,
slice lists, inline data), so without compaction the database grows until it reaches
etcd's backend quota (``--quota-backend-bytes``, 2 GiB by default); etcd then raises
its NOSPACE alarm and refuses every write, and the volume turns read-only.

What: every ``interval`` seconds each mount notes etcd's current revision; the
mount that leads the upkeep (the oldest live one, volume/session.py ``leads_repair``)
compacts the history up to the revision it noted ``window`` seconds ago. The
window is what a resuming watch needs: a watch resumes after failing over to
another member within the engine's timeout (10 s) of its last change, far inside the
window. A watch that still finds its revision compacted (a mount cut off for longer,
a watcher that fell far behind) is told so (IOFailure) and its user reads the state
afresh: the read cache starts empty, the kernel's caches are dropped (vfs/watch.py).
Nothing is skipped silently.

Compaction frees pages inside a member's database file; later writes reuse them, so
the file stops growing, but it does not shrink. When a member's file is mostly free
(in use below half of it, and at least ``defrag_min`` bytes free), the leading
mount defragments it, one member a round, followers first: a member blocks its
requests while it rewrites its file, which takes about as long as copying what is in
use, so the engine fails over meanwhile. If etcd's NOSPACE alarm is raised, a mount
that sees it (any: the leader may be unable to renew its leased record, a write)
compacts all history, defragments every member and disarms the alarm, so writes go
on without an operator (docs/etcd.md, "History").

Settings (environment of the mount; for tests and for unusual clusters):
``BMFS_ETCD_COMPACT_INTERVAL`` (seconds; 0 turns compaction off, e.g. for an etcd run
with its own ``--auto-compaction-*``), ``BMFS_ETCD_COMPACT_WINDOW`` (seconds),
``BMFS_ETCD_DEFRAG_MIN`` (bytes; 0 turns defragmentation off).
"""
from __future__ import annotations

import collections
import logging
from typing import Awaitable, Callable, Protocol

import trio

from ..config import get_settings
from ..errors import FsError

log = logging.getLogger(__name__)


class Maintained(Protocol):
    """What the compactor needs of its engine (etcd.py's EtcdKV)."""

    async def revision(self) -> int: ...
    async def compact(self, revision: int) -> bool: ...
    async def alarms(self) -> list[dict]: ...
    async def disarm(self, alarms: list[dict]) -> None: ...
    async def members_status(self) -> dict[str, dict | None]: ...
    async def defragment(self, ep: str) -> None: ...


class Compactor:
    """The compaction state of one engine: revisions noted, and what was done."""

    def __init__(self, kv: Maintained, interval: float | None = None,
                 window: float | None = None, defrag_min: int | None = None):
        """Each of ``interval``, ``window`` and ``defrag_min`` defaults to this
        process's setting (config.Settings.etcd_*)."""
        s = get_settings()
        self.kv = kv
        self.interval = s.etcd_compact_interval if interval is None else interval
        self.window = s.etcd_compact_window if window is None else window
        self.defrag_min = s.etcd_defrag_min if defrag_min is None else defrag_min
        self.noted: collections.deque[tuple[float, int]] = collections.deque()
        self.compacted = 0      # the revision compacted up to, by this engine
        self.compactions = 0    # statistics
        self.defrags = 0
        self.disarmed = 0

    async def run(self, leads: Callable[[], Awaitable[bool]]) -> None:
        """Note revisions and, while ``leads()`` says so, compact: until cancelled."""
        if self.interval <= 0:
            return
        while True:
            try:
                await self.round(await self.kv.revision(), leads)
            except FsError as e:  # etcd unreachable, say: try again next round
                log.warning("etcd history compaction failed (%s); will retry", e)
            except Exception:  # noqa: BLE001 (logged; the mount goes on)
                log.exception("etcd history compaction failed; will retry")
            await trio.sleep(self.interval)

    async def round(self, revision: int, leads: Callable[[], Awaitable[bool]]) -> None:
        now = trio.current_time()
        self.noted.append((now, revision))
        target = 0
        while self.noted and self.noted[0][0] <= now - self.window:
            target = self.noted.popleft()[1]
        if target:  # (the newest revision older than the window stays the oldest noted)
            self.noted.appendleft((now - self.window, target))
        alarmed = await self.kv.alarms()
        if alarmed:  # writes are refused: keep nothing more than the present. Any
            # mount does it: the leader may be unable to renew its record meanwhile
            # (which is a write), and doing it twice does no harm
            target = revision
        elif not await leads():
            return
        if target > self.compacted:
            if await self.kv.compact(target):
                self.compactions += 1
            self.compacted = target
        if self.defrag_min > 0 or alarmed:
            await self._defragment(everyone=bool(alarmed))
        if alarmed:
            await self.kv.disarm(alarmed)
            self.disarmed += 1
            log.warning("etcd's %s alarm was raised: compacted its history, defragmented "
                        "its members and disarmed the alarm",
                        ", ".join(sorted({str(a.get("alarm")) for a in alarmed})))

    async def _defragment(self, everyone: bool) -> None:
        """Defragment the first member (followers before the leader) whose file is
        mostly free; with ``everyone``, every member."""
        status = await self.kv.members_status()
        leader = {s.get("leader") for s in status.values() if s}
        order = sorted(status, key=lambda ep: status[ep].get("header", {})
                       .get("member_id") in leader if status[ep] else True)
        for ep in order:
            st = status[ep]
            if not st:
                continue
            size, used = int(st.get("dbSize", 0)), int(st.get("dbSizeInUse", 0))
            if everyone or (size - used >= self.defrag_min and used < size // 2):
                await self.kv.defragment(ep)
                self.defrags += 1
                log.info("defragmented etcd member %s: %d bytes, %d in use", ep, size, used)
                if not everyone:
                    return

    def statistics(self) -> dict:
        return {"compacted_to": self.compacted, "compactions": self.compactions,
                "defragmentations": self.defrags, "alarms_disarmed": self.disarmed}
