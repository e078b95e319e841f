"""The event loop a direct client runs on: a trio loop in a thread of its own.

The layers below (vfs, data, transports, engines) are trio code. A direct client is
called from ordinary threads, so each client owns one loop thread and every call is
handed to it (``trio.from_thread.run``): calls from several threads run side by
side as tasks of that loop, and nothing of the loop is ever touched from outside it.

Caveat: a forked child has no copy of the thread, so a loop is only good in the
process that made it (``Portal.pid``); the client notices a fork (os.register_at_fork)
and opens a loop and connections of its own in the child. The parent's objects are
left as they are in the child, never closed there: closing would act on the
parent's connections and files through descriptors the two share.
"""
from __future__ import annotations

import os
import threading

import trio


class Portal:
    """A trio loop in a daemon thread. ``run(afn, *args)`` runs ``afn`` on it and
    returns its result (or raises what it raised); ``close()`` ends the loop."""

    def __init__(self, name: str = "bmfs-client"):
        self.pid = os.getpid()
        self._token = None
        self._ready = threading.Event()
        self._stop = None  # trio.Event, made on the loop
        self.nursery = None
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # noqa: BLE001 - reported to the opener
            self._failed = e
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery  # long-lived tasks (the session's) run here
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def run(self, afn, *args):
        if threading.current_thread() is self._thread:
            raise RuntimeError("a bmfs client is not called from its own event loop")
        return trio.from_thread.run(afn, *args, trio_token=self._token)

    def close(self) -> None:
        if self._token is None or not self._thread.is_alive():
            return
        try:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        except trio.RunFinishedError:
            pass
        self._thread.join()
