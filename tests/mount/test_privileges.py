"""What a volume holds never grants privileges on the host that mounts it (Hardening II, 2).

A token holder can publish a setuid-root program and a world-writable device
node. `strata mount` is nosuid,nodev unless `--privileged` asks otherwise:
uid 65534 then runs the program as itself and cannot open the device.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from mount_harness import MountEnv

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="planting setuid-root files needs root")


def _plant(menv: MountEnv) -> None:
    src = menv.root / "planted"
    src.mkdir()
    shutil.copy2("/usr/bin/id", src / "id")
    os.chown(src / "id", 0, 0)
    os.chmod(src / "id", 0o4755)
    os.mknod(src / "loop-control", 0o20666, os.makedev(10, 237))
    os.chmod(src / "loop-control", 0o666)
    os.mknod(src / "null", 0o20666, os.makedev(1, 3))
    os.chmod(src / "null", 0o666)
    menv.run("volume", "create", "v")
    menv.run("import", "v", str(src), "-m", "a token holder's gift")


def _reachable() -> Path:
    """A mount point uid 65534 can reach (pytest's own directory is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="strata-priv-", dir="/var/tmp"))
    os.chmod(d, 0o755)
    return d / "m"


def _as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                           *argv], capture_output=True, text=True)


def _open_as_nobody(path: Path) -> subprocess.CompletedProcess[str]:
    code = "import os, sys; os.close(os.open(sys.argv[1], os.O_RDWR))"
    return _as_nobody("/usr/bin/python3", "-c", code, str(path))


@pytest.mark.parametrize("mode", ["rw", "ro"])
def test_a_mount_ignores_setuid_bits_and_device_nodes(menv: MountEnv, mode: str) -> None:
    _plant(menv)
    m = menv.mount("v", str(_reachable()), *(["--ro"] if mode == "ro" else []))
    assert os.stat(m / "id").st_mode & 0o4000  # the bit is shown ...
    r = _as_nobody(str(m / "id"), "-u")
    assert r.returncode == 0 and r.stdout.strip() == "65534", (r.stdout, r.stderr)  # ... inert
    for dev in ("loop-control", "null"):
        r = _open_as_nobody(m / dev)
        assert r.returncode != 0 and "PermissionError" in r.stderr, r.stderr
    opts = [line.split()[5] for line in open("/proc/self/mountinfo")
            if line.split()[4] == str(m)]
    assert opts and all("nosuid" in o and "nodev" in o for o in opts), opts


def test_privileged_mount_honours_them_when_asked(menv: MountEnv) -> None:
    _plant(menv)
    m = menv.mount("v", str(_reachable()), "--privileged")
    r = _as_nobody(str(m / "id"), "-u")
    assert r.stdout.strip() == "0", (r.stdout, r.stderr)
    r = _open_as_nobody(m / "null")
    assert r.returncode == 0, r.stderr
