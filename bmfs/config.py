"""Configuration: volume-wide settings (stored in the metadata), per-mount options, and
this process's tuning from ``BMFS_*`` environment variables (:class:`Settings`, read
once by :func:`get_settings`; tests replace it with :func:`use_settings`)."""
from __future__ import annotations

import contextlib
import dataclasses
import grp
import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import Iterator, Mapping

LAYOUTS = ("pool", "files")  # of a device directory: store/pool.py, store/file.py


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
    format: int = 0                  # the volume format revision (format/revision.py)
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


def _seconds_or_none(name: str, raw: str | None) -> float | None:
    """Seconds from ``raw`` (the value of ``name``), None if unset or empty; a bad value
    is logged and taken for unset."""
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        logging.getLogger(__name__).warning("%s=%r is not a number of seconds; ignored",
                                            name, raw)
        return None


def _number(name: str, raw: str | None, default, kind=float):
    """``kind(raw)``, else ``default`` (unset; a bad value is logged)."""
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        logging.getLogger(__name__).warning("%s=%r is not a number; using %s",
                                            name, raw, default)
        return default


@dataclass(frozen=True)
class SqliteLimits:
    """The sqlite engine's memory and batching (bmfs/kv/sqlite.py's module doc); not
    from the environment: tests make them small."""

    apply_keys: int = 4096         # pending keys that make the next commit apply the batch
    cache_keys: int = 65536        # values (and absences) of keys read or written lately
    cache_value_max: int = 20 << 10  # larger values are not kept (inline stripes: 16 KiB)
    cache_bytes: int = 64 << 20      # values kept, in all (the oldest quarter goes beyond)
    complete_prefixes: int = 100_000  # prefixes whose every key is known, and keys listed
    complete_keys: int = 200_000      # under them in all: past either, the oldest go (to half)
    complete_prefix_keys: int = 4096  # a prefix with more keys is forgotten (a big directory)
    log_max: int = 64 << 20  # a redo log this large is cut back (apply, fsync the WAL) at once


@dataclass(frozen=True)
class Settings:
    """This process's tuning, each field from one environment variable (docs:
    operations.md, etcd.md, architecture.md). Read once (:func:`get_settings`) and passed
    down to constructors or asked for; nothing else reads ``BMFS_*`` variables."""

    layout: str = "files"              # BMFS_LAYOUT: mkfs's device layout, unless --layout
    default_volume: str | None = None  # BMFS_DEFAULT_VOLUME: where `bmfs mount /bm` keeps it
    native: bool = True                # BMFS_NATIVE=0: no C helpers (the Python path)
    inline_reads: bool = True          # BMFS_INLINE_READS=0: local reads always in threads
    spin: float = 500e-6               # BMFS_SPIN_US: a lone small tcp read's reply is spun for
    idle_spin: float = 0.0             # BMFS_IDLE_SPIN_US: a mount stays awake after an answer
    repair_rounds: int = 6             # BMFS_REPAIR_ROUNDS: upkeep rounds between repairs
    orphan_grace: float | None = None  # BMFS_ORPHAN_GRACE: deferred frees on shared volumes
    etcd_compact_interval: float = 60.0    # BMFS_ETCD_COMPACT_INTERVAL (0: off)
    etcd_compact_window: float = 300.0     # BMFS_ETCD_COMPACT_WINDOW
    etcd_defrag_min: int = 256 << 20       # BMFS_ETCD_DEFRAG_MIN (0: no defragmentation)
    node_fault: str | None = None      # BMFS_NODE_FAULT: `bmfs node --fault`'s default (tests)
    sqlite: SqliteLimits = SqliteLimits()  # (not from the environment)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        """The settings ``environ`` gives; bad values are logged and defaults used (a
        mount must not fail over a tuning knob)."""
        d = cls()
        return cls(
            layout=environ.get("BMFS_LAYOUT") or d.layout,
            default_volume=environ.get("BMFS_DEFAULT_VOLUME") or None,
            native=environ.get("BMFS_NATIVE", "1") != "0",
            inline_reads=environ.get("BMFS_INLINE_READS", "1") != "0",
            spin=microseconds_setting("BMFS_SPIN_US", d.spin * 1e6, environ),
            idle_spin=microseconds_setting("BMFS_IDLE_SPIN_US", d.idle_spin * 1e6, environ),
            repair_rounds=max(1, _number("BMFS_REPAIR_ROUNDS", environ.get("BMFS_REPAIR_ROUNDS"),
                                         d.repair_rounds, int)),
            orphan_grace=_seconds_or_none("BMFS_ORPHAN_GRACE", environ.get("BMFS_ORPHAN_GRACE")),
            etcd_compact_interval=_number("BMFS_ETCD_COMPACT_INTERVAL",
                                          environ.get("BMFS_ETCD_COMPACT_INTERVAL"),
                                          d.etcd_compact_interval),
            etcd_compact_window=_number("BMFS_ETCD_COMPACT_WINDOW",
                                        environ.get("BMFS_ETCD_COMPACT_WINDOW"),
                                        d.etcd_compact_window),
            etcd_defrag_min=_number("BMFS_ETCD_DEFRAG_MIN", environ.get("BMFS_ETCD_DEFRAG_MIN"),
                                    d.etcd_defrag_min, int),
            node_fault=environ.get("BMFS_NODE_FAULT") or None,
        )


_settings: Settings | None = None


def get_settings() -> Settings:
    """This process's settings, read from the environment the first time."""
    global _settings
    if _settings is None:
        _settings = Settings.from_environ()
    return _settings


@contextlib.contextmanager
def use_settings(**changes) -> Iterator[Settings]:
    """This process's settings with ``changes`` (field=value) until the block ends (for
    tests: objects made inside the block take them)."""
    global _settings
    before = get_settings()
    _settings = dataclasses.replace(before, **changes)
    try:
        yield _settings
    finally:
        _settings = before


def default_volume() -> str:
    """Where `bmfs mount /bm` keeps the default volume (created on first use): root's
    is /var/lib/bmfs/default, another user's $XDG_DATA_HOME/bmfs/default
    (~/.local/share/bmfs/default without it; _home says which home)."""
    if get_settings().default_volume:
        return get_settings().default_volume
    if os.geteuid() == 0:
        return "/var/lib/bmfs/default"
    data = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(data):  # (the XDG spec: a relative one is ignored)
        data = os.path.join(_home(), ".local", "share")
    return os.path.join(data, "bmfs", "default")


def _home() -> str:
    """The user's home: $HOME if it is the user's own directory, else the home of the
    user's passwd entry (a HOME kept from root by setpriv, su -p or sudo -E names a
    directory this user cannot write)."""
    import pwd
    home = os.environ.get("HOME", "")
    try:
        if home and os.stat(home).st_uid == os.geteuid():
            return home
    except OSError:
        pass
    try:
        return pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:  # (a uid without a passwd entry)
        return home or "/"


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
