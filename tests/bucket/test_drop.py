"""Log segments that a checkpoint made redundant give their bytes back, and the fence holds.

Every byte written goes to a log segment and again to its pack. Once a
checkpoint in the log names the uploaded pack, no restore reads those
segments again. Each is overwritten in place by a small `dropped` record:
the number stays taken (the fence, and the search for the log's end, need
every number), the bytes go (engine/tierdrop.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from strata.engine.bucket import OwnerLog, log_name
from strata.engine.checkpoint import Checkpoint
from strata.engine.errors import Corrupt, Fenced, StrataError
from strata.engine.local import LocalStore, init_store
from strata.engine.seal import KEY_FILE, read_key_file
from strata.engine.tier import TIER_STATE, restore
from strata.engine.tierdrop import DROP_MIN, SMALL_RECORD
from strata.engine.txn import Transaction

MiB = 1 << 20


def _kinds(log: OwnerLog) -> list[str]:
    return [body["kind"] for _seq, body in log.read_many(range(log.find_end()))]


def _write(s: LocalStore, prefix: str, n: int, size: int = 200_000) -> dict[str, bytes]:
    wrote = {}
    for i in range(n):
        data = os.urandom(size)
        t = Transaction(s, "v")
        t.write(f"{prefix}{i}", data)
        t.commit()
        assert s._tier is not None
        s._tier.ship()  # a segment a publish, as publishes a second apart would be
        wrote[f"{prefix}{i}"] = data
    return wrote


def _drop_all(s: LocalStore) -> None:
    tier = s._tier
    assert tier is not None
    tier.flush()
    while tier._dropped_to is None or tier._dropped_to < tier._drop_upto:
        tier._drop_some()


def test_segments_below_log_from_are_dropped_and_the_store_restores(
        bucket_url: str, tmp_path: Path) -> None:
    store = tmp_path / "a"
    init_store(str(store), bucket=bucket_url, pack_size_limit=MiB)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        wrote = _write(s, "f", 16)  # 3.2 MiB: three packs sealed and uploaded
        _drop_all(s)
        tier = s._tier
        assert tier is not None
        log = tier.log
        cp = Checkpoint.decode(tier._cp_name or "", tier.bucket.get(tier._cp_name or ""))
        kinds = _kinds(log)
        dropped = [seq for seq, k in enumerate(kinds) if k == "dropped"]
        assert dropped and max(dropped) < cp.log_from, (kinds, cp.log_from)
        # Claims and checkpoints stay as written; what is left of a dropped segment
        # is small, and its number is still taken.
        assert kinds[tier.log.epoch or 0] == "claim"
        assert all(tier.bucket.size(log_name(seq)) <= SMALL_RECORD for seq in dropped)
        assert tier.stats["segment_bytes_dropped"] >= 2 * MiB, tier.stats
        assert all(kinds[seq] != "segment" or tier.bucket.size(log_name(seq)) < DROP_MIN
                   for seq in range(cp.log_from))
    # The owner reopens from its own directory: its last record may be one it dropped.
    with LocalStore(str(store)) as s:
        assert Transaction(s, "v").read("f3") == wrote["f3"]
        more = _write(s, "g", 2)
    key = read_key_file(str(store / KEY_FILE))
    restore(bucket_url, str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as r:
        t = Transaction(r, "v")
        assert all(t.read(name) == data for name, data in {**wrote, **more}.items())
        report = r.fsck()
        assert report["ok"], {k: v for k, v in report.items() if k not in ("packs", "records")}
    # The old owner, reopened after the takeover, is told so (not that the bucket is
    # damaged), even though the successor has overwritten its last record meanwhile.
    with pytest.raises(Fenced, match="taken over"):
        LocalStore(str(store)).close()


def test_a_successor_drops_the_old_owners_segments_and_keeps_its_claims(
        bucket_url: str, tmp_path: Path) -> None:
    """The stalled owner's next number is the successor's claim, and it stays a claim.

    A restores nothing here: B restores while A is open (stalled), publishes
    until its own checkpoints pass A's segments, and drops them; A's next
    write must still fail, and a third restore reads everything.
    """
    a = tmp_path / "a"
    init_store(str(a), bucket=bucket_url, pack_size_limit=MiB)
    s = LocalStore(str(a))
    try:
        s.create_volume("v")
        wrote = _write(s, "a", 8)
        tier_a = s._tier
        assert tier_a is not None
        tier_a.flush()
        a_next = tier_a.log.next
        key = read_key_file(str(a / KEY_FILE))
        restore(bucket_url, str(tmp_path / "b"), key=key)
        with LocalStore(str(tmp_path / "b")) as b:
            wrote.update(_write(b, "b", 12))
            _drop_all(b)
            tier_b = b._tier
            assert tier_b is not None
            kinds = _kinds(tier_b.log)
            # A's own segments, from before B's claims, were dropped by B.
            theirs = [seq for seq in range(a_next or 0) if kinds[seq] == "dropped"
                      and tier_b.log.read(seq)["epoch"] != tier_a.log.epoch]
            assert theirs, kinds
            assert kinds[a_next or 0] == "claim"  # the restore's claim: A's next number
        # A wakes and writes its next record: the claim there refuses it.
        t = Transaction(s, "v")
        t.write("late", b"late")
        with pytest.raises(StrataError):
            t.commit()
            tier_a.flush()
        with pytest.raises(Fenced):
            tier_a.log.append("segment", chunks=[])
    finally:
        try:
            s.close()
        except StrataError:
            pass
    restore(bucket_url, str(tmp_path / "c"), key=key)
    with LocalStore(str(tmp_path / "c")) as c:
        t = Transaction(c, "v")
        assert all(t.read(name) == data for name, data in wrote.items())
        assert t.lookup("late") is None


def test_a_store_that_lost_its_place_finds_where_dropping_reached(tmp_path: Path) -> None:
    """tier.json without `dropped_to` (a restore, or an older strata): search down, once."""
    store = tmp_path / "a"
    init_store(str(store), bucket=f"file://{tmp_path}/bucket", pack_size_limit=MiB)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        _write(s, "f", 8)
        _drop_all(s)
        assert s._tier is not None
        reached = s._tier._dropped_to
    state = json.loads((store / TIER_STATE).read_bytes())
    assert state["dropped_to"] == reached
    del state["dropped_to"]
    (store / TIER_STATE).write_text(json.dumps(state))
    with LocalStore(str(store)) as s:
        tier = s._tier
        assert tier is not None and tier._dropped_to is None
        _write(s, "g", 8)
        _drop_all(s)
        assert tier._dropped_to is not None and tier._dropped_to >= (reached or 0)
        kinds = _kinds(tier.log)
        assert all(kinds[seq] != "segment" or tier.bucket.size(log_name(seq)) < DROP_MIN
                   for seq in range(tier._dropped_to))


def test_a_dropped_segment_where_a_restore_needs_one_is_an_error(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    store = tmp_path / "a"
    init_store(str(store), bucket=url, pack_size_limit=MiB)
    s = LocalStore(str(store))
    try:
        s.create_volume("v")
        _write(s, "f", 2)
        tier = s._tier
        assert tier is not None and tier._thread is not None
        tier.flush()
        tier._stop.set()  # no background checkpoint from here: as if the owner died
        tier._thread.join()
        _write(s, "g", 1)  # shipped past the checkpoint: a restore replays it
        seq = (tier.log.next or 1) - 1
        assert tier.log.read(seq)["kind"] == "segment"
        tier.log.drop(seq, 1, "broken")  # as only a broken owner would
        with pytest.raises(Corrupt, match=f"{log_name(seq)}.*dropped"):
            restore(url, str(tmp_path / "b"), key=read_key_file(str(store / KEY_FILE)))
    finally:
        try:
            s.close()
        except StrataError:
            pass


def test_garbage_collection_does_not_hold_log_from_back(tmp_path: Path) -> None:
    """A pack GC removed holds no segment a restore needs: `log_from` moves on.

    It used to stay at the removed pack's first segment for good, so every
    restore after a collection replayed the log from there (the whole history).
    """
    store = tmp_path / "a"
    init_store(str(store), bucket=f"file://{tmp_path}/bucket", pack_size_limit=MiB)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        for _ in range(12):
            t = Transaction(s, "v")
            t.write("big", os.urandom(600_000))
            t.commit()
        tier = s._tier
        assert tier is not None
        tier.flush()
        before = tier.log.next or 0
        s.policies.set("v", None, keep_last=1)
        s.gc(min_age=0)
        assert s.gc(min_age=0)["packs_deleted"]
        for i in range(3):
            t = Transaction(s, "v")
            t.write(f"x{i}", b"y")
            t.commit()
            tier.flush()
        cp = Checkpoint.decode(tier._cp_name or "", tier.bucket.get(tier._cp_name or ""))
        assert cp.log_from >= before, (cp.log_from, before)
