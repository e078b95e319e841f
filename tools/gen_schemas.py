#!/usr/bin/env python3
"""Regenerate bmfs/wire/ from schemas/ (*.proto and *.fbs).

    tools/gen_schemas.py           rewrite bmfs/wire/ from the schemas
    tools/gen_schemas.py --check   exit 1 (and list the files) if bmfs/wire/ differs

Caveats first:
- The generated code is committed so that running bmfs needs no compiler. Which compiler
  made it matters: the check compares bytes, so it pins the compilers below and says so
  when another version is on PATH instead of reporting a confusing diff.
- protoc is Debian's protobuf-compiler (libprotoc 3.21), on purpose, not grpcio-tools:
  protoc 3.21 emits "builder" gencode that every protobuf runtime from 4.21 to 7.x loads
  without warnings, while protoc >= 26 emits a runtime-version check that refuses any
  runtime older than itself, which would break the `protobuf>=4.25` dependency.
- flatc is Debian's flatbuffers-compiler (2.0.8). Its Python output imports sibling
  tables by their namespace (`from bmfs.examples.Vec3 import Vec3`); those imports are
  rewritten to the package the files land in (`bmfs.wire.fbs.bmfs.examples.Vec3`).
- Only top-level schemas/*.proto are compiled; imports between them become relative
  imports inside bmfs.wire.
- bmfs/wire/ is owned by this script: files there that it would not generate are deleted.

Environment: PROTOC and FLATC override the compiler paths.
"""
import argparse
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMAS = os.path.join(ROOT, "schemas")
WIRE = os.path.join(ROOT, "bmfs", "wire")
PROTOC_VERSION = "libprotoc 3.21.12"
FLATC_VERSION = "flatc version 2.0.8"
APT_HINT = "apt-get install protobuf-compiler flatbuffers-compiler"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if bmfs/wire differs from the schemas")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "wire")
            generate(out)
            if args.check:
                return check(out)
            install(out)
            print(f"regenerated {os.path.relpath(WIRE, ROOT)}")
            return 0
    except GenError as e:
        print(f"gen_schemas: {e}", file=sys.stderr)
        return 2


class GenError(Exception):
    pass


def generate(out):
    """Compile every schema into `out`, laid out as bmfs/wire/ should be."""
    os.makedirs(out)
    protos = sorted(f for f in os.listdir(SCHEMAS) if f.endswith(".proto"))
    fbs = sorted(f for f in os.listdir(SCHEMAS) if f.endswith(".fbs"))
    proto_modules, fbs_tables = [], {}
    if protos:
        protoc = compiler("PROTOC", "protoc", PROTOC_VERSION)
        run([protoc, f"-I{SCHEMAS}", f"--python_out={out}", *protos], cwd=SCHEMAS)
        for name in protos:
            module = name[:-len(".proto")] + "_pb2"
            proto_modules.append(module)
            relative_pb2_imports(os.path.join(out, module + ".py"))
    if fbs:
        flatc = compiler("FLATC", "flatc", FLATC_VERSION)
        fbs_out = os.path.join(out, "fbs")
        run([flatc, "--python", "-o", fbs_out, *fbs], cwd=SCHEMAS)
        fbs_tables = rewrite_fbs_imports(fbs_out)
        write(os.path.join(fbs_out, "__init__.py"),
              '"""flatc output for schemas/*.fbs (generated, do not edit)."""\n')
    write(os.path.join(out, "__init__.py"), init_text(proto_modules, fbs_tables))


def compiler(env, name, want):
    path = os.environ.get(env) or shutil.which(name)
    if not path:
        raise GenError(f"{name} not found ({APT_HINT})")
    got = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
    if got != want:
        raise GenError(f"{path} is {got!r}; the committed code is made with {want!r} "
                       f"({APT_HINT} on Debian 12)")
    return path


def run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise GenError(f"{os.path.basename(cmd[0])} failed:\n{proc.stderr.strip()}")


def relative_pb2_imports(path):
    # protoc writes `import other_pb2 as other__pb2`, which only works from sys.path's root.
    with open(path) as f:
        text = f.read()
    text = re.sub(r"^import (\w+_pb2) as (\w+)$", r"from . import \1 as \2", text, flags=re.M)
    write(path, text)


def rewrite_fbs_imports(fbs_out):
    """Point flatc's namespace imports into bmfs.wire.fbs; return {table name: module}."""
    roots = sorted(d for d in os.listdir(fbs_out) if os.path.isdir(os.path.join(fbs_out, d)))
    pattern = re.compile(r"^(\s*)from (%s)\." % "|".join(map(re.escape, roots)), re.M)
    tables = {}
    for dirpath, _, files in sorted(os.walk(fbs_out)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                text = f.read()
            write(path, pattern.sub(r"\1from bmfs.wire.fbs.\2.", text))
            rel = os.path.relpath(path, fbs_out)[:-len(".py")].replace(os.sep, ".")
            # Tables (not structs) have GetRootAs: those are the ones a file can hold.
            if name != "__init__.py" and "def GetRootAs(" in text:
                tables[rel] = "bmfs.wire.fbs." + rel
    return tables


def init_text(proto_modules, fbs_tables):
    lines = [
        '"""Code generated from schemas/ by tools/gen_schemas.py. Do not edit.',
        "",
        f"Compiled with {PROTOC_VERSION} and {FLATC_VERSION}. bmfs.typed.registry imports",
        "these lazily to resolve type names such as 'proto:bmfs.examples.Sample'.",
        '"""',
        "",
        "# protobuf modules, relative to this package",
        "PROTO_MODULES = (",
        *[f"    {m!r}," for m in proto_modules],
        ")",
        "",
        "# flatbuffers root-able tables: full name -> module defining a class of that name",
        "FBS_TABLES = {",
        *[f"    {k!r}: {v!r}," for k, v in sorted(fbs_tables.items())],
        "}",
        "",
    ]
    return "\n".join(lines)


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def tree(base):
    files = set()
    for dirpath, dirs, names in os.walk(base):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            if not name.endswith(".pyc"):
                files.add(os.path.relpath(os.path.join(dirpath, name), base))
    return files


def check(out):
    new, old = tree(out), tree(WIRE) if os.path.isdir(WIRE) else set()
    differ = sorted(
        [f"missing: {f}" for f in new - old]
        + [f"stale:   {f}" for f in old - new]
        + [f"differs: {f}" for f in new & old
           if not filecmp.cmp(os.path.join(out, f), os.path.join(WIRE, f), shallow=False)])
    if differ:
        print("bmfs/wire is out of date with schemas/ (run tools/gen_schemas.py):",
              file=sys.stderr)
        for line in differ:
            print(f"  {line}", file=sys.stderr)
        return 1
    print("bmfs/wire matches schemas/")
    return 0


def install(out):
    if os.path.isdir(WIRE):
        for f in tree(WIRE) - tree(out):
            os.remove(os.path.join(WIRE, f))
    shutil.copytree(out, WIRE, dirs_exist_ok=True)
    # Remove directories emptied by deleting stale files.
    for dirpath, dirs, files in os.walk(WIRE, topdown=False):
        if dirpath != WIRE and not os.listdir(dirpath):
            os.rmdir(dirpath)


if __name__ == "__main__":
    sys.exit(main())
