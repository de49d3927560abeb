"""Workspaces on this machine: attach, detach and snapshot, as a command asks them.

`attach` forks the attach daemon (workspace/daemon.py) and returns once the
filesystem is mounted on the caller's directory, or raises the daemon's
error; `detach` unmounts, lets the daemon publish and release its lease,
and waits for it; `snapshot` asks the attached daemon (or publishes at the
head when none is attached here). A daemon that died is cleaned up after
here. The state of each attach is workspace/state.py's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

from strata.engine.errors import (
    HelperFailed,
    InvalidInput,
    NotFound,
    StrataError,
    Unavailable,
    WritesDropped,
)
from strata.engine.interface import ChangeSet, Store
from strata.mount import mountinfo
from strata.procs import alive
from strata.workspace.device import SNAPSHOT_PATH, read_layout, snapshot_entry
from strata.workspace.ext4 import abort_fuse, fuse_connections, release_device
from strata.workspace.state import Attached, attached, fenced_note

log = logging.getLogger(__name__)


def _ask(att: Attached, request: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(os.path.join(att.state_dir, "ctl"))
        s.sendall(json.dumps(request).encode() + b"\n")
        reply = json.loads(s.makefile("rb").readline(65536))
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise HelperFailed(f"{request.get('op')} failed: "
                           f"{reply.get('error') if isinstance(reply, dict) else reply}")
    return reply


def attach(server: str, token: str | None, volume: str, branch: str, directory: str, *,
           snapshot: str = "", owner: int = 0, fleet: str = "",
           fleet_store: str = "") -> Attached:
    """Attach in a detached daemon; return once mounted (or raise its error).

    With `snapshot`, that snapshot, read-only (the branch is only a label).
    With `owner`, the daemon detaches by itself once that process is gone.
    With `fleet` (members, comma-separated), the daemon talks to the first
    live member, as `strata --fleet` does, and the fleet's secret comes from
    this process's environment, never from the state file.
    """
    directory = os.path.realpath(directory)
    if not os.path.isdir(directory):
        raise InvalidInput(f"{directory} is not a directory")
    if os.path.ismount(directory):
        raise InvalidInput(f"something is mounted on {directory} already")
    att = Attached(volume, branch, directory, server, token, snapshot=snapshot, owner=owner,
                   fleet=fleet, fleet_store=fleet_store)
    with contextlib.suppress(NotFound):
        old = Attached.load(directory)
        if old.pid and alive(old.pid):
            raise InvalidInput(f"{directory} has a workspace attached (pid {old.pid})")
    shutil.rmtree(att.state_dir, ignore_errors=True)
    os.makedirs(att.state_dir, mode=0o700)
    att.save()
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        msg = b""
        while chunk := os.read(rfd, 4096):
            msg += chunk
        os.close(rfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        if msg != b"ok":
            shutil.rmtree(att.state_dir, ignore_errors=True)
            why = msg.decode(errors="replace") or "the daemon died"
            raise HelperFailed(f"attach failed: {why}")
        return Attached.load(directory)
    os.close(rfd)
    code = 1
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        log = os.open(os.path.join(att.state_dir, "daemon.log"),
                      os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        from strata.logs import setup
        setup(os.path.join(att.state_dir, "daemon.log"))
        from strata.workspace.daemon import run_daemon
        code = run_daemon(att, wfd)
    except BaseException as exc:  # noqa: BLE001 - report anything, then go
        with contextlib.suppress(OSError):
            os.write(wfd, f"{type(exc).__name__}: {exc}".encode())
    finally:
        os._exit(code)


def _gone(att: Attached) -> None:
    """Clean up after a daemon that died (its host's processes were killed)."""
    devdir = os.path.join(att.state_dir, "dev")
    mine = [m for m in mountinfo.read() if m.point == devdir]
    subprocess.run(["umount", "-l", att.dir], capture_output=True)
    abort_fuse(fuse_connections(mine))
    subprocess.run(["umount", "-l", devdir], capture_output=True)
    shutil.rmtree(att.state_dir, ignore_errors=True)


def detach(directory: str, *, timeout: float = 60.0) -> None:
    """Unmount (which flushes), let the daemon publish and release the lease, wait.

    If the daemon is dead (the attach was lost with its processes), clean up
    what it left instead: nothing more reaches the workspace from here anyway.
    """
    att = Attached.load(directory)
    if not att.pid or not alive(att.pid):
        _gone(att)
        return
    p = subprocess.run(["umount", att.dir], capture_output=True, text=True)
    if p.returncode != 0 and os.path.ismount(att.dir):
        raise Unavailable(f"cannot detach {att.dir}: {p.stderr.strip()}")
    if not att.snapshot and alive(att.pid):
        with contextlib.suppress(StrataError, OSError, ValueError):
            _ask(att, {"op": "trim"})  # free blocks become holes; keeping them is safe too
    deadline = time.monotonic() + timeout
    if not release_device(os.path.join(att.state_dir, "dev"), deadline):
        raise Unavailable(f"the device of {att.dir} stays busy")
    while att.pid and alive(att.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    fenced = fenced_note(att)
    shutil.rmtree(att.state_dir, ignore_errors=True)
    if fenced is not None:
        raise WritesDropped(f"{att.dir} was fenced ({fenced['reason']}): another holder took "
                     f"{att.volume}@{att.branch} over, and {fenced['dropped_bytes']} byte(s) "
                     "written here after that were dropped; the workspace holds what the "
                     "other holder wrote")


def snapshot(store: Store, volume: str, branch: str, message: str) -> str:
    """A named snapshot: through the daemon when attached here, else of the head."""
    for att in attached():
        if (att.volume, att.branch) == (volume, branch) and not att.snapshot \
                and alive(att.pid):
            return str(_ask(att, {"op": "snapshot", "message": message})["head"])
    head = store.head(volume, branch)
    read_layout(store, head)
    return store.publish([ChangeSet(volume, branch, head, {SNAPSHOT_PATH: snapshot_entry(message)},
                                    message, {"workspace": "snapshot"})])[0]
