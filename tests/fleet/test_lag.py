"""The default sync's ship-lag gate: no acknowledgement while shipping is too far behind."""

from __future__ import annotations

import time

import pytest

from strata.engine.errors import Unavailable
from strata.fleet.lease import LAG_WAIT, SHIP_LAG_MAX, ship_lag_gate


def test_the_gate_passes_a_store_that_keeps_up() -> None:
    ship_lag_gate("s", lambda: 0.0)
    ship_lag_gate("s", lambda: SHIP_LAG_MAX / 2)


def test_the_gate_waits_for_shipping_to_catch_up() -> None:
    t0 = time.monotonic()
    ship_lag_gate("s", lambda: SHIP_LAG_MAX * 3 if time.monotonic() - t0 < 0.1 else 0.1)
    assert 0.09 <= time.monotonic() - t0 < LAG_WAIT


def test_the_gate_refuses_a_store_that_fell_behind() -> None:
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="not in the bucket yet"):
        ship_lag_gate("s", lambda: SHIP_LAG_MAX + 4.0)
    assert time.monotonic() - t0 >= LAG_WAIT
