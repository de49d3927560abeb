"""A fleet on loopback: routing through any member, failover on SIGKILL, a planned move."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

from fleetutil import Fleet, Publishers, check, make_volume

from bucketutil import FaultProxy, Moto
from strata.server.bodies import MAX_BODY
from strata_harness import STRATA


def test_any_member_routes_and_a_killed_owner_is_replaced(fleet: Fleet) -> None:
    fleet.records.add_store("s1", "bucket")
    for name in ("a", "b", "c"):
        fleet.add(name)
    owner = fleet.owner("s1")
    make_volume(fleet, "s1")
    pubs = Publishers(fleet, ["s1"], per_store=2).start()
    time.sleep(2)
    fleet.kill(owner)
    t0 = time.monotonic()
    new = fleet.owner("s1", not_=owner)
    print(f"failover to {new} seen in the bucket after {time.monotonic() - t0:.2f} s")
    time.sleep(2)
    history = pubs.stop()
    acked = history.acked()
    assert len([o for o in acked if o.owner == new]) > 0, fleet.logs()
    assert check(fleet, history, ["s1"]) == [], fleet.logs()


def strata(*args: str, input: bytes | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*STRATA, *args], input=input, capture_output=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_the_cli_adds_shows_moves_and_leaves(fleet: Fleet) -> None:
    url = fleet.url
    assert strata("fleet", "add-store", url, "s1", "--sync", "bucket").returncode == 0
    for name in ("a", "b", "c"):
        fleet.add(name)
    owner = fleet.owner("s1")
    members = ",".join(fleet.addrs())
    via = ["--fleet", members, "--fleet-store", "s1"]
    done = strata(*via, "volume", "create", "v")
    assert done.returncode == 0, done.stderr
    done = strata(*via, "put", "v", "hello.txt", input=b"hi from any member\n")
    assert done.returncode == 0, done.stderr
    st = json.loads(strata("fleet", "status", url, "--json").stdout)
    assert set(st["members"]) == {"a", "b", "c"}
    s1 = st["stores"]["s1"]
    assert s1["owner"] == owner and s1["state"] == "serving" and s1["sync"] == "bucket"
    assert isinstance(s1["epoch"], int)
    assert "STORE" in strata("fleet", "status", url).stdout.decode()
    # A planned move, then the old owner's host leaves: the store stays readable.
    to = next(n for n in ("a", "b", "c") if n != owner)
    moved = strata("fleet", "move", url, "s1", "--to", to, "--json")
    assert moved.returncode == 0, moved.stderr.decode() + fleet.logs()
    gap = json.loads(moved.stdout)["gap_seconds"]
    print(f"planned move {owner} -> {to}: {gap:.2f} s")
    assert fleet.owner("s1") == to
    left = strata("fleet", "leave", url, "--name", to)
    assert left.returncode == 0, left.stderr.decode() + fleet.logs()
    assert fleet.owner("s1", not_=to) != to
    cat = strata(*via, "cat", "v", "hello.txt")
    assert cat.stdout == b"hi from any member\n", cat.stderr.decode() + fleet.logs()


def test_a_flaky_bucket_loses_nothing_acknowledged(moto: Moto, fleet_url: str,
                                                   tmp_path: Path) -> None:
    """The members' bucket answers 500 to every 9th request and loses answers to PUTs.

    Lost answers hit log records, lease renewals (If-Match) and claims alike:
    a write sent again finds its own nonce. One owner is SIGKILLed on the way.
    """
    proxy = FaultProxy(int(moto.endpoint.rsplit(":", 1)[1])).start()
    fleet = Fleet(fleet_url, tmp_path, moto.env(proxy.endpoint))
    try:
        fleet.records.add_store("s1", "bucket")
        for name in ("a", "b", "c"):
            fleet.add(name)
        owner = fleet.owner("s1")
        make_volume(fleet, "s1")
        pubs = Publishers(fleet, ["s1"], per_store=2).start()
        proxy.fail_status, proxy.fail_every = 500, 9
        for i in range(12):
            proxy.lose_answers += 1
            time.sleep(0.5)
            if i == 4:
                fleet.kill(owner)
        fleet.owner("s1", 60, not_=owner)
        time.sleep(2)
        proxy.fail_status = None
        history = pubs.stop()
        acked = history.acked()
        print(f"{len(history.ops)} publishes, {len(acked)} acknowledged, "
              f"epochs {sorted({o.epoch for o in acked if o.epoch is not None})}")
        assert acked
        assert check(fleet, history, ["s1"]) == [], fleet.logs()
    finally:
        fleet.close()
        proxy.stop()


def test_the_fleet_port_needs_the_fleet_secret_and_bounds_bodies(fleet: Fleet) -> None:
    """The port answers as every store's owner: a stranger gets 403, a huge body 413."""
    import urllib.error
    import urllib.request

    fleet.records.add_store("s1", "bucket")
    fleet.add("a")
    fleet.owner("s1")
    addr = fleet.members["a"].addr

    def post(path: str, body: bytes, token: str | None) -> int:
        headers = {"X-Strata-Store": "s1", "Content-Type": "application/json"}
        if token is not None:
            headers["X-Strata-Fleet-Token"] = token
        req = urllib.request.Request(addr + path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    token = os.environ["STRATA_FLEET_TOKEN"]
    assert post("/v1/volumes", b'{"name": "x"}', None) == 403
    wrong = token[:-1] + ("1" if token.endswith("0") else "0")  # never the secret itself
    assert post("/v1/volumes", b'{"name": "x"}', wrong) == 403
    # A body over the API's limit is refused from its length, before it is read.
    host, port = addr.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/volumes HTTP/1.1\r\nHost: x\r\nX-Strata-Store: s1\r\n"
                  b"X-Strata-Fleet-Token: " + token.encode() + b"\r\n"
                  b"Content-Length: " + str(MAX_BODY + 1).encode() + b"\r\n\r\n{")
        assert s.recv(64).startswith(b"HTTP/1.1 413"), "the body was read, or accepted"
    no_token = {k: v for k, v in os.environ.items() if k != "STRATA_FLEET_TOKEN"}
    p = subprocess.run([*STRATA, "fleet", "join", fleet.url, "--name", "z", "--listen",
                        "127.0.0.1:1", "--dir", str(fleet.root / "z")], env=no_token,
                       capture_output=True, timeout=60)
    assert p.returncode != 0 and b"STRATA_FLEET_TOKEN" in p.stderr, p.stderr
