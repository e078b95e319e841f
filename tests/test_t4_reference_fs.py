"""The benchmark's reference filesystems (tools/memfs.py, tools/passfs.py), mounted for
real: the bench's ratios are only worth something if they hold the bytes they are
given, as bmfs must."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mountutil import is_mounted

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")


@pytest.fixture(params=["memfs", "passfs"])
def refmount(request, tmp_path):
    mp, data = tmp_path / "mp", tmp_path / "data"
    mp.mkdir()
    data.mkdir()
    cmd = [sys.executable, os.path.join(TOOLS, f"{request.param}.py"), str(mp)]
    if request.param == "passfs":
        cmd += ["--data", str(data)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    end = time.monotonic() + 30
    while not is_mounted(mp):
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < end, "did not mount"
        time.sleep(0.02)
    try:
        yield mp, data
    finally:
        subprocess.run(["fusermount3", "-u", str(mp)], check=False)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stdout.read().decode()
    assert os.listdir(data) == [], "passfs left file data behind"


def test_reference_fs_holds_the_bytes(refmount):
    mp, data = refmount
    blob = os.urandom(3 * (1 << 20) + 123)
    f = mp / "f"
    with open(f, "wb") as fh:
        fh.write(blob)
        fh.flush()
        os.fsync(fh.fileno())
    assert f.stat().st_size == len(blob)
    with open(f, "rb") as fh:
        assert fh.read() == blob
        assert os.pread(fh.fileno(), 4096, 1 << 20) == blob[1 << 20:(1 << 20) + 4096]
    os.truncate(f, 1000)
    os.truncate(f, 5000)
    assert f.read_bytes() == blob[:1000] + bytes(4000)
    with open(f, "r+b") as fh:       # a hole, then bytes past it
        fh.seek(10_000)
        fh.write(b"tail")
    assert f.read_bytes() == blob[:1000] + bytes(9000) + b"tail"
    fd = os.open(f, os.O_RDONLY)     # unlinked while open: still readable
    try:
        os.unlink(f)
        assert not f.exists()
        assert os.pread(fd, 4, 10_000) == b"tail"
    finally:
        os.close(fd)
    with open(mp / "g", "wb") as fh:
        fh.write(b"x" * 100)
    with open(mp / "g", "wb") as fh:  # O_TRUNC
        fh.write(b"y")
    assert (mp / "g").read_bytes() == b"y"
    os.mkdir(mp / "d")
    assert sorted(os.listdir(mp)) == ["d", "g"]
