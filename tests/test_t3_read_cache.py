"""Level 3: a file open for reading sees every change made meanwhile (vfs, no FUSE).

Reads keep the inode and slice lists they looked up while nothing was committed
(bmfs/vfs/reads.py, ``_read_cache``); any commit (a write through another handle, a
truncate, an overwrite) must make the next read look again.
"""
import os

import trio

from vfsutil import open_fs, write_file

ROOT = 1
MiB = 1 << 20


def test_reader_sees_writes_truncates_and_overwrites_of_others(tmp_path):
    async def main():
        async with open_fs(tmp_path / "vol") as fs:
            first = os.urandom(5 * MiB)
            ino = await write_file(fs, ROOT, b"f", first)
            rh = await fs.open(ino, os.O_RDONLY)
            assert await fs.files.read(rh, 0, 5 * MiB) == first
            assert await fs.files.read(rh, MiB, 10) == first[MiB:MiB + 10]  # cached now

            wh = await fs.open(ino, os.O_RDWR)  # another handle overwrites the middle
            patch = b"x" * 70_000
            await fs.files.write(wh, 4 * MiB + 5, patch)
            await fs.files.write(wh, 5 * MiB, b"tail")  # and extends the file
            await fs.files.release(wh)
            want = first[:4 * MiB + 5] + patch + first[4 * MiB + 5 + len(patch):] + b"tail"
            assert await fs.files.read(rh, 0, 6 * MiB) == want

            await fs.setattr(ino, size=3 * MiB)  # cut short by someone else
            assert await fs.files.read(rh, 0, 6 * MiB) == want[:3 * MiB]
            await fs.setattr(ino, size=3 * MiB + 100)  # grown with a hole
            assert await fs.files.read(rh, 3 * MiB - 2, 200) == want[3 * MiB - 2:3 * MiB] + \
                bytes(100)
            await fs.files.release(rh)
    trio.run(main)
