"""Every `Store` implementation that the contract suite and the store state machine run against.

A new implementation joins both by adding one `pytest.param` to
`IMPLEMENTATIONS`: a function that takes the directory of an existing store
(made by `init_store`) and a finalizer hook, and returns an open store of
that kind on it. Once the store is closed and the finalizers have run, the
same function opens the same directory again (the state machine's `reopen`).

- `local`: `LocalStore` in this process.
- `remote`: `RemoteStore` over the unix socket of a real `strata serve`
  process on the store (the owner's view: every volume, every call).
  TCP is not listed: a TCP token is scoped to one volume, so half of the
  contract (creating and listing volumes) is refused there by design; TCP is
  covered in tests/server/.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from serverutil import Server
from strata.engine.interface import Store
from strata.engine.local import LocalStore

Finalizer = Callable[[Callable[[], object]], None]
Opener = Callable[[Path, Finalizer], Store]


def local_store(store_dir: Path, _finalize: Finalizer) -> Store:
    return LocalStore(str(store_dir))


def remote_store(store_dir: Path, finalize: Finalizer) -> Store:
    server = Server(store_dir).start()
    finalize(server.stop)
    # Retries are for handoffs and restarts; a call the store refuses must not be retried.
    return server.remote(retry_for=5.0)


IMPLEMENTATIONS = [
    pytest.param(local_store, id="local"),
    pytest.param(remote_store, id="remote"),
]
