"""Garbage collection benchmarks: churn, the cost of a pass, compaction speed.

- **Churn**: rounds of "install a dependency tree, delete it, commit" (2,000
  files of 1–16 KiB per round, written through the engine, not npm on a
  mount), a GC pass (min age 0, keep the last snapshot) after each round.
  The last round ends installed. Store bytes after the churn over the bytes
  of one copy, and bytes written to packs over bytes of data written (95 % of
  the files are the same from round to round, as with `npm ci`, and dedup).
- **Churn on a mount** (the issue's workload): rounds of `npm ci` + `rm -rf
  node_modules` + `strata commit` on a real strata mount (FUSE lower,
  overlayfs upper) through a real server, `strata gc --min-age 0` between
  rounds, the volume keeping its last snapshot. The dependency tree is
  bench/npm-churn's lockfile (express and lodash: about 1,700 files, 4 MiB);
  the npm cache is warmed once from the registry (only what it lacks), then
  every round runs `npm ci --offline`. Without npm, or when the cache cannot
  be warmed, a generated 2,000-file tarball is extracted with `tar -x`
  instead, and the row says so. Rounds: `--churn-rounds` (default 20; 5 with
  --quick). Beside it, the same `npm ci` on the local disk.
- **A pass after 1,000 small publishes** on a 100k-file volume, beside the
  time of those publishes; and the same pass on a copy of the store marking
  in full (the accounting dropped), beside it.
- **Compaction** MB/s: bytes copied over the time of the pass that copied
  them (its sweep included), beside copying the same bytes from file to file
  with fsync on the same disk.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.cli_env import STRATA
from bench.mount import Env, make_tarball
from bench.report import row
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import INLINE_MAX
from strata.engine.txn import Transaction

MIB = 1 << 20


def _packs_bytes(path: str) -> int:
    d = os.path.join(path, "packs")
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def bench_churn(root: str, rounds: int) -> tuple[float, float, int]:
    path = os.path.join(root, "churn")
    init_store(path, pack_size_limit=16 * MIB)
    rng = random.Random(7)
    tree = {f"node_modules/p{i // 50}/f{i}.js": rng.randbytes(rng.randrange(1024, 16384))
            for i in range(2000)}
    one_copy = sum(len(v) for v in tree.values())
    written = 0
    with LocalStore(path) as s:
        s.create_volume("w")
        s.policies.set("w", None, keep_last=1)
        t = Transaction(s, "w")
        t.write("package.json", b"{}")
        t.commit()
        start = s.stats["bytes_written"]
        for r in range(rounds):
            t = Transaction(s, "w")
            for d in sorted({p.rsplit("/", 1)[0] for p in tree}):
                t.mkdir(d, parents=True, exist_ok=True)
            for p, data in tree.items():
                # A few files change between installs, as versions move.
                t.write(p, data if rng.random() > 0.05 else rng.randbytes(len(data)))
            t.commit(f"install {r}")
            written += one_copy
            if r == rounds - 1:
                break  # end installed: one copy is live
            t = Transaction(s, "w")
            t.remove("node_modules", recursive=True)
            t.commit(f"clean {r}")
            s.gc(min_age=0)
        s.gc(min_age=0)
        s.gc(min_age=0)
        amplification = (s.stats["bytes_written"] - start) / written
    final = _packs_bytes(path)
    shutil.rmtree(path)
    return final / one_copy, amplification, one_copy


NPM_CHURN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "npm-churn")
NPM_FLAGS = ("--ignore-scripts", "--no-audit", "--no-fund")


def _tree_bytes(path: str) -> int:
    """Bytes of the regular files under `path` (what one copy of the tree holds)."""
    total = 0
    for d, _dirs, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _install_tool(gen: str) -> tuple[list[str], str, str]:
    """The churn's install command, run in a directory holding `app/`; and what it is.

    Returns (command, description, the copy's path under gen to measure one copy).
    """
    app = os.path.join(gen, "app")
    shutil.copytree(NPM_CHURN, app)
    why = "npm is not installed"
    if shutil.which("npm") is not None:
        # Warm the cache: the registry is asked only for what the cache lacks.
        p = subprocess.run(["npm", "ci", "--prefer-offline", *NPM_FLAGS], cwd=app,
                           capture_output=True, text=True)
        if p.returncode == 0:
            files = sum(len(f) for _d, _s, f in os.walk(os.path.join(app, "node_modules")))
            return (["npm", "ci", "--offline", *NPM_FLAGS],
                    f"npm ci --offline, express+lodash, {files} files",
                    os.path.join(app, "node_modules"))
        why = f"npm ci could not warm its cache: {p.stderr.strip()[-200:]}"
    print(f"gc churn on a mount: {why}; extracting a tarball instead", file=sys.stderr)
    shutil.rmtree(app)
    os.makedirs(app)
    tar = make_tarball(gen, 2000)
    nm = os.path.join(gen, "copy", "node_modules")
    os.makedirs(nm)
    subprocess.run(["tar", "-xf", tar, "-C", nm], check=True)
    return (["sh", "-c", f"mkdir node_modules && tar -xf {tar} -C node_modules"],
            f"tar -x of 2,000 files ({why})", nm)


def bench_churn_mount(root: str, rounds: int) -> list[dict[str, Any]]:
    """The issue's churn on a real mount; rows, or none without root and FUSE."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("gc churn on a mount skipped: it needs root and /dev/fuse", file=sys.stderr)
        return []
    work = os.path.join(root, "mountchurn")
    os.makedirs(work)
    env = Env(work)
    try:
        gen = os.path.join(work, "gen")
        os.makedirs(gen)
        cmd, what, copy = _install_tool(gen)
        one_copy = _tree_bytes(copy)
        subprocess.run([*STRATA, "init", "--store", env.store], check=True,
                       capture_output=True)
        env.cli("volume", "create", "w")
        env.cli("policy", "set", "w", "--keep-last", "1")
        m = env.mount("w", "w")
        app = os.path.join(m, "app")
        shutil.copytree(os.path.join(gen, "app"), app,
                        ignore=shutil.ignore_patterns("node_modules"))
        env.commit(m)
        local = os.path.join(work, "local")
        shutil.copytree(os.path.join(gen, "app"), local,
                        ignore=shutil.ignore_patterns("node_modules"))
        start = env.stats()["bytes_written"]
        stored = 1
        on_mount: list[float] = []
        on_disk: list[float] = []
        commits: list[float] = []
        written = 0
        for r in range(rounds):
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=app, check=True, capture_output=True)
            on_mount.append(time.perf_counter() - t0)
            written += one_copy
            commits.append(env.commit(m)[0])
            if r == 0:  # one copy as the packs hold it (zstd): what amplification is of
                stored = env.stats()["bytes_written"] - start
            if r % 4 == 0:  # the same install on the local disk, now and then
                t0 = time.perf_counter()
                subprocess.run(cmd, cwd=local, check=True, capture_output=True)
                on_disk.append(time.perf_counter() - t0)
                shutil.rmtree(os.path.join(local, "node_modules"))
            if r == rounds - 1:
                break  # end installed: one copy is live
            shutil.rmtree(os.path.join(app, "node_modules"))
            commits.append(env.commit(m)[0])
            env.cli("gc", "--min-age", "0", "--json")
        for _ in range(2):  # packs found empty go one pass later
            env.cli("gc", "--min-age", "0", "--json")
        total = env.stats()["bytes_written"] - start
        amplification = total / written
        stored_amplification = total / (stored * rounds)
        ratio = _packs_bytes(env.store) / one_copy
    finally:
        env.close()
    return [
        row(f"gc: mount churn, {rounds} rounds of {what}, store / one copy", ratio, "x", None,
            f"one copy {one_copy / MIB:.1f} MiB of files; packs are zstd", "<= 1.5",
            met=ratio <= 1.5),
        row(f"gc: mount churn write amplification ({rounds} rounds)", amplification, "x",
            None, f"{written / MIB:.0f} MiB of files installed", "<= 2",
            met=amplification <= 2.0),
        row("gc: mount churn, pack bytes / stored size of what was installed",
            stored_amplification, "x", None,
            f"one copy stored: {stored / MIB:.1f} MiB (zstd)"),
        row("gc: mount churn, install per round (median)", statistics.median(on_mount), "s",
            statistics.median(on_disk), "the same on ext4"),
        row("gc: mount churn, strata commit per round (median)", statistics.median(commits),
            "s", None, "install and delete commits"),
    ]


def bench_pass(root: str, files: int, publishes: int) -> dict[str, float]:
    """A pass after `publishes` small publishes, incremental and full, on the same store.

    The store is copied after the publishes: one copy gets the incremental pass,
    the other a full mark with the accounting dropped first (the pass as it was
    before the accounting), so both start from the same bytes.
    """
    path = os.path.join(root, "gcpass")
    init_store(path)
    with LocalStore(path) as s:
        s.create_volume("v")
        t = Transaction(s, "v")
        for d in range(100):
            t.mkdir(f"d{d:02d}")
        for i in range(files):
            # Just over the inline limit: a file node and a block each (zstd keeps it small).
            t.write(f"d{i % 100:02d}/f{i:06d}", (b"x%d\n" % i).ljust(INLINE_MAX + 100, b"."))
        t.commit()
        s.policies.set("v", None, keep_last=100)
        s.gc(min_age=0)
        t0 = time.perf_counter()
        for i in range(publishes):
            t = Transaction(s, "v")
            t.write(f"d{i % 100:02d}/f{i:06d}", os.urandom(200))
            t.commit()
        publish_s = time.perf_counter() - t0
        objects = s.index.count_objects()
    full_path = os.path.join(root, "gcpass-full")
    shutil.copytree(path, full_path)
    out: dict[str, float] = {"publish_s": publish_s, "objects": objects}
    for mode, p in (("incremental", path), ("full", full_path)):
        with LocalStore(p) as s:
            if mode == "full":
                s.index.uncount()
            t0 = time.perf_counter()
            r = s.gc(min_age=0)
            out[f"{mode}_s"] = time.perf_counter() - t0
            assert r["mode"] == mode, r
            out[f"{mode}_examined"] = r["objects_examined"]
            out[f"{mode}_deleted"] = r["objects_deleted"]
    shutil.rmtree(path)
    shutil.rmtree(full_path)
    return out


def bench_compaction(root: str, mib: int) -> tuple[float, float]:
    path = os.path.join(root, "compact")
    init_store(path, pack_size_limit=64 * MIB)
    with LocalStore(path) as s:
        s.create_volume("v")
        s.policies.set("v", None, keep_last=1)
        t = Transaction(s, "v")
        for i in range(mib):  # live: 1 MiB files, one per 2.1 MiB written
            t.write(f"keep{i}", os.urandom(MIB))
            t.write(f"drop{i}", os.urandom(MIB + MIB // 10))
        t.commit()
        t = Transaction(s, "v")
        for i in range(mib):
            t.remove(f"drop{i}")
        t.commit()
        t0 = time.perf_counter()
        report = s.gc(min_age=0)  # drops the garbage and compacts the packs under half live
        secs = time.perf_counter() - t0
        copied = report["bytes_copied"]
    shutil.rmtree(path)
    # The baseline: the same bytes copied file to file, fsynced, on the same disk.
    src, dst = os.path.join(root, "raw-src"), os.path.join(root, "raw-dst")
    with open(src, "wb") as f:
        f.write(os.urandom(max(copied, MIB)))
        os.fsync(f.fileno())
    t0 = time.perf_counter()
    with open(src, "rb") as a, open(dst, "wb") as b:
        while chunk := a.read(4 * MIB):
            b.write(chunk)
        b.flush()
        os.fsync(b.fileno())
    raw = time.perf_counter() - t0
    os.remove(src)
    os.remove(dst)
    return copied / MIB / secs if secs and copied else 0.0, max(copied, MIB) / MIB / raw


def run(root: str, *, quick: bool = False, churn_rounds: int | None = None
        ) -> list[dict[str, Any]]:
    work = os.path.join(root, "strata-bench-gc")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    rows: list[dict[str, Any]] = []
    try:
        n = churn_rounds if churn_rounds is not None else 5 if quick else 20
        print(f"gc churn on a mount: {n} rounds", file=sys.stderr, flush=True)
        rows += bench_churn_mount(work, n)
        rounds = 10 if quick else 40
        ratio, amp, one = bench_churn(work, rounds)
        rows.append(row(f"gc: churn, {rounds} install+delete rounds, store / one copy", ratio,
                        "x", None, f"one copy {one / MIB:.1f} MiB", "<= 1.5",
                        met=ratio <= 1.5))
        rows.append(row("gc: churn write amplification (pack bytes / data bytes)", amp, "x",
                        None, "", "<= 2", met=amp <= 2.0))
        p = bench_pass(work, 20_000 if quick else 100_000, 300 if quick else 1000)
        what = (f"{int(p['objects']):,} objects; examined {int(p['incremental_examined']):,} "
                f"incremental, {int(p['full_examined']):,} full")
        rows.append(row("gc: a pass after 1,000 small publishes, 100k-file volume",
                        p["incremental_s"], "s", p["publish_s"], "those publishes", "<= 1x",
                        met=p["incremental_s"] <= p["publish_s"]))
        rows.append(row("gc: the same pass, incremental / full mark", p["incremental_s"], "s",
                        p["full_s"], what))
        rate, raw = bench_compaction(work, 16 if quick else 64)
        rows.append(row("gc: compaction throughput", rate, "MB/s", raw,
                        "file copy + fsync", "", lower_is_better=False))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows
