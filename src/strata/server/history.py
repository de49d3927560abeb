"""What snapshots changed: publish descriptions, change counts, and a rejected run's conflicts.

The event feed (server/events.py) and the web view (server/ui.py) both tell
what a snapshot changed against its parent, and both walk a branch back to
an older snapshot; the rules for that live here, once. Everything here
reads the store through the `Store` interface and returns plain values:
no HTTP, no events, nothing written.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from strata.engine.errors import Expired
from strata.engine.interface import SnapshotInfo, Store
from strata.engine.tree import Trees, change_kind

COUNT_LIMIT = 100_000  # diff lines counted per publish before giving up ("truncated")
UNCOUNTED = "_uncounted"  # a publish event whose change counts no reader has needed yet


def run_of(meta: dict[str, Any]) -> str | None:
    """The run a snapshot or change set names in its metadata, if any."""
    run = meta.get("run") if isinstance(meta, dict) else None
    return run if isinstance(run, str) else None


def describe_publish(store: Store, sid: str, count_limit: int = COUNT_LIMIT, *,
                     counts: bool = True) -> dict[str, Any]:
    """A snapshot as a publish event describes it: parent, message, time, +/-/M counts.

    With `counts=False` the counts are left to `EventFeed.counted` (the event
    carries UNCOUNTED until then).
    """
    info = store.snapshot(sid)
    out: dict[str, Any] = {"snapshot": sid, "parent": info.parent, "message": info.message,
                           "snapshot_time": info.time_ns / 1e9, "run": run_of(info.meta)}
    if counts:
        out.update(count_changes(store, sid, count_limit))
    else:
        out[UNCOUNTED] = True
    return out


def count_changes(store: Store, sid: str, count_limit: int = COUNT_LIMIT) -> dict[str, Any]:
    """How many paths a snapshot added, deleted and modified against its parent."""
    info = store.snapshot(sid)
    out: dict[str, Any] = {"added": 0, "deleted": 0, "modified": 0}
    if info.parent is None:
        return out
    try:
        base = store.snapshot(info.parent).root
    except Expired:
        out["parent_expired"] = True  # what came before was let go: nothing to compare
        return out
    n = 0
    for _path, old, new in Trees(store, store.node_cache).diff(base, info.root):
        change = change_kind(old, new)
        out[change] += 1
        n += 1
        if n >= count_limit:
            out["truncated"] = True
            break
    return out


def walk_back(store: Store, head: str, stop: str | None, limit: int
              ) -> tuple[list[str], str | None]:
    """The snapshots from `head` back to `stop` (not included), newest first, at most `limit`.

    Also where the walk ended: `stop` when `head` descends from it, else the
    first snapshot of history (None) or the one the limit cut at.
    """
    chain: list[str] = []
    cur: str | None = head
    while cur is not None and cur != stop and len(chain) < limit:
        chain.append(cur)
        cur = store.snapshot(cur).parent
    return chain, cur


@dataclass
class Touched:
    """A snapshot on another branch that changed some of the rejected run's paths."""

    info: SnapshotInfo
    paths: list[str]


@dataclass
class Rejection:
    """A rejected change set (the head of `rejected/<run>`) beside what it met."""

    head: SnapshotInfo
    changes: dict[str, str]  # path -> added | deleted | modified, against the run's base
    conflicts_with: list[tuple[str, list[Touched]]]  # (branch, its snapshots since the base)


def rejection(store: Store, heads: dict[str, str], branch: str, diff_limit: int,
              chain_limit: int = 1000) -> Rejection:
    """What `branch`'s head changed since its parent, and what else changed those paths.

    `rejected/<run>` holds the refused change set published on the snapshot
    the run started from (its parent). What it conflicted with is on the
    volume's other branches (`heads`, rejected ones left out): the snapshots
    published since that base that touched the same paths. A branch that
    does not descend from the base within `chain_limit` snapshots is passed
    over; each diff is cut at `diff_limit` paths.
    """
    info = store.snapshot(heads[branch])
    base = info.parent
    trees = Trees(store, store.node_cache)
    mine: dict[str, str] = {}
    if base is not None:
        for path, old, new in itertools.islice(
                trees.diff(store.snapshot(base).root, info.root), diff_limit):
            mine[path] = change_kind(old, new)
    against: list[tuple[str, list[Touched]]] = []
    for other, ohead in sorted(heads.items()):
        if other == branch or other.startswith("rejected/") or base is None:
            continue
        chain, reached = walk_back(store, ohead, base, chain_limit)
        if reached != base:
            continue  # this branch does not descend from the run's base
        snaps = []
        for sid in reversed(chain):
            s = store.snapshot(sid)
            touched = []
            if s.parent is not None:
                for path, _o, _n in itertools.islice(
                        trees.diff(store.snapshot(s.parent).root, s.root), diff_limit):
                    if path in mine:
                        touched.append(path)
            if touched:
                snaps.append(Touched(s, touched))
        if snaps:
            against.append((other, snaps))
    return Rejection(info, mine, against)
