"""Sweeping: bucket objects that no checkpoint names, left by work that never finished.

After each checkpoint is in the log, the owner deletes what that checkpoint
replaced (engine/tiercheckpoints.py). It cannot delete what it never learned
of:
- the runs and tables of a checkpoint killed before its log record;
- a pack upload that an outage or a kill cut short (each attempt has a fresh
  name);
- whatever a fenced owner uploaded after its last logged checkpoint.

So now and then (`SWEEP_INTERVAL`, and `SWEEP_FIRST` after open) the owner
LISTs `packs/`, `runs/`, `tables/` and `checkpoints/`, and deletes an object
only when all of these hold:
- no part of its own state names it. That state is its newest logged
  checkpoint's manifest, tables and name, the packs in its map (those that
  checkpoint names, and uploads since), and the objects already queued for
  deletion, which wait for their own turn;
- the epoch in its name is this owner's or an earlier one. A successor's
  objects carry a later epoch, so an owner that is fenced and has not noticed
  yet never touches them;
- it is older than `SWEEP_AGE` by the bucket's clock;
- a HEAD of this owner's next log number finds no successor, just before.

The sweep runs in the background pass, which also does every upload and
checkpoint, so none of this owner's is under way meanwhile. A restore reads
the newest checkpoint logged before its claim. Everything that checkpoint
names is kept here, or is a successor's.
"""

from __future__ import annotations

import logging
import re
import time

from strata.engine.tierstate import TierState

_log = logging.getLogger(__name__)

SWEEP_INTERVAL = 3600.0   # seconds between sweeps
SWEEP_FIRST = 60.0        # ... and the first, this long after open
SWEEP_AGE = 600.0         # an object younger than this (bucket clock) is left alone
PREFIXES = ("packs/", "runs/", "tables/", "checkpoints/")
# The writer's epoch in each name: packs/<number>-<epoch>-..., and <prefix>/<epoch>-<seq>-...
_EPOCH = re.compile(r"^(?:packs/[0-9a-f]+-(\d+)-|(?:runs|tables|checkpoints)/(\d+)-)")


def name_epoch(name: str) -> int | None:
    """The epoch of the owner that wrote `name` (None: not a name the tier writes)."""
    m = _EPOCH.match(name)
    if m is None:
        return None
    return int(m.group(1) or m.group(2))


class Sweeping(TierState):
    """The LIST that finds what nothing names, now and then."""

    def _named(self) -> set[str]:
        """Every bucket object this owner's state names (the newest logged checkpoint's)."""
        with self._lock:
            named = {name for name, _size in self.remote.values()}
            named |= {name for name, _at in self._doomed}
        named |= {p.name for p in self._manifest}
        named |= {name for name, _h in self._tables_ref.values()}
        named |= {name for name, _h in (*self._part_tables, *self._pack_tables)}
        if self._cp_name:
            named.add(self._cp_name)
        return named

    def sweep(self, age: float = SWEEP_AGE) -> int:
        """Delete what no checkpoint names (see the module docstring); how many went."""
        self._swept_at = time.monotonic()
        epoch = self.log.epoch
        if epoch is None or not self._cp_name or not self._cp_name.startswith("checkpoints/"):
            return 0  # nothing logged names anything yet: nothing can be told unnamed
        listed = [item for prefix in PREFIXES for item in self.bucket.listing(prefix)]
        named = self._named()
        now = time.time()
        doomed = [name for name, _size, modified in listed
                  if name not in named and now - modified >= age
                  and (e := name_epoch(name)) is not None and e <= epoch]
        if not doomed:
            return 0
        self.log.check_owner()  # `Fenced` if a successor claimed meanwhile
        for name in doomed:
            self.bucket.delete(name)
            _log.info("swept %s: no checkpoint names it", name)
        self.stats["objects_swept"] += len(doomed)
        return len(doomed)
