"""Garbage collection on a store kept in a bucket: packs leave the bucket only when safe.

A pack that GC emptied is deleted locally, drops out of the next checkpoint,
and its bucket object is deleted only after a checkpoint without it is in
the log: a restore reads the newest checkpoint, so it never needs the pack.
A restore after collection reads every kept snapshot back.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from strata.engine.local import LocalStore, init_store
from strata.engine.tier import restore
from strata.engine.txn import Transaction

MiB = 1 << 20


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
    shutil.rmtree(store)
    restore(bucket_url, str(tmp_path / "b"))
    with LocalStore(str(tmp_path / "b")) as s:
        t = Transaction(s, "v")
        assert t.read("big") == want and t.read("keep") == b"kept"
        report = s.fsck()
        assert report["ok"], {k: v for k, v in report.items() if k not in ("packs", "records")}
