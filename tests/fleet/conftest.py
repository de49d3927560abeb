"""Fixtures for the fleet tests: moto on loopback and a fleet prefix per test."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fleetutil import Fleet  # noqa: E402

from bucketutil import BUCKET, Moto  # noqa: E402


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    m = Moto(tmp_path_factory.mktemp("moto")).start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(autouse=True)
def fleet_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """The fleet's shared secret, for the members and clients a test starts."""
    token = secrets.token_hex(16)
    monkeypatch.setenv("STRATA_FLEET_TOKEN", token)
    return token


@pytest.fixture
def fleet_url(moto: Moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{BUCKET}/{tmp_path.name}"


@pytest.fixture
def fleet(moto: Moto, fleet_url: str, tmp_path: Path) -> Iterator[Fleet]:
    """Members added by the test, all stopped after it."""
    f = Fleet(fleet_url, tmp_path, moto.env())
    try:
        yield f
    finally:
        f.close()
