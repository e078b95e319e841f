"""Process helpers shared by the CLI and the cluster launcher."""
from __future__ import annotations



def alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie (exited, not yet reaped by a parent that may
    never reap it, e.g. in containers whose init does not) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")
