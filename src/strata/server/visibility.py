"""Which snapshots a volume's history holds: the scope check for tokens, kept cheap.

A token scoped to a volume may name only snapshots in that volume's history
(as a publish base, a fork point, a prefix to resolve). Walking every
branch's history on every request would cost O(history) per request, so the
server keeps, per volume, the set of snapshot ids it has seen in that
volume's history and extends it incrementally: a miss walks each branch head
back only until it meets a snapshot already known. A volume that is deleted
and made anew under the same name has another id and starts a fresh set.
Snapshots of deleted branches stay known: they were that volume's history.
"""

from __future__ import annotations

import threading

from strata.engine.interface import Store


class Visibility:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, tuple[str, set[str]]] = {}  # volume -> (volume id, snapshots)

    def contains(self, store: Store, volume_id: str, volume: str, sid: str) -> bool:
        """True if `sid` is in the history of `volume` (whose current id is `volume_id`)."""
        with self._lock:
            entry = self._known.get(volume)
            if entry is None or entry[0] != volume_id:
                entry = self._known[volume] = (volume_id, set())
            known = entry[1]
            if sid in known:
                return True
            for head in store.list_branches(volume).values():
                cur: str | None = head
                while cur is not None and cur not in known:
                    known.add(cur)
                    cur = store.snapshot(cur).parent
            return sid in known
