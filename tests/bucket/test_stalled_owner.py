"""A stalled owner stays fenced while its successor merges runs and deletes what it no longer names.

SlateDB lost an acknowledged write this way (#1622): its garbage collection
deleted a stalled writer's next log slot, so the writer's create-only write
succeeded when it woke. strata deletes index parts, tables and checkpoints
that no checkpoint in the log names, and never a log record: the next free
record is the fence. It overwrites segments below the newest checkpoint's
`log_from` with small `dropped` records, and never a claim. Here the old
owner is stopped (SIGSTOP) in strict mode while a new owner restores the
store, publishes, checkpoints past several merges, deletes and drops the old
owner's segments; then the old owner wakes and is asked to publish. It
must acknowledge nothing, and every log record must still be there.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from bucketutil import BUCKET, Moto, Publisher, content, key_of, survivors
from serverutil import Server
from strata.engine.bucket import Bucket, BucketKey, OwnerLog, log_name
from strata.engine.checkpoint import FANOUT, runs_of
from strata.engine.errors import StrataError
from strata.engine.local import LocalStore, init_store
from strata.engine.tier import restore
from strata.engine.txn import Transaction


def test_a_stalled_owner_wakes_fenced_after_its_successor_deleted_old_objects(
        moto: Moto, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{BUCKET}/{tmp_path.name}"
    a = tmp_path / "host-a"
    init_store(str(a), bucket=url, sync="bucket", pack_size_limit=1 << 20)
    server = Server(a).start(timeout=60)
    try:
        with server.remote(retry_for=5.0) as owner:
            owner.create_volume("v")
        pub = Publisher(server, "a-", size=30_000)
        pub.run_for(1.5)
        pub.stop()
        acked = list(pub.acked)
        assert acked and pub.error is None
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)  # stalled, mid-life, holding the store
        key = key_of(a)
        b = tmp_path / "host-b"
        restore(url, str(b), key=key)  # claims the log: the old owner is fenced
        with LocalStore(str(b)) as s:
            assert s._tier is not None
            for k in range(2 * FANOUT + 2):
                t = Transaction(s, "v")
                t.write(f"b-{k}", content(f"b-{k}", 5000))
                t.commit()
                s.sync_index()
                s._tier.flush()
            s._tier._delete_doomed()
            while s._tier._dropped_to is None or s._tier._dropped_to < s._tier._drop_upto:
                s._tier._drop_some()  # and gives A's old segments' bytes back
            deleted = s._tier.stats["index_objects_deleted"]
            dropped = s._tier.stats["segments_dropped"]
            b_epoch = s._tier.log.epoch
            levels = [r[0].level for r in runs_of(s._tier._manifest)]
        assert deleted > 0 and max(levels) >= 1 and dropped > 0, (deleted, levels, dropped)
        os.kill(server.proc.pid, signal.SIGCONT)
        late: list[str] = []
        with server.remote(retry_for=0.0) as old:
            for i in range(5):
                try:
                    t = Transaction(old, "v")
                    t.write(f"late-{i}", content(f"late-{i}", 5000))
                    t.commit()
                    late.append(f"late-{i}")  # acknowledged: must never happen
                except StrataError:
                    pass
                except OSError:
                    break  # the old owner stopped serving
        assert late == []
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.proc.poll() is not None  # a fenced server stops
    finally:
        server.kill()
    bucket = Bucket(url, BucketKey(key))
    log = OwnerLog(bucket)
    end = log.find_end()
    assert all(bucket.exists(log_name(seq)) for seq in range(end))  # none deleted
    kinds = {seq: body for seq, body in log.read_many(range(end))}
    # A's segments B overwrote: small `dropped` records under the same numbers, and
    # every claim (each one a stalled owner's next number) as it was written.
    assert any(b["kind"] == "dropped" and b["epoch"] == b_epoch for b in kinds.values())
    assert all(kinds[b["epoch"]]["kind"] == "claim" for b in kinds.values()
               if b["kind"] != "dropped")
    got = survivors(tmp_path / "host-b", acked, 30_000)
    assert len(got) == len(acked)  # strict mode: every acknowledged publish of A is there
    with LocalStore(str(tmp_path / "host-b")) as s:
        t = Transaction(s, "v")
        assert t.read(f"b-{2 * FANOUT + 1}") == content(f"b-{2 * FANOUT + 1}", 5000)
        assert t.lookup("late-0") is None
