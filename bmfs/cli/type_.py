"""bmfs type PATH [TYPE] [--clear] [--no-check]: show or set a file's type.

With no TYPE, prints the recorded type (xattr user.bm.type); for a file with none
recorded, prints the type its header shows (.npy, record files) and says so on stderr.
With TYPE (npy, raw:<dtype>[:shape], proto:pkg.Msg, proto-records:pkg.Msg, fbs:ns.Table)
records it, after checking that the schema is registered and the file opens as that type
(--no-check skips both). Exit status: 0; 1 when no type is recorded or readable; 2 with
one line on stderr for a bad type, a mismatch or an unreadable file.
"""
import sys

from bmfs.errors import FsError


def add_parser(subparsers):
    p = subparsers.add_parser("type", help="show or set the type of a file (typed views)",
                              description=__doc__.splitlines()[0])
    p.add_argument("path", help="a file in a bmfs mount")
    p.add_argument("type", nargs="?", metavar="TYPE", help="the type to record")
    p.add_argument("--clear", action="store_true", help="remove the recorded type")
    p.add_argument("--no-check", action="store_true",
                   help="record TYPE without checking the schema or the file")
    p.set_defaults(func=run)


def run(args) -> int:
    from bmfs import typed
    from bmfs.typed.sniff import sniff
    from bmfs.typed.xattr import recorded_type
    try:
        if args.clear:
            if args.type:
                print("bmfs type: give TYPE or --clear, not both", file=sys.stderr)
                return 2
            typed.clear_type(args.path)
            return 0
        if args.type:
            print(typed.set_type(args.path, args.type, check=not args.no_check))
            return 0
        recorded = recorded_type(args.path)
        if recorded is not None:
            print(recorded)
            return 0
        sniffed = sniff(args.path)
        if sniffed is None:
            print(f"bmfs type: {args.path}: no type recorded", file=sys.stderr)
            return 1
        print(sniffed)
        print(f"bmfs type: {args.path}: not recorded, read from the file's header",
              file=sys.stderr)
        return 0
    except (FsError, OSError) as e:
        print(f"bmfs type: {e}", file=sys.stderr)
        return 2
