"""SIGKILL at random points of shipping, uploading, checkpointing and evicting; then the disk.

A bucket store with small packs and a cache budget keeps all of its
background work busy: segments twice a second, a pack sealed and uploaded
every megabyte, a checkpoint every two seconds, eviction once the budget is
passed. A server on it is killed at random moments, several times, and
started again on the same disk: nothing acknowledged may be missing. Then
the disk is lost and the store restored from the bucket: in strict mode
everything acknowledged is there; in the default mode everything but the
last few seconds before the final kill. fsck is clean throughout.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import pytest

from bucketutil import BUCKET, Moto, Publisher, key_of, survivors
from serverutil import Server
from strata.engine.bucket import Bucket, BucketKey, OwnerLog
from strata.engine.local import init_store
from strata.engine.tier import restore

ROUNDS = 4


@pytest.mark.parametrize("sync", ["local", "bucket"])
def test_random_kills_then_a_lost_disk(moto: Moto, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path, sync: str) -> None:
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{BUCKET}/{tmp_path.name}"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    store = tmp_path / "host-a"
    init_store(str(store), bucket=url, sync=sync, pack_size_limit=1 << 20,
               cache_size=16 << 20)
    acked: list[tuple[str, float]] = []
    killed = 0.0
    for r in range(ROUNDS + 1):
        server = Server(store).start(timeout=60)
        try:
            if r == 0:
                with server.remote(retry_for=5.0) as owner:
                    owner.create_volume("v")
            pub = Publisher(server, f"r{r}-", size=60_000)
            try:
                pub.run_for(rng.uniform(0.5, 3.5))
                assert server.proc is not None
                server.proc.kill()
                killed = time.monotonic()
                server.proc.wait()
            finally:
                pub.stop()
            acked += [(p, t) for p, t in pub.acked if t <= killed]
        finally:
            server.kill()
        # SIGKILL keeps the disk: the same store opens and holds every acknowledged file.
        kept = survivors(store, acked, 60_000)
        assert len(kept) == len(acked), (seed, r, len(acked) - len(kept))
    assert len(acked) > 50, acked
    local_bytes = sum(p.stat().st_size for p in (store / "packs").glob("*.pack"))
    key = key_of(store)  # kept away from the host, as its owner must
    shutil.rmtree(store)  # the disk is lost
    report = restore(url, str(tmp_path / "host-b"), key=key)
    # The kills also landed among segments being dropped (engine/tierdrop.py): the
    # restore above read past them, and they are there to read past.
    log = OwnerLog(Bucket(url, BucketKey(key)))
    dropped = sum(body["kind"] == "dropped" for _seq, body in log.read_many(range(log.find_end())))
    assert dropped > 0, seed
    got = survivors(tmp_path / "host-b", acked, 60_000)
    lost = [p for p, t in acked if (p, t) not in got]
    print(f"seed {seed} sync={sync}: {len(acked)} acknowledged over {ROUNDS + 1} kills, "
          f"{len(lost)} lost with the disk; local packs {local_bytes >> 20} MiB at the end; "
          f"restore {report['seconds'] * 1000:.0f} ms")
    if sync == "bucket":
        assert lost == [], (seed, lost[:5])
    else:
        # Only the last moments before the final kill may be missing, and as a suffix.
        assert all(t > killed - 5.0 for p, t in acked if p in lost), (seed, lost[:5])
        assert [p for p, _t in acked[len(acked) - len(lost):]] == lost, seed
