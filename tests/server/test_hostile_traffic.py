"""Findings 6 and 9 of the hardening issue: compressed bodies and half-open requests.

Real `strata serve` processes over loopback TCP, with hostile traffic built
here byte by byte. Attackers connect from other loopback addresses
(127.0.0.2 and up: Linux routes all of 127/8 to lo), so the server tells
them from the token holder on 127.0.0.1 as it would tell hosts apart.

- A gzip body of 63 KiB that inflates to 63 MiB is refused (415) before it is read,
  eight at once, and the server does not grow.
- Requests whose headers or body stop arriving are cut off after the header
  and body timeouts.
- With the descriptor limit at 1,024, 1,100 connections from one peer, then
  1,260 from 21 peers, leave the token holder (after the first) and the
  owner's `strata ls` over the unix socket answered.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import resource
import select
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from serverutil import Server, cli, free_port, peak_rss, reset_peak, served_volume
from strata.engine.local import init_store
from strata.server.client import RemoteStore

MIB = 1024 * 1024
HEADER_TIMEOUT = 10.0  # serve.HEADER_TIMEOUT
BODY_TIMEOUT = 10.0    # app.BODY_TIMEOUT


def gzip_of_zeros(n: int) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    zeros = bytes(MIB)
    return b"".join([z.compress(zeros) for _ in range(n // MIB)] + [z.flush()])


def post(port: int, token: str, path: str, body: bytes, headers: dict[str, str]
         ) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream",
            **headers})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_compressed_body_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    """Finding 6: eight read-only `missing` requests with 63 KiB gzip bodies of 63 MiB."""
    bomb = gzip_of_zeros(63 * MIB)
    assert len(bomb) < 80 * 1024
    with served_volume(tmp_path / "s", "v", "--ro") as (server, token):
        assert server.proc is not None and server.tcp_port is not None
        pid, port = server.proc.pid, server.tcp_port
        time.sleep(0.2)
        reset_peak(pid)
        base = peak_rss(pid)
        answers: list[tuple[int, bytes]] = []

        def attack() -> None:
            answers.append(post(port, token, "/v1/objects/missing", bomb,
                                {"Content-Encoding": "gzip"}))

        threads = [threading.Thread(target=attack) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        grown = peak_rss(pid) - base
        print(f"peak growth under 8 gzip bodies: {grown // MIB} MiB")
        for status, body in answers:
            assert status == 415, (status, body[:200])
            assert json.loads(body)["error"] == "UnsupportedEncoding"
        assert grown < 48 * MIB, f"server grew by {grown // MIB} MiB"
        for encoding in ("deflate", "br", "x-gzip", "GZIP, identity"):
            status, _body = post(port, token, "/v1/objects/missing", b"\0" * 32,
                                 {"Content-Encoding": encoding})
            assert status == 415, encoding
        # A body as it travels is taken as before.
        status, body = post(port, token, "/v1/objects/missing", b"\1" * 32,
                            {"Content-Encoding": "identity"})
        assert status == 200 and body == b"\1" * 32


def connect_from(source: str, port: int, *, wait: bool = True) -> socket.socket:
    """A TCP connection to 127.0.0.1:port from the loopback address `source`."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    if wait:
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
    else:
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))  # completes in the kernel meanwhile
    return s


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed `s` (reading what it sent before, if anything)."""
    poller = select.poll()  # not select(): these descriptors pass 1,024
    poller.register(s, select.POLLIN)
    try:
        while True:
            if not poller.poll(0):
                return False
            if not s.recv(65536):
                return True
    except OSError:  # reset
        return True


def test_requests_that_stall_are_cut_off(tmp_path: Path) -> None:
    """Finding 9: a head trickled a byte at a time, and a body that stops, are cut off."""
    with served_volume(tmp_path / "s", "v", "--ro") as (server, token):
        port = server.tcp_port
        assert port is not None
        heads = [connect_from("127.0.0.2", port) for _ in range(40)]
        for s in heads:
            s.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        bodies = [connect_from("127.0.0.3", port) for _ in range(5)]
        for s in bodies:
            s.sendall(b"POST /v1/objects/missing HTTP/1.1\r\nHost: x\r\n"
                      b"Authorization: Bearer " + token.encode() + b"\r\n"
                      b"Content-Type: application/octet-stream\r\n"
                      b"Content-Length: 3200\r\n\r\n" + bytes(64))
        t0 = time.monotonic()
        closed: dict[socket.socket, float] = {}
        try:
            while time.monotonic() - t0 < HEADER_TIMEOUT + BODY_TIMEOUT and len(closed) < 45:
                for s in heads:  # a byte of a header now and then: never idle for long
                    if s not in closed:
                        with contextlib.suppress(OSError):
                            s.send(b"a")
                for s in heads + bodies:
                    if s not in closed and closed_by_server(s):
                        closed[s] = time.monotonic() - t0
                time.sleep(0.5)
            head_times = sorted(closed[s] for s in heads if s in closed)
            body_times = sorted(closed[s] for s in bodies if s in closed)
            print(f"heads cut after {head_times[:1]}..{head_times[-1:]} s, "
                  f"bodies after {body_times[:1]}..{body_times[-1:]} s")
            assert len(head_times) == len(heads), f"{len(head_times)} of {len(heads)} heads"
            assert head_times[-1] < HEADER_TIMEOUT + 3
            assert len(body_times) == len(bodies), f"{len(body_times)} of {len(bodies)} bodies"
            assert BODY_TIMEOUT - 1 < body_times[0] and body_times[-1] < BODY_TIMEOUT + 3
        finally:
            for s in heads + bodies:
                s.close()
        # A request sent whole meanwhile is answered as ever.
        with RemoteStore(server.tcp_url, token, retry_for=2) as reader:
            assert reader.list_branches("v")


@contextlib.contextmanager
def descriptors(need: int) -> Iterator[None]:
    """Room for `need` descriptors in this (the attacking) process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the attack needs {need} descriptors; this process may have {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def refused(flood: list[socket.socket], at_least: int, within: float = 20.0) -> int:
    """How many of `flood` the server closed, waiting up to `within` s for `at_least`.

    Connections beyond the listen backlog wait for the kernel's SYN retries
    (after 1, 3, 7 and 15 s), so on a loaded machine the last of them reach
    the server several seconds late.
    """
    deadline = time.monotonic() + within
    done: set[socket.socket] = set()
    while True:
        done.update(s for s in flood if s not in done and closed_by_server(s))
        if len(done) >= at_least or time.monotonic() > deadline:
            return len(done)
        time.sleep(0.2)


def test_half_open_connections_leave_room_for_token_holders_and_the_owner(
        tmp_path: Path) -> None:
    """Finding 9: a server whose descriptor limit is 1,024 under 1,100, then 1,260, connections."""
    store = tmp_path / "s"
    init_store(str(store))
    port = free_port()
    server = Server(store, tcp_port=port, prefix=("prlimit", "--nofile=1024:1024", "--"))
    flood: list[socket.socket] = []
    with descriptors(4096):
        server.start()
        try:
            assert cli("volume", "create", "v", store=store).returncode == 0
            p = cli("token", "create", "v", "--rw", "--json", store=store)
            token = json.loads(p.stdout)["token"]
            holder = RemoteStore(server.tcp_url, token, retry_for=3, timeout=3)
            holder.list_branches("v")  # connected before the flood, as a running client is

            # One peer, 1,100 connections that never send a byte.
            flood = [connect_from("127.0.0.2", port, wait=False) for _ in range(1100)]
            cut = refused(flood, 1100 - 64)
            t0 = time.monotonic()
            holder.list_branches("v")
            with RemoteStore(server.tcp_url, token, retry_for=3, timeout=3) as fresh:
                fresh.list_branches("v")  # a new connection from another host gets in
            tcp_wait = time.monotonic() - t0
            t0 = time.monotonic()
            ls = cli("ls", "v", store=store, timeout=30)
            ls_wait = time.monotonic() - t0
            print(f"one peer: {cut} of 1100 refused at once; token holder {tcp_wait:.2f} s, "
                  f"owner's ls {ls_wait:.2f} s")
            assert cut >= 1100 - 64, cut
            assert tcp_wait < 1.0 and ls.returncode == 0 and ls_wait < 5.0, ls.stderr

            # Many peers, each under its own cap: the cap on all of TCP holds.
            for s in flood:
                s.close()
            flood = [connect_from(f"127.0.0.{10 + i // 60}", port, wait=False)
                     for i in range(21 * 60)]
            cut = refused(flood, 1260 - (1024 - 512) // 2)
            t0 = time.monotonic()
            ls = cli("ls", "v", store=store, timeout=30)
            ls_wait = time.monotonic() - t0
            owner = server.remote(retry_for=3)
            tcp = owner.admin("GET", "stats")["tcp"]
            owner.close()
            print(f"21 peers: {cut} of 1260 refused at once; owner's ls {ls_wait:.2f} s; {tcp}")
            assert ls.returncode == 0 and ls_wait < 5.0, ls.stderr
            assert tcp["held"] <= tcp["cap"] <= (1024 - 512) // 2 and cut >= 1260 - tcp["cap"]
            holder.close()
        finally:
            for s in flood:
                s.close()
            server.stop()
