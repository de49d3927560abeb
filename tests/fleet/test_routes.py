"""Through the members: event streams across a move, scoped tokens, large answers.

Three members on loopback (fleetutil.Fleet). A watcher follows a store's
events through a member that does not own it, as `strata watch` does
(reconnecting with its last event id and heads when a stream ends), while
the store moves to another member; it must see publishes from both sides.
A token scoped to one volume is used through a non-owner member with no
fleet secret: it reads and writes its volume, is refused for another in the
same words whether that volume exists or not, never reaches the member's
own endpoints or the store's administration, and keeps working after the
store moves (its tokens travel through the bucket).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleetutil import Fleet, make_volume, three_members

from bucketutil import Moto
from strata.engine.errors import Forbidden, StrataError
from strata.engine.txn import Transaction
from strata.fleet.client import FleetStore
from strata_harness import STRATA


@pytest.fixture
def fleet(moto: Moto, fleet_url: str, tmp_path: Path) -> Iterator[Fleet]:
    yield from three_members(fleet_url, tmp_path, moto.env())


def move(fleet: Fleet, store: str, to: str) -> None:
    owner = fleet.owner(store)
    req = urllib.request.Request(
        fleet.members[owner].addr + "/fleet/v1/move",
        data=json.dumps({"store": store, "to": to}).encode(), method="POST",
        headers={"Content-Type": "application/json",
                 "X-Strata-Fleet-Token": os.environ["STRATA_FLEET_TOKEN"]})
    with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - loopback
        assert resp.status == 200
    deadline = time.monotonic() + 30
    while fleet.owner(store) != to:
        assert time.monotonic() < deadline, fleet.logs()
        time.sleep(0.05)


class Watcher:
    """Follows events through one member and reconnects as `strata watch` does."""

    def __init__(self, addr: str, store: str, **auth: Any) -> None:
        self.remote = FleetStore([addr], store, retry_for=30.0, **auth)
        self.events: list[dict[str, Any]] = []
        self.streams = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        since: str | None = None
        heads: dict[str, str] = {}
        try:
            while not self._stop.is_set():
                self.streams += 1
                for ev in self.remote.events(["v"], since, heads):
                    since = ev.pop("_id", since)
                    if ev.get("type") == "hello":
                        heads = dict(ev.get("heads", {}))
                    elif ev.get("type") == "publish":
                        heads[f"{ev['volume']}@{ev['branch']}"] = ev["snapshot"]
                    self.events.append(ev)
                    if self._stop.is_set():
                        return
                time.sleep(0.1)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def published(self) -> set[str]:
        return {e["snapshot"] for e in self.events if e.get("type") == "publish"}

    def wait_for(self, snapshot: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while snapshot not in self.published():
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"{snapshot} not seen: {self.events}"
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()


def read(remote: FleetStore, volume: str, path: str) -> bytes:
    return Transaction(remote, volume).read(path)


def publish(remote: FleetStore, path: str, data: bytes) -> str:
    t = Transaction(remote, "v")
    t.write(path, data)
    return t.commit(path)


def test_events_stream_through_a_non_owner_across_a_move(fleet: Fleet) -> None:
    owner = fleet.owner("s1")
    make_volume(fleet, "s1")
    others = [n for n in fleet.members if n != owner]
    via, to = others[0], others[1]
    watcher = Watcher(fleet.members[via].addr, "s1")
    remote = FleetStore(fleet.addrs(), "s1", retry_for=30.0)
    # `strata watch` itself, through the same member, reconnecting as it does.
    cli_out = fleet.root / "watch.jsonl"
    cli = subprocess.Popen([*STRATA, "--fleet", fleet.members[via].addr, "--fleet-store", "s1",
                            "watch", "v", "--json"], stdout=open(cli_out, "wb"),  # noqa: SIM115
                           stderr=open(fleet.root / "watch.err", "wb"))  # noqa: SIM115
    try:
        deadline = time.monotonic() + 30
        while b'"hello"' not in cli_out.read_bytes():
            assert cli.poll() is None and time.monotonic() < deadline, \
                (fleet.root / "watch.err").read_text()
            time.sleep(0.05)
        deadline = time.monotonic() + 30  # the stream is open before the first publish
        while not any(e.get("type") == "hello" for e in watcher.events):
            assert watcher.error is None and time.monotonic() < deadline, watcher.error
            time.sleep(0.02)
        before = publish(remote, "before.txt", b"1")
        watcher.wait_for(before)
        streams = watcher.streams
        move(fleet, "s1", to)
        after = publish(remote, "after.txt", b"2")
        watcher.wait_for(after)
        # The stream through `via` ended when the store moved, and the watcher followed
        # again (through `via`, now forwarding to the new owner) with its last id.
        assert watcher.streams > streams, watcher.events
        # And the other way: the watcher's member becomes the owner (the local hop).
        move(fleet, "s1", via)
        last = publish(remote, "last.txt", b"3")
        watcher.wait_for(last)
        seen = [e["snapshot"] for e in watcher.events if e.get("type") == "publish"]
        assert seen.index(before) < seen.index(after) < seen.index(last)
        deadline = time.monotonic() + 30
        while True:
            lines = [json.loads(x) for x in cli_out.read_text().splitlines() if x.strip()]
            got = [e["snapshot"] for e in lines if e.get("type") == "publish"]
            if last in got:
                break
            assert cli.poll() is None and time.monotonic() < deadline, \
                (lines, (fleet.root / "watch.err").read_text())
            time.sleep(0.05)
        assert got.index(before) < got.index(after) < got.index(last), lines
        # A large answer streams through a forward whole (a file over the members'
        # whole-answer limit, read through a member that does not own the store).
        big = os.urandom(3 * 1024 * 1024 + 7)
        publish(remote, "big.bin", big)
        reader = FleetStore([fleet.members[owner].addr], "s1", retry_for=30.0)
        try:
            assert read(reader, "v", "big.bin") == big
        finally:
            reader.close()
    finally:
        cli.kill()
        cli.wait()
        watcher.stop()
        remote.close()


def raw(addr: str, head: str, timeout: float = 20.0) -> bytes:
    """Send a request head (and no body), return what comes back first."""
    host, port = addr.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head.encode())
        return s.recv(4096)


def call(addr: str, method: str, path: str, headers: dict[str, str],
         body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(addr + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def test_a_scoped_token_works_through_any_member_and_only_in_its_scope(fleet: Fleet) -> None:
    owner = fleet.owner("s1")
    make_volume(fleet, "s1", "v")
    make_volume(fleet, "s1", "w")
    admin = FleetStore(fleet.addrs(), "s1", retry_for=30.0)
    made = admin.admin("POST", "tokens", {"volume": "v", "writable": True})
    token = made["token"]
    via = next(n for n in fleet.members if n != owner)
    addr = fleet.members[via].addr
    scoped = FleetStore([addr], "s1", bearer=token, retry_for=30.0)
    assert scoped.fleet_token is None
    try:
        head = publish(scoped, "mine.txt", b"by token")
        assert read(scoped, "v", "mine.txt") == b"by token"
        assert scoped.whoami()["volume"] == "v"
        # Another volume: refused in the same words whether it exists or not.
        bearer = {"Authorization": f"Bearer {token}", "X-Strata-Store": "s1"}
        there = call(addr, "GET", "/v1/volumes/w/branches", bearer)
        absent = call(addr, "GET", "/v1/volumes/nope/branches", bearer)
        assert there[0] == 403 and there[1].replace(b"'w'", b"'nope'") == absent[1], \
            (there, absent)
        # ...the words a store's own TCP listener answers (Scope.check_volume), no more.
        assert json.loads(there[1]) == {"error": "Forbidden",
                                        "message": "token is not valid for volume 'w'"}
        with pytest.raises(Forbidden):
            read(scoped, "w", "anything")
        # No unix-socket trust: the store's administration is refused...
        for method, path in (("GET", "/v1/admin/tokens"), ("GET", "/v1/admin/stats"),
                             ("POST", "/v1/admin/gc")):
            status, body = call(addr, method, path, {**bearer,
                                                      "Content-Type": "application/json"},
                                b"{}" if method == "POST" else None)
            assert status == 403, (path, status, body)
        # ...and so are the member's own endpoints, through any member, saying nothing.
        for name, m in fleet.members.items():
            for method, path in (("GET", "/fleet/v1/status"), ("POST", "/fleet/v1/move"),
                                 ("POST", "/fleet/v1/leave"), ("POST", "/fleet/v1/claim")):
                status, body = call(m.addr, method, path,
                                    {**bearer, "Content-Type": "application/json"},
                                    json.dumps({"store": "s1", "to": name}).encode()
                                    if method == "POST" else None)
                assert status == 403, (name, path, status)
                assert json.loads(body) == {"error": "Forbidden",
                                            "message": "fleet token needed"}, body
        # A client cannot pass as a member: a made-up forwarding mark changes nothing.
        status, _ = call(addr, "GET", "/v1/volumes/v/branches",
                         {**bearer, "X-Strata-Forwarded": "a"})
        assert status == 200
        # Neither token nor secret: 403 before the body is read (none is ever sent).
        head_only = ("POST /v1/publish HTTP/1.1\r\nHost: x\r\nX-Strata-Store: s1\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100000\r\n")
        assert raw(addr, head_only + "\r\n").startswith(b"HTTP/1.1 403")
        # A bad token: the owner's store server refuses it from the head alone, through
        # the forward, while the body is still unsent.
        got = raw(addr, head_only + "Authorization: Bearer strata_00_nope\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 401"), got
        # The token travels with the store: after a move it still works...
        move(fleet, "s1", next(n for n in fleet.members if n not in (owner, via)))
        assert read(scoped, "v", "mine.txt") == b"by token"
        assert publish(scoped, "again.txt", b"after the move") != head
        # ...and a revocation does too: refused by the next owner as well.
        admin.admin("DELETE", f"tokens/{made['id']}")
        move(fleet, "s1", owner)
        with pytest.raises(StrataError):
            read(scoped, "v", "mine.txt")
    finally:
        scoped.close()
        admin.close()
