"""The `store` fixture: every `Store` implementation the contract suite runs against.

A new implementation joins by adding one `pytest.param` to `IMPLEMENTATIONS`:
a function that takes a fresh temporary directory and a finalizer hook, and
returns an open store of that kind.

- `local`: `LocalStore` in this process.
- `remote`: `RemoteStore` over the unix socket of a real `strata serve`
  process on a fresh store (the owner's view: every volume, every call).
  TCP is not listed: a TCP token is scoped to one volume, so half of the
  contract (creating and listing volumes) is refused there by design; TCP is
  covered in tests/server/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from serverutil import Server
from strata.engine.interface import Store
from strata.engine.local import LocalStore, init_store

Finalizer = Callable[[Callable[[], object]], None]


def local_store(tmp: Path, _finalize: Finalizer) -> Store:
    init_store(str(tmp / "store"))
    return LocalStore(str(tmp / "store"))


def remote_store(tmp: Path, finalize: Finalizer) -> Store:
    init_store(str(tmp / "store"))
    server = Server(tmp / "store").start()
    finalize(server.stop)
    # Retries are for handoffs and restarts; a call the store refuses must not be retried.
    return server.remote(retry_for=5.0)


IMPLEMENTATIONS = [
    pytest.param(local_store, id="local"),
    pytest.param(remote_store, id="remote"),
]


@pytest.fixture(params=IMPLEMENTATIONS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    make: Callable[[Path, Finalizer], Store] = request.param
    s = make(tmp_path, request.addfinalizer)
    try:
        yield s
    finally:
        s.close()
