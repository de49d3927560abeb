"""The fence watch: an idle owner looks for a successor's claim.

Every log write already fails once another owner claimed the log, so a busy
owner learns at once. An idle one would not: this thread checks once a
second while nothing was shipped, in a thread of its own so a check stuck in
an outage's retries does not hold up shipping. A claim found marks the tier
failed; the journal then refuses to acknowledge anything more.
"""

from __future__ import annotations

import logging
import time

from strata.engine.errors import BucketUnavailable
from strata.engine.tierstate import TierState

_log = logging.getLogger(__name__)  # `_log`: `self.log` is the owner log

FENCE_CHECK_INTERVAL = 1.0  # an idle owner looks for a successor's claim this often


class FenceWatch(TierState):
    """The thread that notices a successor while nothing is being written."""

    def _watch_successor(self) -> None:
        """While idle, look for a successor's claim once a second.

        In a thread of its own: a check stuck in an outage's retries must not
        hold up shipping.
        """
        while not self._stop.wait(FENCE_CHECK_INTERVAL):
            if self.failed is not None:
                return
            if time.monotonic() - self._shipped_at < FENCE_CHECK_INTERVAL:
                continue  # a write just succeeded: it would have met a claim
            try:
                self.log.check_owner()
            except BucketUnavailable:
                # Shipping logs the outage; here it only delays the check.
                _log.debug("fence check: the bucket is unavailable", exc_info=True)
                continue
            except BaseException as exc:  # noqa: BLE001 - fenced (or broken): stop
                _log.error("fence check: %s; the bucket tier stops", exc, exc_info=True)
                if self.failed is None:
                    self.failed = exc
                return
