"""Hydration: the object index a restored store has not copied in yet.

A store restored from a bucket starts from the checkpoint's tables, but its
object index stays in the bucket as a run of blocks: a lookup the local
index misses reads the one block that would hold the id (`locate`), and the
background pass copies the run in a block at a time (`_hydrate_some`) until
the local index holds all of it. Garbage collection and checkpoints wait
for that.
"""

from __future__ import annotations

import logging

from strata.engine.index import Loc
from strata.engine.tierstate import TierState

_log = logging.getLogger(__name__)  # `_log`: `self.log` is the owner log

HYDRATE_BLOCKS = 64        # blocks of an inherited index run copied in per background pass


class Hydration(TierState):
    """Copying the inherited index run in, and answering lookups from it meanwhile."""

    def _hydrate_some(self) -> bool:
        """Copy the next block of the inherited index run into the local index.

        Returns whether any of it is left to copy.
        """
        run = self._inherited_index
        if run is None:
            return False
        assert self._index is not None
        if self._hydrating is None:
            self._hydrating = run.read_all()
        block = next(self._hydrating, None)
        if block is not None:
            self._index.add_objects(block)
            self.stats["index_entries_hydrated"] += len(block)
            return True
        self._inherited_index, self._hydrating, self._hydrated = None, None, run.name
        self._save_state()
        _log.info("the local index holds all of %s (%d entries)", run.name, run.entries)
        return False

    def locate(self, oid: bytes) -> tuple[Loc | None, list[tuple[bytes, Loc]]]:
        """Where the checkpoint's index run puts `oid`, and the block read to find it."""
        run = self._inherited_index
        if run is None:
            return None, []
        i = run.block_of(oid)
        if i is None or i in self._inherited_blocks:
            return None, []  # fetched before: the caller's index already holds it all
        loc, block = run.lookup(oid)
        self._inherited_blocks.add(i)
        return loc, block

    def index_complete(self) -> bool:
        """Whether the local index holds every object (after a restore it comes lazily)."""
        return self._inherited_index is None
