"""Level 3: repair over a volume of in-process devices (no FUSE)."""
import os

import trio

from bmfs.vfs import repair
from bmfs.vfs.fsck import fsck
from fragments import intact_keys, lose, on_device
from vfsutil import open_fs, read_file, write_file

ROOT = 1


def test_concurrent_repairs_rebuild_each_fragment_once(tmp_path):
    """Background repair and `bmfs repair` at once: each lost fragment is rebuilt by
    one of them, and the volume ends at full redundancy with the data intact."""
    vol = tmp_path / "vol"
    files = {b"f%d" % i: os.urandom((9 << 20) + i) for i in range(3)}

    async def main():
        async with open_fs(vol) as fs:
            inos = {name: await write_file(fs, ROOT, name, data) for name, data in files.items()}
            dev2 = os.path.join(str(vol), "dev2")
            lost = [f for f in on_device(dev2) if f.idx < 4]  # data fragments: read
            assert lost
            for f in lost:
                lose(f)
            for name, ino in inos.items():  # degraded reads queue the damage
                assert await read_file(fs, ino) == files[name]
            results = []

            async def run():
                results.append(await repair.repair(fs.volume))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                nursery.start_soon(run)
            assert sum(r["fragments_rebuilt"] for r in results) == len(lost)
            assert all(r["stripes_failed"] == 0 for r in results)
            assert {(f.sid, f.idx) for f in lost} <= intact_keys(dev2)
            s = await repair.scrub(fs.volume)
            assert s["bad_fragments"] == 0 and s["stripes"] == 0
            fs.volume.data._decoded.clear()
            fs.volume.data._tables.clear()
            for name, ino in inos.items():
                assert await read_file(fs, ino) == files[name]
            problems, _ = await fsck(fs.volume, full=True)
            assert problems == []
    trio.run(main)


def test_fragments_of_the_first_revision_still_read_and_repair(tmp_path, monkeypatch):
    """A volume written before fragment revision 2 (its stripe records say 1): its
    files read back, small reads at every alignment too, damage to them is repaired
    as revision 1 (what their records say), and new files beside them are revision 2."""
    import random
    from bmfs.data import fragment as fr
    from bmfs.kv import prefix_end
    from bmfs.meta.records import Stripe
    from fragments import revision
    vol = tmp_path / "vol"
    old = {b"old%d" % i: os.urandom((5 << 20) + 777 * i) for i in range(2)}
    new = os.urandom((5 << 20) + 3)

    async def versions(fs):
        rows = await fs.volume.kv.begin().range(b"t/", prefix_end(b"t/"))
        return {Stripe.unpack(raw).frag_version for _, raw in rows}

    async def main():
        async with open_fs(vol) as fs:
            monkeypatch.setattr(fr, "VERSION", 1)
            inos = {n: await write_file(fs, ROOT, n, d) for n, d in old.items()}
            assert await versions(fs) == {1}
            monkeypatch.undo()
            inos[b"new"] = await write_file(fs, ROOT, b"new", new)
            assert await versions(fs) == {1, 2}
            files = dict(old, new=new)
            files[b"new"] = files.pop("new")
            fs.volume.data._tables.clear()
            rng = random.Random(5)
            for name, ino in inos.items():
                assert await read_file(fs, ino) == files[name]
                fh = await fs.open(ino, os.O_RDONLY)
                for _ in range(40):
                    off, n = rng.randrange(len(files[name])), rng.choice([1, 100, 4096, 9000])
                    assert bytes(await fs.files.read(fh, off, n)) == files[name][off:off + n]
                await fs.files.release(fh)
            dev1 = os.path.join(str(vol), "dev1")
            lost = [f for f in on_device(dev1) if f.idx < 4]
            assert lost
            for f in lost:
                lose(f)
            fs.volume.data._tables.clear()
            for name, ino in inos.items():
                assert await read_file(fs, ino) == files[name]
            r = await repair.repair(fs.volume)
            assert r["fragments_rebuilt"] == len(lost) and r["stripes_failed"] == 0
            rebuilt = {(f.sid, f.idx): f for f in on_device(dev1)}
            assert {(f.sid, f.idx) for f in lost} <= intact_keys(dev1)
            assert {revision(rebuilt[(f.sid, f.idx)]) for f in lost} == {1, 2}
            problems, _ = await fsck(fs.volume, full=True)
            assert problems == []
            fs.volume.data._decoded.clear()
            fs.volume.data._tables.clear()
            for name, ino in inos.items():
                assert await read_file(fs, ino) == files[name]
    trio.run(main)
