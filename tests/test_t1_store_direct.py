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
