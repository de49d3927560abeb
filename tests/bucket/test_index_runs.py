"""Checkpoints write what changed: index runs, merged in the background, old ones deleted.

Each checkpoint used to upload the whole object index again (about 49 bytes an
object, every 2 s while the store changed), and old index runs were never
deleted. Now a checkpoint adds a run of what changed since the one before;
runs merge when FANOUT share a level; and parts, tables and checkpoints that
no checkpoint in the log names any more are deleted from the bucket.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest

from bucketutil import key_of
from strata.engine import tiercheckpoints
from strata.engine.checkpoint import FANOUT, GROUP_PARTS, Checkpoint, runs_of
from strata.engine.local import LocalStore, init_store
from strata.engine.tier import restore
from strata.engine.tree import Trees
from strata.engine.txn import Transaction


def _bucket_files(root: Path, prefix: str) -> dict[str, int]:
    base = root / "bucket" / prefix
    if not base.is_dir():
        return {}
    out = {}
    for p in base.iterdir():
        try:  # the tier's own pass may be deleting it now
            out[f"{prefix}/{p.name}"] = p.stat().st_size
        except FileNotFoundError:
            continue
    return out


def _checkpoint(s: LocalStore) -> Checkpoint:
    s.sync_index()
    assert s._tier is not None
    s._tier.flush()
    with open(os.path.join(s.path, "tier-checkpoint"), "rb") as f:
        cp = Checkpoint.decode("cp", f.read())
    cp.load_tables(s._tier.bucket.get)
    return cp


def _publish(s: LocalStore, files: dict[str, bytes]) -> None:
    t = Transaction(s, "v")
    for path, data in files.items():
        t.write(path, data)
    t.commit()


def _store(tmp_path: Path) -> Path:
    path = tmp_path / "a"
    init_store(str(path), bucket=f"file://{tmp_path}/bucket")
    return path


def test_a_checkpoint_uploads_what_changed_not_the_whole_index(tmp_path: Path) -> None:
    path = _store(tmp_path)
    with LocalStore(str(path)) as s:
        s.create_volume("v")
        _publish(s, {f"f{i}": (b"%d," % i) * 1500 for i in range(3000)})  # not inline
        first = _checkpoint(s)
        objects = s._indexer.index.count_objects()
        assert sum(p.entries for p in first.parts) >= objects > 3000
        before = {**_bucket_files(tmp_path, "runs"), **_bucket_files(tmp_path, "tables"),
                  **_bucket_files(tmp_path, "checkpoints")}
        _publish(s, {"f0": b"changed\n"})
        second = _checkpoint(s)
        after = {**_bucket_files(tmp_path, "runs"), **_bucket_files(tmp_path, "tables"),
                 **_bucket_files(tmp_path, "checkpoints")}
        added = sum(size for name, size in after.items() if name not in before)
        # The change is a file, its directory, the root and the snapshot: a few objects.
        assert added < 4096, (added, sorted(set(after) - set(before)))
        assert runs_of(second.parts)[1:] == runs_of(first.parts)  # one run more, in front
        assert second.parts[0].entries < 10 and second.pack_tables == first.pack_tables
        assert 0 < s._tier.stats["checkpoint_bytes"] <= added  # before sealing


@pytest.mark.parametrize("part_entries", [None, 128], ids=["parts-inline", "parts-tables"])
def test_runs_merge_and_what_no_checkpoint_names_leaves_the_bucket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part_entries: int | None) -> None:
    """Runs merge; what no checkpoint names goes; a restore reads them back.

    With parts of 128 entries, a run is cut into dozens of parts and the
    checkpoint names them by parts tables (version 6), which the merges
    replace and the deletions follow.
    """
    if part_entries is not None:
        monkeypatch.setattr(tiercheckpoints, "PART_ENTRIES", part_entries)
    path = _store(tmp_path)
    with LocalStore(str(path)) as s:
        s.create_volume("v")
        _publish(s, {f"f{i}": os.urandom(4200) for i in range(3000)})
        _checkpoint(s)
        for k in range(2 * FANOUT + 1):
            _publish(s, {f"f{k}": f"edit {k}\n".encode(), f"new{k}": b"x" * k})
            cp = _checkpoint(s)
        levels = [r[0].level for r in runs_of(cp.parts)]
        assert levels == sorted(levels) and max(levels) >= 1, levels
        assert all(levels.count(lv) < FANOUT for lv in set(levels)), levels
        assert s._tier is not None
        named = {p.name for p in cp.parts}
        if part_entries is not None:
            assert len(cp.part_tables) >= 2 and len(cp.parts) > 2 * GROUP_PARTS, cp.manifest
            # The checkpoint lists a few tables, not every part.
            assert len(cp.raw) < 150 * len(cp.parts), (len(cp.raw), len(cp.parts))
        # The tier's own pass may hold some deletions in hand: wait for it, not just ours.
        deadline = time.monotonic() + 20
        def left() -> bool:
            return (set(_bucket_files(tmp_path, "runs")) != named
                    or len(_bucket_files(tmp_path, "checkpoints")) > 1)

        while left() and time.monotonic() < deadline:
            s._tier._delete_doomed()
            time.sleep(0.1)
        assert set(_bucket_files(tmp_path, "runs")) == named
        assert set(_bucket_files(tmp_path, "checkpoints")) == {s._tier._cp_name}
        assert set(_bucket_files(tmp_path, "tables")) == {
            n for n, _h in [*cp.tables.values(), *cp.part_tables, *cp.pack_tables]}
        live = {f"f{i}": Transaction(s, "v").read(f"f{i}") for i in range(3000)}
    key = key_of(path)
    os.rename(path, tmp_path / "gone")
    restore(f"file://{tmp_path}/bucket", str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as s:
        for name in ("f0", "f5", "f2999", f"new{2 * FANOUT}"):  # read before hydration ends
            assert Transaction(s, "v").read(name) == live.get(name, b"x" * (2 * FANOUT))
        assert s.fsck()["ok"], s.fsck()


def test_dropped_objects_stay_dropped_through_runs_and_restore(tmp_path: Path) -> None:
    path = _store(tmp_path)
    with LocalStore(str(path)) as s:
        s.create_volume("v")
        s.policies.set("v", None, keep_last=1)
        _publish(s, {f"f{i}": os.urandom(4200) for i in range(200)})
        _checkpoint(s)
        root = s.snapshot(s.head("v", "live")).root
        refs = [Trees(s).resolve(root, [f"f{i}"]) for i in range(100)]
        gone = [e.ref for e in refs if e is not None and e.ref is not None]
        assert len(gone) == 100
        t = Transaction(s, "v")
        for i in range(100):
            t.remove(f"f{i}")
        t.commit()
        s.gc(min_age=0)
        s.gc(min_age=0)
        s.sync_index()
        assert s.missing(gone) == gone
        cp = _checkpoint(s)
        assert len(runs_of(cp.parts)) >= 2  # the dropped ids ride in a newer run
    key = key_of(path)
    os.rename(path, tmp_path / "gone")
    restore(f"file://{tmp_path}/bucket", str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as s:
        assert s.missing(gone) == gone  # a tombstone hides the older run's entry
        assert Transaction(s, "v").read("f150") is not None
        assert s.fsck()["ok"]


def test_an_index_that_cannot_tell_what_changed_is_written_whole_once(tmp_path: Path) -> None:
    """An index from before runs (no `cp-base`) gets one run of everything, then deltas."""
    path = _store(tmp_path)
    with LocalStore(str(path)) as s:
        s.create_volume("v")
        _publish(s, {f"f{i}": (b"%d," % i) * 1500 for i in range(500)})
        _checkpoint(s)
    env = lmdb.open(str(path / "index"), max_dbs=16, subdir=True)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.delete(b"cp-base", db=meta)
    env.close()
    with LocalStore(str(path)) as s:
        _publish(s, {"one": b"more"})
        cp = _checkpoint(s)
        assert len(runs_of(cp.parts)) == 1
        assert cp.parts[0].entries == s._indexer.index.count_objects()
        _publish(s, {"two": b"more"})
        cp = _checkpoint(s)
        assert len(runs_of(cp.parts)) == 2 and cp.parts[0].entries < 10


def _slow_merges(s: LocalStore) -> None:
    """A merge budget a small store outgrows, so merges span checkpoints."""
    assert s._tier is not None
    s._tier.merge_floor, s._tier.merge_rate = 200, 1


def _settle(s: LocalStore, tmp_path: Path, cp: Checkpoint) -> None:
    """Wait for the tier's pass to delete what no checkpoint names any more."""
    assert s._tier is not None
    named = {p.name for p in cp.parts}
    deadline = time.monotonic() + 20
    while (set(_bucket_files(tmp_path, "runs")) != named
           and time.monotonic() < deadline):
        s._tier._delete_doomed()
        time.sleep(0.1)


@pytest.mark.parametrize("part_entries", [None, 32], ids=["parts-inline", "parts-tables"])
def test_a_merge_spans_checkpoints_within_its_budget_and_restores_midway(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part_entries: int | None) -> None:
    if part_entries is not None:  # the merge's inputs and output in parts tables
        monkeypatch.setattr(tiercheckpoints, "PART_ENTRIES", part_entries)
    path = _store(tmp_path)
    live: dict[str, bytes] = {}
    with LocalStore(str(path)) as s:
        _slow_merges(s)
        assert s._tier is not None
        s.create_volume("v")
        s.policies.set("v", None, keep_last=1)
        live.update({f"f{i}": os.urandom(4200) for i in range(500)})
        _publish(s, live)
        first = _checkpoint(s)
        assert {p.level for p in first.parts} == {0}  # a run of its size: level 0
        root = s.snapshot(s.head("v", "live")).root
        refs = [Trees(s).resolve(root, [f"f{i}"]) for i in range(40)]
        gone = [e.ref for e in refs if e is not None and e.ref is not None]
        t = Transaction(s, "v")
        for i in range(40):
            t.remove(f"f{i}")
            del live[f"f{i}"]
        t.commit()
        s.gc(min_age=0)
        s.gc(min_age=0)
        s.sync_index()
        assert s.missing(gone) == gone and len(gone) == 40
        seen_midway = None
        k = 0
        while seen_midway is None and k < 40:
            k += 1
            batch = {f"n{k}-{j}": os.urandom(4200) for j in range(150)}
            live.update(batch)
            before = dict(s._tier.stats)
            _publish(s, batch)
            cp = _checkpoint(s)
            after = dict(s._tier.stats)
            checkpoints = after["checkpoints"] - before["checkpoints"]
            # Each checkpoint merges at most max(floor, rate x its own entries) ids (its
            # own: the batch, a file and its block each, and whatever GC moved): a
            # whole merge of these runs would be over 2,500.
            delta = after["delta_entries"] - before["delta_entries"]
            merged = after["merged_entries"] - before["merged_entries"]
            assert merged <= checkpoints * 200 + delta, (k, merged, delta)
            # Bytes, not time: its delta and its merge at 49 bytes an id, plus block
            # hashes, fences, part headers, the manifest and the packs table.
            assert after["checkpoint_bytes_total"] - before["checkpoint_bytes_total"] \
                <= 1.2 * 49 * (delta + merged) + checkpoints * 16384, (k, before, after)
            if cp.merge is not None and cp.merge.after and cp.merge.drop:
                seen_midway = cp
        assert seen_midway is not None, "no merge spanned two checkpoints"
        out = [p for p in seen_midway.parts if p.run == seen_midway.merge.out]
        assert out and out[0].level == 1
        if part_entries is not None:
            assert seen_midway.part_tables and len(out) > 2, seen_midway.manifest
        # The output sits in front of its inputs, which stay whole until it ends.
        runs = [r[0].run for r in runs_of(seen_midway.parts)]
        assert runs.index(seen_midway.merge.out) + 1 == runs.index(seen_midway.merge.inputs[0])
        # Closing writes one more checkpoint; give it nothing to finish the merge with.
        s._tier.merge_floor = 0
        s._tier.merge_rate = 0
    key = key_of(path)
    os.rename(path, tmp_path / "gone")
    restore(f"file://{tmp_path}/bucket", str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as s:
        assert s._tier is not None and s._tier._merging is not None  # still in progress
        for name in ("f40", "f499", "n1-0", f"n{k}-149", "f41"):  # before hydration ends
            assert Transaction(s, "v").read(name) == live[name]
        for name, data in live.items():  # ids on both sides of the merge's boundary
            assert Transaction(s, "v").read(name) == data, name
        assert s.missing(gone) == gone  # dropped ids stay dropped across the boundary
        _slow_merges(s)
        for j in range(30):  # the new owner carries the merge on to its end
            _publish(s, {f"m{j}": b"m%d" % j})
            live[f"m{j}"] = b"m%d" % j
            cp = _checkpoint(s)
            if cp.merge is None:
                break
        assert cp.merge is None
        levels = [r[0].level for r in runs_of(cp.parts)]
        assert levels == sorted(levels), levels
        _settle(s, tmp_path, cp)
        assert set(_bucket_files(tmp_path, "runs")) == {p.name for p in cp.parts}
        assert s.missing(gone) == gone
        for name, data in live.items():
            assert Transaction(s, "v").read(name) == data, name
        assert s.fsck()["ok"]


_CHILD = """
import sys
from strata.engine.local import LocalStore
from strata.engine.txn import Transaction
with LocalStore(sys.argv[1]) as s:
    s._tier.merge_floor, s._tier.merge_rate = 200, 1
    k = 0
    while True:
        k += 1
        t = Transaction(s, "v")
        for j in range(150):
            t.write(f"n{k}-{j}", b"%d-%d," % (k, j) * 900)
        t.commit()
        s.sync_index()
        s._tier.flush()
        m = s._tier._merging
        print(k, "merging" if m is not None and m.after else "idle", flush=True)
"""


def test_a_kill_in_the_middle_of_a_merge_restores_every_checkpointed_object(
        tmp_path: Path) -> None:
    path = _store(tmp_path)
    with LocalStore(str(path)) as s:
        s.create_volume("v")
        _publish(s, {f"f{i}": b"%d," % i * 1500 for i in range(500)})
        _checkpoint(s)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)],
                             stdout=subprocess.PIPE, text=True)
    done = 0
    try:
        assert child.stdout is not None
        for line in child.stdout:
            k, state = line.split()
            done = int(k)
            if state == "merging":
                # Killed inside the next checkpoint, or the merge work it does.
                time.sleep(random.uniform(0.05, 0.4))
                break
    finally:
        child.kill()
        child.wait()
    assert done > 0
    key = key_of(path)
    os.rename(path, tmp_path / "gone")
    restore(f"file://{tmp_path}/bucket", str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as s:
        for k in range(1, done + 1):
            for j in (0, 77, 149):
                assert Transaction(s, "v").read(f"n{k}-{j}") == b"%d-%d," % (k, j) * 900
        assert Transaction(s, "v").read("f499") == b"499," * 1500
        assert s.fsck()["ok"]
        _slow_merges(s)
        for j in range(40):  # the new owner finishes the merge the dead one began
            _publish(s, {f"m{j}": b"m"})
            cp = _checkpoint(s)
            if cp.merge is None:
                break
        assert cp.merge is None
        _settle(s, tmp_path, cp)
        named = {p.name for p in cp.parts}
        assert named <= set(_bucket_files(tmp_path, "runs"))
        # Parts the killed checkpoint uploaded (nothing ever named them) wait for the
        # sweep (engine/tiersweep.py), which takes them and leaves every named one.
        assert s._tier is not None
        s._tier.sweep(age=0)
        assert set(_bucket_files(tmp_path, "runs")) == named
        for k in range(1, done + 1):
            assert Transaction(s, "v").read(f"n{k}-5") == b"%d-%d," % (k, 5) * 900


def test_a_checkpoint_that_fails_midway_through_a_merge_loses_no_ids(tmp_path: Path) -> None:
    """The merge's progress counts only once the checkpoint naming it is in the log."""
    path = _store(tmp_path)
    live: dict[str, bytes] = {}
    cps = tmp_path / "bucket" / "checkpoints"
    with LocalStore(str(path)) as s:
        _slow_merges(s)
        assert s._tier is not None
        s.create_volume("v")
        live.update({f"f{i}": b"%d," % i * 1500 for i in range(500)})
        _publish(s, live)
        _checkpoint(s)
        failed = False
        # Until the merge that a failed checkpoint interrupted is done (background
        # checkpoints share the work on a loaded machine, so it can start late).
        for k in range(1, 150):
            batch = {f"n{k}-{j}": b"%d-%d," % (k, j) * 900 for j in range(150)}
            live.update(batch)
            _publish(s, batch)
            m = s._tier._merging
            if not failed and m is not None and m.after:
                # The next checkpoint merges more, then cannot write its object.
                os.rename(cps, tmp_path / "cps-away")
                cps.write_bytes(b"not a directory")
                with pytest.raises(Exception):  # noqa: B017 - whatever the bucket says
                    _checkpoint(s)
                cps.unlink()
                os.rename(tmp_path / "cps-away", cps)
                failed = True
                continue
            cp = _checkpoint(s)
            if failed and cp.merge is None:
                break
        assert failed and cp.merge is None
    key = key_of(path)
    os.rename(path, tmp_path / "gone")
    restore(f"file://{tmp_path}/bucket", str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as s:
        for name, data in live.items():
            assert Transaction(s, "v").read(name) == data, name
        assert s.fsck()["ok"]
