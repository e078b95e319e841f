"""Level 4: progress bars of long commands, on a terminal (a pty) and not on a pipe,
offline and inside a real mount; what `bmfs status` says of a mount and of usage."""
import json
import os
import pty
import subprocess

import pytest

from mountutil import BMFS, Mounted, bmfs, mkfs


def on_terminal(*args) -> tuple[int, str, str]:
    """Run bmfs with its standard error on a pty (standard output a pipe): (status,
    stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(BMFS + [str(a) for a in args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # (EIO: the last holder of the pty's other side is gone)
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    out = proc.stdout.read().decode()
    return proc.wait(), out, shown.decode(errors="replace")


def _lose_device(volume, dev: int) -> None:
    """Delete every fragment file of device ``dev``."""
    for root, _dirs, files in os.walk(os.path.join(volume, f"dev{dev}")):
        for name in files:
            if name not in ("DEVICE", "LOCK"):
                os.unlink(os.path.join(root, name))


def _bar(shown: str, what: str) -> bool:
    return f"{what}:" in shown and "%|" in shown and " stripes" in shown


def test_scrub_and_fsck_show_a_bar_on_a_terminal_and_nothing_on_a_pipe(tmp_path):
    """Offline scrub (which finds lost fragments and repairs them) and fsck draw a bar
    on a terminal; piped, standard error has no bar (scrub's warnings about what it
    found, as ever) and --json's output is the same report."""
    vol, mp = tmp_path / "vol", tmp_path / "mnt"
    mkfs(vol)
    with Mounted(vol, mp):
        (mp / "f").write_bytes(os.urandom(12 << 20))
    _lose_device(vol, 0)
    status, out, shown = on_terminal("scrub", vol, "--json")
    assert status == 0, shown
    assert _bar(shown, "scrub"), shown
    terminal_report = json.loads(out)
    assert terminal_report["stripes_short"] == 0, terminal_report
    _lose_device(vol, 0)
    r = bmfs("scrub", vol, "--json")
    assert json.loads(r.stdout) == terminal_report
    assert "\r" not in r.stderr and "%|" not in r.stderr  # (its log lines only)
    status, out, shown = on_terminal("fsck", vol)
    assert status == 0 and _bar(shown, "fsck") and "consistent" in out, (out, shown)
    r = bmfs("fsck", vol)
    assert r.stderr == "" and r.stdout.strip().endswith("consistent")


def test_a_scrub_inside_a_mount_shows_the_mounts_progress(tmp_path):
    """`bmfs scrub MOUNTPOINT` runs inside the mount: on a terminal the CLI asks the
    mount for its progress meanwhile and draws it; piped, nothing but the report."""
    vol, mp = tmp_path / "vol", tmp_path / "mnt"
    mkfs(vol)
    with Mounted(vol, mp):
        (mp / "f").write_bytes(os.urandom(12 << 20))
        # (--limit makes it last a few polls: 3 stripes, 4 MiB of fragments each)
        status, out, shown = on_terminal("scrub", mp, "--limit", "4M")
        assert status == 0, shown
        assert _bar(shown, "scrub"), shown
        assert "stripes checked" in out or "checked" in out, out
        r = bmfs("scrub", mp, "--json", "--limit", "8M")
        assert r.stderr == ""
        json.loads(r.stdout)
        # nothing under way now; and the progress file takes no requests, even root's
        assert json.loads((mp / ".bm" / "progress").read_text()) == []
        fd = os.open(mp / ".bm" / "progress", os.O_WRONLY)
        try:
            with pytest.raises(PermissionError):
                os.write(fd, b'{"op": "repair"}')
        finally:
            os.close(fd)
        r = bmfs("branch", "create", "b", "-m", mp)
        (mp / ".bm" / "branches" / "b" / "g").write_bytes(b"x")
        status, out, shown = on_terminal("merge", "b", "--into", "main", "-m", mp)
        assert status == 0 and "fast-forward" in out, (out, shown)


def test_status_shows_branch_usage_clients_and_a_backlog_that_agrees(tmp_path):
    """Through a mount: the branch it shows, the bytes in files and on devices (4+2:
    1.5 times, and the fragments' headers), this mount as the volume's client. With
    a device gone, the repair backlog counts the fragments that device held, in the
    stripes said to be short of full redundancy."""
    vol, mp = tmp_path / "vol", tmp_path / "mnt"
    mkfs(vol)
    with Mounted(vol, mp, "--branch", "main"):
        (mp / "f").write_bytes(os.urandom(12 << 20))
        st = json.loads(bmfs("status", mp, "--json").stdout)
        assert st["branch"] == "main"
        u = st["usage"]
        assert u["file_bytes"] == 12 << 20
        assert u["device_bytes"] == sum(
            os.stat(os.path.join(root, n)).st_size
            for d in range(6) for root, _, names in os.walk(vol / f"dev{d}")
            for n in names if n not in ("DEVICE", "LOCK"))
        assert 1.5 <= u["amplification"] < 1.52
        assert len(st["clients"]) == 1
        text = bmfs("status", mp).stdout
        assert "(branch main)" in text and "space amplification 1.5" in text
        assert "repair backlog: 0 fragments in 0 stripes" in text
        on0 = [d for d in st["devices"] if d["id"] == 0][0]["fragments"]
    os.rename(vol / "dev0", tmp_path / "dev0.away")
    try:
        st = json.loads(bmfs("status", vol, "--json").stdout)
        b = st["repair_backlog"]
        assert b["on_missing_devices"] == on0 == 3 and b["fragments"] == on0
        assert b["stripes"] == st["stripes_short"] == 3
        text = bmfs("status", vol).stdout
        assert f"repair backlog: {on0} fragments in 3 stripes" in text
        assert "stripes short of full redundancy: 3" in text
    finally:
        os.rename(tmp_path / "dev0.away", vol / "dev0")

