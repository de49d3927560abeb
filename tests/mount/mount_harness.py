"""FUSE test harness: a store with its server, mounts that are always torn down.

Every mount made through `mounted()` is unmounted on teardown (lazily if
something still holds it), and the session ends with a sweep that fails
loudly if a strata mount was left behind.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from strata_harness import StrataEnv


class MountEnv(StrataEnv):
    """A store, and the mounts made of it (`mounted()` unmounts them on teardown)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, STRATA_SCRATCH=str(root / "scratch"),
                         XDG_CACHE_HOME=str(root / "cache"))
        self.mounts: list[Path] = []

    def mount(self, ref: str, name: str = "m", *extra: str) -> Path:
        target = self.root / name
        target.mkdir(exist_ok=True)
        self.run("mount", ref, str(target), "--background", *extra)
        self.mounts.append(target)
        wait_mounted(target)
        return target

    def unmount(self, target: Path, *extra: str, rc: int | None = 0
                ) -> subprocess.CompletedProcess[str]:
        p = self.run("unmount", str(target), *extra, rc=rc)
        if p.returncode == 0 and target in self.mounts:
            self.mounts.remove(target)
        return p


def wait_mounted(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.ismount(path):
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} did not become a mount point")


def strata_mounts(prefix: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix)]


