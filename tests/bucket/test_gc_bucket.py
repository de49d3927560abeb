"""Garbage collection on a store kept in a bucket: packs leave the bucket only when safe.

A pack that GC emptied is deleted locally, drops out of the next checkpoint,
and its bucket object is deleted only after a checkpoint without it is in
the log: a restore reads the newest checkpoint, so it never needs the pack.
A restore after collection reads every kept snapshot back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from strata.engine.errors import StrataError
from strata.engine.gc import PINS_UNTIL
from strata.engine.local import LocalStore, init_store
from strata.engine.seal import KEY_FILE, read_key_file
from strata.engine.tier import restore
from strata.engine.txn import Transaction

MiB = 1 << 20


def _index_complete(r: LocalStore) -> Any:
    """The restored store's tier, once it holds the whole index (GC waits for that)."""
    rt = r._tier
    assert rt is not None
    deadline = time.monotonic() + 60
    while not rt.index_complete():
        assert time.monotonic() < deadline, "the index never came"
        time.sleep(0.05)
    return rt


def _bucket_packs(s: LocalStore) -> set[str]:
    tier = s._tier
    assert tier is not None
    return {name for name, _size in tier.remote.values()}


def test_collected_packs_leave_the_bucket_after_a_checkpoint(bucket_url: str,
                                                             tmp_path: Path) -> None:
    store = tmp_path / "a"
    init_store(str(store), bucket=bucket_url, pack_size_limit=MiB)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        for _ in range(12):
            t = Transaction(s, "v")
            t.write("big", os.urandom(600_000))
            t.write("keep", b"kept")
            t.commit()
        tier = s._tier
        assert tier is not None
        tier.flush()
        before = _bucket_packs(s)
        assert len(before) >= 5
        s.policies.set("v", None, keep_last=1)
        s.gc(min_age=0)
        second = s.gc(min_age=0)
        assert second["packs_deleted"], second
        gone = set(before) - _bucket_packs(s)
        assert gone  # out of the tier's map: the next checkpoint does not name them
        for name in gone:  # not deleted yet: the newest checkpoint in the log names them
            assert tier.bucket.exists(name), name
        tier.flush()  # a checkpoint without them ...
        deadline = time.monotonic() + 10
        while any(tier.bucket.exists(n) for n in gone) and time.monotonic() < deadline:
            time.sleep(0.1)  # ... and the background loop deletes them
        assert not any(tier.bucket.exists(n) for n in gone)
        assert tier.report()["packs_deleted"] >= len(gone)
        want = Transaction(s, "v").read("big")
    key = read_key_file(str(store / KEY_FILE))
    shutil.rmtree(store)
    restore(bucket_url, str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as s:
        t = Transaction(s, "v")
        assert t.read("big") == want and t.read("keep") == b"kept"
        report = s.fsck()
        assert report["ok"], {k: v for k, v in report.items() if k not in ("packs", "records")}


def test_policies_travel_with_the_bucket(bucket_url: str, tmp_path: Path) -> None:
    """A store restored from its bucket keeps its retention policies, and GC applies them.

    One policy is in the checkpoint, one only in the log after it. A tag (a
    branch) keeps the oldest snapshot, which the policy alone would let go.
    """
    store = tmp_path / "a"
    init_store(str(store), bucket=bucket_url, pack_size_limit=MiB)
    s = LocalStore(str(store))
    s.create_volume("v")
    sids = [_publish(s, "live", b"live %d" % i) for i in range(4)]
    s.fork("v", "side", at=sids[1])
    s.fork("v", "tags/first", at=sids[0])  # tags are branches: they travel as refs
    for i in range(2):
        _publish(s, "side", b"side %d" % i)
    s.policies.set("v", None, keep_last=2)
    tier = s._tier
    assert tier is not None
    tier.flush()  # a checkpoint holding the volume's policy
    s.policies.set("v", "side", keep_last=1, keep_newer=None)
    tier.ship()   # the branch's: in the log only
    heads = s.list_branches("v")
    want = {"v": {"keep_last": 2}, "v@side": {"keep_last": 1}}
    assert s.policies.load() == want
    try:
        # While `a` still runs: a new machine.
        restore(bucket_url, str(tmp_path / "b"), key=read_key_file(str(store / KEY_FILE)))
        with LocalStore(str(tmp_path / "b")) as r:
            # Pins `a` granted are unknown here: a pass right after the takeover waits.
            _index_complete(r)
            waited = r.gc(min_age=0)
            assert "pins granted before" in (waited.get("waiting") or "")
            assert len(r.log(heads["live"])) == 5
        # This test knows `a` granted no pins: end the wait instead of sleeping it out.
        os.unlink(tmp_path / "b" / PINS_UNTIL)
        with LocalStore(str(tmp_path / "b")) as r:
            assert r.policies.load() == want
            assert r.list_branches("v") == heads
            assert len(r.log(heads["live"])) == 5 and len(r.log(heads["side"])) == 5
            _index_complete(r)  # GC waits for the inherited index
            r.gc(min_age=0)
            assert len(r.log(heads["live"])) == 2 and len(r.log(heads["side"])) == 1
            assert Transaction(r, "v").read("f") == b"live 3" * 50_000
            assert Transaction(r, "v", "side").read("f") == b"side 1" * 50_000
            assert Transaction(r, "v", "tags/first").read("f") == b"live 0" * 50_000
            report = r.fsck()
            assert report["ok"], {k: v for k, v in report.items()
                                  if k not in ("packs", "records")}
        with LocalStore(str(tmp_path / "b")) as r:  # and they stay: they are in its journal
            assert r.policies.load() == want
    finally:
        with contextlib.suppress(StrataError):  # fenced by the restored store
            s.close()


def _publish(s: LocalStore, branch: str, data: bytes) -> str:
    t = Transaction(s, "v", branch)
    t.write("f", data * 50_000)
    return t.commit()


def test_a_restored_store_recounts_once_then_collects_incrementally(bucket_url: str,
                                                                    tmp_path: Path) -> None:
    """The restored index came from checkpoint runs, which carry no counts.

    The first pass recounts it in place from the nodes' frames, read from the
    bucket (the disk that wrote them is gone), and from then on passes take
    only garbage: a full mark finds exactly what the accounting finds.
    """
    from test_gc import assert_accounting_exact

    store = tmp_path / "a"
    init_store(str(store), bucket=bucket_url, pack_size_limit=MiB)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        for i in range(6):
            t = Transaction(s, "v")
            for d in range(3):
                t.mkdir(f"d{d}", exist_ok=True)
            for j in range(12):
                t.write(f"d{j % 3}/f{j}", os.urandom(3000) if j % 6 == i else b"same %d" % j)
            t.write("big", os.urandom(400_000))  # packs fill and go to the bucket sealed
            t.commit()
        s.policies.set("v", None, keep_last=2)
        tier = s._tier
        assert tier is not None
        tier.flush()
        heads = s.list_branches("v")
        want = {f"d{j % 3}/f{j}": Transaction(s, "v").read(f"d{j % 3}/f{j}") for j in range(12)}
        big = Transaction(s, "v").read("big")
    key = read_key_file(str(store / KEY_FILE))
    shutil.rmtree(store)
    restore(bucket_url, str(tmp_path / "b"), key=key)
    with contextlib.suppress(FileNotFoundError):  # `a` closed: it holds no pins
        os.unlink(tmp_path / "b" / PINS_UNTIL)
    with LocalStore(str(tmp_path / "b")) as r:
        rt = _index_complete(r)
        assert not r.index.counted()
        ranged = rt.stats["ranged_reads"]
        first = r.gc(min_age=0)
        assert first["recount"]["exact"] and first["recount"]["nodes"] >= 12, first
        assert rt.stats["ranged_reads"] > ranged  # the nodes came from the bucket
        assert first["mode"] == "incremental" and first["fallback"] is None, first
        assert first["objects_deleted"] > 0, first
        assert_accounting_exact(r)
        for i in range(3):
            t = Transaction(r, "v")
            t.write("d0/f0", b"new %d" % i)
            t.commit()
        full = r.gc(min_age=0, full=True)
        assert full["recount"] is None and full["fallback"] is None, full
        assert full["checked"]["live_in_full_mark"] == 0, full
        assert full["checked"]["missed_by_accounting"] == 0, full
        assert full["objects_deleted"] > 0, full
        later = r.gc(min_age=0)
        assert later["mode"] == "incremental" and later["recount"] is None, later
        assert r.list_branches("v")["live"] != heads["live"]
        got = {p: Transaction(r, "v").read(p) for p in want}
        assert got == {**want, "d0/f0": b"new 2"}
        assert Transaction(r, "v").read("big") == big
        report = r.fsck()
        assert report["ok"], {k: v for k, v in report.items() if k not in ("packs", "records")}
