"""Hydration: the object index a restored store has not copied in yet.

A store restored from a bucket starts from the checkpoint's tables, but its
object index stays in the bucket as runs of blocks: a lookup the local index
misses reads, run by run from the newest, the one block that would hold the
id (`locate`), and the background pass copies the runs in, merged, a block at
a time (`_hydrate_some`) until the local index holds all of it. Garbage
collection, a checkpoint of the whole index, and merges of runs wait for
that.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator

from strata.engine.checkpoint import BLOCK_ENTRIES, Entry, find_in_block, merged
from strata.engine.index import Loc
from strata.engine.tierstate import TierState

_log = logging.getLogger(__name__)  # `_log`: `self.log` is the owner log

HYDRATE_BLOCKS = 64        # blocks of an inherited index run copied in per background pass


BLOCK_CACHE = 64           # blocks of inherited runs kept for lookups (about 3 MB)


class Hydration(TierState):
    """Copying the inherited index runs in, and answering lookups from them meanwhile."""

    def _hydrate_some(self) -> bool:
        """Copy the next block of the inherited index runs into the local index.

        The runs are read merged (the newest run's word on an id wins, and a
        tombstone means the id is gone); the local index keeps what it has,
        which is newer still. Returns whether any of it is left to copy.
        """
        runs = self._inherited_index
        if runs is None:
            return False
        assert self._index is not None
        if self._hydrating is None:
            self._hydrating = _blocks(merged(runs))
        block = next(self._hydrating, None)
        if block is not None:
            self._index.add_objects((oid, loc) for oid, loc in block if loc is not None)
            self.stats["index_entries_hydrated"] += len(block)
            return True
        self._inherited_index, self._hydrating = None, None
        self._hydrated = self._cp_name
        self._inherited_blocks.clear()
        self._save_state()
        _log.info("the local index holds all of checkpoint %s", self._cp_name)
        return False

    def locate(self, oid: bytes) -> tuple[Loc | None, list[tuple[bytes, Loc]]]:
        """Where the inherited runs put `oid`, and entries the caller's index may keep.

        With one run, the whole block read (its neighbours are read next); with
        more, only the entry found, since an older run's block may hold ids a
        newer run dropped.
        """
        runs = self._inherited_index
        if runs is None:
            return None, []
        for run, firsts in zip(runs, self._inherited_firsts, strict=True):
            i = bisect.bisect_right(firsts, oid) - 1
            if i < 0:
                continue
            reader = run[i]
            b = reader.block_of(oid)
            if b is None:
                continue
            key = (reader.name, b)
            block = self._inherited_blocks.get(key)
            if block is None:
                block = reader.read_block(b)
                self._inherited_blocks[key] = block
                while len(self._inherited_blocks) > BLOCK_CACHE:
                    self._inherited_blocks.popitem(last=False)
            else:
                self._inherited_blocks.move_to_end(key)
            found, loc = find_in_block(block, oid)
            if found:
                if loc is None:
                    return None, []  # dropped: older runs' word no longer counts
                keep = [(k, v) for k, v in block if v is not None] if len(runs) == 1 else [
                    (oid, loc)]
                return loc, keep
        return None, []

    def index_complete(self) -> bool:
        """Whether the local index holds every object (after a restore it comes lazily)."""
        return self._inherited_index is None


def _blocks(entries: Iterator[Entry], size: int = BLOCK_ENTRIES) -> Iterator[list[Entry]]:
    block: list[Entry] = []
    for e in entries:
        block.append(e)
        if len(block) >= size:
            yield block
            block = []
    if block:
        yield block
