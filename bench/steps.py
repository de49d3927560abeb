"""Step benchmarks: what `strata run` adds to a command, per sandbox, in one run.

Every figure sits beside the same command run without strata in the same
run: directly (`none`), under the same bubblewrap command line, or under the
same `runsc` bundle (both built by `strata.run.sandbox.build_command` over a
plain directory, in a jail of its own as the runner makes one: `StepJail`, with
the step's id range and user namespace under bwrap; the jail is made and
removed outside the baseline's timing, bench/sandbox.py measures it). The
command prints `date +%s.%N` and writes one file, so "start → command" is
that timestamp minus the moment the caller launched it
(or minus the runner's own start, `timings.began`, which leaves out the
interpreter start and the CLI's imports), and "exit → published" is the
runner's `timings.finish`. Figures are medians. Nothing here asserts.

`strata run` hands steps to the store's step service (run/service.py); the
rows marked "in-process runner" run the same steps with
STRATA_RUN_IN_PROCESS=1, the way every step ran before the service, in turn
with the others, so the two can be compared within one run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.cli_env import STRATA, CliEnv
from bench.report import row

TARGET_MS = {"none": 100.0, "gvisor": 500.0}  # PRODUCT.md: step overhead
WHOLE_MS = {"none": 100.0, "bwrap": 120.0}  # the whole command from the shell
IN_PROCESS = "in-process runner, as before the step service"
BASELINE_WHAT = {"none": "the command run directly", "bwrap": "the same bwrap, no strata",
                 "gvisor": "the same runsc bundle, no strata"}


class Env(CliEnv):
    """A store with its server and a volume `v`, and steps started on it."""

    def start_step(self, sandbox: str, script: str, in_process: bool = False
                   ) -> tuple[float, subprocess.Popen[str]]:
        """`strata run`, through the step service or (`in_process`) in its own process."""
        argv = [*STRATA, "run", "--json", "--sandbox", sandbox, "-v", "v", "--", "sh", "-c",
                script]
        env = {**self.env, "STRATA_RUN_IN_PROCESS": "1"} if in_process else self.env
        t = time.time()
        return t, subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)


def _script(i: int) -> str:
    return f'date +%s.%N; echo {i} > "$STRATA_STORAGE/v/f{i}"'


def _strata_once(env: Env, sandbox: str, i: int, in_process: bool = False
                 ) -> dict[str, float]:
    launched, p = env.start_step(sandbox, _script(i), in_process)
    out, err = p.communicate()
    ended = time.time()
    if p.returncode != 0:
        raise RuntimeError(f"strata run --sandbox {sandbox} exited {p.returncode}: {err.strip()}")
    stamp, _, report = out.partition("\n")
    t = json.loads(report)["timings"]
    cmd = float(stamp)
    return {"launch_to_cmd": cmd - launched, "runner_to_cmd": cmd - t["began"],
            "published": t["finish"], "wall": ended - launched}


class _Plain:
    """The same sandbox over a plain directory, no strata: a step's jail and nothing else.

    For bwrap and gvisor it is what the runner makes (run/runner.py's
    StepJail): a staging directory with the volumes' directory at
    stage/storage, and under bwrap the step's host id range and user
    namespace; the directory belongs to the step's root there, as the mount
    shows a volume. `none` gets a directory under `scratch`.
    """

    def __init__(self, sandbox: str, run_id: str, scratch: str) -> None:
        from strata.run.runner import StepJail
        self.sandbox, self.run_id = sandbox, run_id
        self.work = tempfile.mkdtemp(dir=scratch)
        self.jail = StepJail(sandbox, run_id) if sandbox != "none" else None
        try:
            if self.jail is None:
                self.storage = os.path.join(self.work, "storage")
                os.mkdir(self.storage)
            else:
                self.jail.open()
                self.storage = os.path.join(self.jail.stage, "storage")
                os.mkdir(self.storage, 0o755)
            os.mkdir(os.path.join(self.storage, "v"))
            if self.jail is not None and self.jail.id_base:
                for path in (self.storage, os.path.join(self.storage, "v")):
                    os.chown(path, self.jail.id_base, self.jail.id_base)
        except BaseException:
            self.close()
            raise

    def start(self, argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
        """Build the command and start it (the jail's descriptors go once it has them)."""
        from strata.run.sandbox import build_command
        launch = build_command(self.sandbox, argv, self.storage, network=False,
                               workdir=self.work, run_id=self.run_id, memory=None,
                               jail=self.jail.jail if self.jail is not None else None)
        try:
            return subprocess.Popen(launch.cmd, env=launch.env, cwd=self.storage,
                                    pass_fds=launch.pass_fds, **popen)
        finally:
            if self.jail is not None:
                self.jail.started()

    def close(self) -> None:
        if self.jail is not None:
            self.jail.close()
        shutil.rmtree(self.work, ignore_errors=True)


def _baseline_once(sandbox: str, i: int, scratch: str) -> dict[str, float]:
    """The same command under the same sandbox over a plain directory."""
    plain = _Plain(sandbox, f"bench-{os.getpid()}-{i}", scratch)
    try:
        launched = time.time()
        p = plain.start(["sh", "-c", _script(i)], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
        out, err = p.communicate()
        ended = time.time()
        if p.returncode != 0:
            raise RuntimeError(f"baseline {sandbox} exited {p.returncode}: {err.strip()}")
        return {"launch_to_cmd": float(out.split()[0]) - launched, "wall": ended - launched}
    finally:
        plain.close()


def _throughput(env: Env, sandbox: str, rounds: int, scratch: str,
                base: int, in_process: bool = False) -> tuple[float, float, int]:
    """8 concurrent steps writing disjoint files vs the 8 commands alone: steps/s each."""
    strata_rates, base_rates, failed = [], [], 0
    for r in range(rounds):
        t0 = time.perf_counter()
        procs = [env.start_step(sandbox, _script(base + 8 * r + k), in_process)[1]
                 for k in range(8)]
        for p in procs:
            _out, err = p.communicate()
            if p.returncode != 0:
                failed += 1
                print(f"[steps] a step exited {p.returncode}: {str(err or '')[-400:]}",
                      file=sys.stderr)
        strata_rates.append(8 / (time.perf_counter() - t0))
        # One jail each, as the runner gives every step (a bwrap step's id range owns it).
        jails: list[_Plain] = []
        try:
            for k in range(8):
                jails.append(_Plain(sandbox, f"tp-{os.getpid()}-{r}-{k}", scratch))
            t0 = time.perf_counter()
            plain = [j.start(["sh", "-c", _script(k)], stdout=subprocess.DEVNULL)
                     for k, j in enumerate(jails)]
            for p in plain:
                p.wait()
            base_rates.append(8 / (time.perf_counter() - t0))
        finally:
            for j in jails:
                j.close()
    return statistics.median(strata_rates), statistics.median(base_rates), failed


def run(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    """Run the step benchmarks in a fresh directory under `root`; return table rows."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("step benchmarks skipped: they need root and /dev/fuse", file=sys.stderr)
        return []
    work = tempfile.mkdtemp(prefix="strata-stepbench-", dir=root)
    env = Env(work)
    try:
        return _run_all(env, quick)
    finally:
        env.close()
        shutil.rmtree(work, ignore_errors=True)


def _run_all(env: Env, quick: bool) -> list[dict[str, Any]]:
    n = 3 if quick else 10
    scratch = os.path.join(env.root, "plain")
    os.makedirs(scratch)
    env.cli("init")
    env.cli("volume", "create", "v")
    sandboxes = ["none"] + [s for s, tool in (("bwrap", "bwrap"), ("gvisor", "runsc"))
                            if shutil.which(tool)]
    rows: list[dict[str, Any]] = []
    i = 0
    for sb in sandboxes:
        _log(f"step overhead, --sandbox {sb} ({n} runs, alternating with the baseline)")
        _strata_once(env, sb, i)  # warm: page cache, runsc's first start, the step service
        _baseline_once(sb, i, scratch)
        before = sb in WHOLE_MS  # the in-process runner too, in turn with the others
        runs, bases, olds = [], [], []
        for _ in range(n):
            i += 1
            runs.append(_strata_once(env, sb, i))
            bases.append(_baseline_once(sb, i, scratch))
            if before:
                i += 1
                olds.append(_strata_once(env, sb, i, in_process=True))

        def p50(samples: list[dict[str, float]], key: str) -> float:
            return statistics.median(s[key] for s in samples) * 1000

        base = p50(bases, "launch_to_cmd")
        target = TARGET_MS.get(sb)
        for what, key in (("from `strata run` launch", "launch_to_cmd"),
                          ("from the runner's start", "runner_to_cmd")):
            value = p50(runs, key)
            rows.append(row(f"step start → command, {sb} ({what})", value, "ms", base,
                            BASELINE_WHAT[sb],
                            f"overhead ≤ {target:g} ms" if target else "",
                            met=None if target is None else value - base <= target))
        pub = p50(runs, "published")
        rows.append(row(f"step exit → published, {sb}", pub, "ms", None, "",
                        f"≤ {target:g} ms" if target else "",
                        met=None if target is None else pub <= target))
        whole = WHOLE_MS.get(sb)
        rows.append(row(f"whole `strata run` from the shell, {sb}", p50(runs, "wall"), "ms",
                        p50(bases, "wall"), BASELINE_WHAT[sb],
                        f"≤ {whole:g} ms" if whole else "",
                        met=None if whole is None else p50(runs, "wall") <= whole))
        if olds:
            rows.append(row(f"  same, {IN_PROCESS}", p50(olds, "wall"), "ms",
                            p50(bases, "wall"), BASELINE_WHAT[sb]))
            rows.append(row(f"  start → command, {IN_PROCESS}", p50(olds, "launch_to_cmd"),
                            "ms", base, BASELINE_WHAT[sb]))
    for sb, in_process in [(sb, False) for sb in sandboxes[:2]] + [("none", True)]:
        _log(f"throughput: 8 concurrent steps writing disjoint files, --sandbox {sb}"
             + (f" ({IN_PROCESS})" if in_process else ""))
        rate, base_rate, failed = _throughput(env, sb, 2 if quick else 3, scratch,
                                              1000 * (i + 1), in_process)
        i += 1
        land = "all land" if not failed else f"{failed} FAILED"
        if in_process:
            rows.append(row(f"  same, {IN_PROCESS}", rate, "steps/s", base_rate,
                            "the 8 commands alone", land, lower_is_better=False,
                            met=failed == 0))
        else:
            rows.append(row(f"8 concurrent steps, disjoint files, {sb}", rate, "steps/s",
                            base_rate,
                            "the 8 commands alone" if sb == "none" else "8 plain bwrap",
                            f"≥ 25 steps/s, {land}" if sb == "none" else land,
                            lower_is_better=False,
                            met=failed == 0 and (sb != "none" or rate >= 25)))
    return rows


def _log(msg: str) -> None:
    print(f"[steps] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    from bench.report import print_table
    print_table("strata step benchmarks", run(os.environ.get("STRATA_BENCH_DIR", "/var/tmp"),
                                              quick="--quick" in sys.argv))
