"""Whether a process still runs: the one answer the runner, the mount and workspaces use.

A process that has exited but is not reaped yet counts as gone. The mount
process and the workspace daemon are detached, so whoever adopts them reaps
them, and some init processes take a second or more: waiting for the reap
doubled every unmount.
"""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True while `pid` runs (never for pid 0 or below, which name groups)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False  # gone between the two looks
    except (OSError, IndexError):
        return True  # it answered the signal; /proc could not say more
