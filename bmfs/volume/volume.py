"""A volume: its metadata engine, settings, devices and data client, opened together.

A single-machine volume is a directory holding ``volume.json`` (where the metadata
lives; everything else is in the metadata), the SQLite metadata, and, unless other
paths were given to mkfs, its k+m device directories ``dev0`` ... ``devN``.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import time
import uuid as uuidlib

import trio

from ..config import VolumeSettings, get_settings, group_id
from ..data.client import DataClient
from ..errors import InUse, InUseHere, Unavailable, VolumeError
from ..kv import open_kv, seal
from ..kv.mountsock import SOCKET_NAME, MountSockKV
from ..meta import keys
from ..meta.namespace import ROOT
from ..format.records import Inode
from ..store.file import make_private_dir
from ..store.pmem import (LAYOUTS, check_device_path, format_store, make_private,
                          make_private_folder, open_store, tighten_device)
from ..transport.local import LocalTransport

log = logging.getLogger(__name__)
VOLUME_FILE = "volume.json"
# how new volumes' device directories keep fragments (``bmfs mkfs --layout``)


def read_volume_file(path: str) -> dict:
    vf = os.path.join(path, VOLUME_FILE)
    if not os.path.isdir(path):
        raise VolumeError(f"{path}: no such volume directory")
    try:
        with open(vf) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise VolumeError(f"{path} is not a bmfs volume (no {VOLUME_FILE})")
    except (OSError, ValueError) as e:
        raise VolumeError(f"{path}: unreadable {VOLUME_FILE}: {e}")
    if info.get("magic") != "bmfs-volume":
        raise VolumeError(f"{path}: {VOLUME_FILE} is not a bmfs volume file")
    return info


def _home(info: dict) -> str | None:
    """The directory the volume was made in: named in volume.json (``home``), or, for
    volumes made before that, the directory of its default SQLite database."""
    if info.get("home"):
        return info["home"]
    meta = info.get("meta", "")
    if meta.startswith("sqlite:") and os.path.basename(meta[7:]) == "meta.db":
        return os.path.dirname(meta[7:])
    return None


def _relocation(path: str, info: dict) -> str | None:
    """The directory a copied or moved single-machine volume was made in, if ``path``
    is such a copy (it holds a database of its own, but volume.json still names the
    original's); None for a volume at home, or one whose metadata lives elsewhere
    (etcd, ``mkfs --meta``), where copying the directory copies only its address.

    Raises VolumeError for a copy whose original is still there and that shares device
    directories outside itself with it: both volumes would write the same fragment
    files."""
    home = _home(info)
    here = os.path.realpath(path)
    if home is None or os.path.realpath(home) == here \
            or info.get("meta") != f"sqlite:{home}/meta.db" \
            or not os.path.exists(os.path.join(here, "meta.db")):
        return None
    return home


def _relocate_record(rec: dict, home: str, here: str) -> dict:
    p = rec.get("path", "")
    if rec.get("node", "local") == "local" and (p == home or p.startswith(home + "/")):
        return {**rec, "path": here + p[len(home):]}
    return rec


async def _make_own(kv, path: str, info: dict, home: str) -> None:
    """Make a copied or moved volume its own: device records under the original
    directory now name the same directories under this one, and volume.json names
    this directory's database. Devices outside the volume directory are shared with
    the original only if it is still there: refused (it would corrupt both)."""
    here = os.path.realpath(path)
    records = await device_records(kv)
    original_there = os.path.exists(os.path.join(home, VOLUME_FILE))
    outside = [rec["path"] for rec in records.values()
               if not rec.get("removed") and rec.get("node", "local") == "local"
               and _relocate_record(rec, home, here) is rec]
    if original_there and outside:
        raise VolumeError(
            f"{path} is a copy of the volume in {home}, and its devices "
            f"{', '.join(outside)} are outside the volume directory: both volumes would "
            f"write the same fragment files. Copy those devices and point the copy at "
            f"them, or mount the original")

    async def fn(txn):
        for dev, rec in (await device_records(txn)).items():
            new = _relocate_record(rec, home, here)
            if new is not rec:
                txn.put(keys.device(dev), json.dumps(new).encode())
    await kv.transact(fn)
    _write_volume_file(path, {**info, "meta": f"sqlite:{here}/meta.db", "home": here})
    log.warning("%s: a copy or move of the volume made in %s: its metadata and device "
                "records now name this directory", path, home)


def _write_volume_file(path: str, info: dict) -> None:
    tmp = os.path.join(path, VOLUME_FILE) + ".tmp"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                           0o600), "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(path, VOLUME_FILE))


async def mkfs(path: str, k: int = 4, m: int = 2, devices: list[str] | None = None,
               meta: str | None = None, fragment_size: int = 1 << 20,
               nodes: list[str] | None = None,
               domains: list[str] | None = None,
               layout: str | None = None, on_nodes: bool = False,
               admin_group: str | None = None) -> VolumeSettings:
    """Create a volume in directory ``path``. Raises VolumeError if one is there already.
    ``layout``: how device directories keep fragments (store/pmem.py LAYOUTS; default
    config.Settings.layout). ``on_nodes``: a volume whose devices will be storage nodes' (on
    other machines), none yet: each is added with ``bmfs node add --address`` once its
    node serves it; a new cluster secret is written to ``path``/secret (unless one is
    there). ``admin_group``: a group (of this machine) whose members may manage
    branches and snapshots (vfs/control.py)."""
    layout = layout or get_settings().layout
    if admin_group is not None:
        try:
            group_id(admin_group)
        except KeyError:
            raise VolumeError(f"--admin-group: no group {admin_group!r} on this machine")
    if os.path.exists(os.path.join(path, VOLUME_FILE)):
        raise VolumeError(f"{path} already holds a bmfs volume")
    if layout not in LAYOUTS:
        raise VolumeError(f"unknown device layout {layout!r} (one of {', '.join(LAYOUTS)})")
    if on_nodes and devices:
        raise VolumeError("a volume on storage nodes starts with no devices: add each with "
                          "bmfs node add --address once its node serves it")
    if devices and len(devices) < k + m:
        raise VolumeError(f"--ec {k}+{m} needs at least {k + m} devices, {len(devices)} given")
    for d in devices or ():
        _check_new_device(d, path)
    check_new_volume_dir(path)
    make_private_dir(path)  # (everything in it is then out of others' reach)
    if on_nodes:
        devices = []
    else:
        devices = [d if d.startswith("pmem:") else os.path.abspath(d) for d in devices] \
            if devices else [os.path.join(os.path.realpath(path), f"dev{i}") for i in range(k + m)]
    if len(set(devices)) != len(devices):
        raise VolumeError("the same device path is given twice")
    settings = VolumeSettings(uuid=str(uuidlib.uuid4()), k=k, m=m,
                              fragment_size=fragment_size, format=keys.FORMAT_REVISION,
                              created=time.time())
    meta = meta or f"sqlite:{os.path.realpath(path)}/meta.db"
    kv = await open_kv(meta)
    try:
        if await kv.raw_get(keys.SETTINGS) is not None:
            raise VolumeError(f"the metadata at {meta} already holds a volume")
        if on_nodes:  # (a secret left in the directory by an earlier attempt is kept)
            from ..node.protocol import make_secret
            make_secret(os.path.join(path, "secret"))
        for i, d in enumerate(devices):
            format_store(d, settings.uuid, i, layout)
        txn = kv.begin()
        txn.put(keys.SETTINGS, json.dumps({**settings.to_json(), **(
            {"admin_group": admin_group} if admin_group else {})}).encode())
        for i, d in enumerate(devices):
            rec = {"path": d, "node": nodes[i] if nodes else "local"}
            if domains:
                rec["domain"] = domains[i]
            txn.put(keys.device(i), json.dumps(rec).encode())
        now = time.time_ns()
        root = Inode(mode=0o40755, nlink=2, atime_ns=now, mtime_ns=now, ctime_ns=now)
        txn.put(keys.counter("ino"), b"%d" % (ROOT + 1))
        txn.put(keys.counter("layer"), b"2")
        txn.put(keys.layer(1), json.dumps({"parent": None}).encode())
        txn.put(keys.branch("main"), json.dumps({"head": 1, "created": time.time()}).encode())
        txn.put(keys.inode(ROOT) + b"@%08x" % 1, keys.LIVE + root.pack())
        await kv.commit(txn)
        await kv.sync()
    finally:
        await kv.aclose()
    _write_volume_file(path, {"magic": "bmfs-volume", "meta": meta, "uuid": settings.uuid,
                              "home": os.path.realpath(path),
                              **({"secret": "secret"} if nodes or on_nodes else {})})
    # (SQLite made its files with the process's umask: a bmfs command's is 077, a
    # program calling this may have another)
    tighten(path, {"meta": meta}, {i: {"path": d} for i, d in enumerate(devices)})
    return settings


def check_new_volume_dir(path: str) -> None:
    """VolumeError unless ``path`` may become a volume directory: not a symbolic link
    (one planted in a shared directory would lead mkfs where its owner chose, and the
    owner could point it elsewhere later), not another user's directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise VolumeError(f"{path} is a symbolic link: give the path it names "
                          f"({os.path.realpath(path)})")
    if st.st_uid != os.geteuid():
        raise VolumeError(f"{path} belongs to uid {st.st_uid}: a volume directory must be "
                          f"owned by the user that makes it (uid {os.geteuid()})")


def _check_new_device(d: str, volume: str) -> None:
    """VolumeError unless ``d`` may be made a device of the new volume at ``volume``:
    check_device_path's rules, not the volume directory itself, and (a directory) new
    or empty."""
    check_device_path(d)
    if d.startswith("pmem:"):
        return
    if os.path.abspath(d) == os.path.abspath(volume):
        raise VolumeError(f"{d} is the volume directory: a device needs one of its own")
    if os.path.lexists(os.path.join(d, "DEVICE")):
        raise VolumeError(f"{d} already belongs to a bmfs volume")
    if os.path.isdir(d) and os.listdir(d):
        raise VolumeError(f"{d} is not empty (a new device is an empty or new directory)")


def tighten(path: str, info: dict, records: dict[int, dict]) -> list[str]:
    """Take others' access off what the volume keeps on this machine: its directory
    (0700), its files (0600: volume.json, the SQLite metadata and the files beside it
    named after it: -wal, -shm, lock, mount.log, pid files, the secret) and its local devices (tighten_device). A volume
    made by an older bmfs left them readable. Returns what changed."""
    changed: list[str] = []
    try:
        make_private(path, 0o700, changed)
        names = [VOLUME_FILE, "mount.log", "mount.pid", info.get("secret", "secret")]
        meta = info.get("meta", "")
        if meta.startswith("sqlite:"):  # the database and its -wal, -shm, lock ...
            db = meta[7:]
            names += [os.path.join(os.path.dirname(db), n) for n in
                      os.listdir(os.path.dirname(db) or ".")
                      if n.startswith(os.path.basename(db))]
        for name in names:
            make_private(os.path.join(path, name), 0o600, changed)
        make_private_folder(os.path.join(path, "mounts"), 0o600, changed)
        for rec in records.values():
            if rec.get("node", "local") == "local" and not rec.get("removed"):
                tighten_device(rec.get("path", ""), changed)
    except OSError as e:  # not the volume's owner (a read-only look): leave it
        log.debug("%s: permissions not tightened: %s", path, e)
    return changed


async def device_records(kv) -> dict[int, dict]:
    """Every device record (removed ones too): device id -> its record. ``kv`` is the
    engine, or a transaction (whose commit then compares them)."""
    return {keys.device_of(k): json.loads(v)
            for k, v in await kv.range(keys.DEVICE_PREFIX, keys.DEVICE_PREFIX + b"\xff")}


def in_service(records: dict[int, dict]) -> list[int]:
    """The devices new fragments may go to: neither draining nor removed."""
    return sorted(dev for dev, rec in records.items()
                  if not rec.get("removed") and not rec.get("draining"))


def _local_transport(settings, records) -> LocalTransport:
    stores = {}
    for dev, rec in records.items():
        if rec.get("removed"):  # forgotten: its directory may be gone or reused
            continue
        try:
            stores[dev] = open_store(rec["path"], settings.uuid, dev)
        except VolumeError as e:
            stores[dev] = e
    bad = [s for s in stores.values() if isinstance(s, Exception)]
    if len(bad) > settings.m:
        raise VolumeError(f"{len(bad)} devices unusable, at most {settings.m} may be: "
                          + "; ".join(str(b) for b in bad))
    for b in bad:
        log.warning("degraded: %s", b)
    return LocalTransport(stores)


def _tcp_transport(path, info, records):
    from ..node.protocol import read_secret
    from ..transport.tcp import TcpTransport
    secret_file = os.path.join(path, info.get("secret", "secret"))
    try:
        secret = read_secret(secret_file)
    except OSError as e:
        raise VolumeError(f"{path}: cannot read the cluster secret {secret_file}: {e.strerror}")
    tls = None
    if info.get("tls") is not None:  # node connections over TLS (node/tls.py)
        from ..node.tls import TlsConfig
        try:
            tls = TlsConfig.from_json(info["tls"], path).context(server=False)
        except (ValueError, OSError) as e:  # (ssl.SSLError is an OSError)
            raise VolumeError(f"{path}: the tls section of {VOLUME_FILE}: {e}") from e
    return TcpTransport({dev: rec["node"] for dev, rec in records.items()
                         if not rec.get("removed")}, secret, tls=tls)


async def _mount_kv(path: str):
    """The metadata of the volume at ``path`` read through the mount that owns it
    (bmfs/kv/mountsock.py), for a direct client.

    Raises:
        InUse: no mount answers there (the owner is another process: fsck, a writing
            direct client).
        PermissionError: this user may not connect to it.
    """
    try:
        return await MountSockKV.create(os.path.join(path, SOCKET_NAME))
    except PermissionError:
        raise
    except (OSError, Unavailable):
        raise InUse(f"{path} is in use by another bmfs process, not a mount that "
                    "serves its metadata (fsck, or a writing direct client?)") from None


async def read_settings(kv, path: str, meta: str) -> dict:
    """The volume settings, checked: a sealed record (revision 3 on), or the plain JSON
    of an older revision (then ``kv.sealed`` is set False: its values carry no
    checksums).

    Raises VolumeError: no settings, or a record that is neither."""
    raw = await kv.raw_get(keys.SETTINGS)
    if raw is None:
        raise VolumeError(f"{path}: the metadata at {meta} holds no volume")
    sealed = seal.is_sealed(keys.SETTINGS, raw)
    try:
        d = json.loads(raw[:-seal.SEAL_BYTES] if sealed else raw)
        fmt = d.get("format")
    except (ValueError, AttributeError):
        d, fmt = None, None
    if not isinstance(fmt, int) or sealed != (fmt >= keys.SEALED_REVISION):
        raise VolumeError(f"{path}: the volume settings record in {meta} is damaged "
                          "(fails its checksum)")
    if fmt not in keys.OPENS_REVISIONS:
        raise VolumeError(
            f"{path}: volume format revision {fmt}, this bmfs reads "
            f"revisions {keys.OPENS_REVISIONS[0]} to {keys.OPENS_REVISIONS[-1]}")
    kv.sealed = sealed
    return d


async def _upgrade(kv, path: str, d: dict) -> dict:
    """Raise an older volume's format revision to this bmfs's: below revision 3, seal
    every record (bmfs/kv/seal.py), then the settings; then the revision in the settings
    (revision 4 adds record counts to inodes, records.Inode: those of earlier revisions
    read as UNCOUNTED and stay valid, so nothing else is rewritten). Returns the
    settings, upgraded. Resumes an upgrade cut short; if another process finishes it
    meanwhile, reads what it wrote."""
    old = d["format"]
    n = 0
    if old < keys.SEALED_REVISION:
        n = await seal.seal_all(kv, keys.SEALING, keys.SETTINGS, keys.LEASED_PREFIXES)
        await seal.finish(kv, keys.SEALING, keys.SETTINGS,
                          json.dumps({**d, "format": keys.SEALED_REVISION}).encode())
        kv.sealed = True

    async def raise_revision(txn):
        cur = json.loads(await txn.get(keys.SETTINGS))
        if cur["format"] < keys.FORMAT_REVISION:
            cur["format"] = keys.FORMAT_REVISION
            txn.put(keys.SETTINGS, json.dumps(cur).encode())
        return cur
    d = await kv.transact(raise_revision)
    log.warning("%s: volume format revision %s upgraded to %d (%d records sealed with "
                "checksums): bmfs of revision %s no longer opens it",
                path, old, d["format"], n, old)
    return d


def _say_tightened(path: str, changed: list[str]) -> None:
    if changed:
        log.warning("%s: tightened permissions of %d paths other users could reach "
                    "(directories now 0700, files 0600): %s%s", path, len(changed),
                    ", ".join(changed[:8]), " ..." if len(changed) > 8 else "")


class Volume:
    """An opened volume. Create with ``await Volume.open(path)``; close with ``aclose``."""

    def __init__(self, path, kv, settings, transport, data, device_paths):
        self.path = path
        self.kv = kv
        self.settings = settings
        self.transport = transport
        self.data = data
        self.device_paths = device_paths
        self.removed: set[int] = set()  # devices `bmfs node remove` forgot
        self._devices_lock = None  # a trio.Lock, made on first use (refresh_devices)
        # the device records' change number (their highest "seq") this volume took up,
        # and the one up to which every stripe placed before is committed
        # (session.confirm_devices; published in the mount's m/ record for drain)
        self.devices_seq = 0
        self.devices_confirmed = 0
        self.devices_changed = trio.lowlevel.ParkingLot()  # devices_seq rose
        self.confirmed_changed = trio.lowlevel.ParkingLot()  # devices_confirmed rose
        self.damage: list[tuple[int, int, str]] = []
        self._usage = None

    @classmethod
    async def open(cls, path: str, missing_ok_devices: bool = True,
                   upgrade: bool = True, shared: bool = False) -> "Volume":
        """Open the volume at ``path``. A volume of an older format revision this bmfs
        still reads is upgraded first (keys.FORMAT_REVISION), unless ``upgrade`` is
        False: then it is only read (status, fsck without --repair). ``shared``: for
        a direct client (bmfs/client), the metadata opened beside other processes
        (kv.open_kv), or, where a mount owns a one-machine volume's database, read
        through that mount (_mount_kv); implies ``upgrade=False``.

        Raises VolumeError: no volume there, another volume's metadata, or a format
        revision this bmfs does not read."""
        info = read_volume_file(path)
        upgrade = upgrade and not shared
        home = _relocation(path, info)
        if home is not None and not upgrade:
            raise VolumeError(f"{path} is a copy or move of the volume made in {home}: "
                              f"mount it (or fsck --repair) once to make it its own")
        try:
            kv = await open_kv(f"sqlite:{os.path.realpath(path)}/meta.db" if home
                               else info["meta"], shared=shared)
        except InUseHere:
            raise  # (no mount serves it: this process owns it)
        except InUse:
            if not shared:
                raise
            kv = await _mount_kv(path)
        try:
            d = await read_settings(kv, path, info["meta"])
            if d["format"] != keys.FORMAT_REVISION:
                if upgrade:
                    d = await _upgrade(kv, path, d)
                elif await kv.raw_get(keys.SEALING) is not None:
                    raise VolumeError(f"{path}: an upgrade to format revision "
                                      f"{keys.FORMAT_REVISION} was cut short: mount the "
                                      "volume (or run bmfs fsck --repair) to finish it")
            settings = VolumeSettings.from_json(d)
            if settings.uuid != info.get("uuid"):
                raise VolumeError(f"{path}: {VOLUME_FILE} and the metadata name different volumes")
            if home is not None:
                await _make_own(kv, path, info, home)
            records = await device_records(kv)
            if upgrade:
                _say_tightened(path, tighten(path, info, records))
            # (a volume made for storage nodes names its secret before it has devices)
            if "secret" in info or any(rec.get("node", "local") != "local"
                                       for rec in records.values()):
                transport = _tcp_transport(path, info, records)
            else:
                transport = _local_transport(settings, records)
            vol = cls(path, kv, settings, transport, None, {})
            vol.data = DataClient(transport, [], settings.k, settings.m, settings.inline_max,
                                  on_damage=vol._damaged)
            vol._take_up(records)
            vol.devices_confirmed = vol.devices_seq  # nothing placed before this
            return vol
        except BaseException:
            await kv.aclose()
            raise

    @property
    def on_nodes(self) -> bool:
        """Whether the devices are storage nodes' (TCP), not this machine's directories."""
        return not isinstance(self.transport, LocalTransport)

    def _take_up(self, records: dict[int, dict]) -> None:
        """Make the device records the volume's: devices new to it are attached to the
        transport; the data client places new stripes on those in service (neither
        draining nor removed), keeping its list object (the same one everywhere)."""
        for dev, rec in records.items():
            if rec.get("removed"):
                # forgotten: never read, listed or swept again through this id (its
                # directory may be added back as a new device, under a new id)
                self.transport.forget_device(dev)
                continue
            if dev in self.device_paths:
                if self.on_nodes and self.transport.stores.get(dev) != rec["node"]:
                    # its node moved (bmfs node set-address): reach it there from now on
                    self.transport.add_device(dev, rec["node"])
                continue
            if self.on_nodes:
                self.transport.add_device(dev, rec["node"])
            elif dev not in self.transport.stores:
                try:
                    store = open_store(rec["path"], self.settings.uuid, dev)
                except (VolumeError, OSError) as e:  # absent for now: reads decode
                    store = VolumeError(f"device {dev}: {e}")
                self.transport.add_device(dev, store)
        self.device_paths = {dev: rec.get("path", "") for dev, rec in records.items()}
        self.removed = {dev for dev, rec in records.items() if rec.get("removed")}
        self.data.devices[:] = in_service(records)
        # a device just drained may hold fragments written before: fsync covers it
        self.data.sync_devices = sorted(d for d, r in records.items() if not r.get("removed"))
        self.data.domains.update((dev, rec.get("domain") or rec.get("node", "local"))
                                 for dev, rec in records.items())
        seq = max((rec.get("seq", 0) for rec in records.values()), default=0)
        if seq > self.devices_seq:
            self.devices_seq = seq
            self.devices_changed.unpark_all()

    async def refresh_devices(self) -> None:
        """Read the device records and take them up: after this process changed one
        (drain, undrain, add), and every few seconds in the mount's upkeep loop for
        what other mounts changed. One at a time, so records read earlier are never
        applied after ones read later."""
        if self._devices_lock is None:
            self._devices_lock = trio.Lock()
        async with self._devices_lock:
            self._take_up(await device_records(self.kv))

    async def device_usage(self, max_age: float = 2.0) -> dict[int, dict | Exception]:
        """Usage of every device ({total, free} or the error), cached for ``max_age`` s."""
        import time as _time
        from ..errors import DeviceError
        now = _time.monotonic()
        if self._usage and now - self._usage[0] < max_age:
            return self._usage[1]
        out: dict[int, dict | Exception] = {}

        async def one(dev):
            try:
                with trio.fail_after(3):
                    out[dev] = await self.transport.stat(dev)
            except (DeviceError, OSError, trio.TooSlowError) as e:
                out[dev] = e
        async with trio.open_nursery() as nursery:
            for dev in self.device_paths:
                if dev not in self.removed:  # forgotten: its node may be long gone
                    nursery.start_soon(one, dev)
        self._usage = (now, out)
        return out

    def _damaged(self, sid: int, index: int, why: str) -> None:
        self.damage.append((sid, index, why))

    async def record_damage(self) -> int:
        """Queue fragments found missing or corrupt for repair (``h/`` keys)."""
        found, self.damage = self.damage, []
        if found:
            txn = self.kv.begin()
            for sid, index, why in found:
                txn.put(keys.damage(sid, index), why.encode()[:200])
            await self.kv.commit(txn)
        return len(found)

    async def aclose(self) -> None:
        try:
            await self.record_damage()
        except Exception:  # noqa: BLE001 - closing anyway; damage is found again on read
            log.warning("could not record damaged fragments")
        await self.transport.aclose()
        await self.kv.aclose()
