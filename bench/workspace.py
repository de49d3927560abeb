"""Workspace benchmarks: fsync, resume after host loss, fork, idle bytes.

Each figure sits beside its baseline from the same run: a 4 KiB write +
fsync beside the same on the local disk; resume (attach + first `git
status`) and fork on a workspace 10x larger beside the same on the smaller
one; stored bytes beside the device size and the bytes written. "Host loss"
here SIGKILLs the attach daemon and lazily unmounts its filesystem, in this
namespace (tests/workspace/test_hosts.py does it on hosts of their own).
Nothing here asserts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from typing import Any

from bench.cli_env import CliEnv
from bench.report import row

GIB = 1 << 30


class Env(CliEnv):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.env["STRATA_WORKSPACE_STATE"] = os.path.join(root, "wsstate")
        self.attached: list[str] = []

    def attach(self, ref: str, name: str) -> tuple[str, float]:
        d = os.path.join(self.root, "mnt", name)
        os.makedirs(d, exist_ok=True)
        t0 = time.perf_counter()
        self.cli("workspace", "attach", ref, d)
        self.attached.append(d)
        return d, time.perf_counter() - t0

    def detach(self, d: str) -> None:
        self.cli("workspace", "detach", d)
        self.attached.remove(d)

    def lose(self, d: str) -> None:
        """Host loss: the daemon SIGKILLed, its filesystem gone with it."""
        from strata.workspace import state as ws
        os.environ["STRATA_WORKSPACE_STATE"] = self.env["STRATA_WORKSPACE_STATE"]
        state = os.path.join(self.env["STRATA_WORKSPACE_STATE"],
                             os.path.basename(ws.state_dir_for(d)), "state.json")
        with open(state) as f:
            pid = int(json.load(f)["pid"])
        os.kill(pid, signal.SIGKILL)
        self.cli("workspace", "detach", d)  # a dead daemon's attach: cleared, not flushed
        self.attached.remove(d)

    def close(self) -> None:
        for d in list(self.attached):
            with contextlib.suppress(RuntimeError):
                self.detach(d)
        for d in list(self.attached):
            subprocess.run(["umount", "-l", d], capture_output=True)
        super().close()


def _fsync_latency(path: str, n: int) -> tuple[float, float]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
            out.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    out.sort()
    return out[len(out) // 2] * 1e3, out[min(len(out) - 1, len(out) * 99 // 100)] * 1e3


def _fill_data(d: str, nfiles: int) -> None:
    """Other files of the workspace (about 12 KiB each), outside the repository."""
    for i in range(nfiles):
        sub = os.path.join(d, "data", f"d{i % 64:02d}")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"f{i:06d}.bin"), "wb") as f:
            f.write(os.urandom(12000))
    subprocess.run(["sync", "-f", d], check=True)


def _fill_repo(d: str, nfiles: int) -> int:
    """A git repository of `nfiles` files (about 12 KiB each), committed; its bytes."""
    repo = os.path.join(d, "repo")
    os.makedirs(repo)
    total = 0
    for i in range(nfiles):
        sub = os.path.join(repo, f"d{i % 64:02d}")
        os.makedirs(sub, exist_ok=True)
        data = (f"# file {i}\n".encode() + os.urandom(6000).hex().encode())
        with open(os.path.join(sub, f"f{i:06d}.txt"), "wb") as f:
            f.write(data)
        total += len(data)
    git = ["git", "-c", "user.name=b", "-c", "user.email=b@b", "-C", repo]
    subprocess.run([*git[:-2], "init", "-q", repo], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "fill"], check=True)
    subprocess.run(["sync", "-f", repo], check=True)
    return total


def _packs_bytes(store: str) -> int:
    packs = os.path.join(store, "packs")
    return sum(os.path.getsize(os.path.join(packs, p)) for p in os.listdir(packs))


def _resume(env: Env, name: str, d: str, times: int = 3) -> tuple[float, float]:
    """Lose the host of `d`, attach elsewhere, run the first `git status`.

    Returns the median and the first (the loss right after the fill, with the
    largest journal to replay).
    Each round after the first attaches again and writes (a file, the index
    `git status` refreshes) so that every loss leaves a journal to replay.
    """
    took = []
    for i in range(times):
        if i:
            d, _ = env.attach(name, f"{name}-again{i}")
            with open(os.path.join(d, "repo", f"round{i}"), "wb") as f:
                f.write(os.urandom(1 << 20))
            subprocess.run(["git", "-C", os.path.join(d, "repo"), "status", "--short"],
                           check=True, capture_output=True)
        subprocess.run(["sync"], check=True)  # settle the host's own writeback before timing
        env.lose(d)
        t0 = time.perf_counter()
        e, _ = env.attach(name, f"{name}-resumed{i}")
        subprocess.run(["git", "-C", os.path.join(e, "repo"), "status", "--short"],
                       check=True, capture_output=True)
        took.append(time.perf_counter() - t0)
        env.detach(e)
    return sorted(took)[len(took) // 2], took[0]


def _fork(env: Env, name: str, n: int) -> float:
    from strata.server.client import RemoteStore, default_socket
    rs = RemoteStore("unix:" + default_socket(env.store))
    try:
        head = rs.head(name, "live")
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            rs.fork(name, f"bench{i}", at=head)
            times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2] * 1e3
    finally:
        rs.close()


def run(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    base = os.path.join(root, f"strata-bench-ws-{os.getpid()}")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    env = Env(base)
    small = 300 if quick else 2000
    try:
        env.cli("init")
        rows: list[dict[str, Any]] = []
        # Never-written space: a 20 GiB workspace, formatted and mounted.
        before = _packs_bytes(env.store)
        env.cli("workspace", "create", "empty", "--size", "20G")
        d, fresh = env.attach("empty", "empty")
        env.detach(d)
        empty = _packs_bytes(env.store) - before
        rows.append(row("workspace: 20 GiB workspace, formatted, never written: stored",
                        empty / (1 << 20), "MiB", 20 * 1024, "device size", "~0",
                        met=empty < 64 << 20))
        rows.append(row("workspace: create + first attach (mkfs), 20 GiB", fresh, "s"))
        # fsync on the workspace beside the local disk.
        env.cli("workspace", "create", "dev", "--size", "20G")
        d, _ = env.attach("dev", "dev")
        n = 100 if quick else 400
        local = os.path.join(base, "local-fsync")
        lp50, lp99 = _fsync_latency(local, n)
        p50, p99 = _fsync_latency(os.path.join(d, "fsync"), n)
        rows.append(row("workspace: 4 KiB write + fsync p50", p50, "ms", lp50, "local disk",
                        "<= 3 ms", met=p50 <= 3))
        rows.append(row("workspace: 4 KiB write + fsync p99", p99, "ms", lp99, "local disk",
                        "<= 10 ms", met=p99 <= 10))
        # Resume after host loss and fork, on a workspace and one 10x larger.
        before = _packs_bytes(env.store)
        written = _fill_repo(d, small)
        stored = _packs_bytes(env.store) - before
        rows.append(row("workspace: stored bytes per byte of files written (+ their git objects)",
                        stored / written, "x", None, "", "dedup + zstd", met=None))
        resume_small, first_small = _resume(env, "dev", d)
        fork_small = _fork(env, "dev", 20)
        env.cli("workspace", "create", "big", "--size", "20G")
        b, _ = env.attach("big", "big")
        _fill_repo(b, small)   # the same repository, and nine times as much besides
        _fill_data(b, small * 9)
        resume_big, first_big = _resume(env, "big", b)
        fork_big = _fork(env, "big", 20)
        rows.append(row(f"workspace: host lost -> attach -> first git status ({small} files), "
                        "median of 3",
                        resume_small, "s", None, "", "<= 1 s", met=resume_small <= 1))
        rows.append(row(f"workspace: the same, workspace 10x larger ({small * 10} files)",
                        resume_big,
                        "s", resume_small, f"{small} files", "<= 1.5x",
                        met=resume_big <= 1.5 * resume_small))
        rows.append(row("workspace: the same, first loss only (right after the fill)", first_small,
                        "s", None, "", "<= 1 s", met=first_small <= 1))
        rows.append(row("workspace: the same, first loss only, 10x larger", first_big, "s",
                        first_small, "smaller workspace", "<= 1.5x",
                        met=first_big <= 1.5 * first_small))
        rows.append(row("workspace: fork (API call) p50", fork_small, "ms", None, "",
                        "<= 5 ms", met=fork_small <= 5))
        rows.append(row("workspace: fork, 10x larger p50", fork_big, "ms", fork_small,
                        "smaller workspace", "<= 5 ms", met=fork_big <= 5))
        return rows
    finally:
        env.close()
        shutil.rmtree(base, ignore_errors=True)
