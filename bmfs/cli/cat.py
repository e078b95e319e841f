"""bmfs cat PATH [--type TYPE] [--json] [--limit N]: print a typed file as text.

One protobuf message prints in protobuf text format; a record file prints one record per
line ("INDEX<TAB>text", or one JSON object per line with --json); a flatbuffers table
prints its fields as JSON; an array prints its dtype, shape and a summary of its values.
Exit status: 0, or 2 with one line on stderr when the file cannot be read as its type.
"""
import json
import os
import sys

from bmfs.errors import FsError


def add_parser(subparsers):
    p = subparsers.add_parser(
        "cat", help="print a typed file (protobuf, record file, flatbuffers, numpy)",
        description=__doc__.splitlines()[0])
    p.add_argument("path", help="a typed file in a bmfs mount")
    p.add_argument("--type", "-t", metavar="TYPE",
                   help="read as TYPE (e.g. proto:pkg.Msg) instead of the recorded type")
    p.add_argument("--json", action="store_true",
                   help="JSON output (one object per line for record files)")
    p.add_argument("--limit", "-n", type=int, metavar="N",
                   help="print at most N records of a record file")
    p.set_defaults(func=run)


def run(args) -> int:
    from bmfs import typed
    from bmfs.typed import fbs_view
    try:
        # An explicit --type is what the user wants, even if another one is recorded.
        view = typed.mmap(args.path, args.type, strict=args.type is None)
        write = sys.stdout.write
        if isinstance(view, typed.RecordFile):
            _records(view, args, write)
        elif hasattr(view, "DESCRIPTOR"):
            write(_message(view, args.json, one_line=False) + "\n")
        elif hasattr(view, "_tab"):
            write(json.dumps(fbs_view.to_dict(view, path=args.path), indent=2) + "\n")
        else:
            write(_array(view, args.json) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # `bmfs cat big.rec | head`: stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (FsError, OSError) as e:
        print(f"bmfs cat: {e}", file=sys.stderr)
        return 2
    return 0


def _message(message, as_json, one_line):
    from google.protobuf import json_format, text_format
    if as_json:
        return json.dumps(json_format.MessageToDict(message),
                          indent=None if one_line else 2)
    return text_format.MessageToString(message, as_one_line=one_line).strip()


def _records(view, args, write):
    limit = len(view) if args.limit is None else max(args.limit, 0)
    for i, message in enumerate(view[:limit]):
        text = _message(message, args.json, one_line=True)
        write(text + "\n" if args.json else f"{i}\t{text}\n")
    if limit < len(view):
        print(f"bmfs cat: ... {len(view) - limit} more records", file=sys.stderr)


def _array(arr, as_json):
    import numpy as np
    order = "F" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C"
    if as_json:
        flat = np.asarray(arr).ravel(order="K")  # a view for the contiguous mapping
        return json.dumps({"dtype": arr.dtype.str, "shape": list(arr.shape), "order": order,
                           "nbytes": int(arr.nbytes), "first": flat[:8].tolist()})
    summary = np.array2string(np.asarray(arr), threshold=64, edgeitems=3)
    return (f"{arr.dtype} array, shape {arr.shape}, {order}-order, {arr.nbytes} bytes\n"
            f"{summary}")
