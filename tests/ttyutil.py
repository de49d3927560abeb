"""Run a command with its stderr on a pseudo-terminal, and read what it drew there."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence


def drawn_on_a_terminal(cmd: Sequence[str], env: dict[str, str] | None = None,
                        timeout: float = 120) -> tuple[int, bytes]:
    """(exit status, bytes written to stderr) with stderr a terminal 100 columns wide."""
    leader, follower = os.openpty()
    try:
        p = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=follower,
                             env={**(env if env is not None else os.environ), "COLUMNS": "100"})
        os.close(follower)
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
        return p.wait(timeout), drawn
    finally:
        os.close(leader)
