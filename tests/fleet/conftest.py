"""Fixtures for the fleet tests: moto on loopback and a fleet prefix per test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from bucketutil import BUCKET, Moto  # noqa: E402


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    m = Moto(tmp_path_factory.mktemp("moto")).start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def fleet_url(moto: Moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{BUCKET}/{tmp_path.name}"
