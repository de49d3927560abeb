"""Step test harness: a store with its server, `strata run` as a real process, sweeps.

Each test gets its own store, scratch directory and server (started by the
CLI on first use). Steps run as `python -m strata run ... --json` processes,
either to completion (`step`) or in the background (`start_step`) so a test
can kill the runner. The fixture's teardown checks that every step left
nothing behind: no mount under the test's directory, an empty scratch
directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.server.client import RemoteStore, default_socket
from strata_harness import STRATA, StrataEnv


@dataclass
class StepResult:
    rc: int
    out: dict[str, Any] = field(default_factory=dict)  # the --json report ({} if none)
    stdout: str = ""
    stderr: str = ""


class StepEnv(StrataEnv):
    """A store, and steps run on it as `strata run` processes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, STRATA_SCRATCH=str(root / "scratch"),
                         XDG_CACHE_HOME=str(root / "cache"))
        self.scratch = root / "scratch"

    def step_argv(self, specs: Sequence[str], cmd: Sequence[str], sandbox: str = "none",
                  *extra: str) -> list[str]:
        argv = [*STRATA, "run", "--json", "--sandbox", sandbox, *extra]
        for s in specs:
            argv += ["-v", s]
        return [*argv, "--", *cmd]

    def start_step(self, specs: Sequence[str], cmd: Sequence[str], sandbox: str = "none",
                   *extra: str, env: dict[str, str] | None = None
                   ) -> subprocess.Popen[str]:
        # As a shell's foreground job: a suite started in the background (`make test &`,
        # nohup) ignores SIGINT, children inherit that, and Ctrl-C tests would send theirs
        # to a `strata run` that never sees it.
        return subprocess.Popen(self.step_argv(specs, cmd, sandbox, *extra),
                                env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=_default_sigint)

    def step(self, specs: Sequence[str], cmd: Sequence[str], sandbox: str = "none",
             *extra: str, env: dict[str, str] | None = None, timeout: float = 120
             ) -> StepResult:
        p = self.start_step(specs, cmd, sandbox, *extra, env=env)
        return finish(p, timeout)

    def remote(self) -> RemoteStore:
        """A client of the store's server (started by the first `strata` command)."""
        return RemoteStore("unix:" + default_socket(str(self.store)))

    def head(self, ref: str) -> str:
        out = json.loads(self.run("log", ref, "-n", "1", "--json").stdout)
        return str(out[0]["id"])

    def ls(self, ref: str, path: str = "") -> list[str]:
        args = ["ls", ref] + ([path] if path else [])
        return self.run(*args).stdout.split()

    def cat(self, ref: str, path: str) -> str:
        return self.run("cat", ref, path).stdout

    def branches(self, volume: str) -> dict[str, str]:
        out = json.loads(self.run("branch", "list", volume, "--json").stdout)
        return {b["name"]: b["head"] for b in out}

    def written(self, volume: str, path: str) -> list[Path]:
        """`path` as a running step wrote it: in its mount's upper directory, on the host."""
        return sorted(self.scratch.glob(f"*/upper/{volume}/{path}"))

    def leftovers(self) -> tuple[list[str], list[str]]:
        """Mounts under the test's directory and entries in the scratch directory."""
        scratch = sorted(os.listdir(self.scratch)) if self.scratch.is_dir() else []
        return mounts_under(str(self.root)), scratch

    def wait_clean(self, timeout: float = 5.0) -> None:
        """Wait until no mount and no scratch is left; fail naming what is."""
        left = wait_for(lambda: self.leftovers() == ([], []), timeout)
        assert left, f"left behind after {timeout:g}s: {self.leftovers()}"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(p: subprocess.Popen[str], timeout: float = 120) -> StepResult:
    """Wait for a step started with `start_step` and parse its --json report."""
    stdout, stderr = p.communicate(timeout=timeout)
    out: dict[str, Any] = {}
    start = stdout.find("{\n")
    if start >= 0:  # the command's own output comes first
        out = json.loads(stdout[start:])
    return StepResult(p.returncode, out, stdout[:start] if start >= 0 else stdout, stderr)


def wait_for(cond: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def mounts_under(prefix: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [mp for line in f if (mp := line.split()[4]).startswith(prefix)]


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False
