"""Checkpoints write what changed: index runs, merged in the background, old ones deleted.

Each checkpoint used to upload the whole object index again (about 49 bytes an
object, every 2 s while the store changed), and old index runs were never
deleted. Now a checkpoint adds a run of what changed since the one before;
runs merge when FANOUT share a level; and parts, tables and checkpoints that
no checkpoint in the log names any more are deleted from the bucket.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import lmdb

from bucketutil import key_of
from strata.engine.checkpoint import FANOUT, Checkpoint, runs_of
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
        return Checkpoint.decode("cp", f.read())


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
        assert second.parts[0].entries < 10 and second.tables["packs"] == first.tables["packs"]
        assert 0 < s._tier.stats["checkpoint_bytes"] <= added  # before sealing


def test_runs_merge_and_what_no_checkpoint_names_leaves_the_bucket(tmp_path: Path) -> None:
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
        assert set(_bucket_files(tmp_path, "tables")) == {n for n, _h in cp.tables.values()}
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
