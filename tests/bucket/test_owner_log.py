"""The bucket's owner log: fencing two owners apart with create-only writes.

The same contract runs on a local directory (file://) and on a real S3
server (moto, on loopback).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bucketutil import BUCKET, FaultProxy, Moto
from strata.engine.bucket import (
    HINT,
    Bucket,
    Fenced,
    NoConditionalWrites,
    OwnerLog,
    log_name,
)
from strata.engine.errors import Corrupt, NotFound


@pytest.fixture
def bucket(bucket_url: str) -> Bucket:
    return Bucket(bucket_url)


def test_the_backend_honours_create_only_writes(bucket: Bucket) -> None:
    bucket.check_conditional()


def test_a_backend_that_ignores_if_none_match_is_refused(
        moto: Moto, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    proxy = FaultProxy(moto.port).start()
    try:
        proxy.drop_headers = {"if-none-match"}
        for k, v in moto.env(proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        with pytest.raises(NoConditionalWrites, match="ignores If-None-Match"):
            Bucket(f"s3://{BUCKET}/{tmp_path.name}").check_conditional()
    finally:
        proxy.stop()


def test_a_takeover_fences_the_old_owner_at_its_next_write(bucket: Bucket) -> None:
    old = OwnerLog(bucket)
    e1 = old.claim("host-a")
    assert old.append("group", frames=b"one") == e1 + 1
    new = OwnerLog(bucket)
    e2 = new.claim("host-b")
    assert e2 == e1 + 2
    with pytest.raises(Fenced, match=f"epoch {e2}"):
        old.append("group", frames=b"lost")
    with pytest.raises(Fenced):  # and it stays fenced
        old.append("group", frames=b"lost again")
    assert new.append("group", frames=b"two") == e2 + 1
    kinds = [(body["kind"], body["epoch"], body.get("frames"))
             for _seq, body in OwnerLog(bucket).records(0)]
    assert kinds == [("claim", e1, None), ("group", e1, b"one"), ("claim", e2, None),
                     ("group", e2, b"two")]


def test_an_idle_owner_finds_its_successor_without_writing(bucket: Bucket) -> None:
    old = OwnerLog(bucket)
    old.claim("host-a")
    old.check_owner()  # nobody else: nothing happens
    e2 = OwnerLog(bucket).claim("host-b")
    with pytest.raises(Fenced, match=f"epoch {e2}"):
        old.check_owner()
    with pytest.raises(Fenced):
        old.append("group", frames=b"lost")


def test_the_end_of_the_log_is_found_from_any_hint(bucket: Bucket) -> None:
    log = OwnerLog(bucket)
    assert log.find_end() == 0
    log.claim()
    for i in range(40):
        log.append("group", frames=bytes([i]))
    assert log.next == 41
    for hint in (b"0", b"7", b"40", b"1000", b"junk"):
        bucket.put(HINT, hint)
        assert OwnerLog(bucket).find_end() == 41, hint
    bucket.delete(HINT)
    assert OwnerLog(bucket).find_end() == 41


def test_a_write_whose_answer_was_lost_finds_its_own_record(
        moto: Moto, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A PUT that landed but whose answer was lost counts as written, not as a takeover.

    The resent PUT finds the name taken by its own bytes.
    """
    proxy = FaultProxy(moto.port).start()
    try:
        for k, v in moto.env(proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        log = OwnerLog(Bucket(f"s3://{BUCKET}/{tmp_path.name}"))
        log.claim()
        proxy.lose_answers = 1
        seq = log.append("group", frames=b"x")
        assert proxy.lose_answers == 0
        assert log.append("group", frames=b"y") == seq + 1
        assert [b.get("frames") for _s, b in log.records(seq)] == [b"x", b"y"]
    finally:
        proxy.stop()


def test_a_damaged_or_missing_record_is_an_error_naming_it(bucket: Bucket) -> None:
    log = OwnerLog(bucket)
    log.claim()
    seq = log.append("group", frames=b"payload")
    good = bucket.get(log_name(seq))
    bucket.put(log_name(seq), good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(Corrupt, match=log_name(seq)):
        log.read(seq)
    bucket.put(log_name(seq), b"junk")
    with pytest.raises(Corrupt, match=log_name(seq)):
        log.read(seq)
    with pytest.raises(NotFound, match=log_name(seq + 5)):
        log.read(seq + 5)
