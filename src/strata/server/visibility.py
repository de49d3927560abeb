"""Which snapshots a volume's history holds: the scope check for tokens, kept cheap.

A token scoped to a volume may name only snapshots in that volume's history
(as a publish base, a fork point, a prefix to resolve). Walking every
branch's history on every request would cost O(history) per request, and even
once per volume it costs O(history) before the first scoped read answers.
So the server walks lazily: per volume it keeps the snapshots it has seen in
that volume's history and a frontier of those not yet followed to their
parents, newest first across all branches. A question walks only until the
snapshot turns up, so naming a recent snapshot costs about the number of
snapshots made since, whatever the history's length. Only a snapshot that is
not in the history (another volume's, or none at all) walks the rest, once:
after that the volume's set is complete and a later miss follows only the
snapshots published since. The order is by snapshot time, but only as a
guess at where to look first: a skewed clock makes a walk longer, never
wrong. A volume that is deleted and made anew under the same name has another
id and starts afresh. Snapshots of deleted branches stay known: they were
that volume's history.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass, field

from strata.engine.errors import NotFound
from strata.engine.interface import Store


@dataclass
class _Walk:
    volume_id: str
    known: set[str] = field(default_factory=set)  # seen in the history
    # Seen but not yet followed to their parents: (-time, id, parent), newest first.
    frontier: list[tuple[int, str, str | None]] = field(default_factory=list)


class Visibility:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._walks: dict[str, _Walk] = {}  # volume name -> its walk so far

    def contains(self, store: Store, volume_id: str, volume: str, sid: str) -> bool:
        """True if `sid` is in the history of `volume` (whose current id is `volume_id`)."""
        with self._lock:
            walk = self._walks.get(volume)
            if walk is None or walk.volume_id != volume_id:
                walk = self._walks[volume] = _Walk(volume_id)
            if sid in walk.known:
                return True
            for head in store.list_branches(volume).values():
                _see(store, walk, head)
            while sid not in walk.known and walk.frontier:
                _t, _cur, parent = heapq.heappop(walk.frontier)
                if parent is not None:
                    _see(store, walk, parent)
            return sid in walk.known


def _see(store: Store, walk: _Walk, sid: str) -> None:
    """Add `sid` to the history, to be followed later, unless it is known already."""
    if sid in walk.known:
        return
    try:
        info = store.snapshot(sid)
    except NotFound:  # collected with its expired history: the chain ends here
        return
    walk.known.add(sid)
    heapq.heappush(walk.frontier, (-info.time_ns, sid, info.parent))
