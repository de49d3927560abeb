"""Tunnels (fleet/tunnel.py): a client's connection carried through a member to the owner.

Three members on loopback (fleetutil.Fleet). A client that asks a member
which does not own its store is carried to the owner: its requests are
answered there, counted there as entering the fleet at the carrying member,
and when the store moves the tunnel is cut and the client's next request
goes to the new owner, with nothing lost or made twice. A CONNECT from a
caller without the fleet's secret is answered the same whether its store or
volume exists or not, and its requests then get the usual 403; only a member
opens a tunnel at an owner; a malformed CONNECT is refused. Plain HTTP on the
same port is unchanged.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleetutil import Fleet, make_volume, three_members
from test_routes import move, publish, read

from bucketutil import Moto
from strata.engine.txn import Transaction
from strata.fleet.client import FleetStore
from strata.fleet.splice import Splice


def kernel_splices() -> bool:
    """Whether members here may join a tunnel's sockets in the kernel (fleet/splice.py)."""
    splice = Splice.create()
    if splice is None:
        return False
    splice.close()
    return True


@pytest.fixture(params=["kernel", "python"])
def fleet(request: pytest.FixtureRequest, moto: Moto, fleet_url: str,
          tmp_path: Path) -> Iterator[Fleet]:
    """Three members whose tunnels the kernel carries where it can, or that copy in Python."""
    env = {**moto.env(), "STRATA_FLEET_SPLICE": "1" if request.param == "kernel" else "0"}
    yield from three_members(fleet_url, tmp_path, env)


def status(fleet: Fleet, name: str) -> dict[str, Any]:
    req = urllib.request.Request(fleet.members[name].addr + "/fleet/v1/status", headers={
        "X-Strata-Fleet-Token": os.environ["STRATA_FLEET_TOKEN"]})
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
        return dict(json.loads(resp.read()))


def sees_serving(fleet: Fleet, member: str, store: str, owner: str) -> None:
    """Wait until `member`'s cached lease names `owner` serving `store` (it carries then)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            lease = status(fleet, member)["leases"].get(store) or {}
        except OSError as exc:  # the member is still starting: not listening yet
            lease = {"error": str(exc)}
        if lease.get("holder") == owner and lease.get("state") == "serving":
            return
        assert time.monotonic() < deadline, lease
        time.sleep(0.05)


def raw(addr: str, *messages: bytes, wait: float = 2.0) -> list[bytes]:
    """Each message on one connection, and what came back after each (until quiet)."""
    host, _, port = addr.removeprefix("http://").rpartition(":")
    out = []
    with socket.create_connection((host, int(port)), timeout=10) as s:
        for m in messages:
            s.sendall(m)
            got = b""
            s.settimeout(wait)
            try:
                while True:
                    piece = s.recv(65536)
                    if not piece:
                        break
                    got += piece
                    if b"\r\n\r\n" in got:
                        s.settimeout(0.3)  # the rest of this answer, if any
            except TimeoutError:
                pass
            out.append(got)
    return out


def test_a_client_is_carried_to_the_owner_and_follows_a_move(fleet: Fleet) -> None:
    owner = fleet.owner("s1")
    make_volume(fleet, "s1", "v")
    via = next(n for n in sorted(fleet.members) if n != owner)
    sees_serving(fleet, via, "s1", owner)
    remote = FleetStore([fleet.members[via].addr], "s1", retry_for=30.0)
    try:
        first = publish(remote, "one.txt", b"1")
        conn = remote._local.conn
        assert conn.carried_to == owner and conn.kept_by is None
        assert remote.last.owner == owner
        for i in range(30):
            read(remote, "v", "one.txt")
            assert remote._local.conn is conn, f"a new connection at request {i}"
        # The owner counts the carried requests as entering the fleet at `via`; the
        # carrying member read none of them (it counts the tunnel once).
        seen = status(fleet, owner)["traffic"].get("s1", {})
        assert seen.get(via, 0) >= 30, seen
        tunnels = status(fleet, via)["tunnels"]
        assert tunnels["open"] >= 1
        # Joined in the kernel where it can be: the bytes above never woke `via`.
        kernel = fleet.env.get("STRATA_FLEET_SPLICE") == "1" and kernel_splices()
        assert (tunnels["spliced"] >= 1) == kernel, tunnels
        # The store moves: the tunnel is cut, and the next request reaches the new owner.
        to = next(n for n in sorted(fleet.members) if n not in (owner, via))
        move(fleet, "s1", to)
        sees_serving(fleet, via, "s1", to)
        second = publish(remote, "two.txt", b"2")
        assert remote.last.owner == to
        assert remote._local.conn.carried_to == to
        assert read(remote, "v", "one.txt") == b"1" and read(remote, "v", "two.txt") == b"2"
        # ...and the history has each publish once, in order.
        log = [s.id for s in remote.log(second)]
        assert log[0] == second and first in log
        assert len(set(log)) == len(log)
    finally:
        remote.close()


def test_a_member_keeps_what_it_owns_or_cannot_place(fleet: Fleet) -> None:
    owner = fleet.owner("s1")
    make_volume(fleet, "s1", "v")
    # Its own store: the connection stays with the member (no hop at all).
    mine = FleetStore([fleet.members[owner].addr], "s1", retry_for=30.0)
    # A volume not in the catalog yet: kept, and the create goes through the member.
    other = next(n for n in sorted(fleet.members) if n != owner)
    sees_serving(fleet, other, "s1", owner)
    placed = FleetStore([fleet.members[other].addr], retry_for=30.0)
    try:
        publish(mine, "here.txt", b"here")
        assert mine._local.conn.kept_by == owner and mine._local.conn.carried_to is None
        placed.create_volume("fresh")
        t = Transaction(placed, "fresh")
        t.write("f.txt", b"fresh")
        t.commit()
        assert Transaction(placed, "fresh").read("f.txt") == b"fresh"
        # Once the volume is placed, the next connection for it is carried to its owner.
        placed.close()
        assert Transaction(placed, "v").read("here.txt") == b"here"
        conn = placed._local.conn
        assert conn.target == "volume/v" and conn.carried_to == owner
    finally:
        mine.close()
        placed.close()


def test_a_connect_tells_a_caller_without_the_secret_nothing(fleet: Fleet) -> None:
    owner = fleet.owner("s1")
    make_volume(fleet, "s1", "v")
    via = next(n for n in sorted(fleet.members) if n != owner)
    sees_serving(fleet, via, "s1", owner)
    addr = fleet.members[via].addr
    kept = b"HTTP/1.1 200 Connection established\r\nX-Strata-Tunnel: kept " + via.encode() \
        + b"\r\n\r\n"
    bearer = b"Authorization: Bearer strata_00_nope\r\n"
    cases = [(target, creds) for target in (b"store/s1", b"store/nope", b"volume/v",
                                            b"volume/nope")
             for creds in (b"", b"X-Strata-Fleet-Token: wrong\r\n")]
    cases += [(b"volume/v", bearer), (b"volume/nope", bearer)]  # a token names its store
    for target, creds in cases:
        store = b"nope" if target == b"store/nope" else b"s1"
        got = raw(addr, b"CONNECT " + target + b" HTTP/1.1\r\nHost: x\r\n" + creds + b"\r\n",
                  b"GET /v1/volumes/v/branches HTTP/1.1\r\nHost: x\r\nX-Strata-Store: "
                  + store + b"\r\n" + creds + b"\r\n")
        assert got[0] == kept, (target, creds, got)
        assert got[1].split(b"\r\n", 1)[0] in (b"HTTP/1.1 403 Forbidden",
                                                 b"HTTP/1.1 401 Unauthorized"), got
    # A bearer token names a store: carried, and every request is checked by the owner
    # as any client's (this one carries no credentials: 403 there).
    got = raw(addr, b"CONNECT store/s1 HTTP/1.1\r\nHost: x\r\n" + bearer + b"\r\n",
              b"GET /v1/volumes/v/branches HTTP/1.1\r\nHost: x\r\nX-Strata-Store: s1\r\n\r\n",
              b"GET /v1/volumes/v/branches HTTP/1.1\r\nHost: x\r\nX-Strata-Store: s1\r\n"
              + bearer + b"\r\n")
    assert got[0] == b"HTTP/1.1 200 Connection established\r\nX-Strata-Tunnel: " \
        + owner.encode() + b"\r\n\r\n", got
    assert got[1].startswith(b"HTTP/1.1 403"), got
    assert got[2].startswith(b"HTTP/1.1 401"), got  # the owner's store refused the token
    # A store without an owner: kept, and the request gets what a plain one gets.
    ask = b"GET /v1/volumes/v/branches HTTP/1.1\r\nHost: x\r\nX-Strata-Store: nope\r\n" \
        + bearer + b"\r\n"
    plain = raw(addr, ask)
    through = raw(addr, b"CONNECT store/nope HTTP/1.1\r\nHost: x\r\n" + bearer + b"\r\n", ask)
    assert through[0] == kept
    assert through[1].split(b"\r\n", 1)[0] == plain[0].split(b"\r\n", 1)[0], (plain, through)


def test_malformed_connects_and_forged_tunnels_are_refused(fleet: Fleet) -> None:
    owner = fleet.owner("s1")
    make_volume(fleet, "s1", "v")
    addr = fleet.members[owner].addr
    assert raw(addr, b"CONNECT store/s1\r\n\r\n")[0].startswith(b"HTTP/1.1 400")
    assert raw(addr, b"CONNECT store/s1 HTTP/1.1\r\nno colon\r\n\r\n")[0] \
        .startswith(b"HTTP/1.1 400")
    assert raw(addr, b"CONNECT store/s1 HTTP/1.1\r\nX: " + b"y" * 20_000)[0] \
        .startswith(b"HTTP/1.1 431")
    # Only a member opens a tunnel at an owner: the mark must verify.
    for mark in (b"", b"X-Strata-Forwarded: a\r\n", b"X-Strata-Forwarded: a 00ff\r\n"):
        got = raw(addr, b"POST /fleet/v1/tunnel HTTP/1.1\r\nHost: x\r\n" + mark
                  + b"Content-Length: 0\r\n\r\n")
        assert got[0].startswith(b"HTTP/1.1 403"), got
    # Plain HTTP on the same port, unchanged: a request split mid-method still parses.
    token = os.environ["STRATA_FLEET_TOKEN"].encode()
    got = raw(addr, b"GE", b"T /v1/volumes/v/branches HTTP/1.1\r\nHost: x\r\n"
              b"X-Strata-Fleet-Token: " + token + b"\r\nX-Strata-Store: s1\r\n\r\n")
    assert got[1].startswith(b"HTTP/1.1 200"), got


def test_a_carried_publish_is_one_publish_across_a_kill(fleet: Fleet) -> None:
    """The owner dies under a tunnel: the client retries its publish elsewhere, once."""
    owner = fleet.owner("s1")
    make_volume(fleet, "s1", "v")
    via = next(n for n in sorted(fleet.members) if n != owner)
    sees_serving(fleet, via, "s1", owner)
    remote = FleetStore([fleet.members[via].addr] + [m.addr for n, m in
                                                     sorted(fleet.members.items())
                                                     if n != via], "s1", retry_for=60.0)
    try:
        publish(remote, "before.txt", b"b")
        assert remote._local.conn.carried_to == owner
        fleet.kill(owner)
        t0 = time.monotonic()
        after = publish(remote, "after.txt", b"a")
        assert remote.last.owner not in (None, owner)
        assert time.monotonic() - t0 < 30
        assert read(remote, "v", "after.txt") == b"a"
        log = [s.id for s in remote.log(after)]
        assert log.count(after) == 1 and len(log) == len(set(log))
    finally:
        remote.close()
