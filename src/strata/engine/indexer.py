"""The indexer: LMDB follows the journal, off the commit path.

The journal queues every record it appends here; a background thread writes
the durable ones into the index (docs/design.md, crash-safety rule 4), with
the position reached in the same LMDB transaction. Objects not yet indexed
are kept in `recent`, so a reader finds each object in one place or the
other. The indexer owns the open `Index` and what is derived from it (the
reach table), because rebuilding the index replaces them together.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from strata.engine.errors import StrataError
from strata.engine.index import Index, Loc, RefsOf
from strata.engine.reach import Reach

log = logging.getLogger(__name__)

Pos = tuple[int, int]


class Indexer:
    def __init__(self, index: Index, durable: Callable[[], Pos], report: dict[str, Any]) -> None:
        self.index = index
        self.reach = Reach(index)
        self._durable = durable  # how far the journal is durable
        self._report = report    # the store's recovery report, where errors go
        self.recent: dict[bytes, Loc] = {}
        # What a newly indexed node names (recovery.frame_refs): the GC accounting needs it.
        self.refs_of: RefsOf | None = None
        # Where objects the index lacks may be (a restored store's lazily read index).
        self.fallback: Callable[[bytes], tuple[Loc | None, list[tuple[bytes, Loc]]]] | None \
            = None
        self._queue: collections.deque[tuple[Pos, str, Any]] = collections.deque()
        # One flusher at a time: batches must reach LMDB in order, or `applied`
        # could pass a batch another thread has popped but not yet written.
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def replace(self, index: Index) -> None:
        """Serve from a rebuilt index (caller holds `lock`)."""
        self.index = index
        self.reach = Reach(index)

    def locate(self, oid: bytes) -> Loc | None:
        loc = self.recent.get(oid)
        if loc is None:
            loc = self.index.locate(oid)
        if loc is None and self.fallback is not None:
            loc, block = self.fallback(oid)
            if block:  # keep the whole block: its neighbours are read next
                self.index.add_objects(block)
        return loc

    def has(self, oid: bytes) -> bool:
        if oid in self.recent or self.index.contains(oid):
            return True
        return self.fallback is not None and self.locate(oid) is not None

    def appended_object(self, end: Pos, oid: bytes, loc: Loc) -> None:
        self.recent[oid] = loc
        self._queue.append((end, "object", (oid, loc)))

    def appended(self, end: Pos, what: str, ops: list[list[Any]] | None) -> None:
        """A commit record ("commit", its ops) or a seal ("seal", None) ends at `end`."""
        self._queue.append((end, what, ops))

    def start(self, interval: float, also: Callable[[], None]) -> None:
        """Flush every `interval` seconds, then call `also` (the journal's age check)."""
        self._thread = threading.Thread(target=self._loop, args=(interval, also),
                                        name="strata-indexer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self, interval: float, also: Callable[[], None]) -> None:
        said = ""  # the refusal logged last: a store that failed says so once, not 20 times a s
        while not self._stop.wait(interval):
            try:
                self.flush()
                also()
                said = ""
            except StrataError as exc:  # the store refuses (failed, closing): next round
                if str(exc) != said:
                    said = str(exc)
                    log.warning("indexer: %s", exc, exc_info=True)
                continue
            except Exception as exc:  # keep serving reads; report through fsck
                log.error("indexer: writing the index failed: %s", exc, exc_info=True)
                errs = self._report.setdefault("indexer_errors", [])
                errs.append(str(exc))
                del errs[:-10]

    def flush(self) -> None:
        with self.lock:
            self.flush_locked()

    def flush_locked(self) -> None:
        durable = self._durable()
        objs: list[tuple[bytes, Loc]] = []
        ops: list[list[Any]] = []
        reached: Pos | None = None
        batch = []
        while self._queue and self._queue[0][0] <= durable:
            batch.append(self._queue.popleft())
            pos, what, payload = batch[-1]
            if what == "object":
                objs.append(payload)
            elif what == "commit":
                ops.extend(payload)
            reached = pos
        if reached is None:
            return
        try:
            self.index.apply(objs, ops, reached, self.refs_of)
        except BaseException:
            # Put the batch back, in order, for the next flush: dropped, a later
            # batch would mark the index applied past records it never got.
            self._queue.extendleft(reversed(batch))
            raise
        for oid, _loc in objs:
            self.recent.pop(oid, None)
