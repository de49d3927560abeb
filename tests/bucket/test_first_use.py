"""A bucket store, as a new user met it: failures say why at once.

`init --bucket` on a prefix that already held a store printed success, and
every later command waited 15 s for a server that had exited with the real
cause in serve.log. A store fenced by a takeover behaved the same way.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bucketutil import BUCKET, Moto
from serverutil import Server, cli


def test_init_refuses_a_prefix_that_holds_a_store(tmp_path: Path, bucket_url: str) -> None:
    assert cli("init", "--bucket", bucket_url, store=tmp_path / "a").returncode == 0
    p = cli("init", "--bucket", bucket_url, store=tmp_path / "b")
    assert p.returncode != 0 and b"holds a store already" in p.stderr, p.stderr
    assert not (tmp_path / "b" / "STRATA").exists()


def test_a_fenced_store_says_so_at_once(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli("init", "--bucket", url, store=a).returncode == 0
    assert cli("volume", "create", "v", store=a).returncode == 0  # starts a's server
    assert cli("serve", "--stop", store=a).returncode == 0
    taker = Server(b, args=("--bucket", url, "--takeover", "--key-file",
                            str(a / "bucket.key")))
    taker.start()
    taker.stop()
    t0 = time.monotonic()
    p = cli("ls", "v", store=a)
    took = time.monotonic() - t0
    assert p.returncode != 0 and b"could not start" in p.stderr, p.stderr
    assert b"did not start within" not in p.stderr and took < 10, (took, p.stderr)


def test_bucket_errors_are_one_line_that_says_what_to_do(tmp_path: Path, moto: Moto,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """They were ~30 lines of Rust debug output (`builder error ... BadScheme`)."""
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    p = cli("init", "--bucket", f"s3://{BUCKET}/plain-http", store=tmp_path / "a")
    assert p.returncode != 0 and len(p.stderr.decode().strip().splitlines()) == 1, p.stderr
    assert b"AWS_ALLOW_HTTP" in p.stderr
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    p = cli("init", "--bucket", "s3://no-such-bucket-here/x", store=tmp_path / "b")
    assert p.returncode != 0 and len(p.stderr.decode().strip().splitlines()) == 1, p.stderr
    assert b"does not exist" in p.stderr
