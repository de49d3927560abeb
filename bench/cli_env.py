"""A private store with its own server, and the strata CLI pointed at it.

Shared by the mount and step benchmarks: everything (store, mount scratch,
content cache) lives under one fresh directory, so caches start cold and
nothing outside it is touched.
"""

from __future__ import annotations

import os
import subprocess
import sys

STRATA = [sys.executable, "-m", "strata"]


class CliEnv:
    def __init__(self, root: str) -> None:
        self.root = root
        self.store = os.path.join(root, "store")
        self.scratch = os.path.join(root, "scratch")
        self.cache = os.path.join(root, "cache")
        self.env = {**os.environ, "STRATA_STORE": self.store, "STRATA_SCRATCH": self.scratch,
                    "XDG_CACHE_HOME": self.cache, "STRATA_SERVER_IDLE_EXIT": "3600"}

    def cli(self, *args: str) -> str:
        p = subprocess.run([*STRATA, *args], env=self.env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"strata {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

    def close(self) -> None:
        subprocess.run([*STRATA, "serve", "--stop"], env=self.env, capture_output=True)
