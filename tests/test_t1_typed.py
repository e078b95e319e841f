"""Typed views on local files: round trips, zero copy shown by measurement, schema
evolution, and every error path (corrupt, truncated, mismatched, unregistered)."""
import argparse
import errno
import mmap
import os
import random
import shutil
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from bmfs import errors, typed
from bmfs.typed import recfile, records
from bmfs.wire import examples_v2_pb2
from bmfs.wire.examples_pb2 import Sample
from bmfs.wire.fbs.bmfs.examples.Frame import Frame

sys.path.insert(0, os.path.dirname(__file__))
import typed_checks  # noqa: E402
from typed_checks import sample, shares_mapping, write_frame  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_records(path, n, make=sample, Type=Sample):
    with records.writer(path, Type) as w:
        for i in range(n):
            w.append(make(i))
    return path


def rss_kib(field="RssAnon"):
    # RssAnon is anonymous memory: the memory a copy of the file would show up in. Pages
    # of a mapped file that the process touched count in RssFile instead.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    pytest.skip(f"no {field} in /proc/self/status")


# --- round trips ------------------------------------------------------------------------

def test_roundtrips_on_a_local_directory(tmp_path):
    typed_checks.check_roundtrips(tmp_path)


# --- numpy ------------------------------------------------------------------------------

def test_npy_view_is_the_mapping_and_read_only(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.arange(1000, dtype="<f4"))
    a = typed.mmap(path)
    assert shares_mapping(a, a.mapping)
    assert shares_mapping(a[10:20], a.mapping)  # slices are views too
    with pytest.raises(ValueError):
        a[0] = 1
    assert type(a + 1) is np.ndarray and not shares_mapping(a + 1, a.mapping)
    assert isinstance(a.sum(), np.floating)


def test_raw_array_needs_a_fitting_dtype_and_shape(tmp_path):
    path = tmp_path / "raw.bin"
    path.write_bytes(bytes(100))
    assert typed.mmap(path, np.uint8).shape == (100,)
    assert typed.mmap(path, "raw:<u4:5,5").shape == (5, 5)
    with pytest.raises(typed.TypeMismatch, match="not a whole number"):
        typed.mmap(path, np.float64)
    with pytest.raises(typed.TypeMismatch, match=r"shape \(3, 3\)"):
        typed.mmap(path, np.uint32, shape=(3, 3))
    with pytest.raises(typed.TypeMismatch, match="needs a dtype"):
        typed.mmap(path, np.ndarray)
    with pytest.raises(typed.TypeMismatch, match="not a .npy"):
        typed.mmap(path, "npy")
    (tmp_path / "empty").write_bytes(b"")
    assert typed.mmap(tmp_path / "empty", np.float32).shape == (0,)


def test_npy_mismatches_and_damage(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.zeros((4, 4), dtype="<i4"))
    with pytest.raises(typed.TypeMismatch, match="holds int32, not float32"):
        typed.mmap(path, np.float32)
    with pytest.raises(typed.TypeMismatch, match="shape"):
        typed.mmap(path, np.ndarray, shape=(16,))
    data = path.read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[:-5])
    with pytest.raises(typed.CorruptFile, match="truncated.*offset"):
        typed.mmap(tmp_path / "cut.npy")
    (tmp_path / "bad.npy").write_bytes(data[:10] + b"garbage!" + data[18:])
    with pytest.raises(typed.CorruptFile, match="bad .npy header"):
        typed.mmap(tmp_path / "bad.npy")
    np.save(tmp_path / "obj.npy", np.array([{}, []], dtype=object), allow_pickle=True)
    with pytest.raises(typed.TypeMismatch, match="Python objects"):
        typed.mmap(tmp_path / "obj.npy")


def test_mutable_mmap_writes_reach_the_file_on_flush(tmp_path):
    path = tmp_path / "raw.f8"
    np.zeros(1024, dtype="<f8").tofile(path)
    typed.set_type(path, "raw:<f8")
    a = typed.mutable_mmap(path)
    a[:10] = 3.0
    a.flush()
    assert np.fromfile(path, dtype="<f8")[:11].tolist() == [3.0] * 10 + [0.0]
    with typed.mutable_mmap(path) as b:
        b[-1] = -1.0
    assert np.fromfile(path, dtype="<f8")[-1] == -1.0
    one = tmp_path / "one.pb"
    one.write_bytes(sample(1).SerializeToString())
    with pytest.raises(typed.NotSupportedHere, match="arrays only"):
        typed.mutable_mmap(one, Sample)


# --- record files -----------------------------------------------------------------------

def test_record_file_is_a_sequence(tmp_path):
    recs = typed.mmap(write_records(tmp_path / "r.rec", 300), Sample)
    assert len(recs) == 300
    assert recs[-300] == sample(0) and recs[299] == recs[-1] == sample(299)
    for bad in (300, -301):
        with pytest.raises(IndexError, match="out of range"):
            recs[bad]
    assert [m.id for m in recs[290:]] == list(range(290, 300))
    assert [m.id for m in recs[5:50:10][1:3]] == [15, 25]
    assert len(recs[100:100]) == 0 and list(recs[100:100]) == []
    assert [m.id for m in reversed(recs[:3])] == [2, 1, 0]
    assert sample(17) in recs and recs.index(sample(17)) == 17
    assert recs[np.int64(4)].id == 4
    recs.close()
    with pytest.raises(ValueError, match="closed"):
        recs[0]


def vm_flags(mapping):
    """The kernel's flags of the memory area that holds ``mapping`` (/proc/self/smaps):
    "rr" is MADV_RANDOM's (no read-around on a fault), "sr" MADV_SEQUENTIAL's."""
    addr = np.frombuffer(mapping, np.uint8).ctypes.data
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    pytest.fail("the mapping is not in /proc/self/smaps")


def test_read_ahead_follows_the_accesses(tmp_path, monkeypatch):
    """Records taken at random from a file too big to stay cached make the mapping
    random (a page fault then reads its page, not ~1 MiB around it); records taken in
    order, or an iteration, make it normal again. A file that fits keeps the kernel's
    read-around (a shuffled pass over it is served from the cache), as do arrays unless
    asked; access= and advise() set it; a bad mode is refused before anything opens."""
    from bmfs.typed import access
    path = write_records(tmp_path / "big.rec", 4000,
                         make=lambda i: Sample(id=i, payload=bytes(2000)))
    far = [3000, 100, 2500, 700, 3900, 1500, 50, 2200, 3300, 1000]  # >= 128 KiB apart

    recs = typed.mmap(path, Sample)  # 8 MB: fits in memory, read-around stays
    assert [recs[i].id for i in far] == far
    assert "rr" not in vm_flags(recs.mapping) and recs.access == ("auto", "normal")
    recs.close()

    monkeypatch.setattr(access, "BIG_FILE", 1 << 20)  # now it counts as too big
    recs = typed.mmap(path, Sample)
    assert [recs[i].id for i in far[:access.RANDOM_AFTER - 1]] == far[:access.RANDOM_AFTER - 1]
    assert "rr" not in vm_flags(recs.mapping)  # a few jumps are not a pattern yet
    assert [recs[i].id for i in far[access.RANDOM_AFTER - 1:]] == far[access.RANDOM_AFTER - 1:]
    assert "rr" in vm_flags(recs.mapping) and recs.access == ("auto", "random")
    assert [recs[i].id for i in (10, 11, 12)] == [10, 11, 12]  # in order: normal again
    assert "rr" not in vm_flags(recs.mapping)
    part = recs[2000:]
    assert [part[i - 2000].id for i in (3900, 2100, 3500, 2900, 3100, 2500, 3700, 2300)] \
        == [3900, 2100, 3500, 2900, 3100, 2500, 3700, 2300]
    assert "rr" in vm_flags(recs.mapping)  # a slice shares the mapping and its advice
    assert sum(1 for _ in recs) == 4000  # an iteration reads in order
    assert "rr" not in vm_flags(recs.mapping)
    recs.advise("random")
    assert "rr" in vm_flags(recs.mapping) and recs.access == ("random", "random")
    assert [recs[i].id for i in (10, 11, 12, 13)] == [10, 11, 12, 13]  # stays random
    assert "rr" in vm_flags(recs.mapping)
    recs.advise("sequential")
    assert "sr" in vm_flags(recs.mapping) and "rr" not in vm_flags(recs.mapping)
    with pytest.raises(ValueError, match="access must be one of auto, normal, random"):
        recs.advise("randomly")
    recs.close()
    with pytest.raises(ValueError, match="closed"):
        recs.advise("random")

    assert "rr" in vm_flags(typed.mmap(path, Sample, access="random").mapping)
    arr_path = str(tmp_path / "a.npy")
    np.save(arr_path, np.arange(1 << 20, dtype=np.uint32))
    a = typed.mmap(arr_path)
    assert "rr" not in vm_flags(a.mapping)
    a.advise("random")
    assert "rr" in vm_flags(a.mapping) and a[123457] == 123457
    a = typed.mmap(arr_path, access="random")
    assert "rr" in vm_flags(a.mapping)
    assert "sr" in vm_flags(typed.mutable_mmap(arr_path, access="sequential").mapping)
    for bad in ("fast", None, 3):
        with pytest.raises(ValueError, match="access must be one of"):
            typed.mmap(tmp_path / "missing.npy", access=bad)
        with pytest.raises(ValueError, match="access must be one of"):
            records.open(tmp_path / "missing.rec", Sample, access=bad)


def test_read_ahead_advice_everywhere_it_is_taken(tmp_path, monkeypatch):
    """Slices, views of arrays, flatbuffers and records.open take the advice; two
    readers in order interleaved are no jumps; a closed file says so; a record of
    more than a page under random advice is read whole at its first touch."""
    from bmfs.typed import access
    monkeypatch.setattr(access, "BIG_FILE", 1 << 20)
    path = write_records(tmp_path / "big.rec", 4000,
                         make=lambda i: Sample(id=i, payload=bytes(2000)))
    recs = records.open(path, Sample)
    a, b = recs[:2000], recs[2000:]
    for i in range(20):  # two shards read in order, turn about: never random
        assert (a[i].id, b[i].id) == (i, 2000 + i)
    assert recs.access == ("auto", "normal") and "rr" not in vm_flags(recs.mapping)
    a.advise("random")
    recs.close()
    assert "rr" in vm_flags(b.mapping) and b[5].id == 2005  # the slice outlives it
    with pytest.raises(ValueError, match="closed"):
        recs.access
    assert "rr" in vm_flags(records.open(path, access="random").mapping)

    arr_path = str(tmp_path / "a.npy")
    np.save(arr_path, np.arange(1 << 20, dtype=np.uint32))
    view = typed.mmap(arr_path)[1000:]
    view.advise("random")
    assert "rr" in vm_flags(view.mapping) and view[0] == 1000
    view.advise("auto")
    assert "rr" not in vm_flags(view.mapping)
    fbs_path = tmp_path / "f.bmfr"
    write_frame(fbs_path)
    frame = typed.mmap(fbs_path, Frame, access="random")
    assert "rr" in vm_flags(frame._tab.Bytes)

    big = write_records(tmp_path / "wide.rec", 64,
                        make=lambda i: Sample(id=i, payload=bytes([i]) * 65536))
    fd = os.open(big, os.O_RDONLY)
    os.fsync(fd)  # (dirty pages stay cached)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    wide = records.open(big, Sample, access="random")
    cached = cached_bytes(big)
    start = int(wide.offsets[40])
    assert wide.mapping[start + 30000] == 40  # a plain touch of the mapping: one page
    assert cached_bytes(big) - cached <= 2 * mmap.PAGESIZE
    cached = cached_bytes(big)
    assert wide.raw(20)[-1] == 20  # one byte of a 64 KiB record: all of it is asked for
    assert cached_bytes(big) - cached >= 65536


def cached_bytes(path):
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def test_record_file_edge_sizes(tmp_path):
    empty = typed.mmap(write_records(tmp_path / "empty.rec", 0), Sample)
    assert len(empty) == 0 and list(empty) == []
    # Records of 0 bytes (a default message) and of multi-byte length prefixes.
    big = [Sample(), Sample(payload=b"x" * 200), Sample(payload=b"y" * 70000)]
    path = write_records(tmp_path / "sizes.rec", 3, make=lambda i: big[i])
    assert list(typed.mmap(path)) == big


def test_iterating_a_large_record_file_copies_nothing(tmp_path):
    """Shown, not claimed: iterating a 1 GiB record file keeps anonymous memory flat,
    while the naive way (read the file) grows it by the file size."""
    path = tmp_path / "big.rec"
    payload = b"z" * 4000
    n = (1 << 30) // 4016
    with records.writer(path, Sample) as w:
        for i in range(n):
            w.append(Sample(id=i, payload=payload))
    size = os.path.getsize(path)
    recs = typed.mmap(path, Sample)
    before, before_file = rss_kib(), rss_kib("RssFile")
    count = total = 0
    for m in recs:
        count += 1
        total += len(m.payload)
    grown, mapped = rss_kib() - before, rss_kib("RssFile") - before_file
    assert count == n and total == n * 4000
    assert grown * 1024 < size / 20, f"iteration grew anonymous memory by {grown} KiB"
    assert mapped * 1024 > size / 2, "the records were not read through the mapping"
    # Control: the measure does see a copy of the file.
    before = rss_kib()
    with open(path, "rb") as f:
        data = f.read()
    copied = rss_kib() - before
    assert len(data) == size and copied * 1024 > size * 0.9
    del data


def test_schema_evolution_both_ways(tmp_path):
    V2 = examples_v2_pb2.Sample
    old = write_records(tmp_path / "v1.rec", 50)
    with pytest.raises(typed.TypeMismatch, match="strict=False"):
        typed.mmap(old, V2)
    newer = typed.mmap(old, V2, strict=False)
    assert newer[7].id == 7 and newer[7].tags == [7, -7, 7] and newer[7].source == ""

    def v2_sample(i):
        return V2(id=i, label=f"v2-{i}", source="camera", embedding=[0.5, i])
    new = write_records(tmp_path / "v2.rec", 50, make=v2_sample, Type=V2)
    older = typed.mmap(new, Sample, strict=False)
    assert [m.label for m in older[:3]] == ["v2-0", "v2-1", "v2-2"]
    # The old reader keeps the fields it does not know, so re-writing loses nothing.
    assert V2.FromString(older[9].SerializeToString()) == v2_sample(9)


def test_writer_refuses_other_messages_and_leaves_no_index_on_error(tmp_path):
    path = tmp_path / "r.rec"
    with pytest.raises(RuntimeError):
        with records.writer(path, Sample) as w:
            w.append(sample(1))
            with pytest.raises(typed.TypeMismatch, match="holds bmfs.examples.Sample"):
                w.append(examples_v2_pb2.Sample(id=1))
            raise RuntimeError("the producer failed")
    with pytest.raises(typed.MissingIndex, match="no index.*writer") as e:
        typed.mmap(path, Sample)
    assert str(path) in str(e.value) and "offset" in str(e.value)


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _footer(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(size - recfile.FOOTER.size)
        return size, recfile.FOOTER.unpack(f.read())


def _rewrite_index_entry(path, i, value):
    size, (index_offset, count, _, _, _) = _footer(path)
    _patch(path, index_offset + 8 * i, struct.pack("<Q", value))
    with open(path, "rb") as f:
        f.seek(index_offset)
        crc = zlib.crc32(f.read(8 * (count + 1)))
    # Keep the CRC consistent, so that only the bounds check can catch the bad entry.
    _patch(path, size - 16, struct.pack("<I", crc))
    return index_offset + 8 * i


def test_corrupt_record_files_name_file_and_offset(tmp_path):
    good = write_records(tmp_path / "good.rec", 20)

    def copy(name):
        p = tmp_path / name
        shutil.copyfile(good, p)
        return p

    p = copy("magic.rec")
    _patch(p, 0, b"NOTMAGIC")
    with pytest.raises(typed.CorruptFile, match=r"bad magic.*\(at offset 0\)"):
        typed.mmap(p, "proto-records:bmfs.examples.Sample")

    p = copy("version.rec")
    _patch(p, 8, struct.pack("<I", 9))
    with pytest.raises(typed.NotSupportedHere, match="version 9"):
        typed.mmap(p, Sample)

    p = copy("past.rec")
    at = _rewrite_index_entry(p, 5, 10 ** 9)
    past = rf"entry 5 points to offset 1000000000, past.*offset {at}\)"
    with pytest.raises(typed.CorruptFile, match=past):
        typed.mmap(p, Sample)
    recs = typed.mmap(p, Sample, verify=False)  # no up-front scan: caught on access instead
    assert recs[3] == sample(3)
    with pytest.raises(typed.CorruptFile, match="outside the records section"):
        recs[5]
    with pytest.raises(typed.CorruptFile):
        list(recs)

    p = copy("order.rec")
    _, (index_offset, *_) = _footer(p)
    with open(p, "rb") as f:
        f.seek(index_offset + 8 * 3)
        entry3 = struct.unpack("<Q", f.read(8))[0]
    _rewrite_index_entry(p, 4, entry3)
    with pytest.raises(typed.CorruptFile, match="entry 4 .* does not follow entry 3"):
        typed.mmap(p, Sample)

    p = copy("crc.rec")
    _, (index_offset, *_) = _footer(p)
    _patch(p, index_offset + 8, struct.pack("<Q", 12345))
    with pytest.raises(typed.CorruptFile, match=f"checksum.*offset {index_offset}"):
        typed.mmap(p, Sample)

    p = copy("footer.rec")
    size, _ = _footer(p)
    _patch(p, size - 24, struct.pack("<Q", 10 ** 6))  # count
    with pytest.raises(typed.CorruptFile, match="footer is inconsistent"):
        typed.mmap(p, Sample)


def test_corrupt_record_bytes(tmp_path):
    p = write_records(tmp_path / "r.rec", 20)
    recs = typed.mmap(p, Sample)
    start = int(recs.offsets[6])
    body_len = len(recs.raw(6))
    recs.close()
    # A wire type 7 tag: the field framing is broken right at the record body.
    _patch(p, start + 1, b"\x0f" * body_len)
    recs = typed.mmap(p, Sample)
    assert recs[5] == sample(5)
    with pytest.raises(typed.CorruptFile, match=rf"record 6 does not parse.*offset {start + 1}\)"):
        recs[6]
    with pytest.raises(typed.CorruptFile, match="record 6"):
        list(recs)
    # A length prefix that disagrees with the index.
    _patch(p, start, bytes([body_len - 1]))
    with pytest.raises(typed.CorruptFile, match=rf"record 6: its length prefix.*offset {start}\)"):
        typed.mmap(p, Sample)[6]


def test_truncated_and_damaged_record_files_never_crash(tmp_path):
    """Every truncation and many random byte flips: a FsError or a good read, nothing else."""
    good = (write_records(tmp_path / "good.rec", 40)).read_bytes()
    p = tmp_path / "bad.rec"
    rng = random.Random(6)
    variants = [good[:n] for n in range(0, len(good), 7)]
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        variants.append(bytes(data))
    outcomes = {"ok": 0, "error": 0}
    for data in variants:
        p.write_bytes(data)
        for verify in (True, False):
            try:
                recs = records.open(p, Sample, verify=verify, strict=False)
                list(recs)
                [recs[i] for i in range(-1, -len(recs) - 1, -7)]
                outcomes["ok"] += 1
            except errors.FsError as e:
                assert str(p) in str(e)
                outcomes["error"] += 1
    assert outcomes["ok"] and outcomes["error"]
    cut = good[:len(good) - 3]
    p.write_bytes(cut)
    with pytest.raises(typed.MissingIndex, match="no index"):
        typed.mmap(p, Sample)


# --- single protobuf messages and flatbuffers ---------------------------------------------

def test_single_message(tmp_path):
    p = tmp_path / "one.pb"
    p.write_bytes(b"")
    assert typed.mmap(p, Sample) == Sample()  # an empty file is the empty message
    good = sample(3).SerializeToString()
    p.write_bytes(good + b"\x0f\x01")
    where = rf"does not parse as bmfs.examples.Sample.*offset {len(good)}\)"
    with pytest.raises(typed.CorruptFile, match=where):
        typed.mmap(p, Sample)
    p.write_bytes(good)
    with pytest.raises(typed.TypeMismatch, match="instance"):
        typed.mmap(write_records(tmp_path / "r.rec", 2), Sample())


def test_flatbuffers_errors(tmp_path):
    p = tmp_path / "f.bmfr"
    write_frame(p, values=[1, 2, 3])
    data = bytearray(p.read_bytes())
    data[4:8] = b"XXXX"
    p.write_bytes(bytes(data))
    with pytest.raises(typed.TypeMismatch, match=r"identifier.*\(at offset 4\)"):
        typed.mmap(p, Frame)
    data[4:8] = b"BMFR"
    data[0:4] = struct.pack("<I", len(data) + 100)
    p.write_bytes(bytes(data))
    with pytest.raises(typed.CorruptFile, match=r"root table offset.*past the end.*offset 0\)"):
        typed.mmap(p, Frame)
    p.write_bytes(b"\x01")
    with pytest.raises(typed.CorruptFile, match="too short"):
        typed.mmap(p, "fbs:bmfs.examples.Frame")


# --- types: recorded, guessed, mismatched, unregistered -------------------------------------

def test_type_mismatches(tmp_path):
    npy = tmp_path / "a.npy"
    np.save(npy, np.zeros(3))
    typed.set_type(npy, "npy")
    with pytest.raises(typed.TypeMismatch, match="recorded type is npy, not protobuf"):
        typed.mmap(npy, Sample)
    rec = write_records(tmp_path / "r.rec", 3)
    with pytest.raises(typed.TypeMismatch, match="recorded type is proto-records"):
        typed.mmap(rec, "fbs:bmfs.examples.Frame")
    with pytest.raises(typed.TypeMismatch, match="not a .npy"):
        typed.set_type(rec, "npy")  # checked against the content, so not recorded
    assert typed.get_type(rec) == "proto-records:bmfs.examples.Sample"
    with pytest.raises(typed.TypeMismatch, match="cannot map a file as"):
        typed.mmap(rec, dict)
    plain = tmp_path / "plain.txt"
    plain.write_text("hello")
    with pytest.raises(typed.NoType, match="no type given"):
        typed.mmap(plain)
    assert typed.get_type(plain) is None


def test_unregistered_schemas_and_bad_type_strings(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"12345678")
    with pytest.raises(typed.UnknownSchema, match="'nope.Missing' is not registered"):
        typed.mmap(p, "proto:nope.Missing")
    with pytest.raises(typed.UnknownSchema, match="flatbuffers table 'nope.T'"):
        typed.mmap(p, "fbs:nope.T")
    for bad in ("", "json", "proto:", "proto:1bad", "npy:x", "raw:", "raw:bogus",
                "raw:<f4:3,x", "raw:<f4:-1"):
        with pytest.raises(typed.BadTypeString):
            typed.set_type(p, bad, check=False)
    os.setxattr(p, typed.XATTR, b"what:ever")
    with pytest.raises(typed.BadTypeString, match="recorded type.*malformed"):
        typed.mmap(p)
    assert typed.set_type(p, "raw:<u2") == "raw:<u2"
    typed.clear_type(p)
    typed.clear_type(p)
    assert typed.get_type(p, guess=False) is None


def test_filesystem_without_xattrs(tmp_path, monkeypatch):
    def no_xattrs(*args, **kwargs):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    monkeypatch.setattr(os, "setxattr", no_xattrs)
    monkeypatch.setattr(os, "getxattr", no_xattrs)
    p = tmp_path / "a.npy"
    np.save(p, np.ones(3))
    with pytest.raises(typed.NotSupportedHere, match="does not store user xattrs"):
        typed.set_type(p, "npy")
    assert typed.mmap(p).sum() == 3  # the header still says what it is
    rec = write_records(tmp_path / "r.rec", 5)  # the writer does not need the xattr
    assert typed.get_type(rec) == "proto-records:bmfs.examples.Sample"
    assert typed.mmap(rec)[4] == sample(4)


def test_errors_are_fs_errors_with_errnos():
    assert issubclass(typed.TypeMismatch, errors.Invalid)
    assert issubclass(typed.CorruptFile, errors.IOFailure)
    assert issubclass(typed.MissingIndex, typed.CorruptFile)
    e = typed.CorruptFile("/f", "bad", 12)
    assert e.errno == errno.EIO and str(e) == "/f: bad (at offset 12)" and e.offset == 12


# --- CLI and generated code -------------------------------------------------------------

def _cli(capsys, *argv):
    from bmfs.cli import cat, type_
    parser = argparse.ArgumentParser(prog="bmfs")
    sub = parser.add_subparsers()
    cat.add_parser(sub)
    type_.add_parser(sub)
    args = parser.parse_args(argv)
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_cat_and_type(tmp_path, capsys):
    rec = str(write_records(tmp_path / "r.rec", 5))
    code, out, _ = _cli(capsys, "cat", rec, "-n", "2")
    assert code == 0 and out.splitlines()[1].startswith('1\tid: 1 label: "sample-1"')
    code, out, _ = _cli(capsys, "cat", rec, "--json")
    assert code == 0 and len(out.splitlines()) == 5 and '"label": "sample-4"' in out
    assert _cli(capsys, "type", rec)[:2] == (0, "proto-records:bmfs.examples.Sample\n")
    npy = str(tmp_path / "a.npy")
    np.save(npy, np.arange(6).reshape(2, 3))
    code, out, err = _cli(capsys, "type", npy)
    assert (code, out) == (0, "npy\n") and "not recorded" in err
    code, out, _ = _cli(capsys, "cat", npy)
    assert code == 0 and out.startswith("int64 array, shape (2, 3)")
    frame = str(tmp_path / "f.bmfr")
    write_frame(frame, name="hi", values=[1.5])
    assert _cli(capsys, "type", frame, "fbs:bmfs.examples.Frame")[0] == 0
    code, out, _ = _cli(capsys, "cat", frame)
    assert code == 0 and '"Name": "hi"' in out and '"Values": [\n    1.5\n  ]' in out
    for argv in (("type", rec, "npy"), ("type", rec, "proto:no.Such"),
                 ("cat", npy, "-t", "fbs:x.Y"), ("cat", str(tmp_path / "missing"))):
        code, out, err = _cli(capsys, *argv)
        assert code == 2 and out == "" and len(err.splitlines()) == 1 and "Traceback" not in err
    assert _cli(capsys, "type", rec, "--clear")[0] == 0
    assert _cli(capsys, "type", str(tmp_path / "a.npy"), "--clear")[0] == 0


@pytest.mark.skipif(not (shutil.which("protoc") and shutil.which("flatc")),
                    reason="protoc/flatc not installed (tools/setup.sh --test)")
def test_generated_code_matches_schemas():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_schemas.py"),
                           "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
