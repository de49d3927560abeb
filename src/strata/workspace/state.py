"""Where an attach is recorded on this machine: its state directory and `state.json`.

Both sides read it: the daemon (workspace/daemon.py) writes its pid, loop
device and, once fenced, the `fenced` note; `attach`, `detach`, `snapshot`
and `workspace list` (workspace/attach.py, cli/workspace.py) find the daemon
through it. It holds no connection to a store and starts nothing.

State lives in /run/strata/workspaces/<hash of the directory>/ (`state.json`,
`dev/` the FUSE directory, `ctl` the socket, `daemon.log`, `fenced`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from strata.engine.errors import InvalidInput, NotFound

log = logging.getLogger(__name__)

STATE_ROOT = os.environ.get("STRATA_WORKSPACE_STATE", "/run/strata/workspaces")
FENCED = "fenced"  # in an attach's state directory, once another holder took it over


@dataclass
class Attached:
    """What `detach` and `snapshot` need to find an attached workspace's daemon."""

    volume: str
    branch: str
    dir: str
    server: str
    token: str | None = None
    pid: int = 0
    loop: str = ""
    snapshot: str = ""   # set for a read-only attach of one snapshot
    owner: int = 0       # detach once this process is gone (0: stay until detached)
    fleet: str = ""      # through a fleet: its members, comma-separated (`server` is the first)
    fleet_store: str = ""  # the store named for it ("": the fleet's catalog places the volume)

    @property
    def state_dir(self) -> str:
        return state_dir_for(self.dir)

    def save(self) -> None:
        path = os.path.join(self.state_dir, "state.json")
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(self), f)
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, directory: str) -> Attached:
        try:
            with open(os.path.join(state_dir_for(directory), "state.json")) as f:
                return cls(**json.load(f))
        except FileNotFoundError:
            raise NotFound(f"no workspace is attached at {directory}") from None
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"the attach state of {directory} is damaged: {exc}") from None


def state_dir_for(directory: str) -> str:
    real = os.path.realpath(directory)
    return os.path.join(STATE_ROOT, hashlib.sha256(os.fsencode(real)).hexdigest()[:16])


def attached() -> list[Attached]:
    """Every workspace attached on this machine (in this mount namespace's view)."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(STATE_ROOT)):
            with contextlib.suppress(OSError, ValueError, TypeError):
                with open(os.path.join(STATE_ROOT, name, "state.json")) as f:
                    out.append(Attached(**json.load(f)))
    return out



def fenced_note(att: Attached) -> dict[str, Any] | None:
    """What the daemon recorded when it was fenced, or None if it never was."""
    try:
        with open(os.path.join(att.state_dir, FENCED)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
