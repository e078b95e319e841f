"""Level 6: the Prometheus endpoints of a real mount and a real storage node
(--metrics), scraped over HTTP after doing I/O; an address in use."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from bmfs.cluster.directory import free_ports
from mountutil import Mounted, bmfs, is_mounted
from test_t8_cluster import Cluster, _devices, _drop_caches


def scrape(port: int) -> dict:
    """{'name{labels}': value} of every sample the endpoint serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def moved(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def wait_for(fn, what: str, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not seen"
        time.sleep(0.2)


def _serve_node(tmp_path, cluster, dev: int, port: int, metrics: int, log):
    return subprocess.Popen(
        [sys.executable, "-m", "bmfs.cli.main", "node", "serve", "--format",
         "--listen", f"127.0.0.1:{port}", "--device", f"{dev}={tmp_path / f'n{dev}'}",
         "--secret-file", f"{cluster.dir}/secret", "--volume-uuid", cluster.info["uuid"],
         "--metrics", str(metrics)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def test_a_scraped_mount_and_node_count_what_was_done(tmp_path):
    """A 4+2 cluster on etcd, a seventh node serving device 6 with --metrics and a
    mount with --metrics: writing 24 MiB moves the mount's written bytes by exactly
    that, its stripe writes by the stripes stored, and its etcd round trips; the
    node's PUTs and written bytes by what landed on device 6 (its fragment files).
    Reading it back after dropping the caches moves the read bytes by 24 MiB; with a
    node killed, reads are degraded, and the mount reports that device unhealthy and
    the fragments it found missing as repair backlog."""
    node_port, node_metrics, mount_metrics = free_ports(3)
    with Cluster(tmp_path / "cluster", "--meta", "etcd") as cluster, \
            open(tmp_path / "n6.log", "wb") as log:
        proc = _serve_node(tmp_path, cluster, 6, node_port, node_metrics, log)
        try:
            wait_for(lambda: _listening(node_port) or proc.poll() is not None, "node up")
            assert proc.poll() is None, (tmp_path / "n6.log").read_text()
            node0 = scrape(node_metrics)
            assert node0['bmfs_device_healthy{device="6"}'] == 1
            assert 0 < node0['bmfs_device_bytes_free{device="6"}'] <= \
                node0['bmfs_device_bytes_total{device="6"}']
            mp = tmp_path / "mnt"
            with Mounted(cluster.dir, mp, "--metrics", f"127.0.0.1:{mount_metrics}"):
                bmfs("node", "add", tmp_path / "n6", "--address", f"127.0.0.1:{node_port}",
                     "--id", 6, "-m", mp)
                before = scrape(mount_metrics)
                data = os.urandom(24 << 20)
                with open(mp / "f", "wb") as f:
                    f.write(data)
                    os.fsync(f.fileno())
                after = scrape(mount_metrics)
                assert moved(before, after, 'bmfs_fuse_bytes_total{kind="write"}') == len(data)
                assert moved(before, after, 'bmfs_stripe_bytes_total{kind="write"}') == len(data)
                stripes = moved(before, after, 'bmfs_stripe_operations_total{op="write"}')
                assert stripes == len(data) // (4 << 20)
                assert moved(before, after, 'bmfs_fuse_operations_total{op="write"}') > 0
                assert moved(before, after, 'bmfs_etcd_requests_total{path="/v3/kv/txn"}') > 0
                assert moved(before, after,
                             'bmfs_fuse_operation_seconds_count{op="write"}') > 0

                frag_bytes = sum(e.st_size for e in _fragment_files(tmp_path / "n6"))
                assert _devices(mp)[6]["fragments"] > 0 and frag_bytes > 0
                node1 = scrape(node_metrics)
                assert moved(node0, node1, 'bmfs_node_requests_total{op="put"}') == \
                    _devices(mp)[6]["fragments"]
                assert moved(node0, node1, 'bmfs_node_bytes_total{kind="written"}') == frag_bytes

                _drop_caches()
                before = scrape(mount_metrics)
                assert (mp / "f").read_bytes() == data
                after = scrape(mount_metrics)
                assert moved(before, after, 'bmfs_fuse_bytes_total{kind="read"}') == len(data)
                assert moved(before, after, 'bmfs_stripe_bytes_total{kind="read"}') == len(data)
                assert moved(before, after, 'bmfs_reads_total{kind="degraded"}') == 0

                cluster.kill(0)
                _drop_caches()
                assert (mp / "f").read_bytes() == data
                after2 = scrape(mount_metrics)
                assert moved(after, after2, 'bmfs_reads_total{kind="degraded"}') > 0
                missing = moved(after, after2, 'bmfs_fragments_damaged_total{kind="missing"}')
                assert missing > 0
                wait_for(lambda: scrape(mount_metrics).get(
                    'bmfs_device_healthy{device="0"}') == 0, "device 0 unhealthy")
                wait_for(lambda: scrape(mount_metrics).get(
                    "bmfs_repair_backlog_fragments", 0) > 0, "a repair backlog")
                # bmfs status: this mount as the volume's client; a backlog of the dead
                # node's fragments, in the stripes it says are short
                st = json.loads(bmfs("status", mp, "--json").stdout)
                assert [c["mountpoint"] for c in st["clients"]] == [str(mp)]
                b = st["repair_backlog"]
                assert b["stripes"] == st["stripes_short"] > 0
                # (those reads found missing are queued; the others on a dead device)
                assert b["queued"] + b["on_missing_devices"] == b["fragments"] == \
                    _devices(mp)[0]["fragments"] > 0 and b["on_missing_devices"] > 0
                cluster.start()
        finally:
            proc.kill()
            proc.wait()


def _fragment_files(device):
    for root, _dirs, files in os.walk(device):
        for name in files:
            if name not in ("DEVICE", "LOCK") and not name.startswith("."):
                yield os.stat(os.path.join(root, name))


def test_metrics_address_in_use_is_one_line_and_nothing_starts(tmp_path):
    """--metrics at an address another process listens on: `bmfs mount` and `bmfs
    node serve` each exit 2 with one line naming it; nothing is mounted, the node
    serves nothing. A malformed address is refused the same way."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        vol, mp = tmp_path / "vol", tmp_path / "mnt"
        bmfs("mkfs", vol)
        mp.mkdir()
        for addr in (str(port), f"127.0.0.1:{port}"):
            r = bmfs("mount", mp, "--volume", vol, "--metrics", addr, check=False, timeout=60)
            assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
            assert f"--metrics {addr}" in r.stderr and "in use" in r.stderr
            assert not is_mounted(mp)
        r = bmfs("mount", mp, "--volume", vol, "--metrics", "host:port", check=False)
        assert r.returncode == 2 and "--metrics wants PORT or HOST:PORT" in r.stderr
        assert not is_mounted(mp)

        node_port = free_ports(1)[0]
        (tmp_path / "secret").write_bytes(os.urandom(32))
        r = bmfs("node", "serve", "--format", "--listen", f"127.0.0.1:{node_port}",
                 "--device", f"0={tmp_path / 'd0'}", "--secret-file", tmp_path / "secret",
                 "--volume-uuid", "00000000-0000-0000-0000-000000000000",
                 "--metrics", str(port), check=False, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "in use" in r.stderr
        assert not _listening(node_port) and not (tmp_path / "d0").exists()
    finally:
        busy.close()


def test_metrics_on_an_address_others_reach_is_logged_as_unauthenticated(tmp_path):
    """Off loopback the endpoint serves as asked, and the mount's log says anyone who
    reaches it reads the metrics; on loopback (the default host) nothing is said."""
    vol, mp = tmp_path / "vol", tmp_path / "mnt"
    bmfs("mkfs", vol)
    wide, local = free_ports(2)
    with Mounted(vol, mp, "--metrics", f"0.0.0.0:{wide}"):
        assert "bmfs_fuse_operations_total" in str(scrape(wide))
    assert "have no authentication" in (vol / "mount.log").read_text()
    (vol / "mount.log").write_text("")
    with Mounted(vol, mp, "--metrics", str(local)):
        assert "bmfs_fuse_operations_total" in str(scrape(local))
    assert "authentication" not in (vol / "mount.log").read_text()


def test_metrics_as_a_mount_option(tmp_path):
    """`-o metrics=ADDR` (what an fstab line can say) serves the endpoint as
    `--metrics ADDR` does; at a remount it is refused in one line."""
    vol, mp = tmp_path / "vol", tmp_path / "mnt"
    bmfs("mkfs", vol)
    (port,) = free_ports(1)
    with Mounted(vol, mp, "-o", f"noatime,metrics=127.0.0.1:{port}"):
        assert "bmfs_fuse_operations_total" in str(scrape(port))
        r = subprocess.run(["mount", "-o", f"remount,metrics=127.0.0.1:{port}", str(mp)],
                           capture_output=True, text=True)
        assert r.returncode != 0
    assert not _listening(port)
