"""`bmfs` command dispatcher. One module per command; each has add_parser(sub).

Exit codes (docs/operations.md): 0 success, 1 the check or operation found a
problem or could not finish (fsck, repair, scrub, drain, umount's wait), 2 a usage
or user error (printed as one line), 3 an internal error, 4 a merge refused for its
conflicts (nothing changed; ``--json`` lists them).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ..errors import FsError, VolumeError

COMMANDS = ["mkfs", "mount", "fsck", "status", "branch", "repair", "node", "cluster", "cat", "type_", "admin",
            "dump", "completion", "python"]


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit status 2."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("bmfs")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bmfs", description="bmfs: an erasure-coded POSIX "
                                "filesystem with branches and typed views")
    p.add_argument("--debug", action="store_true", help="log debug messages")
    p.add_argument("--version", action="version", version=f"bmfs {_version()}",
                   help="print bmfs's version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"bmfs.cli.{name}")
        except ImportError as e:
            if name in ("cat", "type_"):
                continue  # typed views not installed in this build
            raise e
        mod.add_parser(sub)
    return p


def main(argv=None) -> int:
    from ..proc import tune_malloc
    tune_malloc()  # this is a bmfs process (a command or a daemon), not an importer's
    # what bmfs makes (volume, metadata, logs, pid files, devices, fragments) is for
    # root or the volume's owner alone, whatever umask it was started with
    os.umask(0o077)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="bmfs: %(levelname)s: %(message)s")
    try:
        code = args.func(args)
    except (UserError, VolumeError, ValueError) as e:
        print(f"bmfs: {e}", file=sys.stderr)
        code = 2
    except FsError as e:
        print(f"bmfs: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        code = 0
    except Exception:
        logging.exception("internal error")
        code = 3
    sys.exit(code or 0)


if __name__ == "__main__":
    # `python -m bmfs.cli.main` (the mount daemon, mount.fuse.bmfs, tests): run the
    # imported module's main, whose except clauses name the UserError the commands raise
    # (this __main__ copy has its own class of that name, which they never raise)
    from bmfs.cli.main import main as _main
    _main()
