"""Objects no checkpoint names are swept from the bucket; what a restore reads never is.

A checkpoint killed before its log record leaves its runs and tables named
by nothing, and so does a pack upload cut short or a fenced owner's late
uploads. The owner's sweep (engine/tiersweep.py) LISTs and deletes them: only
its own epoch's or earlier ones, only unnamed, only old enough.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from strata.engine.errors import Fenced, StrataError
from strata.engine.local import LocalStore, init_store
from strata.engine.seal import KEY_FILE, read_key_file
from strata.engine.tier import restore
from strata.engine.tiersweep import name_epoch
from strata.engine.txn import Transaction

MiB = 1 << 20


def _write(s: LocalStore, prefix: str, n: int) -> dict[str, bytes]:
    wrote = {}
    for i in range(n):
        t = Transaction(s, "v")
        wrote[f"{prefix}{i}"] = data = os.urandom(300_000)
        t.write(f"{prefix}{i}", data)
        t.commit()
    return wrote


def test_name_epochs() -> None:
    assert name_epoch("packs/0000002a-17-0a1b2c3d.pack") == 17
    assert name_epoch("runs/5-40-0a1b2c3d-1-0") == 5
    assert name_epoch("tables/5-40-0a1b2c3d-packs-0") == 5
    assert name_epoch("checkpoints/12-99-0a1b2c3d") == 12
    for other in ("runs/x", "packs/0000002a.pack", "log/00000000000000000003", "probe/ab",
                  "tables/-1-2-x", "checkpoints/a-1-2"):
        assert name_epoch(other) is None, other


def test_unnamed_objects_of_this_epoch_and_earlier_are_swept(bucket_url: str,
                                                             tmp_path: Path) -> None:
    store = tmp_path / "a"
    init_store(str(store), bucket=bucket_url, pack_size_limit=MiB)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        wrote = _write(s, "f", 8)
        tier = s._tier
        assert tier is not None
        s.sync_index()  # so that the checkpoint below names runs, not only packs
        tier.flush()
        epoch = tier.log.epoch or 0
        assert tier._manifest and tier.remote
        body = os.urandom(5000)
        # What a killed checkpoint, a cut upload and an earlier owner leave behind ...
        orphans = [f"runs/{epoch}-{epoch + 3}-0badf00d-1-0",
                   f"tables/{epoch}-{epoch + 3}-0badf00d-expired",
                   f"checkpoints/{epoch}-{epoch + 3}-0badf00d",
                   f"packs/00000063-{epoch}-0badf00d.pack",
                   f"runs/{max(0, epoch - 1)}-1-0badf00d-1-0"]
        # ... and what is not this owner's to judge: a successor's, and a stranger's.
        kept = [f"runs/{epoch + 5}-{epoch + 9}-0badf00d-1-0",
                f"packs/00000063-{epoch + 5}-0badf00d.pack", "runs/hand-made"]
        for name in orphans + kept:
            tier.bucket.put_new(name, body)
        named = tier._named()
        assert tier.sweep() == 0  # all younger than SWEEP_AGE
        assert tier.sweep(age=0) == len(orphans)
        assert tier.stats["objects_swept"] == len(orphans)
        for name in orphans:
            assert not tier.bucket.exists(name), name
        for name in kept + sorted(named):
            assert tier.bucket.exists(name), name
        more = _write(s, "g", 2)
    key = read_key_file(str(store / KEY_FILE))
    restore(bucket_url, str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as r:
        t = Transaction(r, "v")
        assert all(t.read(name) == data for name, data in {**wrote, **more}.items())
        assert r._tier is not None
        # Epoch 5 came before this restore's claim: those are its to sweep now, with
        # what `a` had not deleted yet when it closed (its previous checkpoint).
        assert r._tier.sweep(age=0) >= 2
        assert not any(r._tier.bucket.exists(n) for n in kept[:2])
        assert r._tier.bucket.exists(kept[2])
        r._tier.flush()
    with LocalStore(str(tmp_path / "b")) as r:
        t = Transaction(r, "v")
        assert all(t.read(name) == data for name, data in {**wrote, **more}.items())
        report = r.fsck()
        assert report["ok"], {k: v for k, v in report.items() if k not in ("packs", "records")}


def test_a_fenced_owner_sweeps_nothing_of_its_successors(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    a = tmp_path / "a"
    init_store(str(a), bucket=url, pack_size_limit=MiB)
    s = LocalStore(str(a))
    try:
        s.create_volume("v")
        wrote = _write(s, "a", 6)
        tier_a = s._tier
        assert tier_a is not None
        tier_a.flush()
        tier_a._stop.set()  # stalled: it neither ships nor looks for a successor
        for thread in (tier_a._thread, tier_a._fence_thread):
            assert thread is not None
            thread.join()
        key = read_key_file(str(a / KEY_FILE))
        restore(url, str(tmp_path / "b"), key=key)
        with LocalStore(str(tmp_path / "b")) as b:
            wrote.update(_write(b, "b", 6))
            assert b._tier is not None
            b._tier.flush()
        # A has not noticed: its state still names only its own checkpoint. An orphan
        # of its own epoch makes it look, and the HEAD before deleting stops it.
        tier_a.bucket.put_new(f"runs/{tier_a.log.epoch}-1-0badf00d-1-0", b"x")
        theirs = [name for prefix in ("packs/", "runs/", "tables/", "checkpoints/")
                  for name in tier_a.bucket.names(prefix)
                  if (name_epoch(name) or 0) > (tier_a.log.epoch or 0)]
        assert theirs
        with pytest.raises(Fenced):
            tier_a.sweep(age=0)
        assert all(tier_a.bucket.exists(n) for n in theirs)
    finally:
        with contextlib.suppress(StrataError):
            s.close()
    restore(url, str(tmp_path / "c"), key=key)
    with LocalStore(str(tmp_path / "c")) as c:
        t = Transaction(c, "v")
        assert all(t.read(name) == data for name, data in wrote.items())
