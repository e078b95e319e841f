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
