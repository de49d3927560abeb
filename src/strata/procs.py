"""The resident processes' shared rules: whether one still runs, and how long one idles.

`alive` is the one answer the runner, the mount and workspaces use. A
process that has exited but is not reaped yet counts as gone. The mount
process and the workspace daemon are detached, so whoever adopts them reaps
them, and some init processes take a second or more: waiting for the reap
doubled every unmount.

`idle_exit` is the one reading of STRATA_SERVER_IDLE_EXIT, for the store's
server (started by the CLI), the step service and the mounts that keep the
server busy.
"""

from __future__ import annotations

import os

IDLE_EXIT_ENV = "STRATA_SERVER_IDLE_EXIT"
IDLE_EXIT_DEFAULT = 300.0


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


def idle_exit() -> float:
    """Seconds a resident process started on demand stays without work (STRATA_SERVER_IDLE_EXIT).

    300 when the variable is unset, empty, or not a number of seconds from 0
    up (a bad value never stops a process from starting). What 0 means is
    each caller's: the server never idles out, the step service waits its
    shortest time.
    """
    raw = os.environ.get(IDLE_EXIT_ENV, "").strip()
    try:
        value = float(raw) if raw else IDLE_EXIT_DEFAULT
    except ValueError:
        return IDLE_EXIT_DEFAULT
    return value if value >= 0 else IDLE_EXIT_DEFAULT  # NaN compares False: the default


def keepalive_every() -> float:
    """How often a mount asks something of a server that idles out, so that it stays.

    A third of the idle time, between 0.5 s and a minute.
    """
    return max(min(idle_exit() / 3, 60.0), 0.5)
