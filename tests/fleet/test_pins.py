"""Pins outlive their owner, and a new owner without inherited pins collects garbage at once.

A lease record says how long the pins its writer granted may be held
(fleet/lease.py). Before, every claim waited a blanket 180 s before GC
deleted anything, so a store that moved more often than that never lost its
garbage.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from fleetutil import Fleet, make_volume

from strata.engine.errors import NotFound, Unavailable
from strata.engine.objects import FileNode
from strata.engine.txn import Transaction
from strata.fleet.client import FleetStore
from strata.fleet.lease import DRIFT, LeaseKeeper, pins_end
from strata.fleet.records import Lease, lease_from


def _gc(remote: FleetStore) -> dict[str, Any]:
    return remote._json("POST", "/v1/admin/gc", {"min_age": 1})


def _first_block(remote: FleetStore, volume: str, path: str) -> bytes:
    e = Transaction(remote, volume).lookup(path)
    assert e is not None and e.ref is not None
    return FileNode.decode(remote.get_object(e.ref)).all_block_ids(remote.get_object)[0]


def test_pins_outlive_owners(fleet: Fleet) -> None:
    for s in ("pinned", "plain"):
        fleet.records.add_store(s, "bucket")
    for name in ("a", "b", "c"):
        fleet.add(name)
    remotes = {s: FleetStore(fleet.addrs(), s, retry_for=60.0) for s in ("pinned", "plain")}
    try:
        blocks: dict[str, bytes] = {}
        for s, remote in remotes.items():
            fleet.owner(s)
            make_volume(fleet, s)
            remote._json("POST", "/v1/admin/policy", {"volume": "v", "keep_last": 1})
            t = Transaction(remote, "v")
            t.write("kept", b"K" * 7 + bytes(range(256)) * 256)
            first = t.commit()
            blocks[s] = _first_block(remote, "v", "kept")
            if s == "pinned":
                remote.pin("v", [first], 60.0)
            t = Transaction(remote, "v")
            t.remove("kept")  # the pinned snapshot is past its policy now, held by the pin
            t.commit()
        lease = fleet.records.lease("pinned")
        assert lease is not None and lease.pins is not None and lease.pins >= 60.0, lease
        plain = fleet.records.lease("plain")
        assert plain is not None and plain.pins == 0.0, plain
        owners = {s: fleet.owner(s) for s in remotes}
        for owner in set(owners.values()):
            fleet.kill(owner)
        for s, owner in owners.items():
            fleet.owner(s, 60, not_=owner)
        reports: dict[str, list[dict[str, Any]]] = {s: [] for s in remotes}
        for _ in range(3):  # the second pass finds what the first noted dead 1 s ago
            for s, remote in remotes.items():
                reports[s].append(_gc(remote))
            time.sleep(1.2)
        # The new owner knows no pins of the old: the lease said they may be held, so
        # nothing at all is deleted yet, and the pinned snapshot's content stays.
        assert sum(r["objects_deleted"] for r in reports["pinned"]) == 0, reports["pinned"]
        assert "pins granted before" in str(reports["pinned"][-1].get("waiting")), \
            reports["pinned"][-1]
        assert remotes["pinned"].get_object(blocks["pinned"]).startswith(b"K" * 7)
        # The plain store's old owner granted none: its garbage goes at once, not in 180 s.
        assert not reports["plain"][-1].get("waiting"), reports["plain"][-1]
        with pytest.raises(NotFound):
            remotes["plain"].get_object(blocks["plain"])
    finally:
        for remote in remotes.values():
            remote.close()


def test_a_hostile_or_missing_pin_span_reads_as_unknown() -> None:
    body = {"store": "s", "holder": "a", "addr": "http://x", "state": "serving",
            "epoch": 3, "seq": 1, "ttl": 2.0, "sync": "bucket", "nonce": b"12345678"}
    for bad in (None, -1, float("nan"), float("inf"), True, "60", [60]):
        got = lease_from("l", {**body, "pins": bad}, "etag")
        assert got.pins is None, bad
    assert lease_from("l", body, "etag").pins is None  # an older writer
    assert lease_from("l", {**body, "pins": 12.5}, "etag").pins == 12.5
    # The reader's wait covers the writer's slow clock and its own fast one.
    assert math.isclose(pins_end(10.0, 100.0), 10.0 + 100.0 * (1 + DRIFT) / (1 - DRIFT))


class _Records:
    """Records that refuse every write: the lease was taken by someone else."""

    def write_lease(self, lease: Lease, prior: str | None) -> Lease:
        from strata.engine.errors import AlreadyExists
        raise AlreadyExists("someone else wrote it")


def test_a_pin_the_lease_cannot_record_is_refused() -> None:
    from strata.fleet.lease import clock
    lease = Lease(store="s", holder="a", addr="http://x", state="serving", epoch=1, ttl=2.0,
                  pins=0.0, etag="e")
    lost: list[str] = []
    keeper = LeaseKeeper(_Records(), lease, acquired_at=clock(),  # type: ignore[arg-type]
                         on_lost=lost.append)
    with pytest.raises(Unavailable, match="could not be recorded"):
        keeper.cover_pins(30.0)
    assert lost == ["another member wrote the lease"]
