"""Level 0: the command line starts light."""
import subprocess
import sys

HEAVY = ("trio", "bmfs.volume.volume", "bmfs.data.client", "numpy", "google.protobuf")


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


def test_mount_options():
    """mount(8)'s options: ours, the ones left to mount(8)/fstab/libfuse, a remount
    (mount(8) puts the current options before `remount`: the ones after it win),
    unknown and contradictory ones (one-line errors)."""
    import pytest

    from bmfs.cli.main import UserError
    from bmfs.cli.mount import MS_NOATIME, MS_NODEV, MS_RDONLY, MS_REMOUNT, _mount_flags
    from bmfs.cli.mount import parse_options as p
    assert p("") == ({}, False, None)
    assert p("ro,noatime,nodev,nosuid,noexec,branch=x,defaults,_netdev,x-systemd.a=1") == (
        {"read_only": True, "atime": "noatime", "dev": False, "suid": False, "exec": False},
        False, "x")
    assert p("ro,relatime,remount,noatime,user_id=0,group_id=0,allow_other") == (
        {"read_only": True, "atime": "noatime"}, True, None)
    assert p("rw,relatime,remount") == ({"read_only": False}, True, None)  # (atime: kept)
    assert p("metrics=127.0.0.1:9100,ro") == (
        {"metrics": "127.0.0.1:9100", "read_only": True}, False, None)
    for bad, msg in (("ro,rw", "contradictory mount options: ro and rw"),
                     ("remount,dev,nodev", "contradictory mount options: dev and nodev"),
                     ("bogus", "unknown mount option 'bogus'"), ("sync", "unknown"),
                     ("remount,metrics=:1", "metrics= is set when mounting")):
        with pytest.raises(UserError, match=msg):
            p(bad)
    flags = _mount_flags({"rw", "nodev", "noatime"}, {"read_only": True})
    assert flags == MS_REMOUNT | MS_RDONLY | MS_NODEV | MS_NOATIME


def test_help_explains_every_argument():
    """`--help` of every command says what each of its arguments is: no argument,
    option or command is listed without a line of help."""
    import argparse

    from bmfs.cli.main import build_parser
    missing = []

    def walk(p, path):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                helps = {c.dest: c.help for c in a._choices_actions}
                for name, sp in a.choices.items():
                    if not helps.get(name):
                        missing.append(f"{path} {name}")
                    walk(sp, f"{path} {name}")
            elif not a.help:
                missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}")
    walk(build_parser(), "bmfs")
    assert missing == []


def test_completion_scripts(tmp_path):
    """`bmfs completion bash|zsh` prints a script that knows the commands and their
    options; bash reads it without a syntax error; another shell is a usage error."""
    res = subprocess.run([sys.executable, "-m", "bmfs.cli.main", "completion", "bash"],
                         capture_output=True, text=True, check=True)
    assert "umount" in res.stdout and "--read-only" in res.stdout
    subprocess.run(["bash", "-n"], input=res.stdout, text=True, check=True)
    zsh = subprocess.run([sys.executable, "-m", "bmfs.cli.main", "completion", "zsh"],
                         capture_output=True, text=True, check=True)
    assert "#compdef bmfs" in zsh.stdout and "--nonempty" in zsh.stdout
    for shell in ("bash", "zsh", "tcsh"):  # (a NUL ends a shell's word: no script holds one)
        out = subprocess.run([sys.executable, "-m", "bmfs.cli.main", "completion", shell],
                             capture_output=True, check=True).stdout
        assert b"\0" not in out, shell
    (tmp_path / "bmfs.bash").write_text(res.stdout)  # bmfs completion bash > FILE
    sourced = subprocess.run(["bash", "-c", f"source {tmp_path}/bmfs.bash"],
                             capture_output=True, text=True)
    assert sourced.returncode == 0 and sourced.stderr == "", sourced
    bad = subprocess.run([sys.executable, "-m", "bmfs.cli.main", "completion", "fish"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_readme_starts_with_the_two_commands_and_lists_every_doc():
    """A newcomer's README: its first commands are the two that install and mount and
    install and test, and every page in docs/ is named in it."""
    import os
    import re
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(top, "README.md")) as f:
        readme = f.read()
    commands = re.findall(r"^    (\S.*)$", readme, re.M)
    assert commands[:2] == ["tools/setup.sh && bmfs mount /bm", "tools/test.sh"]
    docs = sorted(n for n in os.listdir(os.path.join(top, "docs")) if n.endswith(".md"))
    assert [d for d in docs if f"docs/{d}" not in readme] == []


def test_fsspec_comes_with_bmfs(tmp_path):
    """The README's `fsspec.filesystem("bm", ...)` works in the Python the first
    command (tools/setup.sh, which installs bmfs without extras) makes: fsspec is one of
    bmfs's own requirements, not only an extra's, and the "bm" protocol is registered
    by the installed package."""
    import re
    from importlib.metadata import requires
    plain = [r for r in requires("bmfs") if "extra ==" not in r]
    assert any(re.match(r"fsspec\b", r) for r in plain), plain
    vol = tmp_path / "vol"
    subprocess.run([sys.executable, "-m", "bmfs.cli.main", "mkfs", str(vol)], check=True,
                   capture_output=True)
    code = ("import fsspec; fs = fsspec.filesystem('bm', volume=%r); "
            "print(fs.ls('main/', detail=False)); fs.close()" % str(vol))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res


def test_bash_completion_installed_as_a_file_is_sourced(tmp_path):
    """What tools/setup.sh does for completion (tools/bash-completion.sh): the script
    it writes to a directory is one bash sources (`bmfs completion bash > FILE; source
    FILE`: a NUL in it broke that) and then completes bmfs; a second run changes
    nothing; without the directory it writes nothing and says how to enable it."""
    import os
    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "bash-completion.sh")
    res = subprocess.run([tool, sys.executable, str(tmp_path)], capture_output=True,
                         text=True)
    assert res.returncode == 0 and f"writing bash completion to {tmp_path}/bmfs" in \
        res.stdout, res
    sourced = subprocess.run(["bash", "-c", f"source {tmp_path}/bmfs && complete -p bmfs"],
                             capture_output=True, text=True)
    assert sourced.returncode == 0 and sourced.stderr == "" and "bmfs" in sourced.stdout, \
        sourced
    again = subprocess.run([tool, sys.executable, str(tmp_path)], capture_output=True,
                           text=True)
    assert again.returncode == 1 and again.stdout == "", again
    missing = subprocess.run([tool, sys.executable, str(tmp_path / "none")],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "bash completion not installed: there is no " \
        f"{tmp_path}/none" in missing.stdout and "bash-completion" in missing.stdout, missing
    assert not (tmp_path / "none").exists()
