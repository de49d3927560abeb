"""Sandbox benchmarks: what the new sandbox costs per step, beside the old design, in one run.

The sandbox was rebuilt (run/sandbox.py, run/runner.py's StepJail,
run/rootfs.py, run/identity.py): a bwrap step now runs as root of a user
namespace over a host id range of its own, from a staging directory that
range owns, with a root of its own (a skeleton with the host's /usr, not the
host's /) and a seccomp filter; a gVisor step gets the same root. Every
figure here sits beside the previous design measured in the same run,
`_old_command` below (a copy of the old command builder, kept only to
measure against), the runs of the two alternating so that noise hits both
alike:

- the launch alone of `true`: for the new design everything the runner does
  per step for the sandbox (StepJail open, build_command, Popen, wait,
  close); for the old one its command built and run (Popen to exit). Then
  the same through each design's way of running a step's command (the new
  run_command with its pids cgroup gate; the old one's setpriv wrapper);
- the whole `strata run -v v --sandbox SB -- true` from the shell, through
  the step service and with STRATA_RUN_IN_PROCESS=1, beside the old
  design's launch alone (what the command itself cost before).

Figures are medians. Nothing here asserts: a failure is printed and its row
left out.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.cli_env import STRATA, CliEnv
from bench.report import row

ARGV = ["true"]
LAUNCH_TARGET_MS = 20.0  # the new sandbox may add this much to a step's launch
NEW_WHAT = {"bwrap": "new: own root, user namespace, seccomp",
            "gvisor": "new: own root, caps, no_new_privs"}


# --- The previous design, kept only to measure against ------------------------------
# A copy of the old strata.run.sandbox.build_command (before the rewrite), for a step
# with volumes and no workspace root: bwrap, started as the host's root, binds the
# host root read-only entry by entry; gVisor's OCI config has the host's "/" as its
# read-only root and runs the command as the caller's uid. Nothing of strata uses it.

def _old_command(sandbox: str, argv: list[str], storage: str, *, network: bool,
                 workdir: str, run_id: str, memory: int | None
                 ) -> tuple[list[str], dict[str, str]]:
    """The OLD design's command line for `argv` in `sandbox`, and its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["STRATA_STORAGE"] = "/storage"
    if sandbox == "bwrap":
        cmd = ["bwrap"]
        for name in sorted(os.listdir("/")):
            if name in ("proc", "dev", "tmp", "storage"):
                continue
            path = "/" + name
            if os.path.islink(path):
                cmd += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                cmd += ["--ro-bind", path, path]
        cmd += ["--dev", "/dev", "--proc", "/proc",
                "--tmpfs", "/tmp", "--bind", storage, "/storage", "--unshare-all",
                "--die-with-parent", "--new-session", "--chdir", "/storage",
                "--setenv", "STRATA_STORAGE", "/storage"]
        if network:
            cmd.append("--share-net")
        return [*cmd, "--", *argv], env
    if sandbox == "gvisor":
        config = _old_oci_config(argv, env, storage, network=network, memory=memory)
        bundle = os.path.join(workdir, "bundle")
        os.makedirs(bundle, exist_ok=True)
        with open(os.path.join(bundle, "config.json"), "w") as f:
            json.dump(config, f)
        return ["runsc", "--root", os.path.join(workdir, "runsc-root"),
                "--network=host" if network else "--network=none", "--platform=ptrace",
                "--ignore-cgroups", "run", "--bundle", bundle, f"strata-{run_id}"], env
    raise ValueError(f"the old design is kept here for bwrap and gvisor, not {sandbox!r}")


def _old_oci_config(argv: list[str], env: dict[str, str], storage: str, *, network: bool,
                    memory: int | None) -> dict[str, object]:
    """The OLD design's OCI config: the host's / read-only as the root (previous design)."""
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if not network:
        namespaces.append({"type": "network"})
    linux: dict[str, object] = {"namespaces": namespaces}
    if memory:
        linux["resources"] = {"memory": {"limit": memory}}
    mounts: list[dict[str, object]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777"]},
        {"destination": "/storage", "type": "bind", "source": storage,
         "options": ["rbind", "rw"]},
    ]
    return {
        "ociVersion": "1.0.0",
        "process": {"terminal": False, "user": {"uid": os.getuid(), "gid": os.getgid()},
                    "args": argv, "cwd": "/storage",
                    "env": [f"{k}={v}" for k, v in env.items()]},
        "root": {"path": "/", "readonly": True},
        "hostname": "strata-step",
        "mounts": mounts,
        "linux": linux,
    }


def _old_run(cmd: list[str], env: dict[str, str], cwd: str) -> int:
    """The OLD run_command without a memory limit: setpriv's pdeathsig, its own group."""
    from strata.run.sandbox import pdeathsig_wrapper
    wrapper = pdeathsig_wrapper()
    if wrapper is not None:
        proc = subprocess.Popen([*wrapper, "--", *cmd], env=env, cwd=cwd, process_group=0)
    else:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, process_group=0)
    proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode

# --- end of the previous design ------------------------------------------------------


class _Timer:
    """Laps of one launch, in ms."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = (now - self.t) * 1000
        self.t = now


def _old_once(sb: str, scratch: str, n: int, via_runner: bool = False) -> dict[str, float]:
    """The old design: its command built, then run to its exit (alone or as it ran steps)."""
    work = tempfile.mkdtemp(dir=scratch)
    storage = os.path.join(work, "storage")
    os.makedirs(os.path.join(storage, "v"))
    try:
        clock = _Timer()
        cmd, env = _old_command(sb, ARGV, storage, network=False, workdir=work,
                                run_id=f"old-{os.getpid()}-{n}", memory=None)
        clock.lap("build")
        if via_runner:
            rc = _old_run(cmd, env, storage)
        else:
            rc = subprocess.Popen(cmd, env=env, cwd=storage).wait()
        clock.lap("run")
        if rc != 0:
            raise RuntimeError(f"old design, {sb}: `true` exited {rc}")
        clock.laps["total"] = clock.laps["build"] + clock.laps["run"]
        return clock.laps
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _new_once(sb: str, scratch: str, n: int, via_runner: bool = False) -> dict[str, float]:
    """The new design, everything the runner adds per step for the sandbox.

    StepJail open (id range, user namespace, staging directory), the volumes'
    directory in it, build_command, Popen to exit, and close. With
    `via_runner`, run_command (its pids cgroup gate) in place of Popen.
    """
    from strata.run.runner import StepJail
    from strata.run.sandbox import DEFAULT_PIDS, build_command, run_command
    run_id = f"sbbench-{os.getpid()}-{n}"
    work = tempfile.mkdtemp(dir=scratch)  # the runner's scratch: gVisor's bundle
    try:
        clock = _Timer()
        jail = StepJail(sb, run_id)
        try:
            jail.open()
            storage = os.path.join(jail.stage, "storage")
            os.mkdir(storage, 0o755)
            if jail.id_base:  # the step's root owns its volumes, as the mount shows them
                os.chown(storage, jail.id_base, jail.id_base)
            clock.lap("open")
            launch = build_command(sb, ARGV, storage, network=False, workdir=work,
                                   run_id=run_id, memory=None, jail=jail.jail)
            clock.lap("build")
            if via_runner:
                try:
                    rc = run_command(launch, cwd=storage, timeout=None, memory=None,
                                     cgroup_name=f"strata-{run_id}",
                                     pids=DEFAULT_PIDS).status
                finally:
                    jail.started()
            else:
                try:
                    proc = subprocess.Popen(launch.cmd, env=launch.env, cwd=storage,
                                            pass_fds=launch.pass_fds)
                finally:
                    jail.started()
                rc = proc.wait()
            clock.lap("run")
        finally:
            jail.close()
        clock.lap("close")
        if rc != 0:
            raise RuntimeError(f"new design, {sb}: `true` exited {rc}")
        clock.laps["total"] = sum(clock.laps.values())
        return clock.laps
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _alternate(n: int, a: Callable[[int], dict[str, float]],
               b: Callable[[int], dict[str, float]]
               ) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """`n` runs of each, interleaved (the order flips every round)."""
    ra: list[dict[str, float]] = []
    rb: list[dict[str, float]] = []
    for i in range(n):
        if i % 2 == 0:
            ra.append(a(i))
            rb.append(b(i))
        else:
            rb.append(b(i))
            ra.append(a(i))
    return ra, rb


def _p50(samples: list[dict[str, float]], key: str = "total") -> float:
    return statistics.median(s[key] for s in samples)


class Env(CliEnv):
    """A store with its server and a volume `v`."""

    def step(self, sb: str, in_process: bool = False, extra: tuple[str, ...] = ()) -> float:
        """`strata run -v v --sandbox SB [EXTRA] -- true` from the shell, in ms."""
        env = {**self.env, "STRATA_RUN_IN_PROCESS": "1"} if in_process else self.env
        t0 = time.perf_counter()
        p = subprocess.run([*STRATA, "run", "--sandbox", sb, "-v", "v", *extra, "--", *ARGV],
                           env=env, capture_output=True, text=True)
        ms = (time.perf_counter() - t0) * 1000
        if p.returncode != 0:
            raise RuntimeError(f"strata run --sandbox {sb}"
                               f"{' (in process)' if in_process else ''} exited "
                               f"{p.returncode}: {p.stderr.strip()[-400:]}")
        return ms


def run(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    """Run the sandbox benchmarks in a fresh directory under `root`; return table rows."""
    if os.geteuid() != 0:
        print("sandbox benchmarks skipped: they need root (a step's id range and namespace)",
              file=sys.stderr)
        return []
    sandboxes = [sb for sb, tool in (("bwrap", "bwrap"), ("gvisor", "runsc"))
                 if shutil.which(tool)]
    if not sandboxes:
        print("sandbox benchmarks skipped: neither bwrap nor runsc is installed",
              file=sys.stderr)
        return []
    n = 5 if quick else 20
    work = tempfile.mkdtemp(prefix="strata-sandboxbench-", dir=root)
    scratch = os.path.join(work, "plain")
    os.makedirs(scratch)
    rows: list[dict[str, Any]] = []
    env: Env | None = None
    try:
        for sb in sandboxes:
            rows += _launch_rows(sb, scratch, n)
        if not os.path.exists("/dev/fuse"):
            print("whole `strata run` rows skipped: they need /dev/fuse", file=sys.stderr)
            return rows
        env = Env(work)
        try:
            env.cli("init")
            env.cli("volume", "create", "v")
        except RuntimeError as exc:
            _fail("a store for the whole `strata run`", exc)
            return rows
        for sb in sandboxes:
            rows += _whole_rows(env, sb, scratch, n)
        for sb in sandboxes:
            rows += _image_rows(env, sb, n)
        return rows
    finally:
        if env is not None:
            env.close()
        shutil.rmtree(work, ignore_errors=True)


def _launch_rows(sb: str, scratch: str, n: int) -> list[dict[str, Any]]:
    """The launch alone of `true`, old design vs new; then the same as each ran steps."""
    rows: list[dict[str, Any]] = []
    _log(f"launch of `true`, {sb}: old design vs new ({n} runs each, alternating)")
    try:
        _old_once(sb, scratch, -1)  # warm: page cache, runsc's first start, the skeleton
        _new_once(sb, scratch, -1)
        subprocess.run(["sync"], check=False)
        olds, news = _alternate(n, lambda i: _old_once(sb, scratch, i),
                                lambda i: _new_once(sb, scratch, i))
    except Exception as exc:  # noqa: BLE001 - a benchmark reports, it never stops the rest
        _fail(f"launch of `true`, {sb}", exc)
        return rows
    old, new = _p50(olds), _p50(news)
    rows.append(row(f"sandbox launch, {sb} ({NEW_WHAT[sb]})", new, "ms", old,
                    "old design: build + Popen → exit",
                    f"≤ +{LAUNCH_TARGET_MS:g} ms over the old design",
                    met=new - old <= LAUNCH_TARGET_MS))
    rows.append(row("  of which: StepJail open (id range, namespace, stage)", _p50(news, "open"),
                    "ms", None))
    rows.append(row("  of which: build_command", _p50(news, "build"), "ms", _p50(olds, "build"),
                    "old design's build"))
    rows.append(row("  of which: Popen → exit", _p50(news, "run"), "ms", _p50(olds, "run"),
                    "old design's Popen → exit"))
    rows.append(row("  of which: StepJail close", _p50(news, "close"), "ms", None))
    _log(f"launch of `true` as a step's command, {sb}: old run_command vs new ({n} runs each)")
    try:
        olds, news = _alternate(n, lambda i: _old_once(sb, scratch, 1000 + i, True),
                                lambda i: _new_once(sb, scratch, 1000 + i, True))
    except Exception as exc:  # noqa: BLE001
        _fail(f"launch of `true` through run_command, {sb}", exc)
        return rows
    rows.append(row(f"  same, through run_command (pids cgroup gate), {sb}", _p50(news), "ms",
                    _p50(olds), "old design, old run_command (setpriv)"))
    return rows


def _whole_rows(env: Env, sb: str, scratch: str, n: int) -> list[dict[str, Any]]:
    """The whole `strata run -- true`, via the step service and in process."""
    rows: list[dict[str, Any]] = []
    _log(f"whole `strata run -v v --sandbox {sb} -- true` ({n} runs each, alternating with "
         "the old design's launch)")
    try:
        env.step(sb)  # warm: the step service, its mount processes, the skeleton
        env.step(sb, in_process=True)
        subprocess.run(["sync"], check=False)
        service: list[float] = []
        in_proc: list[float] = []
        olds: list[float] = []
        for i in range(n):
            # The old design's launch alone, between the two, so noise hits all three.
            service.append(env.step(sb))
            olds.append(_old_once(sb, scratch, 2000 + i)["total"])
            in_proc.append(env.step(sb, in_process=True))
    except Exception as exc:  # noqa: BLE001
        _fail(f"whole `strata run`, {sb}", exc)
        return rows
    base = statistics.median(olds)
    what = "old design's launch alone, no strata"
    rows.append(row(f"whole `strata run -- true` from the shell, {sb}",
                    statistics.median(service), "ms", base, what))
    rows.append(row(f"  same, STRATA_RUN_IN_PROCESS=1, {sb}", statistics.median(in_proc),
                    "ms", base, what))
    return rows


def _tiny_root(target: str) -> None:
    """A root filesystem of this machine's `sh` and `true` and the libraries they load."""
    files: set[str] = set()
    for prog in ("sh", "true"):
        path = shutil.which(prog) or prog
        files.add(os.path.realpath(path))
        out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        files.update(p for line in out.splitlines() for p in line.split() if p.startswith("/"))
    for f in sorted(files):
        for src in {f, os.path.realpath(f)}:
            dest = target + src
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if not os.path.exists(dest):
                shutil.copy2(src, dest)
    os.makedirs(os.path.join(target, "bin"), exist_ok=True)
    for prog in ("sh", "true"):
        link = os.path.join(target, "bin", prog)
        if not os.path.lexists(link):
            os.symlink(os.path.realpath(shutil.which(prog) or prog), link)
    for d in ("proc", "dev", "tmp", "etc", "storage"):
        os.makedirs(os.path.join(target, d), exist_ok=True)


def _image_rows(env: Env, sb: str, n: int) -> list[dict[str, Any]]:
    """`strata run --image` on a small root, cold (no content cache, no page cache) and warm.

    Beside the same step on the default root, in the same loop.
    """
    rows: list[dict[str, Any]] = []
    _log(f"whole `strata run --image img --sandbox {sb} -- true`, cold and warm ({n} runs)")
    try:
        root = os.path.join(env.root, "image-root")
        if not os.path.isdir(root):
            _tiny_root(root)
            env.cli("volume", "create", "img")
            env.cli("import", "img", root, "-m", "a small root")
        image = ("--image", "img")
        env.step(sb, extra=image)  # warm the step service
        cold, warm, default = [], [], []
        for _ in range(n):
            shutil.rmtree(env.cache, ignore_errors=True)
            subprocess.run(["sync"], check=False)
            with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            cold.append(env.step(sb, extra=image))
            warm.append(env.step(sb, extra=image))
            default.append(env.step(sb))
    except Exception as exc:  # noqa: BLE001
        _fail(f"--image steps, {sb}", exc)
        return rows
    base = statistics.median(default)
    what = "the same step on the default root"
    rows.append(row(f"whole `strata run --image` (a small root), cold, {sb}",
                    statistics.median(cold), "ms", base, what))
    rows.append(row(f"  same, warm, {sb}", statistics.median(warm), "ms", base, what))
    return rows


def _fail(what: str, exc: BaseException) -> None:
    print(f"[sandbox] {what} FAILED, row left out: {type(exc).__name__}: {exc}",
          file=sys.stderr, flush=True)


def _log(msg: str) -> None:
    print(f"[sandbox] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    from bench.report import print_table
    print_table("strata sandbox cost (the previous design in the same run)",
                run(os.environ.get("STRATA_BENCH_DIR", "/var/tmp"), quick="--quick" in sys.argv))
