"""A store's lease: the owner renews it; it stops acknowledging before it could expire.

**The clock assumption.** Hosts never compare clocks. Each measures spans
on its own monotonic clock, and we assume every clock's *rate* is within
`DRIFT` (5 %) of real time; wall-clock offsets, steps and NTP slews of the
time of day do not matter at all. (A quartz clock off by 100 ppm is 500
times inside this bound; faketime at 1.04x speed is inside it, see
tests/fleet.)

**The rule.** An owner starts renewal n at its monotonic time t0; if the
conditional write succeeds it may acknowledge until t0 + `ack_window(ttl)`
= t0 + ttl*(1 - DRIFT) - ACK_MARGIN, which in real time ends before
t0 + ttl. A standby sees renewal n only after it was written, so after t0,
and treats the lease as expired only once it saw no change for
`expiry_wait(ttl)` = ttl*(1 + DRIFT) of its own clock: in real time at least
ttl after t0. So the standby's claim comes after the owner's last possible
acknowledgement, whatever the two clocks read. The margin covers the step
between asking the gate and the journal counting a publish as durable.

The gate is asked by the tier after every datasync (engine/tiership.py):
past the window it raises `Unavailable`, the journal acknowledges nothing,
and the client retries with the same txid (at the next owner). With
`--sync bucket` that is belt and braces, since the successor's claim fences
the owner's next log write anyway; with the default sync it is what keeps a
cut-off owner from acknowledging publishes the successor will never see.

**Pins.** A snapshot pinned by a mount or a step must outlive its owner: GC
at the next owner must not delete it. The owner knows its pins; the next one
does not. So each lease record also says how long the pins its writer
granted may still be held, `pins` seconds after the record was written (on
the writer's clock), and the owner grants or renews a pin only once a record
it wrote covers it (`LeaseKeeper.cover_pins`: a renewal written at once, at
most about once a minute thanks to `PIN_SLACK`). The next owner, which first
saw that record at its time `since`, deletes nothing until
`pins_end(since, pins)`; a record without the field (an older writer) means
unknown, and the blanket wait of a restore applies (engine/gc.py). A claim
carries the inherited span in its own records, so a quick third owner still
waits for the first one's pins. With no pins granted, a new owner collects
garbage at once.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

from strata.engine.errors import AlreadyExists, BucketUnavailable, StrataError, Unavailable
from strata.engine.gc import PIN_LIFETIME
from strata.fleet.records import FleetRecords, Lease

log = logging.getLogger(__name__)

LEASE_TTL = 2.0          # seconds a renewal is good for
RENEW_EVERY = 0.5        # an owner renews this often (4 tries per TTL)
DRIFT = 0.05             # bound on any host clock's rate error (see the docstring)
ACK_MARGIN = 0.1         # seconds kept between the last acknowledgement and expiry
MEMBER_TTL = 3.0         # a member whose heartbeat did not change this long is gone
HEARTBEAT_EVERY = 0.5
# Default sync: no acknowledgement while a byte waited longer than this to ship
# ($STRATA_FLEET_SHIP_LAG seconds; the fault tests loosen it to show the other guards).
SHIP_LAG_MAX = float(os.environ.get("STRATA_FLEET_SHIP_LAG", "1.0"))
LAG_WAIT = 0.5          # ... than this, after waiting this long for shipping to catch up
PIN_SLACK = PIN_LIFETIME / 2  # a pin's record covers this much more: one write a minute

# A test-only way to build a broken strata (tests/fleet): "lease" makes an owner
# acknowledge after its lease could have expired and ignore losing it.
BROKEN = frozenset(os.environ.get("STRATA_TEST_BREAK", "").split(","))
# Test-only too: this process's clock runs at this rate (1.04: 4 % fast). faketime
# cannot do it for Python (its timed waits hang when the monotonic clock is faked).
CLOCK_RATE = float(os.environ.get("STRATA_TEST_CLOCK_RATE", "1"))


def clock() -> float:
    """The monotonic clock every lease and liveness span is measured on (seconds)."""
    return time.monotonic() * CLOCK_RATE


def ack_window(ttl: float) -> float:
    """How long after starting a successful renewal an owner may acknowledge."""
    return ttl * (1 - DRIFT) - ACK_MARGIN


def expiry_wait(ttl: float) -> float:
    """How long a standby must see a lease unchanged before it may claim."""
    return ttl * (1 + DRIFT)


def pins_end(since: float, pins: float) -> float:
    """When, on a reader's clock, pins a record covers are over, the record first seen at `since`.

    The record was written before `since`; its writer's span may run slow by
    DRIFT, and the reader's clock fast by DRIFT.
    """
    return since + pins * (1 + DRIFT) / (1 - DRIFT)


def pin_span(until: float, t0: float) -> float:
    """A record's `pins` for a write starting at `t0`: up to `until`, rounded up to a ms."""
    return math.ceil(max(0.0, until - t0) * 1000) / 1000


def ship_lag_gate(store: str, unshipped_for: Callable[[], float]) -> None:
    """The default sync's window: acknowledge nothing while a byte waited too long to ship.

    A host that dies loses what it acknowledged and had not shipped. Without
    this, a bucket that is slow (not down: the lease still renews) lets that
    grow without bound. Waits up to `LAG_WAIT` for shipping to catch up, then
    raises `Unavailable` (the client retries with the same txid).
    """
    deadline = time.monotonic() + LAG_WAIT
    while (lag := unshipped_for()) > SHIP_LAG_MAX:
        if time.monotonic() >= deadline:
            raise Unavailable(f"store {store}: writes of {lag:.1f} s ago are not in the "
                              "bucket yet; retry", retry_after=0.2)
        time.sleep(0.02)


class LeaseKeeper:
    """The owner's side: renew one store's lease, and gate acknowledgements on it.

    A thread of its own renews every RENEW_EVERY seconds with If-Match on the
    etag it wrote last. A refused write means someone else wrote the record
    (a claimant after expiry, or an operator): the lease is lost at once. An
    outage only lets the window run out. `on_lost` is called once, from the
    thread, when the lease is lost or ran out.
    """

    def __init__(self, records: FleetRecords, lease: Lease, *, acquired_at: float,
                 on_lost: Callable[[str], None], pins_until: float = 0.0) -> None:
        self.records = records
        self.lease = lease
        self.deadline = acquired_at + ack_window(lease.ttl)
        # Pins (granted here, or inherited) may be held until `pins_until` (this clock);
        # the last record written says so up to `pins_covered`.
        self.pins_until = pins_until
        self.pins_covered = acquired_at + lease.pins if lease.pins is not None else 0.0
        self.lost: str | None = None
        self.renewals = 0
        self.last_renewed = clock()
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one writer of the record at a time
        self._thread = threading.Thread(target=self._run, name=f"strata-lease-{lease.store}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing (without waiting: callers run on the member's event loop)."""
        self._stop.set()

    def gate(self) -> None:
        """Raise `Unavailable` unless this owner may still acknowledge."""
        if "lease" in BROKEN:
            return
        if self.lost is not None:
            raise Unavailable(f"store {self.lease.store}: this member lost its lease "
                              f"({self.lost}); retry at the new owner", retry_after=0.2)
        if clock() >= self.deadline:
            raise Unavailable(f"store {self.lease.store}: this member's lease could have "
                              "expired; retry at the new owner", retry_after=0.2)

    def valid(self) -> bool:
        """Whether the gate would let this owner acknowledge now."""
        return "lease" in BROKEN or (self.lost is None and clock() < self.deadline)

    def age(self) -> float:
        return clock() - self.last_renewed

    def cover_pins(self, ttl: float) -> None:
        """Before a pin lasting `ttl` seconds is granted or renewed: a record must say so.

        Writes a renewal at once when the last one does not cover it, asking for
        `PIN_SLACK` more; `Unavailable` if that write fails (the client retries).
        """
        need = clock() + ttl
        if need <= self.pins_covered:
            return
        with self._lock:
            self.pins_until = max(self.pins_until, need + PIN_SLACK)
        self.renew()
        if self.pins_covered < need:
            raise Unavailable(f"store {self.lease.store}: the pin could not be recorded "
                              "in the lease; retry", retry_after=0.5)

    def _span(self, lease: Lease, t0: float) -> None:
        """Set the record's pin span for a write starting at `t0` (rounded up to a ms)."""
        lease.pins = pin_span(self.pins_until, t0)

    def _wrote(self, t0: float) -> None:
        assert self.lease.pins is not None
        self.pins_covered = t0 + self.lease.pins

    def rewrite(self, change: Callable[[Lease], None]) -> Lease:
        """Write a changed lease (a handoff, a release) as the holder; `AlreadyExists` if lost."""
        with self._lock:
            if self.lost is not None:
                raise AlreadyExists(f"lease of {self.lease.store} lost: {self.lost}")
            lease = Lease(**{**self.lease.__dict__})
            change(lease)
            lease.seq += 1
            prior = self.lease.etag
            t0 = clock()
            self._span(lease, t0)
            self.lease = self.records.write_lease(lease, prior)
            self._wrote(t0)
            if lease.state == "serving":
                self.deadline = t0 + ack_window(lease.ttl)
            else:
                self.deadline = 0.0  # handing off or freeing: acknowledge nothing more
            return self.lease

    def renew(self) -> None:
        with self._lock:
            # A claim renews too: a restore slower than the TTL must not look dead.
            if self.lost is not None or self.lease.state not in ("serving", "claiming"):
                return
            lease = Lease(**{**self.lease.__dict__})
            lease.seq += 1
            t0 = clock()
            self._span(lease, t0)
            try:
                self.lease = self.records.write_lease(lease, self.lease.etag)
            except AlreadyExists:
                if "lease" in BROKEN:
                    return
                self._lose("another member wrote the lease")
                return
            except BucketUnavailable as exc:
                log.warning("store %s: lease renewal failed (%s); acknowledging until "
                            "%.1f s from now at most", self.lease.store, exc,
                            max(0.0, self.deadline - clock()))
                return
            self.deadline = t0 + ack_window(lease.ttl)
            self._wrote(t0)
            self.renewals += 1
            self.last_renewed = t0

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            self.deadline = 0.0
            log.warning("store %s: lease lost: %s", self.lease.store, why)
            self._on_lost(why)

    def _run(self) -> None:
        while not self._stop.wait(RENEW_EVERY):
            try:
                self.renew()
            except StrataError as exc:  # a damaged record: the window runs out
                log.warning("store %s: lease renewal: %s", self.lease.store, exc)
            if self.lost is None and self.lease.state in ("serving", "claiming") \
                    and clock() >= self.deadline and "lease" not in BROKEN:
                self._lose("could not renew in time")
            if self.lost is not None:
                return
