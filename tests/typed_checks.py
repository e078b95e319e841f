"""Round trips of every typed-view format in a given directory.

check_roundtrips(directory) writes each kind of typed file there, records its type,
reads it back through bmfs.typed and checks the values and the zero-copy properties. It
is run on a local tmp directory by tests/test_t1_typed.py and is meant to be run inside
a real bmfs mount by the mount-level tests, so it uses only the public API and plain
file I/O, and leaves its files behind in a subdirectory for inspection.
"""
import mmap
import os

import flatbuffers
import numpy as np

from bmfs import typed
from bmfs.wire.examples_pb2 import Sample
from bmfs.wire.fbs.bmfs.examples import Frame as frame_mod
from bmfs.wire.fbs.bmfs.examples.Frame import Frame
from bmfs.wire.fbs.bmfs.examples.Vec3 import CreateVec3


def sample(i):
    return Sample(id=i, label=f"sample-{i}", score=i / 4, payload=bytes([i % 256]) * (i % 7),
                  tags=[i, -i, 7])


def write_frame(path, *, id=42, name="frame", position=(1.0, 2.0, 3.0), pixels=b"",
                values=()):
    """Write one bmfs.examples.Frame flatbuffer to `path` (with its file identifier)."""
    b = flatbuffers.Builder(1024)
    name_off = b.CreateString(name)
    pixels_off = b.CreateByteVector(bytes(pixels))
    values_off = b.CreateNumpyVector(np.asarray(values, dtype="<f4"))
    frame_mod.Start(b)
    frame_mod.AddId(b, id)
    frame_mod.AddName(b, name_off)
    frame_mod.AddPosition(b, CreateVec3(b, *position))
    frame_mod.AddPixels(b, pixels_off)
    frame_mod.AddValues(b, values_off)
    b.Finish(frame_mod.End(b), file_identifier=b"BMFR")
    with open(path, "wb") as f:
        f.write(b.Output())


def shares_mapping(arr, mapping):
    return np.shares_memory(arr, np.frombuffer(mapping, dtype=np.uint8))


def check_roundtrips(directory):
    d = os.path.join(os.fspath(directory), "typed-roundtrips")
    os.makedirs(d, exist_ok=True)
    check_npy(d)
    check_raw(d)
    check_mutable(d)
    check_message(d)
    check_records(d)
    check_flatbuffers(d)


def check_npy(d):
    path = os.path.join(d, "a.npy")
    for order in "CF":
        data = np.asarray(np.arange(60, dtype="<i8").reshape(3, 4, 5), order=order)
        np.save(path, data)
        view = typed.mmap(path)  # no type: the .npy header says it
        assert np.array_equal(view, data)
        assert view.flags.f_contiguous == (order == "F")
        assert shares_mapping(view, view.mapping)
        assert not view.flags.writeable
    typed.set_type(path, "npy")
    assert typed.get_type(path) == "npy"
    assert np.array_equal(typed.mmap(path, np.ndarray), data)


def check_raw(d):
    path = os.path.join(d, "raw.u2")
    data = np.arange(480 * 64, dtype="<u2").reshape(480, 64)
    data.tofile(path)
    view = typed.mmap(path, np.dtype("<u2"), shape=(480, 64))
    assert np.array_equal(view, data) and shares_mapping(view, view.mapping)
    assert typed.set_type(path, "raw:<u2:480,64") == "raw:<u2:480,64"
    assert np.array_equal(typed.mmap(path), data)  # dtype and shape from the xattr


def check_mutable(d):
    path = os.path.join(d, "mutable.npy")
    np.save(path, np.zeros((4, 8), dtype="<f8"))
    with typed.mutable_mmap(path) as view:
        assert shares_mapping(view, view.mapping)
        view[1, :] = 7.5
    with open(path, "rb") as f:  # another reader, through the file, not the mapping
        after = np.load(f)
    assert after[1].tolist() == [7.5] * 8 and after[0].sum() == 0


def check_message(d):
    path = os.path.join(d, "one.pb")
    want = sample(5)
    with open(path, "wb") as f:
        f.write(want.SerializeToString())
    typed.set_type(path, Sample)  # a class: the file decides single message vs records
    assert typed.get_type(path) == "proto:bmfs.examples.Sample"
    got = Sample()
    typed.mmap(path, got)  # the seed's form: fill an instance
    assert got == want and got.label == "sample-5"
    assert typed.mmap(path) == want


def check_records(d):
    path = os.path.join(d, "samples.rec")
    n = 1000
    with typed.records.writer(path, Sample) as w:
        for i in range(n):
            w.append(sample(i))
    assert typed.get_type(path) == "proto-records:bmfs.examples.Sample"
    with typed.mmap(path) as recs:
        assert len(recs) == n
        assert recs[0] == sample(0) and recs[-1] == sample(n - 1)
        assert [m.id for m in recs[10:15]] == list(range(10, 15))
        assert [m.id for m in recs[::-250]] == [999, 749, 499, 249]
        assert [m.id for m in recs] == list(range(n))
        raw = recs.raw(3)
        assert isinstance(raw, memoryview) and Sample.FromString(raw) == sample(3)
        assert shares_mapping(np.frombuffer(raw, np.uint8), recs.mapping)
        assert shares_mapping(recs.offsets, recs.mapping)
    assert len(typed.records.open(path, Sample)) == n


def check_flatbuffers(d):
    path = os.path.join(d, "frame.bmfr")
    values = np.linspace(0, 1, 1000, dtype="<f4")
    write_frame(path, id=7, name="seven", pixels=bytes(range(256)), values=values)
    typed.set_type(path, Frame)
    assert typed.get_type(path) == "fbs:bmfs.examples.Frame"
    frame = typed.mmap(path)
    assert isinstance(frame._tab.Bytes, mmap.mmap)  # the table reads the mapping itself
    assert frame.Id() == 7 and frame.Name() == b"seven"
    pos = frame.Position()
    assert (pos.X(), pos.Y(), pos.Z()) == (1.0, 2.0, 3.0)
    got = frame.ValuesAsNumpy()
    assert np.array_equal(got, values) and shares_mapping(got, frame._tab.Bytes)
    assert frame.PixelsAsNumpy().tolist() == list(range(256))
    filled = Frame()
    assert typed.mmap(path, filled) is filled and filled.Id() == 7
