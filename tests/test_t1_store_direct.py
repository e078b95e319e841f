"""Level 1: large fragments go to the device with O_DIRECT, padded to whole pages and
cut back (bmfs/store/file.py): the file must hold exactly the bytes given, whatever
the length, and survive being rewritten in place by a shorter one (repair)."""
import os
import random
import uuid

import pytest

from bmfs.store import file as fstore
from bmfs.store.file import FileStore


@pytest.mark.parametrize("total", [fstore.DIRECT_MIN, fstore.DIRECT_MIN + 1,
                                   (1 << 20) + 1140, 3 * 4096])
def test_direct_write_holds_exactly_the_bytes(tmp_path, total):
    u = str(uuid.uuid4())
    FileStore.format(str(tmp_path), u, 0)
    st = FileStore(str(tmp_path), u, 0)
    rng = random.Random(total)
    head, body = rng.randbytes(1140), rng.randbytes(max(total - 1140, 0))
    name = "%016x.%d" % (0xabc, 2)
    st.write(name, [head, body])
    path = st._file(name)
    assert os.path.getsize(path) == len(head) + len(body)
    assert st.read(name, 0, 1 << 30) == head + body
    st.write(name, [body[:5000]])  # rewritten in place, shorter (repair)
    assert st.read(name, 0, 1 << 30) == body[:5000]
    assert st.pending() == 1
    st.sync()


@pytest.mark.parametrize("total", [fstore.DIRECT_MIN + 1, (1 << 20) + 1140, 3 * 4096])
def test_node_put_from_an_aligned_buffer_holds_exactly_the_bytes(tmp_path, total):
    """A storage node writes a large PUT straight from its page-aligned receive buffer
    (write_aligned): whole pages and the zero-padded last page go with O_DIRECT, the
    file is cut back to the length given, and rewriting it shorter in place works."""
    import mmap
    u = str(uuid.uuid4())
    FileStore.format(str(tmp_path), u, 0)
    st = FileStore(str(tmp_path), u, 0)
    data = random.Random(total).randbytes(total)
    buf = mmap.mmap(-1, total + 8192)  # page-aligned, like the node's receive buffer
    buf[:total] = data
    buf[total:total + 100] = b"\xee" * 100  # what lies past the payload is not written
    name = "%016x.%d" % (0xdef, 1)
    view = memoryview(buf)[:total]
    st.write_aligned(name, view)
    view.release()
    assert os.path.getsize(st._file(name)) == total
    assert st.read(name, 0, 1 << 30) == data
    st.write_aligned(name, memoryview(data)[:5000])  # shorter, in place (repair), and
    # from an unaligned buffer, which O_DIRECT refuses: through the page cache
    assert st.read(name, 0, 1 << 30) == data[:5000]
    st.sync()


def _cached_pages(path) -> int:
    """How many of the file's pages are in the page cache (mincore(2))."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value)
        vec = (ctypes.c_ubyte * ((size + 4095) // 4096))()
        try:
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(addr, size)
        return sum(v & 1 for v in vec)
    finally:
        os.close(fd)


def test_mount_reads_leave_large_reads_out_of_the_page_cache(tmp_path):
    """Read by the mount (the local transport), a large read's pages are dropped from
    the page cache once read: the mount's page cache holds those bytes now, a second
    copy would double the memory a file takes. Small reads keep theirs, and a storage
    node's store (no local transport) keeps its cache for other clients."""
    import trio
    from bmfs.transport.local import LocalTransport
    u = str(uuid.uuid4())
    FileStore.format(str(tmp_path), u, 0)
    st = FileStore(str(tmp_path), u, 0)
    data = random.Random(7).randbytes((1 << 20) + 1140)
    name = "%016x.%d" % (0x123, 0)
    st.write(name, [data])
    path = st._file(name)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # not cached by the write either
    os.close(fd)
    node_view = st.read_parts(name, [(0, len(data))])  # as a node reads: kept
    assert node_view == [data]
    assert _cached_pages(path) >= len(data) // 4096
    transport = LocalTransport({0: st})

    async def read(ranges):
        return await transport.read(0, name, ranges)
    got = trio.run(read, [(0, 4096), (4096, len(data) - 4096)])
    assert b"".join(bytes(p) for p in got) == data
    assert _cached_pages(path) <= 1  # at most the partial last page
    got = trio.run(read, [(8192, 8192)])  # a small read: kept (random readers reuse it)
    assert bytes(got[0]) == data[8192:16384]
    assert _cached_pages(path) >= 2
