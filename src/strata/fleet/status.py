"""What the fleet's records say, read once: for `strata fleet status` and the fleet page.

Ages are measured against the writers' wall clocks (the `wall` fields),
so they are for display only: no decision anywhere reads them (docs/fleet.md,
"The clock assumption"). This module reads the bucket; it never writes.
"""

from __future__ import annotations

import time
from typing import Any

from strata.fleet.records import FleetRecords


def fleet_status(url: str) -> dict[str, Any]:
    """Members with their heartbeats' ages; stores with owner, state, epoch, lease age, lag."""
    rec = FleetRecords(url)
    now = time.time()
    members = rec.members()
    out: dict[str, Any] = {"members": {}, "stores": {}}
    for name, body in sorted(members.items()):
        out["members"][name] = {"addr": body.get("addr"), "leaving": body.get("leaving"),
                                "heartbeat_age": round(now - float(body.get("wall", 0)), 2)}
    for store, meta in sorted(rec.stores().items()):
        lease = rec.lease(store)
        held = members.get(lease.holder, {}) if lease is not None else {}
        mine = (held.get("stores") or {}).get(store, {}) if lease is not None else {}
        out["stores"][store] = {
            "sync": meta.get("sync"),
            "owner": lease.holder if lease is not None else None,
            "state": lease.state if lease is not None else "unowned",
            "epoch": lease.epoch if lease is not None else None,
            "lease_age": mine.get("lease_age"),
            "lag": mine.get("lag"), "unshipped_bytes": mine.get("unshipped_bytes"),
            "loss_window": "none (acknowledged = in the bucket)" if meta.get("sync") == "bucket"
            else "up to ~0.5 s of publishes (shipped twice a second)"}
    return out
