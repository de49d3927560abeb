"""Hard-link groups: a hard link plus a write through it, in a volume of N and of 10N files.

Each volume holds N (or 10N) small files in directories of 100 and one
link group. The measured work, in a new transaction with a cold node cache
(so every tree node it needs is read from the store): hard-link a member to
a new name, then write 4 KiB through the new name, which must reach every
member. The figure at 10N files is printed beside the same work at N files
(the target: within 1.5x), beside the whole-volume walk the search replaced
(a `Transaction` whose `_group` walks its view, on the same store), and
beside `link(2)` plus a 4 KiB `pwrite` in a tree of 10N files on the local
disk. Tree nodes read are counted as well. Nothing here asserts.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from bench.report import row
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import K_FILE, Entry
from strata.engine.tree import NodeCache
from strata.engine.txn import Transaction

WRITE = b"w" * 4096


class WalkingTransaction(Transaction):
    """A transaction that finds a group as strata did before tree node counts."""

    def _group(self, ino: int, nlink: int) -> list[tuple[str, Entry]]:
        return sorted((p, e) for p, e in self.walk("") if e.kind == K_FILE and e.ino == ino)


def _build(store: LocalStore, volume: str, files: int) -> None:
    store.create_volume(volume)
    t = Transaction(store, volume)
    for d in range(files // 100):
        t.mkdir(f"d{d:05}")
        for f in range(100):
            t.write(f"d{d:05}/f{f:03}", b"%d" % f)
    t.hardlink("d00001/f001", "d00002/linked")
    t.commit("built")


def _once(store: LocalStore, volume: str, cls: type[Transaction], i: int
          ) -> tuple[float, int]:
    """Seconds and objects read for one link + write (nothing published)."""
    reads = 0
    real = store.get_object

    def counting(oid: bytes) -> bytes:
        nonlocal reads
        reads += 1
        return real(oid)

    store.get_object = counting  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        t = cls(store, volume, cache=NodeCache())
        t.hardlink("d00002/linked", f"d00003/new{i}")
        t.write_at(f"d00003/new{i}", 0, WRITE)
        dt = time.perf_counter() - t0
    finally:
        del store.get_object
    return dt, reads


def _measure(store: LocalStore, work: list[tuple[str, type[Transaction]]], reps: int
             ) -> list[tuple[float, int]]:
    """Median seconds and most objects read of each (volume, kind of transaction).

    The runs take turns, so a burst of load on the shared machine falls on
    every figure alike rather than on one.
    """
    runs: list[list[tuple[float, int]]] = [[] for _w in work]
    for i in range(reps):
        for j, (volume, cls) in enumerate(work):
            runs[j].append(_once(store, volume, cls, i))
    return [(statistics.median(r[0] for r in rs), max(r[1] for r in rs)) for rs in runs]


def _local(work: str, files: int, reps: int) -> float:
    """`link(2)` and a 4 KiB write through the new name, among `files` files on ext4."""
    base = os.path.join(work, "local")
    for d in range(files // 100):
        os.makedirs(os.path.join(base, f"d{d:05}"))
        for f in range(100):
            with open(os.path.join(base, f"d{d:05}", f"f{f:03}"), "wb") as fh:
                fh.write(b"%d" % f)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        new = os.path.join(base, "d00003", f"new{i}")
        os.link(os.path.join(base, "d00001", "f001"), new)
        fd = os.open(new, os.O_WRONLY)
        try:
            os.pwrite(fd, WRITE, 0)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(root: str, quick: bool = False) -> list[dict[str, Any]]:
    n = 1_000 if quick else 5_000
    reps = 9 if quick else 21
    work = tempfile.mkdtemp(prefix="strata-bench-links-", dir=root)
    try:
        init_store(os.path.join(work, "store"))
        with LocalStore(os.path.join(work, "store")) as store:
            _build(store, "small", n)
            _build(store, "large", 10 * n)
            (small_t, small_r), (large_t, large_r) = _measure(
                store, [("small", Transaction), ("large", Transaction)], reps)
            ((walk_t, walk_r),) = _measure(store, [("large", WalkingTransaction)], 3)
        local_t = _local(work, 10 * n, reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    big = f"{10 * n:,}"
    return [
        row(f"hard link + 4 KiB write through it, {big}-file volume, cold cache",
            large_t * 1e3, "ms", small_t * 1e3, f"same at {n:,} files", "<= 1.5x",
            met=large_t <= 1.5 * small_t),
        row(f"  tree nodes and objects read, {big} files", large_r, "reads", small_r,
            f"same at {n:,} files", "<= 1.5x", met=large_r <= 1.5 * small_r),
        row(f"  the walk it replaced, {big} files", walk_t * 1e3, "ms", large_t * 1e3,
            "today's search, same store"),
        row(f"  reads of the walk it replaced, {big} files", walk_r, "reads", large_r,
            "today's search, same store"),
        row(f"  beside link(2) + pwrite on ext4, {big} files", large_t * 1e3, "ms",
            local_t * 1e3, "local disk"),
    ]
