import contextlib
import os
import sys

sys.dont_write_bytecode = False
os.environ.setdefault("BMFS_TEST", "1")

from bmfs.proc import tune_malloc  # noqa: E402

tune_malloc()  # in-process encodes run at a daemon's speed (bmfs.proc.tune_malloc)

import pytest  # noqa: E402

from bmfs.config import use_settings  # noqa: E402
from mountutil import Mounted, mkfs  # noqa: E402


@pytest.fixture
def use_config():
    """``use_config(field=value, ...)``: this process's config.Settings with those
    changes until the test ends (objects made after it take them)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(use_settings(**changes))


@pytest.fixture
def volume(tmp_path):
    """A fresh 4+2 volume directory."""
    v = tmp_path / "vol"
    mkfs(v)
    return v


@pytest.fixture
def mnt(volume, tmp_path):
    """A real FUSE mount of a fresh volume; yields the Mounted object (.mp, .volume)."""
    with Mounted(volume, tmp_path / "mnt") as m:
        yield m
