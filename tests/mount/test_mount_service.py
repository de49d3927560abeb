"""`strata mount --background` made by the store's step service (run/service.py).

The CLI only asks; a mount process forked ahead by the service, with the
FUSE stack loaded, serves the mount. The mount belongs to nobody but itself:
it outlives the CLI, the service's worker and the service, as a background
mount made in the CLI's own process always did.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from mount_harness import MountEnv

from strata.run import protocol


def _service(menv: MountEnv) -> int:
    return int((menv.store / protocol.LOCK_NAME).read_text())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_background_mount_outlives_the_service(menv: MountEnv) -> None:
    menv.run("volume", "create", "v")
    menv.run("put", "v", "a.txt", input="hello\n")
    m = menv.mount("v")
    assert (m / "a.txt").read_text() == "hello\n"
    service = _service(menv)
    os.kill(service, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _alive(service) and time.monotonic() < deadline:
        time.sleep(0.02)
    (m / "b.txt").write_text("world\n")
    assert sorted(os.listdir(m)) == ["a.txt", "b.txt"]
    menv.run("commit", str(m), "-m", "after the service died")
    assert menv.run("cat", "v", "b.txt").stdout == "world\n"
    menv.unmount(m)
    # The next background mount starts a fresh service.
    m2 = menv.mount("v", "m2", "--ro")
    assert sorted(os.listdir(m2)) == ["a.txt", "b.txt"]
    assert _service(menv) != service
    menv.unmount(m2)


def test_the_in_process_mount_still_works(menv: MountEnv, tmp_path: Path) -> None:
    menv.run("volume", "create", "v")
    menv.run("put", "v", "a.txt", input="x\n")
    menv.env["STRATA_MOUNT_IN_PROCESS"] = "1"
    m = menv.mount("v")
    assert os.listdir(m) == ["a.txt"]
    menv.unmount(m)
    assert not (menv.store / protocol.SOCKET_NAME).exists()  # no service was asked


def test_mount_errors_come_back_from_the_service(menv: MountEnv) -> None:
    menv.run("volume", "create", "v")
    target = menv.root / "t"
    target.mkdir()
    p = menv.run("mount", "nosuchvolume", str(target), "--background", rc=4)
    assert "nosuchvolume" in p.stderr
    p = menv.run("mount", "v#00000000", str(target), "--background", "--ro", rc=None)
    assert p.returncode != 0 and not os.path.ismount(target)
    scratch = menv.root / "scratch"
    assert not scratch.exists() or os.listdir(scratch) == []  # refused before any scratch
