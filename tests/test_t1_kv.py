"""Level 1: the KV conformance suite on every engine that can run here."""
import pytest
import trio

from bmfs.errors import Unavailable
from bmfs.kv import open_kv
from bmfs.kv.memory import MemoryKV
from kv_conformance import CHECKS


@pytest.fixture(params=["memory", "sqlite"])
def kv_url(request, tmp_path):
    if request.param == "memory":
        return "memory:"
    return f"sqlite:{tmp_path}/meta.db"


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(kv_url, check):
    async def main():
        kv = await open_kv(kv_url)
        try:
            await check(kv)
        finally:
            await kv.aclose()
    trio.run(main)


def test_sqlite_survives_reopen(tmp_path):
    url = f"sqlite:{tmp_path}/meta.db"

    async def main():
        kv = await open_kv(url)
        t = kv.begin()
        t.put(b"x", b"y")
        await kv.commit(t)
        await kv.aclose()
        kv = await open_kv(url)
        assert await kv.get(b"x") == b"y"
        await kv.aclose()
    trio.run(main)


def test_sqlite_one_owner(tmp_path):
    from bmfs.errors import VolumeError
    url = f"sqlite:{tmp_path}/meta.db"

    async def main():
        kv = await open_kv(url)
        with pytest.raises(VolumeError, match="in use"):
            await open_kv(url)
        await kv.aclose()
    trio.run(main)


def test_unknown_engine():
    with pytest.raises(ValueError, match="unknown metadata engine"):
        trio.run(open_kv, "redis://x")


class _FailingKV(MemoryKV):
    """The memory engine, whose commit number ``fail_at`` fails: after applying its
    writes when ``applied`` (an outcome the caller cannot know), else before."""
    fail_at, applied, done = 0, False, 0

    async def _commit(self, reads, writes):
        self.done += 1
        if self.done == self.fail_at and not self.applied:
            raise Unavailable("injected")
        await super()._commit(reads, writes)
        if self.done == self.fail_at:
            raise Unavailable("injected, after the commit")


@pytest.mark.parametrize("applied", [False, True])
def test_upgrade_seals_every_record_once_and_resumes(monkeypatch, applied):
    """seal_all (a format upgrade) cut short by a failed commit, run again by two
    tasks at once, then finished: every record sealed exactly once, leased records
    dropped, the settings sealed last."""
    from bmfs.kv import seal
    from bmfs.meta import keys
    monkeypatch.setattr(seal, "BATCH_KEYS", 7)
    plain = {b"i/%016x@00000001" % i: b"\x01record %d" % i for i in range(100)}
    plain[b"t/big"] = b"x" * (seal.BATCH_BYTES + 1)  # a batch of one, over the bytes bound
    plain[b"m/old-mount"] = b"{}"

    async def main():
        kv = _FailingKV()
        kv.sealed = False  # an older volume: values as they are
        t = kv.begin()
        for k, v in plain.items():
            t.put(k, v)
        t.put(keys.SETTINGS, b'{"format": 2}')
        await kv.commit(t)
        kv.fail_at, kv.applied = kv.done + 4, applied
        with pytest.raises(Unavailable):
            await seal.seal_all(kv, keys.SEALING, keys.SETTINGS, keys.LEASED_PREFIXES)
        assert await kv.raw_get(keys.SEALING) is not None  # part done
        async with trio.open_nursery() as n:
            for _ in range(2):
                n.start_soon(seal.seal_all, kv, keys.SEALING, keys.SETTINGS,
                             keys.LEASED_PREFIXES)
        assert await seal.finish(kv, keys.SEALING, keys.SETTINGS, b'{"format": 3}')
        assert not await seal.finish(kv, keys.SEALING, keys.SETTINGS, b'{"format": 3}')
        assert await seal.seal_all(kv, keys.SEALING, keys.SETTINGS) == 0  # finished
        kv.sealed = True
        want = {k: v for k, v in plain.items() if not k.startswith(b"m/")}
        want[keys.SETTINGS] = b'{"format": 3}'
        assert dict(await kv.range(b"", b"")) == want
    trio.run(main)
