"""The bucket goes away, or stutters: the store keeps its promises.

moto on loopback behind the tests' fault proxy, which answers 503 for every
request (an outage) or 500/429 for every other one (a bad minute).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketutil import BUCKET, FaultProxy, Moto
from strata.engine.errors import Unavailable
from strata.engine.local import LocalStore, init_store
from strata.engine.seal import KEY_FILE, read_key_file
from strata.engine.tier import restore
from strata.engine.txn import Transaction


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultProxy]:
    m = Moto(tmp_path_factory.mktemp("moto")).start()
    p = FaultProxy(m.port).start()
    old = {k: os.environ.get(k) for k in m.env()}
    os.environ.update(m.env(p.endpoint))
    try:
        yield p
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        p.stop()
        m.stop()


@pytest.fixture(autouse=True)
def healthy(proxy: FaultProxy) -> Iterator[None]:
    proxy.fail_status = None
    proxy.fail_every = 1
    yield
    proxy.fail_status = None


def _publish(s: LocalStore, path: str) -> None:
    t = Transaction(s, "v")
    t.write(path, path.encode() * 100)
    t.commit()


def _all_there(url: str, tmp: Path, paths: list[str]) -> None:
    """Lose host a's disk (its key kept), restore into b: every path reads back."""
    key = read_key_file(str(tmp / "a" / KEY_FILE))
    shutil.rmtree(tmp / "a")
    store = tmp / "b"
    restore(url, str(store), key=key)
    with LocalStore(str(store)) as s:
        t = Transaction(s, "v")
        for p in paths:
            assert t.read(p) == p.encode() * 100, p
        assert s.fsck()["ok"]


def test_the_default_mode_publishes_through_an_outage_and_catches_up(
        proxy: FaultProxy, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/{tmp_path.name}"
    init_store(str(tmp_path / "a"), bucket=url)
    done: list[str] = []
    with LocalStore(str(tmp_path / "a")) as s:
        s.create_volume("v")
        _publish(s, "before")
        done.append("before")
        proxy.fail_status = 503
        t0 = time.monotonic()
        assert s._tier is not None
        # At least 2 s of publishing, and until the tier met the outage (an upload or
        # checkpoint in flight when it began retries for a few seconds first).
        while (time.monotonic() - t0 < 2.0
               or (not s._tier.stats["outages"] and time.monotonic() - t0 < 30.0)):
            path = f"during-{len(done)}"
            _publish(s, path)  # acknowledged from the local disk, as always
            done.append(path)
            time.sleep(0.01)
        assert s._tier.stats["outages"] > 0
        proxy.fail_status = None
        deadline = time.monotonic() + 30
        while s._tier.report()["unshipped_bytes"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s._tier.report()["unshipped_bytes"] == 0, s._tier.report()
        assert s._tier.failed is None
    _all_there(url, tmp_path, done)


def test_strict_mode_answers_unavailable_and_loses_nothing(
        proxy: FaultProxy, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/{tmp_path.name}"
    init_store(str(tmp_path / "a"), bucket=url, sync="bucket")
    with LocalStore(str(tmp_path / "a")) as s:
        s.create_volume("v")
        _publish(s, "before")
        proxy.fail_status = 503
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="bucket"):
            _publish(s, "during")
        waited = time.monotonic() - t0
        assert waited < 20, waited
        proxy.fail_status = None
        _publish(s, "after")  # the store goes on once the bucket is back
    _all_there(url, tmp_path, ["before", "after"])


@pytest.mark.parametrize("status", [500, 429])
def test_bursts_of_errors_are_retried(proxy: FaultProxy, tmp_path: Path, status: int) -> None:
    url = f"s3://{BUCKET}/{tmp_path.name}"
    init_store(str(tmp_path / "a"), bucket=url, sync="bucket")
    paths = [f"f{i}" for i in range(30)]
    with LocalStore(str(tmp_path / "a")) as s:
        s.create_volume("v")
        proxy.fail_status, proxy.fail_every = status, 2
        for p in paths:
            _publish(s, p)  # every other request fails; each publish still lands
        proxy.fail_status = None
    _all_there(url, tmp_path, paths)
