"""Engine benchmarks: publish latency, group commit, reads, forks, tree writes, import.

Each figure is measured beside the same work on the local disk in the same
run. Nothing here is a test: it measures and reports, it never asserts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

from bench.report import row
from strata.engine.local import LocalStore, StoreConfig, init_store
from strata.engine.objects import K_FILE, SNAPSHOT, TREE
from strata.engine.txn import Transaction

KIB = 1024


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def _store(root: str, name: str) -> LocalStore:
    path = os.path.join(root, name)
    init_store(path)
    return LocalStore(path, StoreConfig())


def bench_publish(root: str, n: int) -> list[dict[str, Any]]:
    s = _store(root, "publish")
    try:
        s.create_volume("v")
        datas = [os.urandom(128 * KIB) for _ in range(16)]
        lat = []
        t = Transaction(s, "v")
        for i in range(n):
            t0 = time.perf_counter()
            t.write(f"f{i % 32}", datas[i % 16] + i.to_bytes(4, "little"))
            t.commit()
            lat.append(time.perf_counter() - t0)
        # Baseline: the same bytes appended and fdatasync'ed to a local file.
        base = []
        fd = os.open(os.path.join(root, "publish.base"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for i in range(n):
                t0 = time.perf_counter()
                os.write(fd, datas[i % 16])
                os.fdatasync(fd)
                base.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
        # Read: 128 KiB of a file in a pinned snapshot vs pread of a cached local file.
        reader = Transaction(s, "v")
        rlat = []
        for i in range(n):
            t0 = time.perf_counter()
            reader.read(f"f{i % 32}")
            rlat.append(time.perf_counter() - t0)
        rbase = []
        fd = os.open(os.path.join(root, "publish.base"), os.O_RDONLY)
        try:
            for i in range(n):
                t0 = time.perf_counter()
                os.pread(fd, 128 * KIB, (i % 16) * 128 * KIB)
                rbase.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
    finally:
        s.close()
    p50, p99 = _pct(lat, 0.5) * 1e3, _pct(lat, 0.99) * 1e3
    return [
        row("durable 128 KiB publish p50", p50, "ms", _pct(base, 0.5) * 1e3,
            "append+fdatasync", "<= 1 ms", met=p50 <= 1.0),
        row("durable 128 KiB publish p99", p99, "ms", _pct(base, 0.99) * 1e3,
            "append+fdatasync", "<= 3 ms", met=p99 <= 3.0),
        row("128 KiB snapshot read p50", _pct(rlat, 0.5) * 1e3, "ms",
            _pct(rbase, 0.5) * 1e3, "pread, page cache"),
    ]


def bench_group_commit(root: str, per_thread: int, threads: int = 16) -> list[dict[str, Any]]:
    s = _store(root, "group")
    try:
        s.create_volume("v")
        head = s.head("v", "live")
        for i in range(threads):
            s.fork("v", f"b{i}", at=head)
        payload = os.urandom(4 * KIB)
        f0, c0 = s.stats["fsyncs"], s.stats["commits"]

        def work(i: int) -> None:
            t = Transaction(s, "v", f"b{i}")
            for j in range(per_thread):
                t.write(f"g{j % 8}", payload + j.to_bytes(4, "little"))
                t.commit()

        elapsed = _threads(work, threads)
        commits = s.stats["commits"] - c0
        fsyncs = s.stats["fsyncs"] - f0
    finally:
        s.close()
    # Baseline: each thread appends 4 KiB and fdatasyncs its own local file.
    fds = [os.open(os.path.join(root, f"group.base{i}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
           for i in range(threads)]

    def base_work(i: int) -> None:
        for _ in range(per_thread):
            os.write(fds[i], payload)
            os.fdatasync(fds[i])

    base_elapsed = _threads(base_work, threads)
    for fd in fds:
        os.close(fd)
    rate = commits / elapsed
    base_rate = threads * per_thread / base_elapsed
    fpc = fsyncs / commits
    return [
        row(f"{threads}-way publish throughput", rate, "commits/s", base_rate,
            "4 KiB append+fdatasync, own file per thread", ">= 2,000/s",
            lower_is_better=False, met=rate >= 2000),
        row(f"{threads}-way fsyncs per commit", fpc, "fsync/commit", 1.0,
            "one fsync per write", "well below 1", met=fpc < 0.5),
    ]


def _threads(fn: Any, n: int) -> float:
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def _fill_volume(s: LocalStore, volume: str, nfiles: int, per_dir: int) -> None:
    s.create_volume(volume)
    t = Transaction(s, volume)
    ndirs = max(1, nfiles // per_dir)
    for d in range(ndirs):
        t.mkdir(f"d{d:04d}")
    for i in range(nfiles):
        t.write(f"d{i % ndirs:04d}/f{i:06d}", b"x%d" % i, mtime_ns=1)
    t.commit("fill")


def _make_local_tree(path: str, nfiles: int, per_dir: int) -> None:
    ndirs = max(1, nfiles // per_dir)
    for d in range(ndirs):
        os.makedirs(os.path.join(path, f"d{d:04d}"), exist_ok=True)
    for i in range(nfiles):
        with open(os.path.join(path, f"d{i % ndirs:04d}/f{i:06d}"), "wb") as f:
            f.write(b"x%d" % i)


def bench_fork_and_tree(root: str, big: int) -> list[dict[str, Any]]:
    s = _store(root, "fork")
    rows = []
    try:
        _fill_volume(s, "small", 1000, 100)
        _fill_volume(s, "big", big, 1000)
        _fill_volume(s, "tiny", 10, 10)
        _fill_volume(s, "flat", big, big)  # one directory with `big` entries
        times = {}
        for vol in ("small", "big"):
            head = s.head(vol, "live")
            samples = []
            for i in range(20):
                t0 = time.perf_counter()
                s.fork(vol, f"f{i}", at=head)
                samples.append(time.perf_counter() - t0)
            times[vol] = _pct(samples, 0.5) * 1e3
        # Tree metadata written by a one-file change.
        tree_bytes = {}
        for vol in ("tiny", "big", "flat"):
            t = Transaction(s, vol)
            path = next(p for p, e in t.walk("") if e.kind == K_FILE)
            s.sync_index()
            before = _meta_bytes(s)
            t.write(path, b"changed")
            t.commit("one file")
            s.sync_index()
            tree_bytes[vol] = _meta_bytes(s) - before
    finally:
        s.close()
    # Local baselines: a hard-link farm copy (the cheapest local "fork").
    local = {}
    for name, n, per in (("small", 1000, 100), ("big", big, 1000)):
        src = os.path.join(root, f"tree-{name}")
        _make_local_tree(src, n, per)
        t0 = time.perf_counter()
        subprocess.run(["cp", "-al", src, src + ".fork"], check=True)
        local[name] = (time.perf_counter() - t0) * 1e3
    ratio = times["big"] / times["small"]
    rows += [
        row("fork, 1k-file volume (p50)", times["small"], "ms", local["small"], "cp -al 1k files",
            "<= 5 ms", met=times["small"] <= 5),
        row(f"fork, {big // 1000}k-file volume (p50)", times["big"], "ms", local["big"],
            f"cp -al {big // 1000}k files", "<= 5 ms", met=times["big"] <= 5),
        row(f"fork time ratio {big // 1000}k / 1k", ratio, "x", None, "", "<= 1.5",
            met=ratio <= 1.5),
        row(f"tree bytes, 1-file change in {big // 1000}k-file volume", tree_bytes["big"] / KIB,
            "KiB", None, "", "<= 64 KiB", met=tree_bytes["big"] <= 64 * KIB),
        row(f"tree bytes, 1-file change in one {big // 1000}k-entry directory",
            tree_bytes["flat"] / KIB, "KiB", None, "", "<= 64 KiB",
            met=tree_bytes["flat"] <= 64 * KIB),
        row("tree bytes, 1-file change in 10-file volume", tree_bytes["tiny"] / KIB, "KiB",
            None),
    ]
    return rows


def _meta_bytes(s: LocalStore) -> int:
    """Bytes of tree-node and snapshot records in the index (commit records excluded)."""
    total = 0
    for _oid, (_p, _o, length, kind) in s.index.iter_objects():
        if kind in (TREE, SNAPSHOT):
            total += length
    return total


def bench_import(root: str, nfiles: int) -> list[dict[str, Any]]:
    try:
        from strata.fsio import import_dir  # the CLI's import
    except ImportError:
        return []
    src = os.path.join(root, "import-src")
    _make_local_tree(src, nfiles, 200)
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-a", src, src + ".copy"], check=True)
    subprocess.run(["sync", "-f", src + ".copy"], check=True)
    cp_time = time.perf_counter() - t0
    s = _store(root, "import")
    try:
        s.create_volume("v")
        t0 = time.perf_counter()
        import_dir(s, "v", "live", src)
        imp_time = time.perf_counter() - t0
    finally:
        s.close()
    return [row(f"import of {nfiles // 1000}k-file tree", imp_time, "s", cp_time,
                "cp -a + sync")]


def run(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    work = tempfile.mkdtemp(prefix="strata-bench-", dir=root)
    try:
        rows: list[dict[str, Any]] = []
        rows += bench_publish(work, 200 if quick else 1000)
        rows += bench_group_commit(work, 20 if quick else 100)
        rows += bench_fork_and_tree(work, 10_000 if quick else 100_000)
        rows += bench_import(work, 2000 if quick else 20_000)
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)
