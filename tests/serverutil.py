"""Real `strata serve` processes for tests: start, wait until they answer, stop, kill.

A server here is always a separate process started with this interpreter
(`python -m strata serve`), listening on a unix socket (the owner's way in)
and optionally on a TCP port of loopback. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from strata.server.client import RemoteStore, default_socket, is_serving
from strata_harness import STRATA


def peak_rss(pid: int) -> int:
    """A process's peak resident set (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def reset_peak(pid: int) -> None:
    """Start a process's peak resident set again from its current one."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One `strata serve` process on `store_dir` (the store must exist)."""

    def __init__(self, store_dir: Path, *, tcp_port: int | None = None,
                 args: tuple[str, ...] = (), prefix: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.store_dir = store_dir
        self.sock = default_socket(str(store_dir))
        self.tcp_port = tcp_port
        self.args = args      # more `serve` options
        self.prefix = prefix  # e.g. ("ip", "netns", "exec", NAME): serve on another "host"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = store_dir.parent / f"{store_dir.name}-serve.log"

    @property
    def unix_url(self) -> str:
        return f"unix:{self.sock}"

    @property
    def tcp_url(self) -> str:
        assert self.tcp_port is not None
        return f"http://127.0.0.1:{self.tcp_port}"

    def start(self, timeout: float = 20.0) -> Server:
        cmd = [*self.prefix, *STRATA, "serve", "--store", str(self.store_dir),
               "--listen", self.unix_url, *self.args]
        if self.tcp_port is not None:
            cmd += ["--listen", f"tcp:127.0.0.1:{self.tcp_port}"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True,
                                         env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # The socket appears under its path only once the store is open.
            if is_serving(self.sock):
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"strata serve exited with {self.proc.returncode}:\n"
                                   + self.log.read_text(errors="replace"))
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"strata serve did not answer within {timeout:g}s:\n"
                           + self.log.read_text(errors="replace"))

    def remote(self, **kw: float) -> RemoteStore:
        return RemoteStore(self.unix_url, **kw)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then wait; SIGKILL only if it will not go. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        return rc

    def kill(self) -> None:
        """SIGKILL: no draining, no cleanup, as a crash."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None


@contextmanager
def served_volume(store_dir: Path, volume: str = "v", *flags: str
                  ) -> Iterator[tuple[Server, str]]:
    """A new store with one volume, served over unix and TCP, and a token for it (--rw)."""
    from strata.engine.local import init_store
    init_store(str(store_dir))
    server = Server(store_dir, tcp_port=free_port()).start()
    try:
        assert cli("volume", "create", volume, store=store_dir).returncode == 0
        p = cli("token", "create", volume, *(flags or ("--rw",)), "--json", store=store_dir)
        assert p.returncode == 0, p.stderr
        yield server, str(json.loads(p.stdout)["token"])
    finally:
        server.stop()


def cli(*args: str, server: str | None = None, token: str | None = None,
        store: Path | None = None, input: bytes | None = None,
        timeout: float = 60.0) -> subprocess.CompletedProcess[bytes]:
    """Run `strata ARGS` as a process; global options first."""
    cmd = list(STRATA)
    if store is not None:
        cmd += ["--store", str(store)]
    if server is not None:
        cmd += ["--server", server]
    if token is not None:
        cmd += ["--token", token]
    env = {k: v for k, v in os.environ.items()
           if k not in ("STRATA_SERVER", "STRATA_TOKEN", "STRATA_STORE", "STRATA_IN_PROCESS")}
    return subprocess.run([*cmd, *args], input=input, capture_output=True, timeout=timeout,
                          env=env)
