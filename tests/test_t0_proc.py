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
