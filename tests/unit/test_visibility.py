"""The scope check walks a volume's history only as far as the question needs."""

from __future__ import annotations

from typing import Any

from strata.engine.interface import SnapshotInfo
from strata.engine.local import LocalStore
from strata.engine.txn import Transaction
from strata.server.visibility import Visibility


class Counting:
    """The two calls the scope check makes, with the snapshot reads counted."""

    def __init__(self, store: LocalStore) -> None:
        self.store = store
        self.reads = 0

    def list_branches(self, volume: str) -> dict[str, str]:
        return self.store.list_branches(volume)

    def snapshot(self, sid: str) -> SnapshotInfo:
        self.reads += 1
        return self.store.snapshot(sid)


def publish(store: LocalStore, volume: str, n: int, branch: str = "live") -> list[str]:
    out = []
    for i in range(n):
        t = Transaction(store, volume, branch)
        t.write("f", str(i).encode())
        out.append(t.commit())
    return out


def test_a_recent_snapshot_costs_its_distance_from_the_head_not_the_history(
        store: LocalStore) -> None:
    history = publish(store, "v", 300)
    store.fork("v", "side", at=history[100])
    side = publish(store, "v", 5, branch="side")
    store.create_volume("w")
    other = publish(store, "w", 3)
    vis, counted = Visibility(), Counting(store)
    vid = store.volume_id("v")
    check: Any = counted  # the scope check needs only the two calls above

    assert vis.contains(check, vid, "v", history[-3])
    # Both heads, then newest first: the side branch's five (newer), then two of live's.
    assert counted.reads <= 12  # not 300
    before = counted.reads
    assert vis.contains(check, vid, "v", side[-1])
    assert vis.contains(check, vid, "v", history[-1])
    assert counted.reads == before  # seen already

    # Another volume's snapshot is not in this history: that walks the rest, once.
    assert not vis.contains(check, vid, "v", other[-1])
    assert 300 <= counted.reads <= 310
    before = counted.reads
    assert vis.contains(check, vid, "v", history[0])
    assert not vis.contains(check, vid, "v", other[0])
    assert not vis.contains(check, vid, "v", "ab" * 32)
    assert counted.reads == before  # the set is complete: misses cost nothing more

    # New publishes are followed only back to what is known.
    newer = publish(store, "v", 3)
    assert vis.contains(check, vid, "v", newer[0])
    assert counted.reads - before <= 4


def test_a_volume_made_anew_under_the_same_name_starts_afresh(store: LocalStore) -> None:
    old = publish(store, "v", 2)
    vis = Visibility()
    assert vis.contains(store, store.volume_id("v"), "v", old[-1])
    store.delete_volume("v")
    store.create_volume("v")
    new = publish(store, "v", 1)
    vid = store.volume_id("v")
    assert vis.contains(store, vid, "v", new[0])
    assert not vis.contains(store, vid, "v", old[-1])
