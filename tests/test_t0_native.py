"""Level 0: the C helper (native/bmfs_native.c) against the Python path it replaces.

Both paths must write the same bytes: a volume written by one is read by the other
(a machine where the helper was not built, or BMFS_NATIVE=0). tools/setup.sh builds
the helper, so its absence here is a failure, not a skip, unless BMFS_NATIVE=0 asks
for the Python path.
"""
import errno
import os
import random
import struct
import subprocess
import sys

import pytest
from crc32c import crc32c
from pyeclib.ec_iface import ECDriver

from bmfs.format import fragment as fr
from bmfs.data.codec import EC_TYPE, LIB_HEADER, Codec
from bmfs.native import NATIVE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_native = pytest.mark.skipif(os.environ.get("BMFS_NATIVE") == "0",
                                  reason="BMFS_NATIVE=0: the Python path is under test")


@needs_native
def test_helper_is_built():
    assert NATIVE is not None, "bmfs.data._native is missing: run tools/setup.sh"


@needs_native
@pytest.mark.parametrize("k,m", [(4, 2), (2, 1), (6, 3), (8, 4)])
@pytest.mark.parametrize("size", [1, 17, 4095, 4096, 16_385, 100_000, 3 * 2**20 + 7, 4 << 20])
def test_encode_is_byte_identical_to_pyeclib(k, m, size):
    ref = ECDriver(k=k, m=m, ec_type=EC_TYPE)
    fast = Codec(k, m)
    rng = random.Random(size * 31 + k)
    for round_ in range(4):  # the first encode of a length learns its headers
        data = rng.randbytes(size)
        arg = memoryview(data) if round_ == 2 else data  # stripes arrive as views too
        if round_ == 3:  # and as the write buffer's pieces, cut anywhere
            cuts = sorted(rng.sample(range(size + 1), min(size + 1, 5)))
            arg = [data[a:b] for a, b in zip([0] + cuts, cuts + [size])]
        got = fast.encode(arg)
        assert got == ref.encode(data)
        # and what the fast path wrote decodes with pyeclib from any k fragments
        pick = rng.sample(range(k + m), k)
        assert ref.decode([got[i] for i in pick]) == data


@pytest.mark.parametrize("native", [None, NATIVE])
def test_encode_takes_pieces_on_both_paths(native):
    """A stripe handed over as a list of pieces (empty ones and a memoryview among
    them) encodes as their concatenation, the first encode of a length and later."""
    data = random.Random(9).randbytes((4 << 20) - 5)
    pieces = [b"", data[:1 << 20], memoryview(data)[1 << 20:3 << 20], b"", data[3 << 20:]]
    want = ECDriver(k=4, m=2, ec_type=EC_TYPE).encode(data)
    c = Codec(4, 2, native=native)
    assert c.encode(pieces) == want
    assert c.encode(pieces) == want


@pytest.mark.parametrize("k,m", [(4, 2), (2, 1), (6, 3)])
@pytest.mark.parametrize("size", [1, 4096, 100_000, (4 << 20) - 3])
def test_rebuild_data_both_paths(k, m, size):
    """Degraded reads rebuild lost data fragments from any k others: the C path and
    the pyeclib path give the payloads the encode wrote, for every choice of k
    fragments (whole fragments handed over as views, as the client does)."""
    import itertools
    data = random.Random(size + k).randbytes(size)
    frags = Codec(k, m).encode(data)
    paths = [Codec(k, m, native=None)] + ([Codec(k, m)] if NATIVE is not None else [])
    for have in itertools.combinations(range(k + m), k):
        missing = [i for i in range(k) if i not in have]
        if not missing:
            continue
        for c in paths:
            got = c.rebuild_data({i: memoryview(frags[i]) for i in have}, missing)
            assert [bytes(g) for g in got] == [f[LIB_HEADER:] for f in
                                               (frags[i] for i in missing)], (have, c._native)


@needs_native
def test_encode_runs_concurrently_in_threads():
    """Stripes are encoded in worker threads: the cached headers and the C tables
    must stay right when several threads encode stripes of different lengths."""
    import concurrent.futures
    c = Codec(4, 2)
    ref = ECDriver(k=4, m=2, ec_type=EC_TYPE)
    rng = random.Random(5)
    datas = [rng.randbytes(rng.choice([65_536, 1 << 20, 4 << 20, 123_457])) for _ in range(24)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(c.encode, datas))
    for d, frags in zip(datas, outs):
        assert frags == ref.encode(d)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 80, 1 << 20])
def test_block_table_both_paths(size):
    data = random.Random(size).randbytes(size)
    want = b"".join(struct.pack("<I", crc32c(data[i:i + fr.BLOCK]))
                    for i in range(0, size, fr.BLOCK))
    # revision 2: pyeclib's header is block 0, the stripe data's pages the others
    cut = min(LIB_HEADER, size)
    want2 = struct.pack("<I", crc32c(data[:cut])) + b"".join(
        struct.pack("<I", crc32c(data[i:i + fr.BLOCK])) for i in range(cut, size, fr.BLOCK))
    assert fr.block_table(data, 1, native=None) == want
    assert fr.block_table(data, 2, native=None) == want2
    if NATIVE is not None:
        assert fr.block_table(data, 1) == want
        assert fr.block_table(data, 2) == want2
        # parts are one stream: a fragment's table spans liberasurecode's header
        assert NATIVE.crc32c_blocks([data[:cut], memoryview(data)[cut:]], fr.BLOCK) == want


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("native", [None, NATIVE], ids=["python", "native"])
def test_corrupt_block_is_named_on_both_paths(native, version):
    import array
    payload = random.Random(3).randbytes(6 * fr.BLOCK + 99)
    geo = fr.geometry(version, len(payload))
    table = fr.parse_header(fr.build_header(9, 1, 4, 2, payload, version), 9, 1,
                            len(payload), version)
    as_array = array.array("I", table)  # what the data client keeps
    for t in (table, as_array):
        fr.check_blocks(t, 0, payload, version, native=native)
        fr.check_blocks(t, 2, payload[geo.block_start(2):], version, native=native)
        bad = bytearray(payload)
        bad[geo.block_start(4) + 7] ^= 0x40
        with pytest.raises(fr.CorruptFragment, match="block 4"):
            fr.check_blocks(t, 0, bad, version, native=native)
        with pytest.raises(fr.CorruptFragment, match="block 4"):
            fr.check_blocks(t, 3, bytes(bad[geo.block_start(3):]), version, native=native)


@needs_native
def test_python_fallback_runs_the_data_tests():
    """BMFS_NATIVE=0 (as on a machine without the helper): codec, fragment and data
    client tests pass on the pyeclib + crc32c path."""
    env = dict(os.environ, BMFS_NATIVE="0")
    code = ("from bmfs.native import NATIVE; assert NATIVE is None; "
            "import bmfs.data.codec as c; assert c.codec(4, 2)._native is None")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=REPO)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_t0_codec.py", "tests/test_t0_native.py",
                        "tests/test_t2_data.py"],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


@needs_native
def test_rebuild_rejects_bad_arguments():
    """rs_rebuild's arguments: a wrong type is a TypeError, an index out of range
    (negative, not below k+m, or past a C int) a ValueError, never truncated."""
    k, m = 4, 2
    frags = Codec(k, m).encode(random.Random(1).randbytes(10_000))
    payload = len(frags[0]) - LIB_HEADER
    good = [(i, frags[i]) for i in range(1, 5)]
    assert NATIVE.rs_rebuild(k, m, payload, good, [0]) == [frags[0][LIB_HEADER:]]
    for survivors in ([[1, frags[1]]] + good[1:], [1] + good[1:], [(1,)] + good[1:],
                      [(1, frags[1], 0)] + good[1:], [("1", frags[1])] + good[1:],
                      [(1.0, frags[1])] + good[1:], [(1, "text")] + good[1:]):
        with pytest.raises(TypeError):
            NATIVE.rs_rebuild(k, m, payload, survivors, [0])
    for missing in (["0"], [0.0], [None]):
        with pytest.raises(TypeError):
            NATIVE.rs_rebuild(k, m, payload, good, missing)
    for bad in (-1, k + m, 2**32 + 1, 2**31, -2**32, 2**64 + 1):
        with pytest.raises(ValueError):
            NATIVE.rs_rebuild(k, m, payload, [(bad, frags[1])] + good[1:], [0])
    for bad in (-1, k, 2**32 + 1, 2**32, 2**64):  # 2**32 + 1 was taken for 1
        with pytest.raises(ValueError):
            NATIVE.rs_rebuild(k, m, payload, good[1:] + [(5, frags[5])], [bad])


@needs_native
def test_pread_batch_reads_what_python_reads(tmp_path):
    """pread_batch (a direct client's small reads of fragment files, in threads without
    the GIL): every job's parts are what os.pread gives, shorter at a file's end, the
    last one in the caller's buffer when given; a job that fails is its OSError (a
    missing file, a link, a directory) and the others are still read."""
    rng = random.Random(4)
    files = []
    for i in range(5):
        p = tmp_path / f"f{i}"
        p.write_bytes(rng.randbytes(rng.randrange(1, 200_000)))
        files.append(p)
    os.symlink(files[0], tmp_path / "link")
    jobs, want = [], []
    for i in range(300):
        p = rng.choice(files)
        size = p.stat().st_size
        ranges = [(rng.randrange(size + 10), rng.randrange(9000)) for _ in range(rng.randrange(1, 4))]
        into = memoryview(bytearray(ranges[-1][1])) if rng.random() < 0.5 else None
        jobs.append((os.fsencode(p), ranges, into))
        data = p.read_bytes()
        want.append([data[o:o + n] for o, n in ranges])
    bad = [(os.fsencode(tmp_path / "missing"), [(0, 10)], None, errno.ENOENT),
           (os.fsencode(tmp_path / "link"), [(0, 10)], None, errno.ELOOP),
           (os.fsencode(tmp_path), [(0, 10)], None, errno.EISDIR)]
    for path, ranges, into, _ in bad:
        jobs.insert(rng.randrange(len(jobs)), (path, ranges, into))
    got = NATIVE.pread_batch(jobs, 16)
    assert len(got) == len(jobs)
    errors = {}
    k = 0
    for job, parts in zip(jobs, got):
        if isinstance(parts, OSError):
            errors[job[0]] = parts
            continue
        assert [bytes(x) for x in parts] == want[k]
        if job[2] is not None:  # the last part is the caller's buffer (or its start)
            assert parts[-1].obj is job[2].obj
        k += 1
    assert k == len(want)
    for path, _, _, code in bad:
        assert errors[path].errno == code and errors[path].filename == path
    assert NATIVE.pread_batch([], 4) == []
    for job in ((b"x", [(0, 1)]), ("str", [(0, 1)], None), (b"x", [(-1, 1)], None),
                (b"x", [(0, 5)], bytearray(4)), (b"x", [(0, 5)], b"12345"), (b"x", [0], None)):
        with pytest.raises((TypeError, ValueError, BufferError)):
            NATIVE.pread_batch([job], 2)
