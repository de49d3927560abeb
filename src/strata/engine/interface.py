"""The `Store` interface: what every store (in-process or remote) offers.

The mount, the steps runner and the CLI use only this interface, so they work
the same against a local store directory and against a server. Contract tests
in tests/contract/ run against every implementation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from strata.engine.objects import Entry, FileNode, Snapshot
from strata.engine.tree import NodeCache


class Lease(NamedTuple):
    """A time-limited right to publish to one branch; `fencing` only ever grows.

    `id` is the holder's secret ("<fencing>.<32 hex digits>"), returned only by
    `acquire_lease`: renewing, releasing and publishing under the lease all
    need it, so nobody else with write access can use or end the lease. The
    store keeps only `key`, a hash of the secret.
    """

    fencing: int
    expires_ns: int
    holder: str = ""
    key: bytes = b""
    id: str = ""


@dataclass(frozen=True, slots=True)
class ChangeSet:
    """What one transaction changed on one branch, as final values per path.

    `changes` maps a volume-relative path to its new entry, or to None for a
    deletion (of a whole subtree, for a directory). Every object an entry
    refers to must already be in the store. `base` is the snapshot the
    changes were made against; if the branch has moved since, the store
    replays the changes onto the new head or raises `Conflict`.
    """

    volume: str
    branch: str
    base: str
    changes: dict[str, Entry | None]
    message: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    lease: str | None = None   # id of the lease held on the branch (Lease.id), if any
    # Accept a path the head already holds exactly as this change set wants it.
    # Off by default: two read-modify-writes with equal results are two updates,
    # and accepting both loses one. Only for jobs whose results are idempotent.
    identical: bool = False


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    id: str
    parent: str | None
    time_ns: int
    message: str
    meta: dict[str, Any]
    root: Entry
    tx: bytes | None = None  # the publish that made it, if it recorded one

    @classmethod
    def of(cls, sid: str, snap: Snapshot) -> SnapshotInfo:
        return cls(sid, snap.parent, snap.time_ns, snap.message, snap.meta, snap.root, snap.tx)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "parent": self.parent, "time": self.time_ns / 1e9,
                "message": self.message}


class Store(ABC):
    """A store of volumes: objects, snapshots, and branches moved by CAS."""

    block_size: int
    node_cache: NodeCache
    snapshot_cache_keep = 4096  # snapshot records kept; past it the cache starts again

    def protect_base(self, sid: str) -> None:  # noqa: B027 - optional: most stores need nothing
        """A transaction starts from snapshot `sid`: keep it from garbage collection.

        For a while, or until a publish from it lands. A no-op by default.
        """

    def pin(self, volume: str, sids: Sequence[str], ttl: float) -> list[str]:
        """Keep snapshots of `volume` from garbage collection; one pin id per snapshot.

        Until released, or until `ttl` seconds pass without a renewal.
        """
        raise NotImplementedError

    def renew_pins(self, volume: str, pins: Sequence[str], ttl: float) -> None:
        raise NotImplementedError

    def release_pins(self, volume: str, pins: Sequence[str]) -> None:
        raise NotImplementedError

    def protected_head(self, volume: str, branch: str) -> str:
        """The branch's head, held (`protect_base`) in the same step: no collection between."""
        sid = self.head(volume, branch)
        self.protect_base(sid)
        return sid

    # -- objects -------------------------------------------------------------

    @abstractmethod
    def missing(self, ids: Sequence[bytes]) -> list[bytes]:
        """The subset of `ids` the store does not have, in the given order."""

    @abstractmethod
    def put_objects(self, objects: Sequence[tuple[int, bytes]]) -> list[bytes]:
        """Store (kind, raw bytes) objects not already present; return all their ids.

        Stored objects become durable with the next publish.
        """

    @abstractmethod
    def get_object(self, oid: bytes) -> bytes:
        """The raw bytes of an object; `NotFound` if absent, `Corrupt` if damaged."""

    def get_objects(self, ids: Sequence[bytes]) -> list[bytes]:
        """Several objects at once (one round trip for a remote store)."""
        return [self.get_object(oid) for oid in ids]

    def prefetch_path(self, tree: bytes, names: Sequence[bytes]) -> None:
        """A hint: the tree nodes from directory node `tree` down `names` are read next.

        A remote store fetches them in one round trip, so that a publish into
        a directory it has not read costs one round trip, not one a node;
        this one reads on demand and does nothing here.
        """
        return None

    def get_file(self, ref: bytes, offset: int, end: int
                 ) -> tuple[FileNode, dict[bytes, bytes]]:
        """A file's root node, and by id the nodes below it and the chunks covering [offset, end).

        A remote store answers all of them in one round trip, and may leave
        some out (the caller reads what is missing); this one reads them all.
        """
        node = FileNode.decode(self.get_object(ref))
        got: dict[bytes, bytes] = {}
        # A level at a time: the ids the walk reaches before it needs a node not yet
        # fetched are fetched together (one round trip a level for a remote store).
        while True:
            batch: list[bytes] = []
            try:
                for _kind, oid in node.range_ids(offset, end, got.__getitem__):
                    if oid not in got:
                        batch.append(oid)
            except KeyError:
                pass
            if not batch:
                return node, got
            got.update(zip(batch, self.get_objects(batch), strict=True))

    def get_range(self, oid: bytes, offset: int, length: int) -> bytes:
        """A byte range of an object (whole-object fetch unless overridden)."""
        return self.get_object(oid)[offset:offset + length]

    # -- volumes and branches --------------------------------------------------

    @abstractmethod
    def create_volume(self, name: str) -> str:
        """Create a volume whose branch ``live`` points at the empty snapshot."""

    @abstractmethod
    def delete_volume(self, name: str) -> None: ...

    @abstractmethod
    def list_volumes(self) -> list[str]: ...

    @abstractmethod
    def list_branches(self, volume: str) -> dict[str, str]:
        """Branch name -> head snapshot id."""

    def head(self, volume: str, branch: str) -> str:
        heads = self.list_branches(volume)
        if branch not in heads:
            from strata.engine.errors import NotFound
            raise NotFound(f"no branch {branch!r} in volume {volume!r}")
        return heads[branch]

    def heads(self, refs: Sequence[tuple[str, str]]) -> list[str]:
        """The heads of several (volume, branch) pairs, read at one instant.

        A run that reads several volumes must see a multi-volume publish on
        all of them or on none; reading the heads one by one could fall
        between. Implementations override this to read them atomically.
        """
        return [self.head(v, b) for v, b in refs]

    @abstractmethod
    def fork(self, volume: str, new_branch: str, *, at: str | None) -> str:
        """Create `new_branch` at snapshot `at` (None: the empty snapshot); constant time."""

    @abstractmethod
    def delete_branch(self, volume: str, branch: str) -> None: ...

    @abstractmethod
    def find_snapshot(self, prefix: str) -> str:
        """The full id of the one snapshot whose id starts with `prefix`."""

    def snapshot(self, sid: str) -> SnapshotInfo:
        """A snapshot's record; snapshots never change, so they are kept (bounded)."""
        cache: dict[str, SnapshotInfo] = self.__dict__.setdefault("_snap_cache", {})
        info = cache.get(sid)
        if info is None:
            info = self._read_snapshot(sid)
            self.snapshot_cache_put(info)
        return info

    def snapshot_cache_put(self, info: SnapshotInfo) -> None:
        """Keep a snapshot's record that this process made or verified."""
        cache: dict[str, SnapshotInfo] = self.__dict__.setdefault("_snap_cache", {})
        if len(cache) > self.snapshot_cache_keep:
            cache.clear()
        cache[info.id] = info

    def _read_snapshot(self, sid: str) -> SnapshotInfo:
        from strata.engine.errors import InvalidInput, NotFound
        try:
            oid = bytes.fromhex(sid)
        except ValueError as exc:
            raise InvalidInput(f"invalid snapshot id {sid!r}") from exc
        raw = self.get_object(oid)
        try:
            snap = Snapshot.decode(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise NotFound(f"{sid} is not a snapshot") from exc
        return SnapshotInfo.of(sid, snap)

    def log(self, sid: str, limit: int | None = None) -> list[SnapshotInfo]:
        """History from `sid` back through its parents, newest first."""
        from strata.engine.errors import Expired
        out: list[SnapshotInfo] = []
        cur: str | None = sid
        while cur is not None and (limit is None or len(out) < limit):
            try:
                info = self.snapshot(cur)
            except Expired:
                if cur == sid:
                    raise
                break  # older history was let go by a retention policy
            out.append(info)
            cur = info.parent
        return out

    # -- leases ----------------------------------------------------------------

    @abstractmethod
    def acquire_lease(self, volume: str, branch: str, ttl: float, holder: str = "", *,
                      steal: bool = False) -> Lease:
        """Take the branch's lease for `ttl` seconds; `Unavailable` while another holds it.

        With `steal`, take it even from a live holder: the fencing number grows, so
        every later renew and publish of the earlier holder is refused (fenced).
        """

    @abstractmethod
    def renew_lease(self, volume: str, branch: str, lease: str, ttl: float) -> Lease:
        """Extend a held lease; `Forbidden` if it expired or was superseded."""

    @abstractmethod
    def release_lease(self, volume: str, branch: str, lease: str) -> None: ...

    # -- publishing ------------------------------------------------------------

    @abstractmethod
    def publish(self, changesets: Sequence[ChangeSet],
                objects: Sequence[tuple[int, bytes]] = (), *,
                txid: bytes | None = None) -> list[str]:
        """Publish change sets on one or more branches atomically.

        `objects` are (kind, raw) objects the change sets refer to that the
        caller has not uploaded yet; they are stored with the commit (small
        change sets then cost one request). Returns the new head of each
        branch, in order. All land or none does; `Conflict` lists every
        conflicting path.

        `txid` (16 bytes) names this publish so that it can be retried after
        an answer was lost: the snapshots record it, and a retry of a publish
        that already landed returns the snapshots it made instead of a
        conflict with itself.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

