"""A hypothesis state machine driving volumes, forks and publishes against a model.

The model is plain data: volume -> branch -> the branch's snapshots, oldest
first, each a dict of file path -> bytes. Publishes go through `Transaction`
from the branch head or from an older (stale) snapshot of the branch, and
in racing pairs: two transactions from one snapshot that write equal values
to the same paths, the way two read-modify-writes with equal results do. The
model decides on its own whether a publish conflicts: exactly when a path it
writes or removes was changed between base and head (first committer wins,
whatever the bytes), unless it opted into `identical` and the head already
holds what it wants there. After every step the store's volumes, branches,
trees and log chains must equal the model, including after the store is
closed and opened again.

The machine runs over every store implementation of the contract suite
(tests/contract/implementations.py): in this process, and through a real
`strata serve` process, which `reopen` stops and starts again.
STRATA_STATEFUL_EXAMPLES sets the number of examples for the in-process
store (100 unless set; `make fuzz` runs 1000); every other implementation
runs one example for every `SHARE` of those (3 by default, 33 in `make fuzz`):
each example starts a server, and each `reopen`, about one step in three,
starts it again, so one example of 40 steps costs several seconds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from implementations import IMPLEMENTATIONS, Opener

from strata.engine.errors import AlreadyExists, Conflict, NotFound
from strata.engine.local import init_store
from strata.engine.objects import EMPTY_SNAPSHOT_ID, K_FILE
from strata.engine.storedir import _write_meta, read_store_meta
from strata.engine.txn import Transaction

Files = dict[str, bytes]
History = list[tuple[str, Files]]  # (snapshot id, files), oldest first

VOLUMES = ["v1", "v2", "v3"]
BRANCHES = ["live", "exp", "run/a", "run/b"]
PATHS = ["a", "b", "d1/x", "d1/y", "d2/sub/z"]
# Inline files and files in blocks; drawn by key, so failure reports stay short.
VALUES = {"empty": b"", "one": b"one", "two": b"two", "5k": b"x" * 5000,
          "77k": bytes(range(256)) * 300}
CHANGES = st.dictionaries(st.sampled_from(PATHS), st.none() | st.sampled_from(sorted(VALUES)),
                          min_size=1, max_size=4)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self, open_store: Opener) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="strata-stateful-")
        self.store_dir = Path(self.dir) / "store"
        init_store(str(self.store_dir))
        # Small packs, so sealing and new packs happen within a run. Written into the
        # store's settings (below the 1 MiB `init_store` allows) so that every
        # implementation, a server process too, opens the store with them.
        _write_meta(str(self.store_dir),
                    {**read_store_meta(str(self.store_dir)), "pack_size_limit": 64 * 1024})
        self.open_store = open_store
        self.finalizers: list[Callable[[], object]] = []
        self.store = open_store(self.store_dir, self.finalizers.append)
        self.model: dict[str, dict[str, History]] = {}
        self.checked: set[str] = set()  # snapshots whose tree already matched

    def close(self) -> None:
        """Close the store, then stop what serves it (a server process), newest first."""
        try:
            self.store.close()
        finally:
            while self.finalizers:
                self.finalizers.pop()()

    def teardown(self) -> None:
        try:
            self.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def branches(self) -> list[tuple[str, str]]:
        return [(v, b) for v in sorted(self.model) for b in sorted(self.model[v])]

    # -- rules ---------------------------------------------------------------------

    @initialize()
    def first_volume(self) -> None:
        self.create_volume("v1")

    @rule(name=st.sampled_from(VOLUMES))
    def create_volume(self, name: str) -> None:
        if name in self.model:
            with pytest.raises(AlreadyExists):
                self.store.create_volume(name)
            return
        assert self.store.create_volume(name) == EMPTY_SNAPSHOT_ID
        self.model[name] = {"live": [(EMPTY_SNAPSHOT_ID, {})]}

    @precondition(lambda self: bool(self.model))
    @rule(name=st.sampled_from(VOLUMES))
    def delete_volume(self, name: str) -> None:
        if name not in self.model:
            with pytest.raises(NotFound):
                self.store.delete_volume(name)
            return
        self.store.delete_volume(name)
        del self.model[name]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), new=st.sampled_from(BRANCHES), empty=st.booleans())
    def fork(self, data: st.DataObject, new: str, empty: bool) -> None:
        volume = data.draw(st.sampled_from(sorted(self.model)), label="volume")
        branches = self.model[volume]
        if empty or not branches:
            at, history = None, [(EMPTY_SNAPSHOT_ID, {})]
        else:
            src = data.draw(st.sampled_from(sorted(branches)), label="from")
            # Usually the head; sometimes an older snapshot of the source.
            i = data.draw(st.integers(0, len(branches[src]) - 1) | st.just(-1), label="at")
            history = branches[src][:i + 1] if i >= 0 else list(branches[src])
            at = history[-1][0]
        if new in branches:
            with pytest.raises(AlreadyExists):
                self.store.fork(volume, new, at=at)
            return
        assert self.store.fork(volume, new, at=at) == history[-1][0]
        branches[new] = list(history)

    @precondition(lambda self: bool(self.branches()))
    @rule(data=st.data(), keys=CHANGES, identical=st.booleans())
    def publish_from_head(self, data: st.DataObject, keys: dict[str, str | None],
                          identical: bool) -> None:
        volume, branch = data.draw(st.sampled_from(self.branches()), label="branch")
        history = self.model[volume][branch]
        self.publish(volume, branch, len(history) - 1, keys, identical)

    @precondition(lambda self: bool(self.stale_branches()))
    @rule(data=st.data(), keys=CHANGES, identical=st.booleans())
    def publish_from_stale_base(self, data: st.DataObject, keys: dict[str, str | None],
                                identical: bool) -> None:
        volume, branch = data.draw(st.sampled_from(self.stale_branches()), label="branch")
        history = self.model[volume][branch]
        base = data.draw(st.integers(0, len(history) - 2), label="base")
        self.publish(volume, branch, base, keys, identical)

    @precondition(lambda self: bool(self.branches()))
    @rule(data=st.data(), keys=CHANGES, extra=st.sampled_from(PATHS),
          identical=st.booleans())
    def racing_equal_writes(self, data: st.DataObject, keys: dict[str, str | None],
                            extra: str, identical: bool) -> None:
        """Two transactions from one snapshot write the same values; the second may add one."""
        volume, branch = data.draw(st.sampled_from(self.branches()), label="branch")
        history = self.model[volume][branch]
        i = data.draw(st.integers(0, len(history) - 1), label="base")
        base_sid, base = history[i]
        first = self.wanted(base, keys)
        second = dict(first)
        if extra not in second:
            second[extra] = b"second"
        t1 = self.stage(volume, branch, base_sid, first, identical=False)
        t2 = self.stage(volume, branch, base_sid, second, identical=identical)
        event("racing pair, identical opt-in" if identical else "racing pair")
        self.commit(t1, volume, branch, base, first, identical=False)
        self.commit(t2, volume, branch, base, second, identical=identical)

    def stale_branches(self) -> list[tuple[str, str]]:
        return [(v, b) for v, b in self.branches() if len(self.model[v][b]) > 1]

    @staticmethod
    def wanted(base: Files, keys: dict[str, str | None]) -> dict[str, bytes | None]:
        # Only files the base has can be removed (the transaction refuses the rest).
        return {p: None if k is None else VALUES[k] for p, k in keys.items()
                if k is not None or p in base}

    def publish(self, volume: str, branch: str, i: int, keys: dict[str, str | None],
                identical: bool) -> None:
        history = self.model[volume][branch]
        base_sid, base = history[i]
        changes = self.wanted(base, keys)
        event("publish from a stale base" if i < len(history) - 1 else "publish from the head")
        t = self.stage(volume, branch, base_sid, changes, identical=identical)
        self.commit(t, volume, branch, base, changes, identical=identical)

    def stage(self, volume: str, branch: str, base_sid: str, changes: dict[str, bytes | None],
              *, identical: bool) -> Transaction:
        t = Transaction(self.store, volume, branch, base=base_sid)
        t.identical = identical
        for path in sorted(changes):
            value = changes[path]
            if value is None:
                t.remove(path)
                continue
            parts = path.split("/")
            for n in range(1, len(parts)):
                t.mkdir("/".join(parts[:n]), exist_ok=True, mtime_ns=0)
            t.write(path, value, mtime_ns=0)
        return t

    def commit(self, t: Transaction, volume: str, branch: str, base: Files,
               changes: dict[str, bytes | None], *, identical: bool) -> None:
        history = self.model[volume][branch]
        head_sid, head = history[-1]
        conflicts = sorted(p for p, v in changes.items()
                           if base.get(p) != head.get(p)
                           and not (identical and head.get(p) == v))
        if conflicts:
            with pytest.raises(Conflict) as info:
                t.commit()
            assert info.value.paths == conflicts
            event("publish conflicted")
            return
        if identical and any(base.get(p) != head.get(p) for p in changes):
            event("identical result accepted by opt-in")
        stale = t.base != head_sid
        sid = t.commit()
        new = dict(head)
        for p, v in changes.items():
            if v is None:
                new.pop(p, None)
            else:
                new[p] = v
        if new == head:
            assert sid == head_sid  # nothing changed: the branch does not move
            event("publish changed nothing")
            return
        if stale:
            event("stale publish replayed")
        assert sid != head_sid
        history.append((sid, new))

    @precondition(lambda self: bool(self.branches()))
    @rule(data=st.data())
    def delete_branch(self, data: st.DataObject) -> None:
        volume, branch = data.draw(st.sampled_from(self.branches()), label="branch")
        self.store.delete_branch(volume, branch)
        del self.model[volume][branch]
        with pytest.raises(NotFound):
            self.store.head(volume, branch)

    @rule()
    def reopen(self) -> None:
        self.close()
        self.store = self.open_store(self.store_dir, self.finalizers.append)
        self.checked.clear()

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def volumes_and_heads_match(self) -> None:
        assert self.store.list_volumes() == sorted(self.model)
        for volume, branches in self.model.items():
            assert self.store.list_branches(volume) == {
                b: history[-1][0] for b, history in branches.items()}

    @invariant()
    def trees_match(self) -> None:
        for volume, branches in self.model.items():
            for history in branches.values():
                sid, files = history[-1]
                if sid in self.checked:
                    continue
                t = Transaction(self.store, volume, base=sid)
                got = {p: t.read(p) for p, e in t.walk() if e.kind == K_FILE}
                assert got == files, f"{volume} at {sid[:12]}"
                self.checked.add(sid)

    @invariant()
    def log_chains_match(self) -> None:
        for branches in self.model.values():
            for history in branches.values():
                log = self.store.log(history[-1][0])
                assert [i.id for i in log] == [sid for sid, _ in reversed(history)]
                for newer, older in zip(log, log[1:], strict=False):
                    assert newer.parent == older.id
                assert log[-1].parent is None


EXAMPLES = int(os.environ.get("STRATA_STATEFUL_EXAMPLES", "100"))
SHARE = 30  # in-process examples per example of every other implementation


@pytest.mark.parametrize("open_store", IMPLEMENTATIONS)
def test_store_state_machine(open_store: Opener, request: pytest.FixtureRequest) -> None:
    in_process = request.node.callspec.id == "local"
    run_state_machine_as_test(lambda: StoreMachine(open_store), settings=settings(
        max_examples=EXAMPLES if in_process else max(1, EXAMPLES // SHARE),
        stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
