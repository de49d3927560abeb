"""The `store` fixture: every `Store` implementation the contract suite runs against.

A new implementation (the remote client) joins by adding one `pytest.param`
to `IMPLEMENTATIONS`: a function that takes a fresh temporary directory and
returns an open store of that kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from strata.engine.interface import Store
from strata.engine.local import LocalStore, init_store


def local_store(tmp: Path) -> Store:
    init_store(str(tmp / "store"))
    return LocalStore(str(tmp / "store"))


IMPLEMENTATIONS = [
    pytest.param(local_store, id="local"),
]


@pytest.fixture(params=IMPLEMENTATIONS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    make: Callable[[Path], Store] = request.param
    s = make(tmp_path)
    try:
        yield s
    finally:
        s.close()
