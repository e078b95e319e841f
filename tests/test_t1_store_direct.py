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
