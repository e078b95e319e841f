"""Process helpers shared by the CLI and the cluster launcher."""
from __future__ import annotations

import os


def tune_malloc() -> bool:
    """Keep large buffers in malloc's arena, for this whole process: pyeclib allocates
    each fragment afresh, and with glibc's defaults every 1 MiB buffer is mmap'd and
    handed back to the kernel, which cuts encode speed many times over on machines
    where fresh memory is slow to touch (design.md, "Buffers"). Called by bmfs's own
    processes (every `bmfs` command, the mount and node daemons), never on import: a
    program that imports bmfs keeps its own malloc settings. False where the C
    library is not glibc."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.mallopt(-3, 64 << 20)   # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)    # M_TRIM_THRESHOLD
    return True


def alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie (exited, not yet reaped by a parent that may
    never reap it, e.g. in containers whose init does not) counts as gone once it is
    alone: a multi-threaded process's main thread turns zombie first, and its other
    threads, until they have exited too, still hold its files open. A storage node
    killed this way keeps accepting connections on its port for a few milliseconds
    after its main thread is a zombie: long enough for `bmfs cluster start --node`
    to take the old node's listening socket for the new one's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state not in ("Z", "X"):
            return True
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def notify_ready(status: str = "") -> bool:
    """Tell systemd a Type=notify service is ready (sd_notify's READY=1 on the datagram
    socket named by NOTIFY_SOCKET; an abstract one if it starts with '@'). False when
    not run by systemd or the message could not be sent: nothing waits for it then."""
    import socket
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    msg = "READY=1" + (f"\nSTATUS={status}" if status else "")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(path)
            s.sendall(msg.encode())
        return True
    except OSError:
        return False
