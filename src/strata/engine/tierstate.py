"""The state the bucket tier's parts share, and the files it keeps in the store.

`TieredPacks` (engine/tier.py) is put together from one class per job, each
in a module of its own; this is the base they all build on: the attributes
set up at open, the locks that guard them, and the check that refuses work
once the tier has failed. It does no work of its own and starts no thread.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from strata.engine.bucket import Bucket, OwnerLog
from strata.engine.checkpoint import Checkpoint, Entry, Merge, Part, PartReader, runs_of
from strata.engine.errors import StoreFailed
from strata.engine.index import Index
from strata.engine.packstore import LocalPacks, PackStore

Progress = Callable[[int, int, int], None]  # records done, records in all, bytes so far
Chunk = tuple[int, int, bytes | None]  # pack, offset, bytes (None: cut the pack here)
BUCKET_META = "strata-bucket"
BUCKET_FORMAT = 2          # 2: every object sealed with the store's key; 1: none was
TIER_STATE = "tier.json"              # in the store: this owner's epoch and log position
TIER_CHECKPOINT = "tier-checkpoint"   # in the store: the last checkpoint it wrote or read


class TierState(PackStore):
    """What every part of the tier reads and writes (see engine/tier.py for the whole)."""

    def __init__(self, local: LocalPacks, bucket: Bucket, log: OwnerLog, *, strict: bool,
                 checkpoint: Checkpoint | None = None, cache_size: int | None = None,
                 hydrated: str | None = None, clean: bool = False,
                 from_log: set[int] | None = None, cp_name: str | None = None,
                 dropped_to: int | None = None) -> None:
        self.local = local
        self.bucket = bucket
        self.log = log
        self.strict = strict
        self.cache_size = cache_size
        self.failed: BaseException | None = None
        # Asked after every datasync, before the journal acknowledges: raises
        # `Unavailable` to withhold the acknowledgement (a fleet member whose
        # lease could have expired; strata/fleet/lease.py). None: always ack.
        self.ack_gate: Callable[[], None] | None = None
        self._lock = threading.Lock()          # pending chunks and the maps below
        self._ship_lock = threading.Lock()     # one segment write at a time, in order
        self._work_lock = threading.Lock()     # the background pass, or a flush
        self._pending: list[Chunk] = []
        self._pending_bytes = 0
        self._shipped_at = time.monotonic()
        self._pending_since: float | None = None
        self._shipping_since: float | None = None  # the oldest chunk of the ship under way
        # Packs in the bucket: number -> (object name, size). From the checkpoint a
        # restore started from, then each upload.
        self.remote: dict[int, tuple[str, int]] = dict(checkpoint.packs) if checkpoint else {}
        self._first_seq: dict[int, int] = {}   # pack -> first segment holding its bytes
        self._uploads: collections.deque[int] = collections.deque()
        self._windows: collections.OrderedDict[tuple[int, int], bytes] = \
            collections.OrderedDict()
        # Windows being fetched now: a second reader of one waits for the first's GET.
        self._window_loads: dict[tuple[int, int], threading.Event] = {}
        # The object index of the checkpoint this store started from, until the local
        # index holds all of it (`hydrated` names the run it holds whole): misses read
        # it a block at a time meanwhile, and the background loop copies it in.
        self._inherited_index: list[list[PartReader]] | None = None
        self._hydrated = hydrated
        # Whether the last owner of this directory shipped everything it wrote (a clean
        # close, or a restore, whose packs come from the log): if not, reship at attach.
        self._clean_at_open = clean
        self._clean = False
        # Packs a restore rebuilt from log segments: their bytes came from the bucket,
        # so objects read from them are checked against their ids like bucket packs.
        self._from_log: set[int] = set(from_log or ())
        self._hydrating: Iterator[list[Entry]] | None = None
        # The index as the last checkpoint left it in the bucket: its runs (the manifest),
        # its tables, and its name (`cp-base` in the index says whether the index's
        # `changed` table counts from there; see engine/tiercheckpoints.py).
        self._manifest: list[Part] = list(checkpoint.parts) if checkpoint else []
        self._tables_ref: dict[str, tuple[str, bytes]] = (
            dict(checkpoint.tables) if checkpoint else {})
        # The parts tables its manifest names (checkpoint version 6), reused by digest.
        self._part_tables: list[tuple[str, bytes]] = (
            list(checkpoint.part_tables) if checkpoint else [])
        self._pack_tables: list[tuple[str, bytes]] = (
            list(checkpoint.pack_tables) if checkpoint else [])
        self._cp_name: str | None = cp_name
        self._next_run = 1 + max((p.run for p in self._manifest), default=0)
        # The merge the last checkpoint left in progress, if any (engine/checkpoint.py).
        self._merging: Merge | None = checkpoint.merge if checkpoint else None
        if self._merging is not None:
            self._next_run = max(self._next_run, self._merging.out + 1)
        self._written_bytes: dict[str, int] = {}
        if self._manifest and hydrated not in (
                cp_name, *(p.name for p in self._manifest if len(self._manifest) == 1)):
            self._inherited_index = [
                [PartReader(p, self._ranged(p.name)) for p in run]
                for run in runs_of(self._manifest)]
        # Each inherited run's parts' first ids, for a lookup to pick the part.
        self._inherited_firsts = [[r.part.first for r in run]
                                  for run in self._inherited_index or []]
        self._inherited_blocks: collections.OrderedDict[tuple[str, int], list[Entry]] = \
            collections.OrderedDict()
        # The local directory, as the tier sees it: which packs are there, which reads
        # are using one (eviction waits for them), when each was last read.
        self._local: set[int] = set(local.numbers())
        self._reading: collections.Counter[int] = collections.Counter()
        self._last_read: dict[int, float] = {}
        self._misses: collections.Counter[int] = collections.Counter()
        self._fetches: collections.deque[int] = collections.deque()
        # Bucket objects of packs garbage collection removed: (name, checkpoints written
        # before the removal). Deleted once a later checkpoint is in the log.
        self._doomed: list[tuple[str, float]] = []
        self._cp_taken = 0  # checkpoints that took their view of the packs
        self._cp_done = 0   # the newest of those views that is in the log
        # Packs the last checkpoint this owner saved names as uploaded: only these may
        # be evicted, since a reopened store learns where packs are from that file.
        self._checkpointed: set[int] = set(checkpoint.packs) if checkpoint else set()
        self._evict_checked = 0.0
        self._log_from_at_open = checkpoint.log_from if checkpoint is not None else 0
        # Log segments given back (engine/tierdrop.py): every one below `_dropped_to`
        # that was worth it (None: not known yet, so searched for, down from the
        # checkpoint's `log_from`), up to the newest checkpoint's `log_from`.
        self._dropped_to = dropped_to
        self._drop_search = self._log_from_at_open - 1
        self._drop_upto = self._log_from_at_open if cp_name else 0
        self._own_from = log.epoch if log.epoch is not None else 0  # this process's claim
        self._own_segments: dict[int, int] = {}  # segments it shipped, not yet dropped
        self._swept_at = time.monotonic()  # the last sweep (engine/tiersweep.py)
        self._index: Index | None = None
        self._state_dir: str | None = None
        self._store_id = b""
        self._block_size = 0
        self._changed = False
        self._checkpointed_at = 0.0
        self.stats = {"segments": 0, "segment_bytes": 0, "packs_uploaded": 0,
                      "bytes_uploaded": 0, "checkpoints": 0, "ranged_reads": 0,
                      "last_checkpoint": 0.0, "last_ship": 0.0, "max_unshipped_ms": 0.0,
                      "outages": 0, "evicted": 0, "evicted_bytes": 0, "fetched_back": 0,
                      "index_entries_hydrated": 0, "packs_deleted": 0,
                      "index_objects_deleted": 0, "checkpoint_bytes": 0, "index_runs": 0,
                      "checkpoint_bytes_total": 0, "index_parts": 0,
                      "merged_entries": 0, "delta_entries": 0, "segments_dropped": 0,
                      "segment_bytes_dropped": 0, "objects_swept": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fence_thread: threading.Thread | None = None

    def _ranged(self, name: str) -> Callable[[int, int], bytes]:
        return lambda start, end: self.bucket.get_range(name, start, end)

    def _check(self) -> None:
        if self.failed is not None:
            raise StoreFailed(f"the bucket tier stopped: {self.failed}")

    if TYPE_CHECKING:  # the parts call each other through the assembled class
        def ship(self) -> None: ...
        def _record(self, chunk: Chunk) -> None: ...
        def _upload_queued(self) -> None: ...
        def checkpoint(self) -> str: ...
        def _save_state(self, checkpoint: bytes | None = None) -> None: ...
        def _hydrate_some(self) -> bool: ...
        def index_complete(self) -> bool: ...
        def _download(self, number: int) -> None: ...
        def _using(self, number: int) -> AbstractContextManager[bool]: ...
