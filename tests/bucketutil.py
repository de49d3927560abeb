"""A real S3-protocol server for tests: moto in server mode on loopback, plus a fault proxy.

`Moto` starts `python -m moto.server` on a free loopback port and creates a
bucket; `env()` gives the AWS_* variables that point obstore (and boto3) at
it. `FaultProxy` sits between a client and moto and can break what a real
network or a sloppy backend breaks; its first trick drops If-None-Match, as
a backend that ignores conditional writes would; its second forwards a PUT
and drops the answer, as a lost connection does; its third answers 500, 503
or 429 instead of forwarding (every request, or every n-th).
"""

from __future__ import annotations

import http.client
import http.server
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from serverutil import Server, free_port
from strata.engine.errors import StrataError
from strata.engine.local import LocalStore
from strata.engine.seal import KEY_FILE, read_key_file
from strata.engine.txn import Transaction

BUCKET = "strata-test"


class Moto:
    """moto on loopback; or, given `netns` and its address, on a host of the tests' own."""

    def __init__(self, log_dir: Path, *, netns: str | None = None,
                 address: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.log = log_dir / f"moto-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.netns = netns
        self.address = address

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def start(self) -> Moto:
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "moto.server",
                                          "-H", "0.0.0.0" if self.netns else "127.0.0.1",
                                          "-p", str(self.port)], stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((self.address, self.port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, self.log.read_text()
                assert self.proc.poll() is None, self.log.read_text()
                time.sleep(0.05)
        self.s3().create_bucket(Bucket=BUCKET)
        return self

    def s3(self) -> Any:
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test",
                            aws_secret_access_key="test", region_name="us-east-1")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


class FaultProxy:
    """An HTTP proxy in front of moto; set `drop_headers` to strip request headers."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.drop_headers: set[str] = set()
        self.lose_answers = 0  # forward this many PUTs, then drop their answers
        self.fail_status: int | None = None  # answer this instead of forwarding ...
        self.fail_every = 1                  # ... every this many requests (1: all)
        self._count = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                proxy._count += 1
                if proxy.fail_status is not None and proxy._count % proxy.fail_every == 0:
                    self.send_response(proxy.fail_status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in proxy.drop_headers}
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if self.command == "PUT" and proxy.lose_answers > 0:
                    proxy.lose_answers -= 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def key_of(store: Path) -> bytes:
    """The bucket key of a store (read it before the store's disk is lost)."""
    return read_key_file(str(store / KEY_FILE))


def set_env(env: dict[str, str]) -> None:
    os.environ.update(env)


# -- publishing through a server, and what survived -------------------------------------


def content(path: str, size: int = 20_000) -> bytes:
    """`size` bytes (20 KB) that do not compress, different for every path."""
    return random.Random(path).randbytes(size) + path.encode()


class Publisher:
    """Publishes one file per commit through the server's socket; notes each ack's time."""

    def __init__(self, server: Server, prefix: str, size: int = 20_000) -> None:
        self.server = server
        self.prefix = prefix
        self.size = size
        self.acked: list[tuple[str, float]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with self.server.remote(retry_for=0.0) as remote:
                i = 0
                while not self._stop.is_set():
                    path = f"{self.prefix}{i:05d}"
                    t = Transaction(remote, "v")
                    t.write(path, content(path, self.size))
                    t.commit()
                    self.acked.append((path, time.monotonic()))
                    i += 1
        except BaseException as exc:  # noqa: BLE001 - the server went away: recorded
            self.error = exc

    def run_for(self, seconds: float) -> None:
        self.thread.start()
        time.sleep(seconds)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)


def survivors(store: Path, acked: list[tuple[str, float]], size: int = 20_000
              ) -> list[tuple[str, float]]:
    """The acknowledged files that read back whole from `store` (which must fsck clean)."""
    with LocalStore(str(store)) as s:
        t = Transaction(s, "v")
        out = []
        for path, when in acked:
            try:
                if t.read(path) == content(path, size):
                    out.append((path, when))
            except StrataError:
                pass
        report = s.fsck()
        assert report["ok"], report
    return out


