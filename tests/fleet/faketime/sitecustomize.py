"""Loaded (through PYTHONPATH) only by fleet members the tests run under libfaketime.

A member's wall clock is offset with libfaketime (FAKETIME="+40s",
FAKETIME_DONT_FAKE_MONOTONIC=1). libfaketime 0.9.10 turns Python 3.11's
`time.sleep`, which is `clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`,
into EINVAL: it converts the absolute deadline as if it were a faked wall
time. Every other timed wait (select, poll, epoll, condition variables,
obstore's own timers) is relative or untouched and works. So `time.sleep`
becomes a relative `select` here; strata itself runs unchanged.
"""

from __future__ import annotations

import os
import select
import time

if os.environ.get("FAKETIME"):
    def _sleep(seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        select.select([], [], [], seconds)

    time.sleep = _sleep
