"""The `store` fixture: a fresh store of every implementation the contract suite runs against.

The implementations are listed in tests/contract/implementations.py
(`IMPLEMENTATIONS`); a new one joins there with one line, and the store
state machine (tests/test_stateful.py) runs over the same list.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from implementations import IMPLEMENTATIONS, Opener

from strata.engine.interface import Store
from strata.engine.local import init_store


@pytest.fixture(params=IMPLEMENTATIONS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    make: Opener = request.param
    init_store(str(tmp_path / "store"))
    s = make(tmp_path / "store", request.addfinalizer)
    try:
        yield s
    finally:
        s.close()
