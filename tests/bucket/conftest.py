"""A real S3 server for the bucket tests (moto on loopback), and each test's bucket URL.

`bucket_url` runs a test on moto and on a local directory (file://): the
same contract on both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketutil import BUCKET, Moto


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    m = Moto(tmp_path_factory.mktemp("moto")).start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(params=["s3", "file"])
def bucket_url(request: pytest.FixtureRequest, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/bucket"
    moto: Moto = request.getfixturevalue("moto")
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{BUCKET}/{tmp_path.name}"
