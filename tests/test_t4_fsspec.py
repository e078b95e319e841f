"""fsspec ``bm`` over the direct client on a one-machine volume: pandas and pyarrow
round trips, the filesystem's operations, cat_ranges."""
from __future__ import annotations

import os

import pytest

fsspec = pytest.importorskip("fsspec")
pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
import pyarrow.parquet as pq  # noqa: E402


def bm(volume, **kw):
    """fsspec.filesystem("bm", ...): registered by the package's entry point (this
    worktree's checkout may not be the one installed: then registered here)."""
    if "bm" not in fsspec.available_protocols():
        fsspec.register_implementation("bm", "bmfs.client.fsspec_fs.BmFileSystem")
    return fsspec.filesystem("bm", volume=str(volume), skip_instance_cache=True, **kw)


def test_entry_point_declared():
    import tomllib
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]["fsspec.specs"]
    assert eps["bm"] == "bmfs.client.fsspec_fs:BmFileSystem"


def test_pandas_and_pyarrow_round_trips(volume):
    fs = bm(volume, writable=True)
    df = pd.DataFrame({"a": range(10_000), "b": [f"row {i}" for i in range(10_000)]})
    fs.mkdir("main/data")
    with fs.open("bm://main/data/t.csv", "wb") as f:
        df.to_csv(f, index=False)
    table = pa.Table.from_pandas(df)
    pq.write_table(table, "data/t.parquet", filesystem=fs_main(fs))
    fs.pipe_file("main/data/raw", b"12345")
    fs.close()  # (a writer owns a one-machine volume while it is open)
    rd = bm(volume)
    with rd.open("bm://main/data/t.csv", "rb") as f:
        assert pd.read_csv(f).equals(df)
    assert pq.read_table("main/data/t.parquet", filesystem=rd).equals(table)
    assert pd.read_parquet("bm://main/data/t.parquet",
                           storage_options={"volume": str(volume)}).equals(df)
    assert sorted(rd.ls("main/data", detail=False)) == \
        ["main/data/raw", "main/data/t.csv", "main/data/t.parquet"]
    assert rd.info("main/data/raw")["size"] == 5 and rd.isdir("main/data")
    assert rd.cat_ranges(["main/data/raw"] * 4, [0, 1, -2, 4], [2, None, None, 100]) == \
        [b"12", b"2345", b"45", b"5"]
    got = rd.cat_ranges(["main/data/raw", "main/data/nope"], [0, 0], [1, 1])
    assert got[0] == b"1" and isinstance(got[1], FileNotFoundError)
    with pytest.raises(PermissionError):
        rd.rm("main/data/raw")
    rd.close()
    fsspec.filesystem("bm", volume=str(volume)).close()  # (pandas' instance, cached)
    fs.rm("main/data", recursive=True)
    assert not fs.exists("main/data")
    fs.close()


def fs_main(fs):
    """pyarrow's view of the bm filesystem (its paths: BRANCH/path)."""
    from pyarrow.fs import FSSpecHandler, PyFileSystem, SubTreeFileSystem
    return SubTreeFileSystem("main", PyFileSystem(FSSpecHandler(fs)))


def test_branch_urls_and_errors(volume, tmp_path):
    fs = bm(volume, writable=True)
    fs.pipe_file("/x", b"main's")  # /path: the instance's branch (main)
    assert fs.cat("bm://main/x") == b"main's"
    fs.close()
    fs = bm(volume)
    with pytest.raises(FileNotFoundError):
        fs.cat("bm://nobranch/x")
    with pytest.raises(FileNotFoundError):
        fs.cat("bm://main/missing")
    with pytest.raises(FileNotFoundError):
        bm(tmp_path / "novolume").ls("main/")


def test_read_while_mounted(volume, tmp_path):
    """A mount owns the volume: fsspec reads through it, what was written through the
    mount just before included; writes are refused naming the mount."""
    from mountutil import Mounted
    df = pd.DataFrame({"a": range(5000), "b": [f"row {i}" for i in range(5000)]})
    with Mounted(volume, tmp_path / "mnt") as m:
        os.makedirs(os.path.join(m.mp, "data"))
        pq.write_table(pa.Table.from_pandas(df), os.path.join(m.mp, "data", "t.parquet"))
        blob = os.urandom(1 << 20)
        with open(os.path.join(m.mp, "data", "blob"), "wb") as f:
            f.write(blob)
        fs = bm(volume)
        assert sorted(fs.ls("main/data", detail=False)) == ["main/data/blob",
                                                             "main/data/t.parquet"]
        back = pq.read_table("data/t.parquet", filesystem=fs_main(fs)).to_pandas()
        assert back.equals(df)
        assert fs.cat_ranges(["main/data/blob"] * 2, [5, 1000], [10, 5000]) == \
            [blob[5:10], blob[1000:5000]]
        with pytest.raises(PermissionError, match=f"the mount at {m.mp}"):
            fs.pipe_file("main/data/new", b"x")
        fs.close()


from fsspec.tests.abstract import AbstractFixtures  # noqa: E402
from fsspec.tests.abstract.copy import AbstractCopyTests  # noqa: E402
from fsspec.tests.abstract.open import AbstractOpenTests  # noqa: E402
from fsspec.tests.abstract.pipe import AbstractPipeTests  # noqa: E402


class BmFixtures(AbstractFixtures):
    """fsspec's own abstract tests on a fresh one-machine volume, written through a
    writable instance (paths BRANCH/path)."""

    @pytest.fixture
    def fs(self, volume):
        fs = bm(volume, writable=True)
        yield fs
        fs.close()

    @pytest.fixture
    def fs_join(self):
        import posixpath
        return posixpath.join

    @pytest.fixture
    def fs_path(self):
        return "main/root"


class TestBmCopy(BmFixtures, AbstractCopyTests):
    pass


class TestBmOpen(BmFixtures, AbstractOpenTests):
    pass


class TestBmPipe(BmFixtures, AbstractPipeTests):
    pass
