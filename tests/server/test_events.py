"""The event feed on a real store: publish order, no duplicates, catch-up from history."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from strata.engine.interface import ChangeSet
from strata.engine.local import LocalStore, init_store
from strata.engine.txn import Transaction
from strata.server.events import EventFeed, Subscription, Watch


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    init_store(str(tmp_path / "store"))
    s = LocalStore(str(tmp_path / "store"))
    s.create_volume("v")
    s.create_volume("w")
    yield s
    s.close()


def _publish(store: LocalStore, feed: EventFeed, name: str, volume: str = "v") -> str:
    txn = Transaction(store, volume)
    txn.write(name, name.encode())
    sid = txn.commit(f"write {name}")
    feed.note_publish([ChangeSet(volume, "live", txn.base, {})], [sid], None)
    return sid


def _settle(feed: EventFeed, seq: int) -> None:
    deadline = time.monotonic() + 10
    while feed.last_seq < seq:
        assert time.monotonic() < deadline, f"feed stuck at {feed.last_seq}, waiting for {seq}"
        time.sleep(0.01)


def test_events_in_publish_order_even_when_noted_out_of_order(store: LocalStore) -> None:
    feed = EventFeed(lambda: store)
    try:
        sub = Subscription(feed, Watch({"v"}, set()))
        sub.start(store, None, {})
        # Publishes noted child first (as two handlers woken by one fsync may be).
        a = Transaction(store, "v")
        a.write("a", b"1")
        sa = a.commit("a")
        b = Transaction(store, "v")
        b.write("b", b"22")
        b.write("a", b"3")
        sb = b.commit("b")
        feed.note_fork("v", "seen", sa)  # the feed now knows live's head is older than sb
        _settle(feed, 1)
        feed._heads[("v", "live")] = store.snapshot(sa).parent or ""
        feed.note_publish([ChangeSet("v", "live", sa, {})], [sb], None)
        feed.note_publish([ChangeSet("v", "live", "", {})], [sa], None)
        feed.note_publish([ChangeSet("v", "live", "", {})], [sa], None)  # a duplicate
        _settle(feed, 3)
        time.sleep(0.1)
        events = [e for e in sub.poll(store) if e["type"] == "publish"]
        assert [e["snapshot"] for e in events] == [sa, sb]
        assert (events[1]["added"], events[1]["modified"]) == (1, 1)
        assert feed.last_seq == 3  # the duplicate was not announced
    finally:
        feed.close()


def test_reader_behind_the_ring_catches_up_from_history(store: LocalStore) -> None:
    feed = EventFeed(lambda: store, ring=4)
    try:
        sub = Subscription(feed, Watch({"v"}, set()))
        hello = sub.start(store, None, {})
        assert hello[-1]["type"] == "hello"
        sids = [_publish(store, feed, f"f{i}") for i in range(10)]
        _publish(store, feed, "other", volume="w")  # not watched
        _settle(feed, 11)
        first = sub.poll(store)
        pubs = [e for e in first if e["type"] == "publish"]
        assert [e["snapshot"] for e in pubs] == sids  # all ten, oldest first, none twice
        assert all(e.get("replayed") for e in pubs)
        assert first[-1]["type"] == "resync"
        more = [_publish(store, feed, f"g{i}") for i in range(2)]
        _settle(feed, 13)
        assert [e["snapshot"] for e in sub.poll(store)] == more
        assert sub.poll(store) == []
    finally:
        feed.close()


def test_resume_with_known_heads_after_a_restart(store: LocalStore) -> None:
    feed = EventFeed(lambda: store)
    try:
        old = store.head("v", "live")
        sids = [_publish(store, feed, f"f{i}") for i in range(3)]
        _settle(feed, 3)
        # A reader from another server process (another epoch) that had seen `old`.
        sub = Subscription(feed, Watch(set(), {("v", "live")}))
        out = sub.start(store, "deadbeef:99", {("v", "live"): old})
        assert [e["snapshot"] for e in out if e["type"] == "publish"] == sids
        assert out[-1] == {**out[-1], "type": "hello", "resync": True}
        assert sub.poll(store) == []  # what the catch-up covered is not sent again
    finally:
        feed.close()


def test_change_counts_are_the_same_counted_at_once_or_when_first_read(
        store: LocalStore) -> None:
    from strata.server.events import UNCOUNTED, count_changes
    feed = EventFeed(lambda: store)
    try:
        first, second = Subscription(feed, Watch({"v"}, set())), Subscription(
            feed, Watch({"v"}, set()))
        first.start(store, None, {})
        second.start(store, None, {})
        quiet = _publish(store, feed, "nobody-listens")  # counted when first read
        _settle(feed, 1)
        undo = feed.listen(lambda: None)
        try:
            watched = _publish(store, feed, "someone-listens")  # counted at once
            _settle(feed, 2)
        finally:
            undo()
        ring = dict(feed.since(0)[0])
        assert ring[1].get(UNCOUNTED) and "added" not in ring[1]
        assert not ring[2].get(UNCOUNTED) and ring[2]["added"] == 1
        for sub in (first, second):  # two readers, one count, the ring left as it was
            got = {e["snapshot"]: e for e in sub.poll(store) if e["type"] == "publish"}
            for sid in (quiet, watched):
                want = count_changes(store, sid)
                assert {k: got[sid][k] for k in want} == want
                assert UNCOUNTED not in got[sid]
        assert ring[1].get(UNCOUNTED)
    finally:
        feed.close()
