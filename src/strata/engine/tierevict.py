"""Eviction: the local pack directory kept under a budget, as a cache.

Only packs named by the last checkpoint this owner saved may be dropped (a
reopened store learns where packs are from that file), least recently read
first, and never while a read is using one (`_using` counts them). A pack
read again and again from the bucket is fetched back whole (`_fetch_back`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from strata.engine.tierstate import TierState

_log = logging.getLogger(__name__)  # `_log`: `self.log` is the owner log

EVICT_INTERVAL = 1.0       # seconds between checks of the local budget


class Eviction(TierState):
    """Dropping checkpointed packs to fit the budget, and fetching hot ones back."""

    def evict(self, budget: int) -> list[int]:
        """Drop checkpointed packs, least recently read first, until local bytes fit."""
        with self._lock:
            local = sorted(self._local)
            candidates = [n for n in local if n in self._checkpointed]
        sizes = {}
        for n in local:
            with contextlib.suppress(FileNotFoundError):
                sizes[n] = self.local.size(n)
        total = sum(sizes.values())
        dropped: list[int] = []
        candidates.sort(key=lambda n: (self._last_read.get(n, 0.0), n))
        for n in candidates:
            if total <= budget:
                break
            with self._lock:
                if self._reading[n] or n not in self._local:
                    continue  # in use: a later pass takes it
                self._local.discard(n)  # new reads go to the bucket from now on
            with contextlib.suppress(FileNotFoundError):  # or collected meanwhile
                self.local.remove(n)
            total -= sizes.get(n, 0)
            self.stats["evicted"] += 1
            self.stats["evicted_bytes"] += sizes.get(n, 0)
            dropped.append(n)
        if dropped:
            _log.info("evicted %d pack(s) to fit the %d-byte budget: %s", len(dropped), budget,
                      dropped)
        return dropped

    def _fetch_back(self, number: int) -> None:
        with self._lock:
            if number in self._local or number not in self.remote:
                return
        self._download(number)
        self.stats["fetched_back"] += 1
        _log.info("fetched pack %d back from the bucket (read again and again)", number)

    @contextlib.contextmanager
    def _using(self, number: int) -> Iterator[bool]:
        """Whether `number` is read locally; if so, eviction leaves it alone meanwhile."""
        with self._lock:
            local = number in self._local or number not in self.remote
            if local:
                self._reading[number] += 1
        try:
            yield local
        finally:
            if local:
                self._last_read[number] = time.monotonic()
                with self._lock:
                    self._reading[number] -= 1
                    if not self._reading[number]:
                        del self._reading[number]
