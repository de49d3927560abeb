"""Fixtures for the engine's unit tests: real stores in temporary directories."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from strata.engine.local import LocalStore, init_store


def open_store(path: Path, *, block_size: int | None = None) -> LocalStore:
    if block_size is None:
        init_store(str(path))
    else:
        init_store(str(path), block_size=block_size)
    return LocalStore(str(path))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    s = open_store(tmp_path / "store")
    s.create_volume("v")
    yield s
    s.close()


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStore]:
    """One store for a whole module, for tests that only add objects to it."""
    s = open_store(tmp_path_factory.mktemp("shared") / "store")
    yield s
    s.close()


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStore]:
    """A store with 4 KiB blocks (the smallest), so modest files cross many blocks."""
    s = open_store(tmp_path_factory.mktemp("small") / "store", block_size=4096)
    s.create_volume("v")
    yield s
    s.close()
