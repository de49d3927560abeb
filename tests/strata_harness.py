"""What every process-driving test harness shares: how `strata` is started, and one `run()`.

`STRATA` is the command line of the `strata` under test: this interpreter's
`python -m strata`, so the process runs the checkout's code, never an
installed copy found on PATH. `StrataEnv` is a store directory under a test's
own root plus the environment `strata` runs with; the mount, step and
workspace harnesses (tests/mount/mount_harness.py, tests/run/run_harness.py,
tests/workspace/ws_harness.py) extend it with what they set up and tear down.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

STRATA = [sys.executable, "-m", "strata"]


class StrataEnv:
    """A store at `root/store`, and `strata` run as a real process against it."""

    def __init__(self, root: Path, **env: str) -> None:
        self.root = root
        self.store = root / "store"
        self.env = {**os.environ, "STRATA_STORE": str(self.store), **env}

    def run(self, *args: str, rc: int | None = 0, input: str | None = None
            ) -> subprocess.CompletedProcess[str]:
        """Run `strata ARGS` to completion; unless `rc` is None, fail unless it exits `rc`."""
        p = subprocess.run([*STRATA, *args], env=self.env, capture_output=True, text=True,
                           timeout=120, input=input)
        if rc is not None:
            assert p.returncode == rc, (args, p.returncode, p.stdout, p.stderr)
        return p
