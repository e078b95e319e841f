"""Level 1: the KV conformance suite on every engine that can run here."""
import pytest
import trio

from bmfs.kv import open_kv
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
