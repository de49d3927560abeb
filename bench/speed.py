"""Issue 12 ("Speed") figures: CLI start-up, cold reads and copy-up on the mount.

Each figure is printed beside the same work without strata in the same run:
`strata ls` beside `python -c pass` (the interpreter's own start), a cold
read of a 512 MiB file on a fresh mount beside reading the same bytes from a
local file evicted from the page cache, and the first 1-byte append to a
512 MiB snapshot file (overlayfs copies the whole file up) beside `cp` of
the local file plus fsync (what a copy-up does on the local disk); and
`strata status` / `strata commit` after a one-file edit once 20k files and
1 GiB are committed, beside `git status` / `git commit -a` on the same tree
on the local disk, and beside the same status on a mount left on its old
snapshot (its upper directory holding everything committed).
Nothing here asserts; it measures and reports.
"""

from __future__ import annotations

import contextlib
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
from bench.mount import _evict, _files_under, _read_file, make_tarball
from bench.report import row

MIB = 1024 * 1024


def _cmd_ms(cmd: list[str], env: dict[str, str], n: int) -> float:
    """Median wall time of a command from the shell, in ms (after one warm-up run)."""
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _write_big(path: str, size: int) -> None:
    buf = bytearray(os.urandom(MIB))
    with open(path, "wb") as f:
        for i in range(size // MIB):
            buf[:8] = i.to_bytes(8, "little")  # every MiB distinct
            f.write(buf)


def _append_one(path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "ab") as f:
        f.write(b"x")
    return time.perf_counter() - t0


def _cp_fsync(src: str, dst: str) -> float:
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"x")
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def run(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    work = tempfile.mkdtemp(prefix="strata-speedbench-", dir=root)
    env = CliEnv(work)
    # Byte-compiled modules, as an installed strata has them (the runner may forbid
    # writing them: then every start would compile strata's sources again).
    env.env.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        return _run_all(env, quick)
    finally:
        for d in ("m1", "m2", "m3"):
            with contextlib.suppress(RuntimeError):
                env.cli("unmount", os.path.join(work, d), "--discard")
        env.close()
        shutil.rmtree(work, ignore_errors=True)


def _run_all(env: CliEnv, quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    n = 10 if quick else 30
    env.cli("init")
    env.cli("volume", "create", "v")
    small = os.path.join(env.root, "small.txt")
    with open(small, "w") as f:
        f.write("hello\n")
    env.cli("put", "v", "a.txt", "--from", small)

    _log("strata ls")
    ls = _cmd_ms([*STRATA, "ls", "v"], env.env, n)
    script = os.path.join(os.path.dirname(sys.executable), "strata")
    ls_script = _cmd_ms([script, "ls", "v"], env.env, n) if os.path.exists(script) else ls
    bare = _cmd_ms([sys.executable, "-c", "pass"], env.env, n)
    rows.append(row("`strata ls VOL` from the shell (median)", ls_script, "ms", bare,
                    "python -c pass", "<= 50 ms", met=ls_script <= 50))
    rows.append(row("  same as `python -m strata ls VOL`", ls, "ms", bare, "python -c pass"))

    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("mount rows skipped: they need root and /dev/fuse", file=sys.stderr)
        return rows
    size = (128 if quick else 512) * MIB
    local = os.path.join(env.root, "big.bin")
    _write_big(local, size)
    env.cli("put", "v", "big.bin", "--from", local)

    _log(f"cold read {size // MIB} MiB")
    m1 = os.path.join(env.root, "m1")
    os.makedirs(m1)
    env.cli("mount", "v", m1, "--background")
    _evict([local, *_files_under(env.store)])
    rl = _read_file(local)
    rm = _read_file(os.path.join(m1, "big.bin"))
    rows.append(row(f"cold sequential read of a {size // MIB} MiB file on the mount", rm,
                    "MB/s", rl, "ext4, evicted from page cache", ">= 500 MB/s",
                    lower_is_better=False, met=rm >= 500))
    env.cli("unmount", m1, "--discard")

    _log("first append (copy-up)")
    m2 = os.path.join(env.root, "m2")
    os.makedirs(m2)
    shutil.rmtree(env.cache, ignore_errors=True)  # cold: nothing fetched yet
    env.cli("mount", "v", m2, "--background")
    _evict([local, *_files_under(env.store)])
    tm = _append_one(os.path.join(m2, "big.bin"))
    _evict([local])
    tl = _cp_fsync(local, os.path.join(env.root, "big.copy"))
    rows.append(row(f"first 1-byte append to a {size // MIB} MiB snapshot file (copy-up)", tm,
                    "s", tl, "cp + fsync on ext4", "<= 1 s", met=tm <= 1.0))
    env.cli("unmount", m2, "--discard")
    rows += _commit_after_edit(env, quick)
    return rows


GIT = ("git", "-c", "user.name=bench", "-c", "user.email=bench@example.com",
       "-c", "commit.gpgsign=false", "-c", "core.compression=0",
       "-c", "core.bigFileThreshold=1m")


def _commit_after_edit(env: CliEnv, quick: bool) -> list[dict[str, Any]]:
    """status/commit after a one-file edit, with 20k files and 1 GiB committed before.

    The same tree is a git work tree on the local disk for the baseline. The
    first commit is made while a process sits in the mount, so the mount
    stays on its old snapshot with everything in its upper directory (as
    every commit left it before mounts moved); then `strata reload` moves it,
    and the same status is timed again.
    """
    nfiles, big = (5_000, 128 * MIB) if quick else (20_000, 1024 * MIB)
    label = f"{nfiles // 1000}k files + {big // MIB} MiB"
    _log(f"commit after one edit ({label})")
    gen = os.path.join(env.root, "gen")
    os.makedirs(gen)
    tar = make_tarball(gen, nfiles)
    _write_big(os.path.join(gen, "big.bin"), big)
    env.cli("volume", "create", "w")
    m3 = os.path.join(env.root, "m3")
    local = os.path.join(env.root, "local-tree")
    for d in (m3, local):
        os.makedirs(d)
    env.cli("mount", "w", m3, "--background")
    for d in (m3, local):
        subprocess.run(["tar", "-xf", tar, "-C", d], check=True)
        shutil.copyfile(os.path.join(gen, "big.bin"), os.path.join(d, "big.bin"))
    holder = subprocess.Popen(["sleep", "600"], cwd=m3)
    try:
        stayed = json.loads(env.cli("commit", m3, "-m", "tree", "--json"))
    finally:
        holder.kill()
        holder.wait()
    subprocess.run(["git", "init", "-q", local], check=True)
    subprocess.run([*GIT, "-C", local, "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", local, "commit", "-q", "-m", "tree"], check=True)
    some = sorted(os.path.relpath(p, m3) for p in _files_under(m3) if p.endswith(".js"))

    def edit(i: int) -> None:
        for d in (m3, local):
            with open(os.path.join(d, some[i]), "a") as f:
                f.write(f"// edit {i}\n")

    rows = []
    n = 3 if quick else 5
    edit(0)
    old_st = _cmd_ms([*STRATA, "status", m3], env.env, n)
    env.cli("reload", m3)  # nothing holds it now: onto what "tree" published
    st = _cmd_ms([*STRATA, "status", m3], env.env, n)
    read = json.loads(env.cli("status", m3, "--json"))["read"]
    git_st = _cmd_ms(["git", "-C", local, "status", "--porcelain"], env.env, n)
    rows.append(row(f"`strata status` after a one-file edit ({label} committed)", st, "ms",
                    git_st, "git status, same tree on ext4",
                    f"reads what changed ({read['files']} file(s), {read['bytes']} B read)",
                    met=read["files"] <= 1))
    rows.append(row("  same on a mount left on its old snapshot (as every commit left it "
                    "before)", old_st, "ms", st, "strata status on the moved mount",
                    "moved: " + ("no (held)" if not stayed["moved"] else "yes (not held!)")))
    t0 = time.perf_counter()
    done = json.loads(env.cli("commit", m3, "-m", "edit 0", "--json"))
    cm = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    subprocess.run([*GIT, "-C", local, "commit", "-q", "-a", "-m", "edit 0"], check=True)
    git_cm = (time.perf_counter() - t0) * 1e3
    rows.append(row(f"`strata commit` after a one-file edit ({label} committed)", cm, "ms",
                    git_cm, "git commit -a, same tree on ext4",
                    f"reads what changed ({done['read']['files']} file(s), "
                    f"{done['read']['bytes']} B read)", met=done["read"]["files"] <= 1))
    env.cli("unmount", m3, "--discard")
    shutil.rmtree(local, ignore_errors=True)
    shutil.rmtree(gen, ignore_errors=True)
    return rows


def _log(what: str) -> None:
    print(f"[speed bench] {what}", file=sys.stderr, flush=True)
