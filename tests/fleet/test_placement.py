"""Volumes placed in stores by the fleet's catalog, `serve --fleet`, and moving a store to its work.

Members are real `strata` processes on loopback over moto; clients are the
CLI and `FleetStore` without a store named.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from fleetutil import Fleet

from serverutil import free_port
from strata.engine.bucket import frame_record
from strata.engine.errors import AlreadyExists, Corrupt, InvalidInput, NotFound, StrataError
from strata.engine.txn import Transaction
from strata.fleet.client import FleetStore
from strata.fleet.placement import PREFIX, VolumeCatalog, place, placement_from
from strata.fleet.records import MAGIC, VERSION
from strata_harness import STRATA


def strata(*args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*STRATA, *args], input=input, capture_output=True, timeout=120,
                          env=os.environ.copy())


def names_for(stores: list[str]) -> dict[str, str]:
    """One volume name that the rule places in each store."""
    out: dict[str, str] = {}
    i = 0
    while len(out) < len(stores):
        out.setdefault(place(f"vol{i}", stores), f"vol{i}")
        i += 1
    return out


def test_the_catalog_places_volumes_and_any_member_routes_them(fleet: Fleet) -> None:
    stores = ["s1", "s2"]
    for s in stores:
        fleet.records.add_store(s)
    for name in ("a", "b"):
        fleet.add(name)
    for s in stores:
        fleet.owner(s)
    a, b = fleet.addrs()
    vols = names_for(stores)
    for store, vol in vols.items():
        # Created through one member, written and read through the other: no store named.
        done = strata("--fleet", a, "volume", "create", vol)
        assert done.returncode == 0, done.stderr.decode() + fleet.logs()
        done = strata("--fleet", b, "put", vol, "f.txt", input=f"in {store}\n".encode())
        assert done.returncode == 0, done.stderr.decode()
        cat = strata("--fleet", f"{b},{a}", "cat", vol, "f.txt")
        assert cat.stdout == f"in {store}\n".encode(), cat.stderr.decode()
        # It lives in the store the rule names, and only there.
        held = FleetStore([a], store)
        try:
            assert vol in held.list_volumes()
            assert held.placed_in(vol) == store
        finally:
            held.close()
    listed = strata("--fleet", b, "volume", "list")
    assert listed.stdout.decode().split() == sorted(vols.values()), listed.stderr.decode()
    catalog = VolumeCatalog(fleet.records)
    assert {catalog.get(v).store for v in vols.values()} == set(stores)  # type: ignore[union-attr]
    assert all(catalog.get(v).state == "ready" for v in vols.values())  # type: ignore[union-attr]
    # The override: --fleet-store places a new volume in that store, whatever the rule says.
    other = next(s for s in stores if s != place("pinned", stores))
    done = strata("--fleet", a, "--fleet-store", other, "volume", "create", "pinned")
    assert done.returncode == 0, done.stderr.decode()
    assert catalog.get("pinned").store == other  # type: ignore[union-attr]
    assert strata("--fleet", b, "ls", "pinned").returncode == 0
    # A name is one volume in the catalog; a store named outright keeps its own names.
    again = strata("--fleet", b, "volume", "create", vols["s1"])
    assert again.returncode != 0 and b"exists" in again.stderr.lower(), again.stderr
    twin = strata("--fleet", b, "--fleet-store", "s2", "volume", "create", vols["s1"])
    assert twin.returncode == 0, twin.stderr.decode()
    assert catalog.get(vols["s1"]).store == "s1"  # type: ignore[union-attr]
    assert strata("--fleet", a, "cat", vols["s1"], "f.txt").stdout == b"in s1\n"
    # Deleted: gone from the list; created again, it goes back to the same store.
    gone = strata("--fleet", a, "volume", "delete", "--yes", vols["s2"])
    assert gone.returncode == 0, gone.stderr.decode()
    assert vols["s2"] not in strata("--fleet", b, "volume", "list").stdout.decode().split()
    assert catalog.get(vols["s2"]).state == "deleted"  # type: ignore[union-attr]
    assert strata("--fleet", b, "volume", "create", vols["s2"]).returncode == 0
    assert catalog.get(vols["s2"]).store == "s2"  # type: ignore[union-attr]
    missing = strata("--fleet", a, "cat", "nosuch", "f.txt")
    assert missing.returncode != 0 and b"nosuch" in missing.stderr


def test_a_half_made_volume_is_completed_and_two_creators_make_one(fleet: Fleet) -> None:
    fleet.records.add_store("s1")
    fleet.add("a")
    fleet.add("b")
    fleet.owner("s1")
    addrs = fleet.addrs()
    cat = VolumeCatalog(fleet.records)
    client = FleetStore(addrs)
    try:
        # A creator that died after the catalog record, before the store: not listed,
        # and the name is not blocked: the next create completes it.
        cat.create("half", "s1")
        assert "half" not in client.list_volumes()
        client.create_volume("half")
        assert "half" in client.list_volumes()
        assert cat.get("half").state == "ready"  # type: ignore[union-attr]
        # One that died after the store, before `ready`: listed (its store says it
        # exists), and the record is settled.
        p = cat.get("half")
        assert p is not None
        cat.set_state(p, "creating")
        assert "half" in client.list_volumes()
        assert cat.get("half").state == "ready"  # type: ignore[union-attr]
        # Two creators at once, through different members: exactly one wins.
        for round_ in range(3):
            name = f"race{round_}"
            results: list[str] = []

            def create(addr: str, name: str = name, results: list[str] = results) -> None:
                c = FleetStore([addr])
                try:
                    c.create_volume(name)
                    results.append("created")
                except AlreadyExists:
                    results.append("exists")
                finally:
                    c.close()
            ts = [threading.Thread(target=create, args=(a,)) for a in addrs]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
            assert sorted(results) == ["created", "exists"], results
            assert client.list_volumes().count(name) == 1
        # Untrusted catalog bytes: a record of another format, and one that is not
        # a record at all, are refused with a clear error, and listing goes on.
        bucket = fleet.records.bucket
        bucket.put_tagged(PREFIX + "future", frame_record(MAGIC, VERSION, {
            "format": 2, "volume": "future", "store": "s1", "state": "ready",
            "nonce": b"12345678"}), None)
        bucket.put_tagged(PREFIX + "junk", b"not a record" * 10, None)
        bucket.put_tagged(PREFIX + "big", b"x" * 10_000, None)
        with pytest.raises(Corrupt, match="format 2.*format 1 only"):
            cat.get("future")
        with pytest.raises(Corrupt, match="10000 bytes"):
            cat.get("big")
        assert "future" not in client.list_volumes()
        with pytest.raises(StrataError, match="not a strata fleet record"):
            client.list_branches("junk")  # the member's Corrupt, as the client sees it
        with pytest.raises(NotFound):
            client.list_branches("never-made")
        with pytest.raises(InvalidInput):
            client.create_volume("../up")
    finally:
        client.close()


def test_placement_records_are_checked() -> None:
    good = {"format": 1, "volume": "v", "store": "s1", "state": "ready", "nonce": b"n" * 8}
    assert placement_from(PREFIX + "v", frame_record(MAGIC, VERSION, good), "e").store == "s1"
    for bad in ({**good, "store": "../x"}, {**good, "state": "odd"}, {**good, "volume": "w"},
                {k: v for k, v in good.items() if k != "store"}):
        with pytest.raises(Corrupt):
            placement_from(PREFIX + "v", frame_record(MAGIC, VERSION, bad), "e")
    # The rule: stable, and every store gets some names.
    stores = ["s1", "s2", "s3"]
    assert place("abc", stores) == place("abc", list(reversed(stores)))
    assert {place(f"n{i}", stores) for i in range(60)} == set(stores)


def test_serve_fleet_joins_as_a_member(fleet: Fleet, tmp_path: Path) -> None:
    fleet.records.add_store("s1")
    port = free_port()
    log = open(tmp_path / "serve.log", "ab")  # noqa: SIM115 - the process keeps it
    proc = subprocess.Popen(
        [*STRATA, "serve", "--fleet", fleet.url, "--name", "solo", "--listen",
         f"tcp:127.0.0.1:{port}", "--store", str(tmp_path / "solo"),
         "--key-file", str(fleet.key)], stdout=log, stderr=log, env=os.environ.copy())
    try:
        assert fleet.owner("s1") == "solo"
        via = ["--fleet", f"http://127.0.0.1:{port}"]
        assert strata(*via, "volume", "create", "v").returncode == 0
        st = json.loads(strata("fleet", "status", fleet.url, "--json").stdout)
        assert "solo" in st["members"]
        bad = strata("serve", "--fleet", fleet.url, "--listen", "tcp:127.0.0.1:1")
        assert bad.returncode != 0 and b"--name" in bad.stderr
    finally:
        proc.terminate()
        proc.wait(30)


MOVE_ENV = {"STRATA_FLEET_MOVE_WINDOW": "2", "STRATA_FLEET_MOVE_MIN": "20",
            "STRATA_FLEET_MOVE_COOLDOWN": "3"}


def publish_through(addr: str, volume: str, stop: threading.Event, tag: str,
                    owners: list[str | None]) -> None:
    c = FleetStore([addr], retry_for=30.0)
    n = 0
    try:
        while not stop.is_set():
            t = Transaction(c, volume)
            t.write(f"{tag}-{n}", b"x" * 64)
            t.commit()
            owners.append(getattr(c.last, "owner", None))
            n += 1
            time.sleep(0.02)
    finally:
        c.close()


def test_a_store_moves_to_the_member_doing_its_work(fleet: Fleet) -> None:
    fleet.records.add_store("s1")
    for name in ("a", "b"):
        fleet.add(name, env=MOVE_ENV)
    owner = fleet.owner("s1")
    other = next(n for n in ("a", "b") if n != owner)
    addr = fleet.members[other].addr
    c = FleetStore([addr])
    c.create_volume("v")
    c.close()
    stop = threading.Event()
    owners: list[str | None] = []
    t = threading.Thread(target=publish_through, args=(addr, "v", stop, "w", owners))
    t.start()
    try:
        moved = fleet.owner("s1", 60, not_=owner)
    finally:
        stop.set()
        t.join(60)
    assert moved == other, fleet.logs()
    assert owners and owners[-1] == other  # the last publishes were served where they entered
    st = fleet.records.lease("s1")
    assert st is not None and st.holder == other


def test_two_members_sharing_the_work_do_not_ping_pong(fleet: Fleet) -> None:
    fleet.records.add_store("s1")
    for name in ("a", "b", "c"):
        fleet.add(name, env=MOVE_ENV)
    owner = fleet.owner("s1")
    # The two members that do not own the store publish evenly: neither has 80 %.
    others = [fleet.members[n].addr for n in ("a", "b", "c") if n != owner]
    c = FleetStore(others)
    c.create_volume("v")
    c.close()
    stop = threading.Event()
    owners: list[str | None] = []
    ts = [threading.Thread(target=publish_through, args=(a, "v", stop, f"w{i}", owners))
          for i, a in enumerate(others)]
    for t in ts:
        t.start()
    time.sleep(9)  # three cooldowns, four windows
    stop.set()
    for t in ts:
        t.join(60)
    assert len(owners) > 60
    assert fleet.owner("s1") == owner, fleet.logs()
    assert set(owners) == {owner}


def test_the_move_policy_needs_a_share_a_count_and_a_cooldown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import strata.fleet.traffic as traffic
    now = [1000.0]
    monkeypatch.setattr(traffic, "clock", lambda: now[0])
    t = traffic.Traffic(traffic.MovePolicy(share=0.8, window=10, min_requests=50,
                                           cooldown=60))
    t.reset("s")

    def feed(seconds: int, per_second: dict[str, int]) -> None:
        for _ in range(seconds):
            now[0] += 1
            for origin, n in per_second.items():
                for _ in range(n):
                    t.note("s", origin)
    feed(30, {"b": 10})
    assert t.target("s", "a") is None           # held 30 s: inside the cooldown
    feed(40, {"b": 10})
    assert t.target("s", "a") == "b"            # 100 % from b over the window
    feed(20, {"b": 7, "c": 3})
    assert t.target("s", "a") is None           # 70 %: short of the share
    feed(20, {"b": 9, "a": 1})
    assert t.target("s", "a") == "b"            # 90 %
    feed(20, {"a": 10})
    assert t.target("s", "a") is None           # the owner's own work keeps it
    feed(20, {"b": 4})
    assert t.target("s", "a") is None           # 40 in the window: too few to judge
    t.reset("s")                                 # claimed afresh: counts and cooldown restart
    assert t.counts("s") == {} and t.target("s", "a") is None
    off = traffic.Traffic(traffic.MovePolicy(enabled=False))
    off.reset("s")
    now[0] += 100
    for _ in range(100):
        off.note("s", "b")
    assert off.target("s", "a") is None
