"""Level 3: repair over a volume of in-process devices (no FUSE)."""
import errno
import os

import pytest
import trio

from bmfs.errors import Invalid, NoSpace
from bmfs.volume import devices, repair
from bmfs.volume.volume import mkfs
from bmfs.volume.fsck import fsck
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
    from bmfs.format import fragment as fr
    from bmfs.kv import prefix_end
    from bmfs.format.records import Stripe
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


def test_add_drain_undrain_remove_a_device(tmp_path):
    """A 4+2 volume of 6 directories: drain is refused (nowhere to move); `add_device`
    formats a seventh directory, and new stripes use it; drain then empties device 0
    and keeps new stripes off it; undrain puts it back; remove forgets it for good,
    its id is not reused. Wrong adds change nothing and say why."""
    vol = tmp_path / "vol"
    files = {}

    async def main():
        async with open_fs(vol) as fs:
            v = fs.volume

            async def put(name, size):
                files[name] = os.urandom(size)
                return await write_file(fs, ROOT, name, files[name])

            def count(dev):
                return len(on_device(v.device_paths[dev]))
            inos = {b"a": await put(b"a", 12 << 20)}
            with pytest.raises(NoSpace, match="add a device first"):
                await devices.drain(v, 0)
            assert v.data.devices == [0, 1, 2, 3, 4, 5]
            # wrong adds: a node address on a volume of directories, an id in use,
            # a path in use, a directory of another volume
            other = tmp_path / "other"
            await mkfs(str(other))
            for kw, why in (({"address": "127.0.0.1:9"}, "directories of this machine"),
                            ({"device": 3}, "device 3 exists already"),
                            ({"path": str(vol / "dev1")}, "is device 1 already"),
                            ({"path": str(other / "dev0")}, "belongs to another volume")):
                with pytest.raises(Invalid, match=why):
                    await devices.add_device(v, **{"path": str(tmp_path / "x"), **kw})
            assert not (tmp_path / "x").exists() and len(v.data.devices) == 6
            r = await devices.add_device(v, str(tmp_path / "d6"))
            assert r["device"] == 6 and v.data.devices == [0, 1, 2, 3, 4, 5, 6]
            inos[b"b"] = await put(b"b", 32 << 20)
            assert count(6) > 0  # new stripes are spread over the seven
            r = await devices.drain(v, 0)
            assert r["fragments_left_on_device"] == 0 and count(0) == 0
            inos[b"c"] = await put(b"c", 8 << 20)
            assert count(0) == 0  # kept off the drained device
            r = await devices.undrain(v, 0)
            assert r["was_draining"] and 0 in v.data.devices
            inos[b"d"] = await put(b"d", 32 << 20)
            assert count(0) > 0
            r = await devices.drain(v, 2, remove=True)
            assert r["removed"] and v.removed == {2} and 2 not in v.data.devices
            with pytest.raises(Invalid, match="was removed"):
                await devices.undrain(v, 2)
            with pytest.raises(Invalid, match="ids are not reused"):
                await devices.add_device(v, str(tmp_path / "y"), device=2)
            v.data._decoded.clear()
            for name, ino in inos.items():
                assert await read_file(fs, ino) == files[name]
        # reopened: the same devices, states and data
        async with open_fs(vol) as fs:
            v = fs.volume
            assert v.data.devices == [0, 1, 3, 4, 5, 6] and v.removed == {2}
            for name, ino in inos.items():
                assert await read_file(fs, ino) == files[name]
    trio.run(main)


def test_rebalance_moves_fragments_onto_an_added_device(tmp_path):
    """After a seventh device is added, `rebalance` moves fragments of the stripes
    written before onto it (where placement puts them over seven devices, about 1/7
    of all), copying them as they are: every stripe still has six distinct devices,
    the files read back exact, and a second run has nothing to move."""
    vol = tmp_path / "vol"
    files = {b"f%d" % i: os.urandom((6 << 20) + i) for i in range(8)}

    async def main():
        async with open_fs(vol) as fs:
            v = fs.volume
            inos = {name: await write_file(fs, ROOT, name, data) for name, data in files.items()}
            await devices.add_device(v, str(tmp_path / "d6"))
            assert on_device(str(tmp_path / "d6")) == []
            r = await repair.rebalance(v)
            total = sum(len(on_device(v.device_paths[d])) for d in range(7))
            placed = len(on_device(str(tmp_path / "d6")))
            assert r["fragments_moved"] == placed and r["fragments_failed"] == 0
            assert total / 7 * 0.5 < placed < total / 7 * 1.5, (placed, total)
            async for sid, st in repair._stripes(v):
                assert len(set(st.devices)) == 6, (sid, st.devices)
            v.data._decoded.clear()
            v.data._tables.clear()
            for name, ino in inos.items():
                assert await read_file(fs, ino) == files[name]
            assert v.data.stats["degraded_reads"] == 0
            assert (await repair.rebalance(v))["fragments_moved"] == 0
            problems, _ = await fsck(v, full=True)
            assert problems == []
    trio.run(main)


def test_two_drains_at_once_cannot_both_leave_too_few_devices(tmp_path):
    """Seven devices, 4+2: two drains started together (devices 1 and 4) would leave
    five. The room check is part of the transaction that marks the device, so exactly
    one drain goes ahead; the other is refused and its device stays in service."""
    vol = tmp_path / "vol"

    async def main():
        async with open_fs(vol) as fs:
            v = fs.volume
            await write_file(fs, ROOT, b"f", os.urandom(9 << 20))
            await devices.add_device(v, str(tmp_path / "d6"))
            outcome = {}

            async def drain(dev):
                try:
                    outcome[dev] = (await devices.drain(v, dev))["fragments_left_on_device"]
                except NoSpace as e:
                    outcome[dev] = str(e)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain, 1)
                nursery.start_soon(drain, 4)
            refused = [d for d, o in outcome.items() if isinstance(o, str)]
            assert len(refused) == 1 and "would be left" in outcome[refused[0]], outcome
            done = ({1, 4} - set(refused)).pop()
            assert outcome[done] == 0
            assert v.data.devices == sorted({0, 1, 2, 3, 4, 5, 6} - {done})
    trio.run(main)


def test_scrub_and_repair_keep_to_their_limit(tmp_path):
    """`--limit`: scrub reads every fragment, and repair rebuilds lost ones, no faster
    than the rate given (bytes read and written on devices a second, on average), and
    the rebuilt fragments are there all the same."""
    vol = tmp_path / "vol"
    data = os.urandom(8 << 20)  # 2 full stripes of 4 fragments of 1 MiB (+ parity)

    async def main():
        async with open_fs(vol) as fs:
            ino = await write_file(fs, ROOT, b"f", data)
            plain = await repair.scrub(fs.volume)
            frag = (1 << 20)
            limit = 8 << 20
            t0 = trio.current_time()
            s = await repair.scrub(fs.volume, limit=limit)
            took = trio.current_time() - t0
            assert s["fragments_checked"] == plain["fragments_checked"] == 12
            assert took >= 12 * frag / limit  # 1.5 s (0.05 s here without the limit)
            dev1 = os.path.join(str(vol), "dev1")
            lost = on_device(dev1)
            assert len(lost) == 2  # one fragment of each stripe
            for f in lost:
                lose(f)
            fs.volume.data._decoded.clear()
            assert await read_file(fs, ino) == data  # degraded: queues the damage
            t0 = trio.current_time()
            r = await repair.repair(fs.volume, limit=limit)
            took = trio.current_time() - t0
            assert r["fragments_rebuilt"] == 2 and r["stripes_failed"] == 0, r
            assert took >= 2 * (4 + 1) * frag / limit  # k read, one written, per stripe
            assert {(f.sid, f.idx) for f in lost} <= intact_keys(dev1)
            fs.volume.data._decoded.clear()
            assert await read_file(fs, ino) == data
    trio.run(main)


def test_stripe_with_damage_in_every_fragment_reads_and_repairs(tmp_path):
    """Damage in five of the six fragments of a stripe that still leaves k good copies
    of every block row: one cut short, one with a bad block, one whose padding after
    the block table is not zeros, one with bad blocks elsewhere, one longer than its
    header says. The file reads back; repair rebuilds all five (it could not read the
    stripe before: no 4 of its fragments were whole), scrub then finds nothing, and
    fsck --full is clean."""
    from fragments import flip, intact, on_volume, payload_area
    vol = tmp_path / "vol"
    data = os.urandom(4 << 20)  # one stripe: fragments of 1 MiB, 4 KiB blocks

    async def main():
        async with open_fs(vol, layout="files") as fs:
            ino = await write_file(fs, ROOT, b"f", data)
            frags = {f.idx: f for f in on_volume(vol)}
            assert sorted(frags) == list(range(6))

            def block(i, row):  # a byte of payload block ``row`` (revision 2)
                return payload_area(frags[i])[0] + 80 + 4096 * (row - 1) + 9
            os.truncate(frags[0].path, block(0, 150))
            flip(frags[1], block(1, 10))
            flip(frags[2], payload_area(frags[2])[0] - 5)  # the padding
            flip(frags[3], block(3, 100))
            flip(frags[3], block(3, 101))
            with open(frags[4].path, "ab") as f:
                f.write(b"\0")
            fs.volume.data._tables.clear()
            assert await read_file(fs, ino) == data
            r = await repair.repair(fs.volume)
            assert r["fragments_rebuilt"] == 5 and r["stripes_failed"] == 0, r
            assert r["stripes_short"] == 0 and r["fragments_short"] == {}, r
            assert all(intact(f) for f in on_volume(vol))
            s = await repair.scrub(fs.volume)
            assert s["bad_fragments"] == 0 and s["stripes"] == 0, str(s)
            problems, _ = await fsck(fs.volume, full=True)
            assert problems == []
            fs.volume.data._decoded.clear()
            fs.volume.data._tables.clear()
            assert await read_file(fs, ino) == data
    trio.run(main)


class Refusing:
    """A device that reads as ``store`` does but fails every write with ``err``
    (ENOSPC: full; EIO: failing)."""

    def __init__(self, store, err):
        self._store, self._err = store, err

    def write(self, name, parts):
        raise OSError(self._err, os.strerror(self._err))

    write_aligned = write

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_repair_reports_the_stripes_it_leaves_short_and_why(tmp_path):
    """A 4+2 volume of 8 devices that lost device 0: each of its fragments can go to
    the two devices its stripe does not use. With every other device failing writes,
    repair rebuilds none and says why, per fragment: ENOSPC, or device down; with one
    spare device full, each fragment goes to the other (a failed write is tried on
    the next device); then nothing is short, and fsck --full is clean."""
    import errno
    vol = tmp_path / "vol"
    data = os.urandom(20 << 20)
    paths = [str(tmp_path / f"d{i}") for i in range(8)]

    async def main():
        async with open_fs(vol, devices=paths) as fs:
            v = fs.volume
            ino = await write_file(fs, ROOT, b"f", data)
            on0 = len(on_device(paths[0]))
            assert on0 > 0
            stores = dict(v.transport.stores)
            v.transport.stores[0] = FileNotFoundError("device gone")
            for err, why in ((errno.ENOSPC, "no_space"), (errno.EIO, "device_down")):
                for d in range(1, 8):
                    v.transport.stores[d] = Refusing(stores[d], err)
                r = await repair.repair(v)
                assert r["fragments_rebuilt"] == 0 and r["stripes_short"] == on0, r
                assert r["fragments_short"] == {why: on0}, r
            for d in range(1, 8):
                v.transport.stores[d] = stores[d]
            # the device repair tries first for a fragment of device 0 is full
            from bmfs.format.records import Stripe
            sid, st = next((int(k[2:], 16), st) for k, raw in await v.kv.range(b"t/", b"t0")
                           if 0 in (st := Stripe.unpack(raw)).devices)
            first = repair._places(v, sid, st.devices.index(0), list(st.devices), {0})[0]
            v.transport.stores[first] = Refusing(stores[first], errno.ENOSPC)
            r = await repair.repair(v)
            assert r["fragments_rebuilt"] == on0, r
            assert r["stripes_short"] == 0 and r["fragments_short"] == {}, r
            v.transport.stores[first] = stores[first]
            v.transport.stores[0] = stores[0]
            await repair.repair(v)  # (the copies left on device 0 are swept)
            v.data._decoded.clear()
            assert await read_file(fs, ino) == data
            problems, _ = await fsck(v, full=True)
            assert problems == []
    trio.run(main)


def test_the_control_file_serves_volume_administration_once_installed(tmp_path):
    """The control file of a filesystem the volume layer has not set up refuses status,
    device and repair requests (EOPNOTSUPP, said in the reply); once volume/admin.py
    installs its handlers it answers them, and branch requests work either way."""
    import json

    from bmfs.vfs.control import IN_PROCESS
    from bmfs.volume import admin

    async def ask(fs, fh, req: dict) -> dict:
        await fs.control.write(fh, json.dumps(req).encode())
        return json.loads(fs.control.read(fh, 0, 1 << 20))

    async def main():
        async with open_fs(tmp_path / "vol") as fs:
            fh = fs.control.open(IN_PROCESS)
            for op in ("status", "devices", "repair"):
                r = await ask(fs, fh, {"op": op})
                assert not r["ok"] and r["errno"] == errno.EOPNOTSUPP, r
                assert "not served here" in r["error"]
            assert (await ask(fs, fh, {"op": "branch_create", "name": "b"}))["ok"]
            admin.install(fs)
            r = await ask(fs, fh, {"op": "devices"})
            assert r["ok"] and sorted(r["result"]) == [str(d) for d in range(6)]
            r = await ask(fs, fh, {"op": "repair"})
            assert r["ok"] and r["result"]["stripes_failed"] == 0
            r = await ask(fs, fh, {"op": "status"})
            assert r["ok"] and len(r["result"]["devices"]) == 6
            fs.control.release(fh)
    trio.run(main)
