"""Workspace test harness: a store with its server, cleanup, and tiny root filesystems.

Test modules import from here (not from conftest, whose module name other
test directories share).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from strata_harness import StrataEnv


class WsEnv(StrataEnv):
    """A store with its server, and a `strata` that talks to it."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, STRATA_WORKSPACE_STATE=str(root / "state"))
        self.attached: list[Path] = []

    def attach(self, name: str, dirname: str) -> Path:
        d = self.root / dirname
        d.mkdir(exist_ok=True)
        self.run("workspace", "attach", name, str(d))
        self.attached.append(d)
        return d

    def detach(self, d: Path) -> None:
        self.run("workspace", "detach", str(d))
        self.attached.remove(d)


def cleanup(root: Path) -> None:
    """Lazily unmount everything under `root`, and abort its FUSE connections."""
    from strata.workspace.ext4 import abort_fuse, fuse_connections
    lines = [ln for ln in open("/proc/self/mountinfo").read().splitlines()
             if ln.split()[4].startswith(str(root))]
    for line in reversed(lines):
        subprocess.run(["umount", "-l", line.split()[4]], capture_output=True)
    abort_fuse(fuse_connections("\n".join(lines)))


def tiny_root(target: Path, programs: tuple[str, ...] = ("sh", "cat", "ls", "mkdir", "rm")
              ) -> Path:
    """A root filesystem of real binaries of this machine and the libraries they load."""
    import shutil
    files: set[str] = set()
    for prog in programs:
        path = shutil.which(prog)
        assert path is not None, prog
        files.add(os.path.realpath(path))
        out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            for p in parts:
                if p.startswith("/"):
                    files.add(p)
                    files.add(os.path.realpath(p))
    for f in files:
        dest = target / f.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
    (target / "bin").mkdir(exist_ok=True)
    for prog in programs:
        real = os.path.realpath(shutil.which(prog) or "")
        link = target / "bin" / prog
        if not link.exists():
            link.symlink_to(real)
    for d in ("proc", "dev", "tmp", "etc"):
        (target / d).mkdir(exist_ok=True)
    (target / "etc" / "hostname").write_text("seeded\n")
    return target
