"""Level 0: the command line starts light."""
import subprocess
import sys

HEAVY = ("trio", "bmfs.vfs.volume", "bmfs.data.client", "numpy", "google.protobuf")


def test_the_command_line_starts_without_the_event_loop_or_the_volume_code():
    """Building every command's parser (what `bmfs branch create`, `bmfs snapshot
    list`, `bmfs type` and the other commands that send a request to a mount do
    before they send it) loads neither trio nor the volume, data or typed code: on
    these machines they were ~0.3 s of a ~0.45 s start. Commands that open a volume
    themselves (mkfs, fsck, status of an unmounted volume...) load them when they run."""
    code = ("import sys; from bmfs.cli.main import build_parser; build_parser(); "
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == ""


def test_version():
    from importlib.metadata import version
    res = subprocess.run([sys.executable, "-m", "bmfs.cli.main", "--version"],
                         capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == f"bmfs {version('bmfs')}", res
