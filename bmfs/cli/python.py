"""bmfs python [ARGS...]: run the Python that bmfs is installed in (the checkout's
.venv), so ``import bmfs`` works: ``bmfs python script.py``, ``bmfs python -c ...``,
or ``bmfs python`` alone for a prompt."""
from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub):
    p = sub.add_parser("python", help="run the Python bmfs is installed in (import bmfs "
                       "works there)", description=__doc__.splitlines()[0] + " "
                       + " ".join(ln.strip() for ln in __doc__.splitlines()[1:]),
                       prefix_chars="\0", add_help=False)  # every argument is the
    # interpreter's (bmfs python -h: python's help); no option of its own, so no
    # option string with that NUL prefix reaches the completion scripts
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="arguments for python (a script, -c CODE, -m MODULE ...)")
    p.set_defaults(func=run)


def run(args) -> int:
    os.umask(0o022)  # (bmfs's commands run with 077; a user's program with the usual)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *args.args])
