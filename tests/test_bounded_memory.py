"""GC and fsck hold per-object state on disk: their memory does not grow with the store.

Two real stores, one five times the other, each walked by a full GC mark
(`gc --full`, dry run: it marks every object and sweeps the whole index) and
by fsck. The scratch tables' bounds are lowered so that both sizes are well
past them; then the peak of Python's allocations (tracemalloc) through each
pass must be nearly the same at both sizes and under a fixed bound. Holding
one Python set or dict entry per object (~200 bytes) would add about 7 MiB
between the two sizes, and the test fails (`test_the_check_can_fail` shows
it with the buffer let grow past the store).

Also: a scan of the whole index hands the LMDB map's pages back, so they do
not stay resident in the process.
"""

from __future__ import annotations

import os
import shutil
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from strata.engine import gc as gcmod
from strata.engine import reach, scratch
from strata.engine.index import Index
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import BLOCK, SNAPSHOT, references
from strata.engine.recount import recount
from strata.engine.txn import Transaction

SMALL, LARGE = 4_000, 20_000  # files: a block and a file node each, so ~8k and ~40k objects
SLACK = 1 << 20               # what the larger store may add to a pass's peak (bytes)
BOUND = 8 << 20               # a pass's peak at either size, with the bounds below


def _build(path: Path, files: int) -> None:
    init_store(str(path))
    with LocalStore(str(path)) as s:
        s.create_volume("v")
        s.policies.set("v", None, keep_last=1)  # what the churn replaces is garbage
        for start in range(0, files, 10_000):
            t = Transaction(s, "v")
            for n in range(start, min(files, start + 10_000)):
                if n % 500 == 0:
                    t.mkdir(f"d{n // 500:04d}")
                t.write(f"d{n // 500:04d}/f{n:06d}", b"file %08d\n" % n + b"x" * 4200)
            t.commit(f"files from {start}")
        # Some garbage, so the sweep has something to decide.
        t = Transaction(s, "v")
        for n in range(0, files, 50):
            t.write(f"d{n // 500:04d}/f{n:06d}", b"changed %08d" % n)
        t.commit("churn")
        s.sync_index()


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Path]]:
    root = tmp_path_factory.mktemp("bounded")
    out = {}
    for files in (SMALL, LARGE):
        out[files] = root / f"s{files}"
        _build(out[files], files)
    yield out


@pytest.fixture
def small_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scratch, "SCRATCH_BATCH", 1024)
    monkeypatch.setattr(scratch, "SCRATCH_FILTER_BITS", 16)
    monkeypatch.setattr(scratch, "SCRATCH_CACHE_KIB", 1024)
    monkeypatch.setattr(gcmod, "SWEEP_BATCH", 256)
    monkeypatch.setattr(gcmod, "MEMO_ENTRIES", 1024)
    monkeypatch.setattr(gcmod, "NAMES_BYTES", 64 << 10)


def _peak(path: Path, run: Callable[[LocalStore], Any]) -> tuple[int, Any]:
    with LocalStore(str(path)) as s:
        s.sync_index()
        tracemalloc.start()
        try:
            out = run(s)
            return tracemalloc.get_traced_memory()[1], out
        finally:
            tracemalloc.stop()


def _gc(s: LocalStore) -> Any:
    return s.gc(min_age=0, dry_run=True, full=True)


def _gc_incremental(s: LocalStore) -> Any:
    return s.gc(min_age=0, dry_run=True)


def _fsck(s: LocalStore) -> Any:
    return s.fsck()


def _recount(s: LocalStore) -> Any:
    """A restored store's first pass recounts the accounting (it changes no result)."""
    return recount(s.index, s._packs, s.path)


@pytest.mark.parametrize("run", [_gc, _gc_incremental, _fsck, _recount],
                         ids=["gc-full", "gc-incremental", "fsck", "recount"])
def test_peak_does_not_grow_with_the_store(stores: dict[int, Path], small_bounds: None,
                                           run: Callable[[LocalStore], Any]) -> None:
    small, small_out = _peak(stores[SMALL], run)
    large, large_out = _peak(stores[LARGE], run)
    if run is _gc_incremental:
        assert large_out["mode"] == "incremental" and not large_out["fallback"]
        assert large_out["objects_unreachable"] > 4 * small_out["objects_unreachable"] > 0
    elif run is _recount:
        assert small_out["exact"] and large_out["exact"], (small_out, large_out)
        assert large_out["nodes"] > 4 * small_out["nodes"]
    elif run is _gc:
        assert large_out["mode"] == "full"
        assert large_out["objects_live"] > 4 * small_out["objects_live"]
        assert large_out["objects_unreachable"] > 4 * small_out["objects_unreachable"] > 0
    else:
        assert small_out["ok"] and large_out["ok"], (small_out, large_out)
        assert large_out["objects"] > 4 * small_out["objects"]
    assert large - small < SLACK, f"peak {small >> 10} KiB -> {large >> 10} KiB"
    assert large < BOUND, f"peak {large >> 10} KiB"


def test_the_check_can_fail(stores: dict[int, Path], small_bounds: None,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With the scratch buffer larger than the store, the mark set is all in memory."""
    monkeypatch.setattr(scratch, "SCRATCH_BATCH", 10**9)
    small, _ = _peak(stores[SMALL], _gc)
    large, _ = _peak(stores[LARGE], _gc)
    assert large - small > SLACK


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_index_scan_hands_its_pages_back(stores: dict[int, Path]) -> None:
    with LocalStore(str(stores[LARGE])) as s:
        s.sync_index()
        data = os.path.realpath(os.path.join(s.index.path, "data.mdb"))
        size = os.path.getsize(data)
        assert size > 8 << 20  # the index is larger than what may stay resident
        n = sum(1 for _ in s.index.iter_objects())
        assert n > 30_000
        assert _resident(data) < 2 << 20, (_resident(data), size)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_gc_writes_hand_their_pages_back(stores: dict[int, Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropping garbage changes counts all over the index: its write transactions hand back too.

    LMDB reads through its map inside a write transaction as well; at a million
    objects one sweep transaction left 400 MiB of the map resident before.
    """
    shutil.copytree(stores[LARGE], tmp_path / "s")
    seen: list[int] = []
    forget = Index._forget_locked

    def measured(self: Index, txn: Any, gone: Any) -> None:
        forget(self, txn, gone)
        seen.append(_resident(os.path.realpath(os.path.join(self.path, "data.mdb"))))

    monkeypatch.setattr(Index, "_forget_locked", measured)
    with LocalStore(str(tmp_path / "s")) as s:
        s.sync_index()
        size = os.path.getsize(os.path.join(s.index.path, "data.mdb"))
        out = s.gc(min_age=0)
        assert out["mode"] == "incremental" and out["objects_deleted"] > 400, out
    assert seen and size > 8 << 20
    assert max(seen) < 2 << 20, (seen, size)


def _resident(path: str) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                ours = len(head) >= 6 and head[5] == path
            elif ours and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def test_reach_walk_marks_every_object_in_batches(stores: dict[int, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A volume's reach is marked in many small transactions, and all of it is marked."""
    monkeypatch.setattr(reach, "MARK_BATCH", 256)
    with LocalStore(str(stores[LARGE])) as s:
        s.sync_index()
        head = bytes.fromhex(next(iter(s.list_branches("v").values())))
        under: set[bytes] = set()  # what the head's tree reaches, walked here in memory
        todo = [(SNAPSHOT, head)]
        while todo:
            kind, oid = todo.pop()
            if oid not in under:
                under.add(oid)
                if kind != BLOCK:
                    todo.extend((k, o) for k, o in references(kind, s.get_object(oid))
                                if k != SNAPSHOT)
        assert len(under) > 35_000
        assert all(s.reachable("v", sorted(under)))
        stranger = [bytes(32)]
        assert s.reachable("v", stranger) == [False]
