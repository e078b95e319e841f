"""bmfs completion SHELL: print a tab-completion script for bash, zsh or tcsh.

The script is made from the command line parser itself (shtab), so it knows every
command, option and choice. Install it once, for example (bash, as root):

    bmfs completion bash > /etc/bash_completion.d/bmfs
"""
from __future__ import annotations

from .main import UserError

SHELLS = ("bash", "zsh", "tcsh")


def add_parser(sub):
    p = sub.add_parser("completion", help="print a shell completion script",
                       description="Print a tab-completion script for SHELL on stdout. "
                       "bash: bmfs completion bash > /etc/bash_completion.d/bmfs; zsh: "
                       "bmfs completion zsh > a directory of $fpath as _bmfs.")
    p.add_argument("shell", choices=SHELLS, help="the shell the script is for")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        import shtab
    except ImportError:
        raise UserError("shell completion needs the Python package shtab "
                        "(pip install shtab, or tools/setup.sh)")
    from .main import build_parser
    print(shtab.complete(build_parser(), shell=args.shell))
    return 0
