"""Level 0: bmfs.proc.alive, which `bmfs cluster start/down` and `bmfs umount` wait on."""
import os
import socket
import subprocess
import sys
import time

from bmfs.proc import alive

# the main thread ends (pthread_exit: a zombie from then on) while another thread
# still runs and holds the process's files, a listening socket here
# (until its stdin is closed)
LINGER = """
import ctypes, socket, sys, threading
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
threading.Thread(target=sys.stdin.read).start()
print(s.getsockname()[1], flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_process_is_alive_until_its_last_thread_has_exited():
    p = subprocess.Popen([sys.executable, "-c", LINGER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        deadline = time.monotonic() + 10
        while _state(p.pid) != "Z":  # the main thread is gone
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # its port still takes connections: the process has not let go of its files
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert alive(p.pid)
        p.stdin.close()
        while alive(p.pid):  # the other thread ends: now it is gone
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _state(p.pid) == "Z" and os.listdir(f"/proc/{p.pid}/task") == [str(p.pid)]
        assert not alive(os.getpid() + 10 ** 7)  # (no such process)
    finally:
        p.kill()
        p.wait()


# Where glibc puts an 8 MiB malloc: in the heap (brk) only while its mmap threshold is
# raised; by default a block this big is a mapping of its own.
MALLOC_PROBE = """
import ctypes, sys
{setup}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
addr = libc.malloc(8 << 20)
with open("/proc/self/maps") as f:
    heap = [line.split()[0] for line in f if line.rstrip().endswith("[heap]")]
print(any(int(a, 16) <= addr < int(b, 16) for a, b in (r.split("-") for r in heap)))
"""


def _big_malloc_in_heap(setup: str) -> bool:
    out = subprocess.run([sys.executable, "-c", MALLOC_PROBE.format(setup=setup)],
                         check=True, capture_output=True, text=True).stdout
    return out.strip() == "True"


def test_importing_bmfs_leaves_the_programs_malloc_alone():
    """A program that imports bmfs (the typed views, the volume code) keeps glibc's
    malloc settings; bmfs's own processes raise them (tune_malloc, as `bmfs` does)."""
    assert not _big_malloc_in_heap("import bmfs, bmfs.volume.volume, bmfs.data.client, bmfs.cli.main")
    assert _big_malloc_in_heap("from bmfs.proc import tune_malloc; tune_malloc()")
