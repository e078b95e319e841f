"""Level 0: the floors of bmfs/ (docs/architecture.md) read from the code's own imports.

Every ``import`` in every module of bmfs/ is read with ``ast``, those inside functions
and under ``TYPE_CHECKING`` too (a lazy import is still a dependency). A module may
import modules on its own floor or below; an import that runs back up, or an import
cycle between modules, must be listed below with its reason. The lists may only
shrink: a new one fails the test, and so does a listed one that no longer exists, so
that whoever removes one also strikes it off.

``python tests/test_t0_layers.py`` prints the counts (imports, imports that run back
up, cycles) and each of them.
"""
from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bmfs"

# Top to bottom. ``x.*`` is the package x and all below it, a bare name one module;
# the longest pattern that matches a module places it.
FLOORS = [
    ("cli", ["bmfs", "bmfs.cli.*"]),  # bmfs itself: bmfs.mmap and friends, for programs
    # typed views work on a mounted path; the direct client opens a volume beside them
    ("fuse", ["bmfs.fuse.*", "bmfs.typed.*", "bmfs.client.*"]),
    ("volume", ["bmfs.volume.*", "bmfs.cluster.*"]),  # opening and administering a volume
    ("vfs", ["bmfs.vfs.*"]),
    ("data", ["bmfs.data.*"]),
    ("transport", ["bmfs.transport.*"]),
    ("node", ["bmfs.node.*"]),
    ("store", ["bmfs.store.*"]),
    ("meta", ["bmfs.meta.*"]),
    ("kv", ["bmfs.kv.*"]),
    ("leaves", ["bmfs.errors", "bmfs.config", "bmfs.proc", "bmfs.lru", "bmfs.wire.*",
                "bmfs.format.*", "bmfs.native", "bmfs.ownfile", "bmfs.metrics"]),
]

# (importer, imported): why it is there. Only ever shrinks.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

# Sets of modules that import each other (strongly connected): why. Only ever shrinks.
KNOWN_CYCLES: dict[frozenset, str] = {}


def modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted name -> (file, is a package's __init__) for every module of bmfs/."""
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        out[".".join(parts)] = (p, is_pkg)
    return out


def imports(name: str, path: pathlib.Path, is_pkg: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, anywhere in its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[:len(name.split(".")) - node.level + is_pkg]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:  # `from pkg import mod` imports the module mod
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {n: imports(n, p, pkg, set(mods)) for n, (p, pkg) in mods.items()}


def floor_of(name: str) -> int:
    """The index (0 = top) of the floor of module ``name``; KeyError if none places it."""
    best = None
    for i, (_, patterns) in enumerate(FLOORS):
        for pat in patterns:
            hit = (name == pat[:-2] or name.startswith(pat[:-1])) if pat.endswith(".*") \
                else name == pat
            if hit and (best is None or len(pat) > best[0]):
                best = (len(pat), i)
    if best is None:
        raise KeyError(name)
    return best[1]


def upward(g: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The imports that run back up: to a module on a higher floor."""
    return {(a, b) for a, deps in g.items() for b in deps if floor_of(b) < floor_of(a)}


def cycles(g: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected sets of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.add(frozenset(scc))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_floor():
    assert [n for n in graph() if _unplaced(n)] == []


def _unplaced(name: str) -> bool:
    try:
        floor_of(name)
        return False
    except KeyError:
        return True


def test_the_reader_sees_lazy_and_relative_imports():
    g = graph()
    assert "bmfs.vfs.gc" in g["bmfs.vfs.fs"]          # inside a method
    assert "bmfs.meta.keys" in g["bmfs.volume.volume"]  # `from ..meta import keys`
    assert "bmfs.kv" in g["bmfs.volume.volume"]         # `from ..kv import open_kv, seal`
    assert "bmfs.kv.seal" in g["bmfs.volume.volume"]


def folder(name: str) -> str:
    """The folder (package directly under bmfs/) of module ``name``, or the module
    itself if it sits directly in bmfs/."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() \
        else name


def folder_graph(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports between folders (and bmfs/'s own modules)."""
    out: dict[str, set[str]] = {}
    for a, deps in g.items():
        out.setdefault(folder(a), set()).update(folder(b) for b in deps)
    return {f: deps - {f} for f, deps in out.items()}


def test_a_folder_stands_on_one_floor():
    """No module sits on a floor other than its folder's (a leaf is a folder or a
    module of bmfs/ of its own, not one module of a folder above): so the folders'
    own imports keep the order too."""
    g = graph()
    assert [n for n in g if floor_of(n) != floor_of(folder(n))] == []


def test_no_import_runs_back_up_but_the_known_ones():
    found = upward(graph())
    new = sorted(found - set(KNOWN_UPWARD))
    gone = sorted(set(KNOWN_UPWARD) - found)
    assert new == [], f"imports that run back up (floors: {[f for f, _ in FLOORS]}): {new}"
    assert gone == [], f"no longer there: strike them off KNOWN_UPWARD: {gone}"


def test_no_import_cycle_but_the_known_ones():
    found = cycles(graph())
    new = [sorted(c) for c in found - set(KNOWN_CYCLES)]
    gone = [sorted(c) for c in set(KNOWN_CYCLES) - found]
    assert new == [], f"new import cycles (or known ones that changed): {new}"
    assert gone == [], f"no longer cycles as listed: update KNOWN_CYCLES: {gone}"


def main() -> None:
    g = graph()
    up, cyc = sorted(upward(g)), sorted(sorted(c) for c in cycles(g))
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports between them, "
          f"{len(up)} run back up, {len(cyc)} cycles "
          f"({sum(map(len, cyc))} modules in them)")
    fg = folder_graph(g)
    fup = sorted(upward(fg))
    print(f"{len(fg)} folders (and modules of bmfs/), {sum(map(len, fg.values()))} "
          f"imports between them, {len(fup)} run back up, {len(cycles(fg))} cycles")
    for a, b in up + fup:
        print(f"  up: {a} ({FLOORS[floor_of(a)][0]}) -> {b} ({FLOORS[floor_of(b)][0]})")
    for c in cyc:
        print(f"  cycle: {' '.join(c)}")


if __name__ == "__main__":
    main()
