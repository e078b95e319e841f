"""Read-ahead for a direct client's sequential reader (File.readinto on a file
opened for reading only).

A mount reads ahead for a sequential reader (the kernel's read-ahead, the daemon's
stripes in flight); a direct client's ``readinto`` in a loop would otherwise leave
the devices idle while the caller works on each buffer. So once two reads follow
one another (each READ_AHEAD_MIN to READ_AHEAD_MAX bytes), the next range of the
same length is fetched in the background, into a buffer of the reader's own, while
the caller has this one: a read that finds its range fetched copies it over and
starts the one after (two ranges in flight). Any other read (a seek, another
length) is read directly into the caller's buffer, and what was fetched is left.
Two buffers per reader are reused; one still being filled is never reused.
"""
from __future__ import annotations

import trio

from .batch import read_many

READ_AHEAD_MIN = 256 << 10  # reads smaller than this are not read ahead
READ_AHEAD_MAX = 64 << 20   # nor larger ones (the buffers are the reader's length)
AHEAD = 2                   # ranges fetched ahead of the one being read


class _Fetch:
    """One range fetched ahead: into ``buf``, ``result`` the count read (or the
    exception) once ``done`` is set."""
    __slots__ = ("gen", "offset", "length", "buf", "done", "result")

    def __init__(self, gen: int, offset: int, buf: bytearray):
        self.gen, self.offset, self.length, self.buf = gen, offset, len(buf), buf
        self.done = None  # trio.Event, made on the loop
        self.result = None


async def _fetch(s, fh: int, f: _Fetch, task_status=trio.TASK_STATUS_IGNORED) -> None:
    f.done = trio.Event()
    task_status.started()
    try:
        f.result = (await read_many(s.fs.files, [(fh, f.offset, f.length)], [f.buf]))[0]
    except Exception as e:  # noqa: BLE001 - the reader reads the range itself then
        f.result = e
    finally:
        f.done.set()


class ReadAhead:
    """A File's read-ahead state (see the module docstring). Used by one thread at a
    time, as a file position is."""

    def __init__(self):
        self.next = None     # where the last read ended
        self.ahead = []      # _Fetch in flight or done, in file order
        self.spare = []      # buffers no fetch is filling

    def readinto(self, client, fh: int, view: memoryview, pos: int) -> int:
        """Read ``len(view)`` bytes at ``pos`` into ``view`` (fewer at the end)."""
        n, gen = len(view), client._gen
        ahead = self.ahead
        hit = bool(ahead) and ahead[0].gen == gen and ahead[0].offset == pos and \
            ahead[0].length == n
        if not hit:  # (what was fetched is left: buffers still being filled too)
            ahead = self.ahead = []
            self.spare = [b for b in self.spare if len(b) == n]
        sequential = hit or pos == self.next and READ_AHEAD_MIN <= n <= READ_AHEAD_MAX
        start = []
        if sequential:
            at = ahead[-1].offset + n if ahead else pos + n
            while len(ahead) + len(start) < 1 + AHEAD:
                buf = self.spare.pop() if self.spare else bytearray(n)
                start.append(_Fetch(gen, at, buf))
                at += n
        first = ahead.pop(0) if hit else None
        ahead.extend(start)

        async def fn(s):
            for f in start:  # (first: they overlap the wait for this one)
                await s.nursery.start(_fetch, s, fh, f)
            if first is not None:
                await first.done.wait()
                if not isinstance(first.result, Exception):
                    return first.result
            return -1 - (await read_many(s.fs.files, [(fh, pos, n)], [view]))[0]
        got = client._call(fn)
        if got >= 0:  # (fetched ahead: copied over here, off the loop)
            view[:got] = memoryview(first.buf)[:got]
            self.spare.append(first.buf)
        else:
            got = -1 - got
        self.next = pos + got
        return got

    def close(self, client) -> None:
        """Wait for fetches still under way (their handle is about to be released)."""
        ahead, self.ahead = [f for f in self.ahead if f.gen == client._gen], []
        if ahead:
            async def fn(s):
                for f in ahead:
                    await f.done.wait()
            client._call(fn)
