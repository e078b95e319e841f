"""Configuration: volume-wide settings (stored in the metadata) and per-mount options."""
from __future__ import annotations

import grp
import logging
import os
from dataclasses import asdict, dataclass, fields

from .format.revision import FORMAT_REVISION

LAYOUTS = ("pool", "files")  # of a device directory: store/pool.py, store/file.py
DEFAULT_LAYOUT = os.environ.get("BMFS_LAYOUT", "files")  # mkfs's, unless --layout


def group_id(name: str | None) -> int | None:
    """The gid of group ``name`` (a name, or a number) on this machine; None for none.
    The volume's admin group (vfs/control.py) is stored by name and resolved so on
    each machine that mounts the volume or makes it.

    Raises:
        KeyError: no such group here.
    """
    if name is None:
        return None
    if name.isdigit():
        return int(name)
    return grp.getgrnam(name).gr_gid


@dataclass(frozen=True)
class VolumeSettings:
    """Chosen at mkfs, stored at ``v/settings``, checked at every mount."""
    uuid: str
    k: int = 4
    m: int = 2
    fragment_size: int = 1 << 20      # data bytes per fragment of a full stripe
    inline_max: int = 16 << 10       # stripes this small live in the metadata
    format: int = FORMAT_REVISION
    created: float = 0.0

    @property
    def stripe_size(self) -> int:
        return self.k * self.fragment_size

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "VolumeSettings":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class MountOptions:
    branch: str = "main"
    attr_timeout: float = 1.0
    entry_timeout: float = 1.0
    allow_other: bool = True
    read_ahead_kb: int = 4096
    # mount(8)'s options (bmfs/cli/mount.py parses them; docs/operations.md)
    read_only: bool = False
    atime: str = "relatime"   # or "strictatime", "noatime"
    dev: bool = True          # device files usable (root's mounts only: FUSE forces
    suid: bool = True         # nodev and nosuid on other users' mounts)
    exec: bool = True
    metrics: str | None = None  # HOST:PORT of the Prometheus endpoint (metrics.py), or off


MAX_NAME = 255
MAX_FILE_SIZE = (1 << 63) - 1  # what the kernel allows (it answers EFBIG beyond)


def microseconds_setting(name: str, default_us: float, environ=os.environ) -> float:
    """Seconds from the environment variable ``name`` (microseconds, from 0 to 100000;
    0 turns the thing it sets off), else ``default_us``; a bad value is logged and
    the default used (a mount must not fail over a tuning knob)."""
    raw = environ.get(name)
    if raw is None:
        return default_us / 1e6
    try:
        us = float(raw)
        if not 0 <= us <= 100_000:
            raise ValueError
    except ValueError:
        logging.getLogger(__name__).warning(
            "%s=%r is not a number of microseconds from 0 to 100000; using %g",
            name, raw, default_us)
        us = default_us
    return us / 1e6


def default_volume() -> str:
    """Where `bmfs mount /bm` keeps the default volume (created on first use)."""
    if os.environ.get("BMFS_DEFAULT_VOLUME"):
        return os.environ["BMFS_DEFAULT_VOLUME"]
    if os.geteuid() == 0:
        return "/var/lib/bmfs/default"
    return os.path.expanduser("~/.local/share/bmfs/default")


def parse_ec(text: str) -> tuple[int, int]:
    try:
        k, m = (int(x) for x in text.lower().split("+"))
    except ValueError:
        raise ValueError(f"--ec wants K+M such as 4+2, not {text!r}")
    if not (1 <= k <= 32 and 0 <= m <= 16):
        raise ValueError(f"--ec {text}: need 1 <= K <= 32 and 0 <= M <= 16")
    if m == 0:
        raise ValueError(f"--ec {text}: M must be at least 1 (use K+1 or more for redundancy)")
    return k, m


def parse_rate(text: str) -> int:
    """Bytes a second from ``text``: a number with an optional K, M, G or T (powers of
    1024), e.g. 50M. For argparse (``type=``): a bad one is a usage error."""
    import argparse
    import re
    m = re.fullmatch(r"(\d{1,15}(?:\.\d{1,6})?)([kmgt]?)(?:i?b)?(?:/s)?", text.strip().lower())
    rate = float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " ") if m else 0
    if rate < 1:
        raise argparse.ArgumentTypeError(
            f"a rate is bytes a second, such as 50M (K, M, G, T: powers of 1024), not {text!r}")
    return int(rate)
