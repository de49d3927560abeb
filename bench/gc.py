"""Garbage collection benchmarks: churn, the cost of a pass, compaction speed.

- **Churn**: rounds of "install a dependency tree, delete it, commit" (2,000
  files of 1–16 KiB per round, written through the engine, not npm on a
  mount), a GC pass (min age 0, keep the last snapshot) after each round.
  The last round ends installed. Store bytes after the churn over the bytes
  of one copy, and bytes written to packs over bytes of data written (95 % of
  the files are the same from round to round, as with `npm ci`, and dedup).
- **A pass after 1,000 small publishes** on a 100k-file volume, beside the
  time of those publishes.
- **Compaction** MB/s: bytes copied over the time of the pass that copied
  them (its sweep included), beside copying the same bytes from file to file
  with fsync on the same disk.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from typing import Any

from bench.report import row
from strata.engine.local import LocalStore, init_store
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


def bench_pass(root: str, files: int, publishes: int) -> tuple[float, float]:
    path = os.path.join(root, "gcpass")
    init_store(path)
    with LocalStore(path) as s:
        s.create_volume("v")
        t = Transaction(s, "v")
        for d in range(100):
            t.mkdir(f"d{d:02d}")
        for i in range(files):
            t.write(f"d{i % 100:02d}/f{i:06d}", b"x%d\n" % i)
        t.commit()
        s.policies.set("v", None, keep_last=100)
        s.gc(min_age=0)
        t0 = time.perf_counter()
        for i in range(publishes):
            t = Transaction(s, "v")
            t.write(f"d{i % 100:02d}/f{i:06d}", os.urandom(200))
            t.commit()
        publish_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        s.gc(min_age=0)
        gc_s = time.perf_counter() - t0
    shutil.rmtree(path)
    return gc_s, publish_s


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


def run(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    work = os.path.join(root, "strata-bench-gc")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    rows: list[dict[str, Any]] = []
    try:
        rounds = 10 if quick else 40
        ratio, amp, one = bench_churn(work, rounds)
        rows.append(row(f"gc: churn, {rounds} install+delete rounds, store / one copy", ratio,
                        "x", None, f"one copy {one / MIB:.1f} MiB", "<= 1.5",
                        met=ratio <= 1.5))
        rows.append(row("gc: churn write amplification (pack bytes / data bytes)", amp, "x",
                        None, "", "<= 2", met=amp <= 2.0))
        gc_s, pub_s = bench_pass(work, 20_000 if quick else 100_000, 300 if quick else 1000)
        rows.append(row("gc: a pass after 1,000 small publishes, 100k-file volume", gc_s, "s",
                        pub_s, "those publishes", "<= 1x", met=gc_s <= pub_s))
        rate, raw = bench_compaction(work, 16 if quick else 64)
        rows.append(row("gc: compaction throughput", rate, "MB/s", raw,
                        "file copy + fsync", "", lower_is_better=False))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows
