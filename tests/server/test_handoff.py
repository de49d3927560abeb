"""Handing the store from one `strata serve` to the next under load, as real processes.

Four client processes (`handoff_client.py`) publish and read in a steady loop
through the remote store while `strata serve --takeover` replaces the owner,
three times in a row. No client call may fail, every publish a client saw
acknowledged must be in the store afterwards with the content it sent, and
fsck must pass. Also: a second `serve` without `--takeover` is refused at once
naming the owner and leaves it serving; `serve --stop` stops it; and the same
handoff over TCP with a token.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from strata.engine.local import LocalStore, init_store
from strata.engine.txn import Transaction
from strata.server.client import RemoteStore, default_socket, is_serving

PY = sys.executable
CLIENT = str(Path(__file__).with_name("handoff_client.py"))
CLIENTS = 4
GAP = re.compile(r"took over the store; requests waited (\d+) ms")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _wait(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


class Server:
    """One `strata serve` process, its stderr kept in a file."""

    def __init__(self, store: Path, log: Path, *extra: str) -> None:
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [PY, "-m", "strata", "serve", "--store", str(store), *extra],
                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=_env())

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 20.0) -> None:
        # on_ready runs once the store is open and requests are served.
        _wait(lambda: "strata: serving" in self.text() or self.proc.poll() is not None,
              timeout, f"server {self.proc.pid} to serve")
        assert self.proc.poll() is None, f"server exited early:\n{self.text()}"

    def wait_exit(self, timeout: float = 30.0) -> int:
        # Generous: closing the store fsyncs, and on a disk shared with busy
        # neighbours one fsync has been seen to take seconds.
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server {self.proc.pid} did not exit:\n{self.text()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class Clients:
    """N client processes, each printing ACK lines to its own file."""

    def __init__(self, tmp: Path, url: str, token: str | None = None, n: int = CLIENTS) -> None:
        self.stop_file = tmp / "stop-clients"
        self.outs = [tmp / f"client{i}.out" for i in range(n)]
        self.procs = []
        for i, out in enumerate(self.outs):
            cmd = [PY, CLIENT, "--url", url, "--client", str(i), "--stop", str(self.stop_file)]
            if token:
                cmd += ["--token", token]
            with open(out, "wb") as f:
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f,
                                                   stderr=subprocess.STDOUT, env=_env()))

    def acks(self) -> list[int]:
        return [sum(line.startswith("ACK ") for line in out.read_text(errors="replace")
                    .splitlines()) for out in self.outs]

    def wait_progress(self, at_least: list[int], timeout: float = 20.0) -> None:
        """Wait until every client has acknowledged more publishes than `at_least`."""
        def moved() -> bool:
            self.check_alive()
            return all(a >= b + 3 for a, b in zip(self.acks(), at_least, strict=True))
        _wait(moved, timeout, f"every client to publish (acks {self.acks()}, were {at_least})")

    def check_alive(self) -> None:
        for p, out in zip(self.procs, self.outs, strict=True):
            if p.poll() is not None:
                raise AssertionError(f"client exited early ({p.returncode}):\n"
                                     f"{out.read_text(errors='replace')[-3000:]}")

    def finish(self, timeout: float = 30.0) -> tuple[list[tuple[str, str, str]], list[str]]:
        """Stop the clients; return every acknowledged (snapshot, path, sha256) and DONE line."""
        self.stop_file.touch()
        acked, done = [], []
        for p, out in zip(self.procs, self.outs, strict=True):
            rc = p.wait(timeout)
            text = out.read_text(errors="replace")
            errs = [line for line in text.splitlines() if line.startswith("ERR")]
            assert rc == 0 and not errs, f"client failed ({rc}):\n" + "\n".join(errs[:20])
            last = text.splitlines()[-1]
            assert last.startswith("DONE ") and " errors=0 " in last, last
            done.append(last)
            for line in text.splitlines():
                if line.startswith("ACK "):
                    _ack, sid, path, digest = line.split()
                    acked.append((sid, path, digest))
        return acked, done

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "s"
    init_store(str(path))
    with LocalStore(str(path)) as s:
        s.create_volume("v")
    yield path


def _verify(store: Path, acked: list[tuple[str, str, str]]) -> None:
    """Every acknowledged publish is in its snapshot and in the head; fsck passes."""
    assert acked
    with LocalStore(str(store)) as s:
        head = Transaction(s, "v")
        for sid, path, digest in acked:
            at_ack = Transaction(s, "v", base=sid).read(path)
            assert hashlib.sha256(at_ack).hexdigest() == digest, (sid, path)
            assert hashlib.sha256(head.read(path)).hexdigest() == digest, path
        report = s.fsck()
    assert report["ok"], report


def _strata(store: Path, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "strata", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=timeout, env=_env())


def _handoffs(tmp: Path, store: Path, first: Server, clients: Clients, rounds: int,
              extra: tuple[str, ...]) -> list[Server]:
    """Replace the owner `rounds` times while the clients run; return every server."""
    servers = [first]
    for r in range(rounds):
        before = clients.acks()
        old = servers[-1]
        new = Server(store, tmp / f"serve{r + 1}.log", "--takeover", *extra)
        servers.append(new)
        rc = old.wait_exit()
        assert rc == 0, f"old owner exited {rc}:\n{old.text()}"
        assert "handed off" in old.text(), old.text()
        new.wait_ready()
        # The gap is reported as soon as the new owner serves, not when it exits.
        _wait(lambda srv=new: GAP.search(srv.text()) is not None, 5.0,
              "the gap to be reported")
        clients.wait_progress(before)  # through the new owner
    return servers


def _gaps(servers: list[Server]) -> list[int]:
    out = []
    for srv in servers[1:]:
        m = GAP.search(srv.text())
        assert m, f"no gap reported by a takeover:\n{srv.text()}"
        out.append(int(m.group(1)))
    return out


def test_handoff_under_load_three_times(tmp_path: Path, store: Path) -> None:
    sock = default_socket(str(store))
    first = Server(store, tmp_path / "serve0.log")
    servers = [first]
    clients = None
    try:
        first.wait_ready()
        clients = Clients(tmp_path, f"unix:{sock}")
        clients.wait_progress([0] * CLIENTS)
        servers = _handoffs(tmp_path, store, first, clients, 3, ())
        acked, done = clients.finish()
        stop = _strata(store, "serve", "--stop")
        assert stop.returncode == 0, stop.stderr
        assert servers[-1].wait_exit() == 0, servers[-1].text()
    finally:
        if clients is not None:
            clients.kill()
        for srv in servers:
            srv.kill()
    gaps = _gaps(servers)
    print(f"\nhandoff gaps reported by the new owners: {gaps} ms; clients: {done}")
    _verify(store, acked)


def test_second_serve_without_takeover_is_refused(tmp_path: Path, store: Path) -> None:
    sock = default_socket(str(store))
    owner = Server(store, tmp_path / "serve0.log")
    try:
        owner.wait_ready()
        inode = os.stat(sock).st_ino
        t0 = time.monotonic()
        second = _strata(store, "serve", timeout=20)
        took = time.monotonic() - t0
        assert second.returncode != 0
        assert f"process {owner.proc.pid}" in second.stderr, second.stderr
        assert took < 10, f"refusal took {took:.1f}s"
        # The owner is undisturbed: same socket file, still answering, still the owner.
        assert owner.proc.poll() is None
        assert os.stat(sock).st_ino == inode
        remote = RemoteStore(f"unix:{sock}", retry_for=0.0)
        try:
            assert remote.list_volumes() == ["v"]
        finally:
            remote.close()
        assert [p for p in os.listdir(store) if ".new-" in p] == []  # no stray socket
        stop = _strata(store, "serve", "--stop")
        assert stop.returncode == 0, stop.stderr
        assert owner.wait_exit() == 0, owner.text()
        assert not is_serving(sock)
        assert not os.path.exists(sock), "a stopped server leaves its socket behind"
        again = _strata(store, "serve", "--stop")
        assert again.returncode == 0 and "no server was running" in again.stderr
    finally:
        owner.kill()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_handoff_under_load_over_tcp(tmp_path: Path, store: Path) -> None:
    # Only a TCP listener is named: the store's unix socket is served as well,
    # since --takeover and --stop reach the owner through it.
    listen = ("--listen", f"tcp:127.0.0.1:{_free_port()}")
    port = listen[1].rsplit(":", 1)[1]
    first = Server(store, tmp_path / "serve0.log", *listen)
    servers = [first]
    clients = None
    try:
        first.wait_ready()
        tok = _strata(store, "token", "create", "v", "--rw")
        assert tok.returncode == 0, tok.stderr
        token = tok.stdout.strip()
        assert token.startswith("strata_")
        clients = Clients(tmp_path, f"http://127.0.0.1:{port}", token)
        clients.wait_progress([0] * CLIENTS)
        servers = _handoffs(tmp_path, store, first, clients, 2, listen)
        acked, done = clients.finish()
        stop = _strata(store, "serve", "--stop")
        assert stop.returncode == 0, stop.stderr
        assert servers[-1].wait_exit() == 0, servers[-1].text()
    finally:
        if clients is not None:
            clients.kill()
        for srv in servers:
            srv.kill()
    gaps = _gaps(servers)
    print(f"\nTCP handoff gaps reported by the new owners: {gaps} ms; clients: {done}")
    _verify(store, acked)


def test_handoff_waits_for_a_running_fsck(tmp_path: Path, store: Path) -> None:
    # fsck reads every pack through the open store: a handoff must drain it like
    # any other request, not close the store under it ("store is closed").
    with LocalStore(str(store)) as s:
        t = Transaction(s, "v")
        for i in range(20_000):
            t.write(f"f{i}", os.urandom(4200))  # a block and a file node each
        t.commit()
    first = Server(store, tmp_path / "serve0.log")
    servers = [first]
    try:
        first.wait_ready()
        fsck = subprocess.Popen([PY, "-m", "strata", "--store", str(store), "fsck"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_env())
        time.sleep(0.3)  # fsck is under way (it takes a few seconds here)
        servers.append(Server(store, tmp_path / "serve1.log", "--takeover"))
        out, _ = fsck.communicate(timeout=60)
        assert fsck.returncode == 0 and out.startswith("ok:"), out
        assert first.wait_exit() == 0, first.text()
        servers[1].wait_ready()
        assert _strata(store, "serve", "--stop").returncode == 0
        assert servers[1].wait_exit() == 0
    finally:
        for srv in servers:
            srv.kill()
