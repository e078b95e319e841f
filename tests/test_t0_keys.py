"""Level 0: the metadata keyspace is defined in bmfs/meta/keys.py alone, and
docs/keyspace.md describes the same keys."""
import ast
import inspect
import pathlib
import re

from bmfs.meta import keys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# a bytes literal that is a key prefix (b"d/", b"h/%016x/") or a range end (b"h0")
RAW_KEY = re.compile(rb"^[a-z]/|^[a-z]0$")
# engine-private keys (below the 0xFF prefix the kv layer reserves), not metadata
ALLOWED = {("bmfs/kv/etcd_wire.py", b"r/")}
SAMPLE = {int: 1, str: "a", bytes: b"a"}


def _doc_prefixes() -> set[bytes]:
    text = (ROOT / "docs/keyspace.md").read_text()
    rows = re.findall(r"^([a-z]/[^<\s]*)", text, re.M)
    return {row.encode() for row in rows}


def test_keyspace_table_matches_docs():
    table = {prefix for prefix, _, _ in keys.KEYSPACE}
    assert len(table) == len(keys.KEYSPACE)
    assert set(keys.LAYERED_PREFIXES) | set(keys.LEASED_PREFIXES) <= table
    docs = _doc_prefixes()
    assert table - docs == set(), "in keys.KEYSPACE but not in docs/keyspace.md"
    assert docs - table == set(), "in docs/keyspace.md but not in keys.KEYSPACE"


def test_builders_make_keys_under_their_prefix():
    for prefix, builder, _ in keys.KEYSPACE:
        if builder is None:
            continue
        params = inspect.signature(builder).parameters.values()
        key = builder(*(SAMPLE[p.annotation] for p in params))
        assert key.startswith(prefix), (builder.__name__, key)
        assert sum(key.startswith(p) for p, _, _ in keys.KEYSPACE) == 1, key


def test_parsers_invert_builders():
    assert keys.device_of(keys.device(0x12)) == 0x12
    assert keys.node_of(keys.node("n1")) == "n1"
    assert keys.layer_of(keys.layer(7)) == 7
    assert keys.tree_name_of(keys.branch("main")) == "main"
    assert keys.tree_name_of(keys.snapshot("s.1")) == "s.1"
    assert keys.stripe_of(keys.stripe(2**40 + 3)) == 2**40 + 3
    assert keys.stripe_of(keys.garbage(9)) == 9
    assert keys.damage_of(keys.damage(5, 0x1f)) == (5, 0x1f)
    assert keys.damage(5, 1).startswith(keys.damage_prefix(5))
    assert keys.orphan_of(keys.orphan(3, 99)) == (3, 99)
    assert keys.orphan(3, 99).startswith(keys.orphan_prefix(3))
    assert keys.mount_id_of(keys.mount("host:1:ab")) == "host:1:ab"
    assert keys.inode_of(keys.inode(42)) == 42
    assert keys.inode_of(keys.symlink(42)) is None
    assert keys.dentry_of(keys.dentry(1, b"a/b\xff")) == (1, b"a/b\xff")
    assert keys.chunk_of(keys.chunk(8, 3)) == (8, 3)
    assert keys.xattr_name_of(keys.xattr(8, b"user.x")) == b"user.x"
    for sub in (keys.inode(6), keys.dentry(6, b"n"), keys.chunk(6, 0),
                keys.xattr(6, b"user.x"), keys.symlink(6)):
        assert keys.ino_of(sub) == 6
        assert keys.kind(sub) in keys.LAYERED_PREFIXES
    start, end = keys.span(keys.DAMAGE_PREFIX)
    assert start <= keys.damage(2**64 - 1, 255) < end
    assert not start <= keys.garbage(0) < end


def test_no_raw_key_prefix_outside_keys_module():
    found = []
    for path in sorted((ROOT / "bmfs").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "bmfs/meta/keys.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Constant) and isinstance(node.value, bytes) \
                    and RAW_KEY.match(node.value) and (rel, node.value) not in ALLOWED:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert found == [], "key prefixes spelled outside bmfs/meta/keys.py:\n" + "\n".join(found)
