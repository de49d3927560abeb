"""Dropping: log segments that a checkpoint made redundant give their bytes back.

Every byte written reaches the bucket twice: in a log segment, within about
half a second, and in its pack, uploaded when the pack is sealed. Once a
checkpoint in the log names the uploaded packs, every restore starts at that
checkpoint's `log_from` or later, so the segments before it are never read
again. They are not deleted: the log's numbers are the fence. A missing number
is where a stalled owner's create-only write would land (SlateDB lost an
acknowledged write that way), and where a search for the end of the log would
stop. So each one is overwritten in place by a small `dropped` record (log
record version 2). The number stays taken, and the bytes go. Claim and checkpoint
records are small and stay as they were written.

The range to drop is `[dropped_to, log_from)`, walked upwards a few records per
background pass. Segments this process shipped are known by number. Records
from before its claim (a previous run's or a previous owner's) are looked at
with a HEAD. Only segments of at least `DROP_MIN` bytes are overwritten: a
drop is one PUT, which costs more than keeping a few KiB does. A
store that does not know where dropping reached (a restore, or one written
before dropping) walks down from its checkpoint's `log_from` to the newest
`dropped` record first. `dropped_to` is kept in tier.json.
"""

from __future__ import annotations

import logging

from strata.engine.bucket import log_name
from strata.engine.errors import NotFound
from strata.engine.tierstate import TierState

_log = logging.getLogger(__name__)

DROP_PER_PASS = 64    # bucket requests one background pass spends on dropping
SMALL_RECORD = 1024   # claims, checkpoint and `dropped` records are smaller than this
# A segment smaller than this stays whole. Dropping one costs a PUT, and at object
# stores' list prices a PUT costs about what keeping 8 KiB costs for three years.
DROP_MIN = 8 << 10


class Dropping(TierState):
    """The log segments below the newest checkpoint's `log_from`, overwritten a few a pass."""

    def _drop_some(self) -> None:
        """Find where dropping reached, if unknown, then drop up to `_drop_upto`."""
        budget = DROP_PER_PASS
        while budget > 0 and self._dropped_to is None:
            budget -= self._search_dropped()
        while budget > 0 and self._dropped_to is not None and self._dropped_to < self._drop_upto:
            seq = self._dropped_to
            with self._lock:
                size = self._own_segments.pop(seq, None)
            if size is None and seq < self._own_from:
                # A record from before this claim: its size says whether it is a segment
                # worth dropping (claims, checkpoints and `dropped` records are small).
                budget -= 1
                try:
                    stored = self.bucket.size(log_name(seq))
                except NotFound:
                    stored = 0  # a gap is for the owner log's checks to find, not here
                size = stored if stored >= DROP_MIN else None
            if size is not None:
                budget -= 1
                self.log.drop(seq, size, self._cp_name or "")
                self.stats["segments_dropped"] += 1
                self.stats["segment_bytes_dropped"] += size
                _log.debug("dropped log record %d (%d bytes): %s is in the log", seq, size,
                           self._cp_name)
            self._dropped_to = seq + 1

    def _search_dropped(self) -> int:
        """One step down from the checkpoint's `log_from` towards the newest `dropped` record.

        Returns the requests it made. Below the newest `dropped` record every
        segment was dropped, since dropping goes upwards; above it, up to
        `log_from`, nothing was (a restore's walk reached there).
        """
        seq = self._drop_search
        if seq < 0:
            self._dropped_to = 0
            return 0
        try:
            stored = self.bucket.size(log_name(seq))
        except NotFound:
            stored = SMALL_RECORD + 1  # not ours to judge: the owner log's checks are
        if stored <= SMALL_RECORD and self.log.read(seq)["kind"] == "dropped":
            self._dropped_to = seq + 1
            return 2
        self._drop_search = seq - 1
        return 1 if stored > SMALL_RECORD else 2
