"""SIGKILL at random points of garbage collection and compaction; then everything kept reads.

`gc_worker.py` publishes and collects in a loop (min age 0, so deletions and
compactions happen all the time) and is killed at random moments, five
times. After each kill the store opens, fsck is clean, and the head's every
file matches the version its manifest names. With a bucket, the store is
then lost and restored: no object the newest checkpoint needs was deleted.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gc_worker import content
from strata.engine.local import LocalStore, init_store
from strata.engine.tier import restore
from strata.engine.txn import Transaction

WORKER = str(Path(__file__).resolve().parent / "gc_worker.py")


def _check(store: Path) -> int:
    with LocalStore(str(store)) as s:
        report = s.fsck()
        assert report["ok"], report
        if "v" not in s.list_volumes():
            return 0
        t = Transaction(s, "v")
        names = {n for n, _e in t.listdir("")}
        if "manifest" not in names:
            return 0
        manifest = dict(x.split("=") for x in t.read("manifest").decode().split())
        for path, v in manifest.items():
            assert t.read(path) == content(path, int(v)), (path, v)
        return len(s.log(s.head("v", "live")))


@pytest.mark.parametrize("bucket", [False, True])
def test_kills_during_gc_lose_nothing_kept(tmp_path: Path, bucket: bool) -> None:
    store = tmp_path / "s"
    url = f"file://{tmp_path}/bucket" if bucket else None
    init_store(str(store), pack_size_limit=1 << 20, bucket=url)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    acks = 0
    for r in range(5):
        proc = subprocess.Popen([sys.executable, WORKER, str(store), str(seed + r)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.8, 2.5))
        proc.kill()
        out, err = proc.communicate()
        acks += out.count(b"ack ")
        assert proc.returncode == -9, err.decode(errors="replace")[-2000:]
        _check(store)
    assert acks > 10, (seed, acks)
    if bucket:
        from strata.engine.seal import KEY_FILE, read_key_file
        with LocalStore(str(store)) as s:
            want = Transaction(s, "v").read("manifest")
        key = read_key_file(str(store / KEY_FILE))  # kept apart from the disk, as a user would
        shutil.rmtree(store)  # the disk is lost: only the bucket is left
        restore(url or "", str(tmp_path / "r"), key=key)
        _check(tmp_path / "r")
        with LocalStore(str(tmp_path / "r")) as s:
            assert Transaction(s, "v").read("manifest") == want
