"""The mount's idle spin (bmfs/fuse/idle.py): awake between back-to-back requests only,
and asleep (no CPU burnt) once they stop."""
import time

import trio

from bmfs.config import Settings
from bmfs.fuse.idle import IdleSpin, watch_handlers

WINDOW = 0.2  # long enough that a busy machine does not end a spin before it is seen


async def _request(idle, took=0.0):
    idle.begin()
    try:
        if took:
            await trio.sleep(took)
    finally:
        idle.end()


def _spinning(idle) -> bool:
    return idle.spinning


async def _settle():
    """Let the spin task run (trio may run this task first in a batch)."""
    for _ in range(3):
        await trio.sleep(0)


def _beside_the_spinner(body):
    """Run ``body(idle)`` with an IdleSpin's task (WINDOW) running."""
    async def main():
        idle = IdleSpin(WINDOW)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(idle.run)
            await trio.sleep(0.01)
            await body(idle)
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_spins_after_back_to_back_requests_and_stops():
    async def body(idle):
        # the first request after a pause: no spin after it
        await _request(idle)
        await _settle()
        assert not _spinning(idle) and idle.stats["spins"] == 0
        # the next one comes at once: the loop stays awake after it
        await _request(idle)
        await _settle()
        assert _spinning(idle) and idle.stats["spins"] == 1
        # a request that comes while it spins ends that spin ("caught") and, being
        # back to back, is spun after too
        await _request(idle, took=0.001)
        await _settle()
        assert idle.stats == {"spins": 2, "caught": 1}
        # then nothing: after the window it sleeps, and burns no CPU
        await trio.sleep(WINDOW * 3)
        assert not _spinning(idle)
        cpu = time.process_time()
        await trio.sleep(0.3)
        assert time.process_time() - cpu < 0.05
        # a request after that pause is not back to back: no spin
        await _request(idle)
        await _settle()
        assert not _spinning(idle) and idle.stats["spins"] == 2
    _beside_the_spinner(body)


def test_concurrent_requests_are_not_spun_for_until_the_last_ends():
    async def body(idle):
        await _request(idle)
        idle.begin()
        idle.begin()
        idle.end()
        await _settle()
        assert not _spinning(idle)  # one still under way
        idle.end()
        await _settle()
        assert _spinning(idle)
    _beside_the_spinner(body)


def test_turned_off():
    async def main():
        idle = IdleSpin(0.0)
        with trio.fail_after(1):
            await idle.run()  # returns at once: nothing to do
        await _request(idle)
        await _request(idle)
        assert idle.stats["spins"] == 0
    trio.run(main)


def test_setting_from_the_environment(caplog):
    assert Settings.from_environ({}).idle_spin == 0.0  # off unless asked for
    assert Settings.from_environ({"BMFS_IDLE_SPIN_US": "0"}).idle_spin == 0.0
    assert Settings.from_environ({"BMFS_IDLE_SPIN_US": "120"}).idle_spin == 0.00012
    for bad in ("soon", "-1", "1e6", "nan"):
        assert Settings.from_environ({"BMFS_IDLE_SPIN_US": bad}).idle_spin == 0.0
    assert "BMFS_IDLE_SPIN_US='soon'" in caplog.text


def test_watch_handlers_counts_every_coroutine_handler():
    class Ops:
        async def read(self, fh, off, size):
            assert idle.active == 1
            return b"x" * size

        async def getattr(self, inode, ctx=None):
            raise OSError("boom")

        def not_a_handler(self):
            return 1

    idle = IdleSpin(WINDOW)
    ops = Ops()
    watch_handlers(ops, idle)

    async def main():
        assert await ops.read(1, 0, 3) == b"xxx"
        try:
            await ops.getattr(1)
        except OSError:
            pass
        assert idle.active == 0 and idle.hot  # the second came right after the first
        assert ops.not_a_handler() == 1
    trio.run(main)
