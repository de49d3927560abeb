"""A fleet on loopback: routing through any member, failover on SIGKILL, a planned move."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fleetutil import Fleet, Publishers, check, make_volume

from bucketutil import Moto


@pytest.fixture
def fleet(moto: Moto, fleet_url: str, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(fleet_url, tmp_path, moto.env())
    try:
        yield f
    finally:
        f.close()


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
