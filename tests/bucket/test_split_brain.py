"""Two owners of one bucket store, on two "hosts" (network namespaces), and `serve --bucket`.

Host A serves the store, kept in moto on a third namespace, in strict mode
(`--sync bucket`). Its network is cut while a client keeps publishing; host
B then takes the store over with `serve --bucket URL --takeover`, restoring
it without a download, and serves publishes of its own. When A's network
comes back, A's next bucket write finds B's claim, A refuses the publish it
was holding, and its server stops (exit code 1, Fenced). Everything either of them
acknowledged is in B's store, and fsck is clean.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketutil import BUCKET, Moto
from netnsutil import Hosts
from serverutil import Server, cli
from strata.engine.errors import StrataError
from strata.engine.txn import Transaction

pytestmark = pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2")


def content(path: str) -> bytes:
    return random.Random(path).randbytes(5_000) + path.encode()


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[Hosts, Moto]]:
    with Hosts(["a", "b"]) as h:
        moto = Moto(tmp_path, netns=h.bucket_ns, address=h.bucket_address["test"]).start()
        try:
            yield h, moto
        finally:
            moto.stop()


class Publisher:
    """Publishes one file per commit to a server until stopped; records what was acked."""

    def __init__(self, server: Server, prefix: str) -> None:
        self.server, self.prefix = server, prefix
        self.acked: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            path = f"{self.prefix}{i:04d}"
            i += 1
            try:
                with self.server.remote(retry_for=0.0) as remote:
                    t = Transaction(remote, "v")
                    t.write(path, content(path))
                    t.commit()
                self.acked.append(path)
            except (StrataError, OSError) as exc:
                self.errors.append(f"{path}: {exc}")
                time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(60)


def test_split_brain_the_old_owner_is_fenced_and_nothing_acknowledged_is_lost(
        hosts: tuple[Hosts, Moto], tmp_path: Path) -> None:
    h, moto = hosts
    url = f"s3://{BUCKET}/split"
    a_dir, b_dir = tmp_path / "host-a", tmp_path / "host-b"
    a = Server(a_dir, args=("--bucket", url, "--sync", "bucket"), prefix=h.exec_prefix("a"),
               env=moto.env(f"http://{h.bucket_address['a']}:{moto.port}"))
    b = Server(b_dir, args=("--bucket", url, "--takeover", "--sync", "bucket",
                            "--key-file", str(a_dir / "bucket.key")),
               prefix=h.exec_prefix("b"),
               env=moto.env(f"http://{h.bucket_address['b']}:{moto.port}"))
    try:
        a.start(timeout=40)
        assert b"created" in a.log.read_bytes()
        with a.remote(retry_for=5.0) as owner:
            owner.create_volume("v")
        pub_a = Publisher(a, "a")
        time.sleep(2.0)
        h.cut("a")  # A keeps running, but cannot reach the bucket
        acked_before_cut = len(pub_a.acked)
        time.sleep(1.0)
        t0 = time.monotonic()
        b.start(timeout=60)  # restores from the bucket, fencing A
        takeover = time.monotonic() - t0
        assert b"restored" in b.log.read_bytes()
        pub_b = Publisher(b, "b")
        time.sleep(2.0)
        h.heal("a")  # A's next bucket write meets B's claim
        assert a.proc is not None
        rc = a.proc.wait(60)
        pub_a.stop()
        time.sleep(1.0)
        pub_b.stop()
        assert rc == 1, a.log.read_text(errors="replace")
        assert "taken over" in a.log.read_text(errors="replace")
        print(f"A acknowledged {len(pub_a.acked)} ({acked_before_cut} before its network "
              f"was cut), B {len(pub_b.acked)}; takeover (restore + serve) {takeover:.2f} s")
        assert acked_before_cut >= 3 and len(pub_b.acked) >= 3, (pub_a.errors, pub_b.errors)
        # Strict mode: A acknowledged nothing it could not put in the bucket.
        with b.remote(retry_for=5.0) as remote:
            t = Transaction(remote, "v")
            for path in pub_a.acked + pub_b.acked:
                assert t.read(path) == content(path), path
        p = cli("fsck", "--json", store=b_dir)
        assert p.returncode == 0, p.stdout[-2000:]
        # The old store refuses to start again as an owner: it was taken over.
        p = subprocess.run([*h.exec_prefix("a"), sys.executable, "-m", "strata", "serve",
                            "--store", str(a_dir), "--bucket", url],
                           capture_output=True, timeout=60,
                           env={**moto.env(f"http://{h.bucket_address['a']}:{moto.port}"),
                                "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        assert p.returncode != 0 and b"taken over" in p.stderr, p.stderr[-2000:]
    finally:
        a.kill()
        b.kill()


def test_serve_bucket_refuses_a_held_store_without_takeover(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    a = Server(tmp_path / "a", args=("--bucket", url))
    try:
        a.start()
        assert cli("volume", "create", "v", store=tmp_path / "a").returncode == 0
        p = cli("serve", "--bucket", url, store=tmp_path / "b")
        assert p.returncode != 0 and b"--takeover" in p.stderr, p.stderr
        assert not (tmp_path / "b" / "STRATA").exists()
        p = cli("serve", "--bucket", f"file://{tmp_path}/other", store=tmp_path / "a")
        assert p.returncode != 0 and b"not file://" in p.stderr, p.stderr
    finally:
        a.kill()
