"""The workspace device against a model.

Bytes written are the bytes read, before and after flushes, and what was
flushed is what a new host finds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from serverutil import Server
from strata.engine.errors import Forbidden
from strata.engine.local import init_store
from strata.server.client import RemoteStore
from strata.workspace.device import Device, DeviceError, Layout, create, read_layout

BLOCK = 4096
EXTENT = 4 * BLOCK
SIZE = 16 * EXTENT


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteStore]:
    root = tmp_path_factory.mktemp("dev")
    init_store(str(root / "store"))
    server = Server(root / "store").start()
    store = server.remote()
    try:
        yield store
    finally:
        store.close()
        server.stop()


def _new(store: RemoteStore, name: str) -> Device:
    head = create(store, name, Layout(size=SIZE, block=BLOCK, extent=EXTENT))
    lease = store.acquire_lease(name, "live", 60.0, "test")
    return Device(store, name, "live", head, read_layout(store, head), lease=lease.id)


_n = [0]


class DeviceMachine(RuleBasedStateMachine):
    store: RemoteStore

    def __init__(self) -> None:
        super().__init__()
        _n[0] += 1
        self.name = f"m{_n[0]}"
        self.dev = _new(self.store, self.name)
        self.model = bytearray(SIZE)
        self.durable = bytes(SIZE)

    @rule(off=st.integers(0, SIZE - 1), data=st.binary(min_size=1, max_size=3 * BLOCK),
          zeros=st.booleans())
    def write(self, off: int, data: bytes, zeros: bool) -> None:
        if zeros:
            data = bytes(len(data))
        data = data[:SIZE - off]
        self.dev.write(off, data)
        self.model[off:off + len(data)] = data

    @rule(off=st.integers(0, SIZE - 1), data=st.binary(min_size=1, max_size=3 * BLOCK))
    def write_on_the_loop(self, off: int, data: bytes) -> None:
        """The FUSE adapter's path: in memory when it can, else the threaded write."""
        data = data[:SIZE - off]
        if not self.dev.try_write(off, data):
            self.dev.write(off, data)
        self.model[off:off + len(data)] = data

    @rule(off=st.integers(0, SIZE - 1), n=st.integers(1, 3 * BLOCK))
    def read_on_the_loop(self, off: int, n: int) -> None:
        got = self.dev.try_read(off, n)
        if got is not None:
            assert got == bytes(self.model[off:off + n])

    @rule(off=st.integers(0, SIZE - 1), n=st.integers(1, 2 * EXTENT))
    def punch(self, off: int, n: int) -> None:
        n = min(n, SIZE - off)
        self.dev.punch(off, n)
        self.model[off:off + n] = bytes(n)

    @rule()
    def flush(self) -> None:
        self.dev.flush()
        self.durable = bytes(self.model)

    @rule()
    def reopen(self) -> None:
        """A new host: what was flushed is there; what was not is lost."""
        lease = self.store.acquire_lease(self.name, "live", 60.0, "test", steal=True)
        head = self.store.head(self.name, "live")
        self.dev = Device(self.store, self.name, "live", head,
                          read_layout(self.store, head), lease=lease.id)
        self.model = bytearray(self.durable)

    @rule(off=st.integers(0, SIZE - 1), n=st.integers(1, 3 * BLOCK))
    def read_some(self, off: int, n: int) -> None:
        assert self.dev.read(off, n) == bytes(self.model[off:off + n])

    @invariant()
    def whole(self) -> None:
        assert self.dev.read(0, SIZE) == bytes(self.model)


DeviceMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25,
                                           deadline=None,
                                           suppress_health_check=list(HealthCheck))


def test_device_model(served: RemoteStore) -> None:
    DeviceMachine.store = served
    DeviceMachine.TestCase().runTest()


def test_never_written_space_costs_nothing(served: RemoteStore) -> None:
    dev = _new(served, "sparse")
    dev.write(5 * EXTENT + 100, b"x" * 10)
    dev.write(9 * EXTENT, bytes(EXTENT))  # zeros: stays a hole
    dev.flush()
    snap = served.snapshot(dev.head)
    from strata.engine.tree import Trees
    from strata.workspace.device import written_extents
    assert list(written_extents(Trees(served), snap.root)) == [5]


def test_a_fenced_device_writes_nothing_more(served: RemoteStore) -> None:
    old = _new(served, "fenced")
    old.write(0, b"before")
    old.flush()
    # Another host attaches: it steals the lease, and the old holder is fenced.
    lease = served.acquire_lease("fenced", "live", 60.0, "host2", steal=True)
    new = Device(served, "fenced", "live", served.head("fenced", "live"),
                 read_layout(served, old.head), lease=lease.id)
    old.write(0, b"after!")
    with pytest.raises(DeviceError, match="lease"):
        old.flush()
    with pytest.raises(DeviceError):
        old.write(0, b"again")
    assert new.read(0, 6) == b"before"
    assert served.head("fenced", "live") == new.head
    with pytest.raises(Forbidden):
        served.renew_lease("fenced", "live", old.lease or "", 10.0)


def test_a_layout_of_another_version_is_refused() -> None:
    with pytest.raises(DeviceError, match="format 2"):
        Layout.decode(b'{"format": 2, "size": 1048576, "block": 65536, "extent": 1048576}')
