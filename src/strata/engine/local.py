"""The in-process store: one directory, one owner, packs as the journal.

`LocalStore` owns a store directory while it is open (an exclusive lock) and
answers the `Store` interface over it. The jobs behind that are modules of
their own, which it puts together and holds (composition: each lock and each
piece of state has one owner, and no module of engine/ imports this one; those
that need the store take what they use as arguments or as a `Protocol`):

- storedir.py: the `STRATA` file, settings, permissions, the owner lock;
- packstore.py: where pack bytes live (`PackStore`; `LocalPacks` here);
- recovery.py: replaying the packs into the index, cutting a torn tail;
- journal.py: appending, sealing, group-commit durability;
- refs.py: the pending and served views of heads, volumes and leases;
- indexer.py: the background thread that writes LMDB off the commit path;
- fsck.py: checking packs, index, refs and trees;
- gc.py: garbage collection (a `Collectable`, with the journal and packs);
- tier.py: the bucket tier, a `PackStore` in place of `LocalPacks`.

What stays here is the API: objects, volumes, branches, leases, publishing.
The crash-safety order the store follows is written out in docs/design.md;
keep the two in step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from strata.engine import gc as gcmod
from strata.engine import pack as packfmt
from strata.engine.changes import rebase
from strata.engine.errors import (
    AlreadyExists,
    Conflict,
    Corrupt,
    Expired,
    Fenced,
    Forbidden,
    InvalidInput,
    Locked,
    NotFound,
    StrataError,
    Unavailable,
    no_object,
)
from strata.engine.fsck import FsckProgress, fsck
from strata.engine.index import Index, Loc
from strata.engine.indexer import Indexer
from strata.engine.interface import ChangeSet, Lease, SnapshotInfo, Store
from strata.engine.journal import MAX_OBJECT, Journal, Pos
from strata.engine.names import check_branch, check_hex_id, check_volume
from strata.engine.objects import (
    BLOCK,
    EMPTY_SNAPSHOT_ID,
    EMPTY_SNAPSHOT_RAW,
    EMPTY_TREE,
    FILENODE,
    ID_LEN,
    K_DIR,
    K_FILE,
    KIND_NAMES,
    SNAPSHOT,
    TREE,
    TXID_LEN,
    ZERO_ID,
    Entry,
    FileNode,
    Snapshot,
    TreeNode,
    check_entry_size,
    object_id,
    packb,
    references,
)
from strata.engine.packstore import LocalPacks, PackStore

if TYPE_CHECKING:
    from strata.engine.tier import TieredPacks
from strata.engine.reach import volume_key
from strata.engine.recovery import frame_refs, open_index, rebuild_index
from strata.engine.refs import (
    CasMismatch,
    Refs,
    lease_fencing,
    lease_key,
    lease_matches,
    state_ops,
)
from strata.engine.scratch import clear_scratch
from strata.engine.storedir import (
    StoreConfig,
    StoreLock,
    init_store,
    make_private,
    read_store_meta,
)
from strata.engine.tree import NodeCache, Trees

log = logging.getLogger(__name__)

__all__ = ["MAX_OBJECT", "LocalStore", "StoreConfig", "init_store", "read_store_meta"]


def check_tree_shape(node: TreeNode, get: Callable[[bytes], TreeNode]) -> None:
    """A tree node must describe what it names exactly, or lookups and listings lie.

    Each child is one level down, holds as many entries as the parent says,
    and its names lie in its range: from its first name up to (not including)
    the next child's. Otherwise two leaves could hold the same name (`ls`
    showed `x x`, and export failed), or a name could sit where no lookup
    goes. Each node's own order was checked when it arrived (server/wire.py).
    A version 2 node's count of hard-linked files under a child or a
    subdirectory is the count that node holds: a count of 0 over a linked
    file would hide that file from its group's search (docs/design.md
    "Hard links").
    """
    links = node.item_links
    if node.level == 0:
        if node.links is not None:
            for (name, e), n in zip(node.entries, links, strict=True):
                if e.kind == K_DIR and e.ref is not None:
                    _check_links(n, get(e.ref), f"directory {name!r}")
        return
    kids = node.children
    for i, (first, oid, count) in enumerate(kids):
        child = get(oid)
        if node.links is not None:
            _check_links(links[i], child, "a child")
        if child.level != node.level - 1:
            raise InvalidInput(f"a level-{node.level} tree node has a level-{child.level} child")
        if child.count != count:
            raise InvalidInput(f"a tree node says its child holds {count} entries, "
                               f"not the {child.count} it holds")
        if child.first != first:
            raise InvalidInput("a tree node names its child by a name it does not start with")
        last = child
        while last.level > 0:  # the rightmost leaf holds the child's last name
            last = get(last.children[-1][1])
        if i + 1 < len(kids) and last.entries and not last.entries[-1][0] < kids[i + 1][0]:
            raise InvalidInput("two tree nodes of one directory hold overlapping names")


def _check_links(claim: int | None, child: TreeNode, what: str) -> None:
    # Unknown (nil) is always true: the search descends. A writer that carries an
    # old node's items over says nil where the child, read, would give a number.
    if claim is not None and claim != child.linked:
        raise InvalidInput(f"a tree node counts {claim} hard-linked files under {what}, "
                           f"which holds {child.linked}")


class LocalStore(Store):
    """A store directory opened in this process (see the module docstring)."""

    def __init__(self, path: str, config: StoreConfig | None = None) -> None:
        self.path = os.path.abspath(path)
        self.config = config or StoreConfig()
        meta = read_store_meta(self.path)
        if config is None:  # settings chosen at init time, unless the caller overrides
            self.config = StoreConfig(
                pack_size_limit=int(meta.get("pack_size_limit", self.config.pack_size_limit)),
                pack_age_limit=float(meta.get("pack_age_limit", self.config.pack_age_limit)))
        self.store_id = bytes.fromhex(meta["id"])
        self.block_size = int(meta.get("block_size", self.config.block_size))
        self._lock = StoreLock(self.path, self.config.lock_timeout)
        self.packs_dir = os.path.join(self.path, "packs")
        self.index_dir = os.path.join(self.path, "index")
        make_private(self.path)  # stores made before 0700 was the rule
        clear_scratch(self.path)  # a pass's tables a crash left behind (engine/scratch.py)
        self._packs: PackStore = LocalPacks(self.packs_dir)
        self._tier: TieredPacks | None = None
        if meta.get("bucket"):  # the store is kept in a bucket too (engine/tier.py)
            from strata.engine.tier import open_tier  # obstore: only with a bucket
            try:
                self._tier = open_tier(self.path, meta, LocalPacks(self.packs_dir))
            except BaseException:
                self._lock.release()
                raise
            self._packs = self._tier
        self.node_cache = NodeCache()
        self._snap_cache: dict[str, SnapshotInfo] = {}
        self.recovery: dict[str, Any] = {"truncated": [], "damaged": [], "replayed": 0}
        self._branch_locks: dict[tuple[str, str], threading.Lock] = {}
        self._branch_locks_guard = threading.Lock()
        # Garbage collection (engine/gc.py): what it must not take away.
        self.gate = gcmod.Gate()
        self.gc_lock = threading.Lock()
        self._opened = time.monotonic()
        self._uploaded_at: dict[bytes, float] = {}  # uploaded or found present: oid -> when
        self._bases: dict[bytes, tuple[int, float]] = {}  # transaction bases: count, when
        self._pins_guard = threading.Lock()
        try:
            self.pins = gcmod.Pins(self.path)
            index = open_index(self.index_dir, self._packs, self.recovery)
            self._indexer = Indexer(index, lambda: self._journal.durable, self.recovery)
            self._indexer.refs_of = frame_refs(self._packs)
            if self._tier is not None:  # a restored store's index comes lazily
                self._indexer.fallback = self._tier.locate
            self._refs = Refs(index)
            self._journal = Journal(self._packs, self.store_id, self.config, self._refs,
                                    self._indexer)
            self.policies = gcmod.Policies(self._refs, self._journal)
            self.stats = self._journal.stats
            if EMPTY_SNAPSHOT_ID not in set(self._refs.served.values()) and not (
                    self._indexer.has(bytes.fromhex(EMPTY_SNAPSHOT_ID))):
                self.put_objects([(TREE, EMPTY_TREE), (SNAPSHOT, EMPTY_SNAPSHOT_RAW)])
                self._journal.commit([])
            self.policies.migrate_file(self.path)
        except BaseException:
            self._packs.close()
            self._lock.release()
            raise
        self._indexer.start(self.config.index_interval, self._journal.maybe_seal_by_age)
        if self._tier is not None:
            self._tier.attach(self.index, self.store_id, self.block_size, self.path)

    @property
    def index(self) -> Index:
        """The open index (replaced whole by `rebuild_index`)."""
        return self._indexer.index

    # -- objects --------------------------------------------------------------------

    def missing(self, ids: Sequence[bytes]) -> list[bytes]:
        self._check_open()
        out = []
        for oid in ids:
            if not isinstance(oid, bytes) or len(oid) != ID_LEN:
                raise InvalidInput("object ids are 32 bytes")
        with self.gate.shared():  # what is found here stays until the publish comes
            present = []
            for oid in ids:
                if self._indexer.has(oid):
                    present.append(oid)
                else:
                    out.append(oid)
            self._pin_uploaded(present)
        return out

    def put_objects(self, objects: Sequence[tuple[int, bytes]]) -> list[bytes]:
        self._journal.check_usable()
        ids, frames = self._journal.frame_objects(objects)
        with self.gate.shared():
            if frames:
                with self._journal.append_lock:
                    self._journal.check_usable()
                    self._journal.append_records_locked(frames)
            self._pin_uploaded(ids)  # sent ahead of its publish: pinned until it comes
        return ids

    def _pin_uploaded(self, oids: Sequence[bytes]) -> None:
        """Keep objects a writer uploaded, or was told are present, for `UPLOAD_PIN` seconds.

        Its publish will name them; garbage collection must not take them first.
        """
        now = time.monotonic()
        with self._pins_guard:
            for oid in oids:
                self._uploaded_at[oid] = now
            if len(self._uploaded_at) > 1024 and len(self._uploaded_at) % 1024 == 0:
                self._prune_uploaded(now)

    def _prune_uploaded(self, now: float) -> None:
        old = [o for o, t in self._uploaded_at.items() if now - t > gcmod.UPLOAD_PIN]
        for o in old:
            del self._uploaded_at[o]

    def upload_pins(self) -> set[bytes]:
        """What is pinned for transactions in progress.

        Objects uploaded ahead of a publish or found present by `missing`, lately;
        and the snapshots transactions started from (until they publish, or a while).
        """
        now = time.monotonic()
        with self._pins_guard:
            self._prune_uploaded(now)
            for key in [k for k, (_c, t) in self._bases.items() if now - t > gcmod.UPLOAD_PIN]:
                del self._bases[key]
            return set(self._uploaded_at) | set(self._bases)

    def protect_base(self, sid: str) -> None:
        """Count a transaction starting from `sid`; its publish lets go (`_release_bases`)."""
        try:
            key = bytes.fromhex(sid)
        except ValueError:
            return
        with self._pins_guard:
            count, _t = self._bases.get(key, (0, 0.0))
            self._bases[key] = (count + 1, time.monotonic())

    def _release_bases(self, sids: list[str]) -> None:
        with self._pins_guard:
            for sid in sids:
                key = bytes.fromhex(sid)
                count, t = self._bases.get(key, (0, 0.0))
                if count <= 1:
                    self._bases.pop(key, None)
                else:
                    self._bases[key] = (count - 1, t)

    def pin(self, volume: str, sids: Sequence[str], ttl: float, holder: str = "") -> list[str]:
        """Pin snapshots for `ttl` seconds; `holder` is the asking token's id ("": the owner)."""
        check_volume(volume)
        if not isinstance(sids, list | tuple) or not 0 < len(sids) <= 64:
            raise InvalidInput("pin 1 to 64 snapshots at a time")
        with self.gate.shared():  # not between a sweep's roots and its deletions
            for sid in sids:
                oid = bytes.fromhex(check_hex_id(sid))
                if self.object_kind(oid) != SNAPSHOT:
                    if self.index.is_expired(oid):
                        raise Expired(f"snapshot {sid} expired (retention policy; garbage "
                                      "collection removed it)")
                    raise NotFound(f"no snapshot {sid}")
            return [self.pins.pin(sid, ttl, holder) for sid in sids]

    def renew_pins(self, volume: str, pins: Sequence[str], ttl: float) -> None:
        for pid in pins:
            self.pins.renew(pid, ttl)

    def release_pins(self, volume: str, pins: Sequence[str]) -> None:
        for pid in pins:
            self.pins.release(pid)

    def protected_head(self, volume: str, branch: str) -> str:
        with self.gate.shared():  # not between a sweep's roots and its deletions
            sid = self.head(volume, branch)
            self.protect_base(sid)
        return sid

    def _unpin_uploaded(self, oids: set[bytes]) -> None:
        """A publish named these: they are reachable now, or garbage like any other."""
        with self._pins_guard:
            for oid in oids:
                self._uploaded_at.pop(oid, None)

    def get_object(self, oid: bytes) -> bytes:
        self._check_open()
        loc = self._indexer.locate(oid)
        if loc is None:
            if self.index.is_expired(oid):
                raise Expired(f"snapshot {oid.hex()} expired (retention policy; "
                              "garbage collection removed it)")
            raise no_object(oid)
        frame = self._packs.pread(loc.pack, loc.length, loc.offset)
        try:
            kind, stored_id, raw = packfmt.decode_object(
                frame, self._packs.info(loc.pack).sync, packfmt.pack_name(loc.pack), loc.offset)
            if stored_id != oid:
                raise Corrupt("", loc.offset,
                              f"index points at {stored_id.hex()}, not {oid.hex()}")
            if self._packs.verify_reads(loc.pack) and object_id(kind, raw) != oid:
                raise Corrupt("", loc.offset, f"object {oid.hex()} does not hash to its id")
        except Corrupt as exc:  # named by where the bytes came from (only when it fails)
            raise Corrupt(self._packs.label(loc.pack), loc.offset, exc.detail) from None
        return raw

    def reachable(self, volume: str, oids: Sequence[bytes]) -> list[bool]:
        """Whether each object is reachable from `volume`'s history or was given to it.

        The object half of a token's scope (see engine/reach.py): a miss walks
        only the snapshots the volume gained since the last miss.
        """
        key = volume_key(volume, self.volume_id(volume))
        got = self._indexer.reach.marked(key, oids)
        if not all(got):
            self._indexer.reach.extend(key, self.list_branches(volume).values(),
                                       lambda sid: self.snapshot(sid).parent, self.get_object)
            got = self._indexer.reach.marked(key, oids)
        return got

    def grant_reach(self, volume: str, oids: Sequence[bytes]) -> None:
        """Make objects a writer of `volume` uploaded reachable for it (it has their bytes)."""
        self._indexer.reach.give(volume_key(volume, self.volume_id(volume)), oids)

    def _vet(self, volume: str, roots: dict[bytes, int],
             given: dict[bytes, tuple[int, bytes]]) -> None:
        """Everything a publish makes reachable must be in `volume`'s reach, and present.

        Walks down from `roots` (the change sets' references) through every
        object that is not vetted yet: those in this publish (`given`) and
        those a writer of the volume uploaded before. A vetted object's subtree
        was checked already (a snapshot walk or an earlier publish). Without
        this, an uploaded file node naming another volume's block, under an
        uploaded tree, became readable through the tree (the web view served
        it) and kept that block alive after its own volume let it go.
        """
        from strata.engine.reach import GIVEN
        key = volume_key(volume, self.volume_id(volume))
        reach = self._indexer.reach
        todo = dict(roots)
        seen: set[bytes] = set()
        checked: list[bytes] = []
        while todo:
            batch = [oid for oid in todo if oid not in seen]
            kinds = {oid: todo[oid] for oid in batch}
            todo = {}
            outside = [oid for oid in batch if oid not in given]
            states = dict(zip(outside, reach.states(key, outside), strict=True))
            if any(s is None for s in states.values()):
                self.reachable(volume, outside)  # a miss: walk the history gained since
                states = dict(zip(outside, reach.states(key, outside), strict=True))
            for oid in batch:
                seen.add(oid)
                state = states.get(oid, GIVEN)
                if state is None or (oid not in given and not self._indexer.has(oid)):
                    raise InvalidInput(f"publish refers to object {oid.hex()} the store lacks")
                if state != GIVEN or kinds[oid] == BLOCK:
                    continue  # vetted already, or a block: it refers to nothing
                raw = given[oid][1] if oid in given else self.get_object(oid)
                try:
                    todo.update((o, k) for k, o in references(kinds[oid], raw))
                except ValueError as exc:
                    raise InvalidInput(f"object {oid.hex()} does not decode: {exc}") from None
                if oid not in given:
                    checked.append(oid)
        # Marked only once the whole walk held: what an upload gave is now known good.
        reach.vet(key, checked)

    def object_size(self, oid: bytes) -> int:
        """An object's raw size from its frame header, read without its body."""
        self._check_open()
        loc = self._indexer.locate(oid)
        if loc is None:
            if self.index.is_expired(oid):  # as get_object says it: history ends there
                raise Expired(f"snapshot {oid.hex()} expired (retention policy; "
                              "garbage collection removed it)")
            raise no_object(oid)
        return packfmt.peek_object_size(partial(self._packs.pread, loc.pack), loc.offset,
                                        self._packs.info(loc.pack).sync)

    def object_kind(self, oid: bytes) -> int | None:
        loc = self._indexer.locate(oid)
        return loc.kind if loc is not None else None

    def _check_open(self) -> None:
        if self._journal.closed:
            raise Unavailable("store is closed")

    # -- volumes and branches ----------------------------------------------------------

    def list_volumes(self) -> list[str]:
        self._check_open()
        return sorted(self._refs.served_vols)

    def list_branches(self, volume: str) -> dict[str, str]:
        self._check_open()
        check_volume(volume)
        if volume not in self._refs.served_vols:
            raise NotFound(f"no volume {volume!r}")
        return {br: sid for (v, br), sid in sorted(self._refs.served.items()) if v == volume}

    def head(self, volume: str, branch: str) -> str:
        return self.heads([(volume, branch)])[0]

    def volume_id(self, volume: str) -> str:
        """The id drawn when `volume` was created; a volume made again gets a new one."""
        check_volume(volume)
        if volume not in self._refs.served_vols:
            raise NotFound(f"no volume {volume!r}")
        return self._refs.vol_ids.get(volume, "")

    def heads(self, refs: Sequence[tuple[str, str]]) -> list[str]:
        self._check_open()
        current = self._refs.served  # swapped whole when commits become durable: one instant
        out = []
        for volume, branch in refs:
            check_volume(volume)
            check_branch(branch)
            sid = current.get((volume, branch))
            if sid is None:
                if volume not in self._refs.served_vols:
                    raise NotFound(f"no volume {volume!r}")
                raise NotFound(f"no branch {branch!r} in volume {volume!r}")
            out.append(sid)
        return out

    def create_volume(self, name: str) -> str:
        check_volume(name)
        with self._branch_lock(name, "live"):
            if name in self._refs.pending_vols:
                raise AlreadyExists(f"volume {name!r} already exists")
            # A fresh id per creation: a volume deleted and created again under the
            # same name is another volume (tokens bound to the old one stop working).
            pos = self._journal.commit([["vol+", name, uuid.uuid4().hex],
                                        ["ref", name, "live", None, EMPTY_SNAPSHOT_ID]])
        self._journal.wait_durable(pos)
        return EMPTY_SNAPSHOT_ID

    def delete_volume(self, name: str) -> None:
        check_volume(name)
        with self._journal.append_lock:
            if name not in self._refs.pending_vols:
                raise NotFound(f"no volume {name!r}")
        pos = self._commit_retry(lambda: [["vol-", name]] + [
            ["ref", v, b, old, None] for (v, b), old in sorted(self._refs.pending.items())
            if v == name])
        self._journal.wait_durable(pos)

    def _commit_retry(self, make_ops: Any) -> Pos:
        # Ops computed from pending state, then committed only if it did not move.
        for _ in range(100):
            ops = make_ops()
            expect = [(str(op[1]), str(op[2]), op[3]) for op in ops if op[0] == "ref"]
            try:
                return self._journal.commit(ops, expect)
            except CasMismatch:
                continue
        raise Unavailable("store too busy to apply the change; retry")

    def fork(self, volume: str, new_branch: str, *, at: str | None) -> str:
        check_volume(volume)
        check_branch(new_branch)
        sid = EMPTY_SNAPSHOT_ID if at is None else check_hex_id(at)
        if self.object_kind(bytes.fromhex(sid)) != SNAPSHOT:
            raise NotFound(f"no snapshot {sid}")
        with self.gate.shared(), self._branch_lock(volume, new_branch):
            if volume not in self._refs.pending_vols:
                raise NotFound(f"no volume {volume!r}")
            if (volume, new_branch) in self._refs.pending:
                raise AlreadyExists(f"branch {new_branch!r} already exists in {volume!r}")
            if self.object_kind(bytes.fromhex(sid)) != SNAPSHOT:
                raise NotFound(f"no snapshot {sid}")  # collected meanwhile
            pos = self._journal.commit([["ref", volume, new_branch, None, sid]],
                                       [(volume, new_branch, None)])
        self._journal.wait_durable(pos)
        return sid

    def delete_branch(self, volume: str, branch: str) -> None:
        check_volume(volume)
        check_branch(branch)
        with self._branch_lock(volume, branch):
            old = self._refs.pending.get((volume, branch))
            if old is None:
                raise NotFound(f"no branch {branch!r} in volume {volume!r}")
            pos = self._journal.commit([["ref", volume, branch, old, None]],
                                       [(volume, branch, old)])
        self._journal.wait_durable(pos)

    # -- leases ------------------------------------------------------------------------

    def acquire_lease(self, volume: str, branch: str, ttl: float, holder: str = "", *,
                      steal: bool = False) -> Lease:
        check_volume(volume)
        check_branch(branch)
        _check_ttl(ttl)
        with self._branch_lock(volume, branch):
            if (volume, branch) not in self._refs.pending:
                raise NotFound(f"no branch {branch!r} in volume {volume!r}")
            now = time.time_ns()
            cur = self._refs.leases.get((volume, branch))
            if cur is not None and cur.expires_ns > now and not steal:
                wait = (cur.expires_ns - now) / 1e9
                raise Locked(f"{volume}@{branch} is leased (fencing token {cur.fencing}) "
                                  f"for {wait:.1f}s more", retry_after=min(wait, 5.0))
            fencing = (cur.fencing if cur else 0) + 1
            secret = os.urandom(16)
            lease = Lease(fencing, now + int(ttl * 1e9), holder, lease_key(secret))
            pos = self._journal.commit([["lease", volume, branch, *lease[:4]]])
        self._journal.wait_durable(pos)
        return lease._replace(id=f"{fencing}.{secret.hex()}")

    def renew_lease(self, volume: str, branch: str, lease: str, ttl: float) -> Lease:
        check_volume(volume)
        check_branch(branch)
        _check_ttl(ttl)
        with self._branch_lock(volume, branch):
            cur = self._live_lease(volume, branch, lease)
            new = cur._replace(expires_ns=time.time_ns() + int(ttl * 1e9))
            pos = self._journal.commit([["lease", volume, branch, *new[:4]]])
        self._journal.wait_durable(pos)
        return new._replace(id=lease)

    def release_lease(self, volume: str, branch: str, lease: str) -> None:
        check_volume(volume)
        check_branch(branch)
        with self._branch_lock(volume, branch):
            cur = self._refs.leases.get((volume, branch))
            if cur is None or cur.expires_ns == 0:
                return  # already released, or never held
            if not lease_matches(cur, lease):
                if lease_fencing(lease) < cur.fencing:
                    return  # expired and taken over since: nothing of ours to release
                raise Forbidden(f"that is not the id of the lease on {volume}@{branch}")
            pos = self._journal.commit([["lease", volume, branch, cur.fencing, 0,
                                         cur.holder, cur.key]])
        self._journal.wait_durable(pos)

    def lease_of(self, volume: str, branch: str) -> Lease | None:
        cur = self._refs.leases.get((volume, branch))
        return cur if cur is not None and cur.expires_ns > time.time_ns() else None

    def _live_lease(self, volume: str, branch: str, lease: str) -> Lease:
        cur = self._refs.leases.get((volume, branch))
        if (cur is None or not lease_matches(cur, lease)
                or cur.expires_ns <= time.time_ns()):
            raise Forbidden(f"lease {lease_fencing(lease)} on {volume}@{branch} has expired, "
                            "been superseded, or is not yours")
        return cur

    def find_snapshot(self, prefix: str) -> str:
        matches = self.snapshots_with_prefix(prefix, limit=2)
        if not matches:
            gone = self.index.expired_with_prefix(check_hex_id(prefix, min_len=8))
            if len(gone) == 1:
                raise Expired(f"snapshot {gone[0]} expired (retention policy; garbage "
                              "collection removed it)")
            raise NotFound(f"no snapshot matches {prefix}")
        if len(matches) > 1:
            raise InvalidInput(f"snapshot prefix {prefix} is ambiguous")
        return matches[0]

    def snapshots_with_prefix(self, prefix: str, limit: int = 64) -> list[str]:
        """Durable snapshot ids starting with `prefix` (at most `limit`), sorted."""
        self._check_open()
        prefix = check_hex_id(prefix, min_len=8)
        matches: set[str] = set()
        durable = self._journal.durable
        for oid, loc in list(self._indexer.recent.items()):
            if (loc.kind == SNAPSHOT and (loc.pack, loc.offset + loc.length) <= durable
                    and oid.hex().startswith(prefix)):
                matches.add(oid.hex())
        start = bytes.fromhex(prefix[: len(prefix) // 2 * 2])
        for oid, loc in self.index.prefix(start):
            h = oid.hex()
            if not h.startswith(prefix[: len(start) * 2]):
                break
            if loc.kind == SNAPSHOT and h.startswith(prefix):
                matches.add(h)
                if len(matches) >= limit:
                    break
        return sorted(matches)[:limit]

    # -- publishing ------------------------------------------------------------------

    def _branch_lock(self, volume: str, branch: str) -> threading.Lock:
        with self._branch_locks_guard:
            lock = self._branch_locks.get((volume, branch))
            if lock is None:
                lock = self._branch_locks[(volume, branch)] = threading.Lock()
            return lock

    def publish(self, changesets: Sequence[ChangeSet],
                objects: Sequence[tuple[int, bytes]] = (), *,
                txid: bytes | None = None) -> list[str]:
        return self.publish_detailed(changesets, objects, txid=txid)[0]

    def publish_detailed(self, changesets: Sequence[ChangeSet],
                         objects: Sequence[tuple[int, bytes]] = (), *,
                         txid: bytes | None = None
                         ) -> tuple[list[str], dict[bytes, bytes]]:
        """`publish`, also returning the tree nodes it wrote (id -> raw).

        The server sends those to the client with its answer: they are the
        nodes the client reads next. Garbage collection's sweep waits for
        publishes in flight (and they for it): what a publish checked exists
        stays until it lands.
        """
        with self.gate.shared():
            return self._publish(changesets, objects, txid)

    def _publish(self, changesets: Sequence[ChangeSet], objects: Sequence[tuple[int, bytes]],
                 txid: bytes | None) -> tuple[list[str], dict[bytes, bytes]]:
        self._journal.check_usable()
        if not changesets:
            raise InvalidInput("nothing to publish")
        if txid is not None and (not isinstance(txid, bytes) or len(txid) != TXID_LEN):
            raise InvalidInput(f"a publish id is {TXID_LEN} bytes")
        keys = []
        for cs in changesets:
            check_volume(cs.volume)
            check_branch(cs.branch)
            check_hex_id(cs.base)
            if cs.branch.startswith(gcmod.TAG_PREFIX):
                raise InvalidInput(f"{cs.volume}@{cs.branch} is a tag: tags do not move")
            _check_message_meta(cs.message, cs.meta)
            keys.append((cs.volume, cs.branch))
        if len(set(keys)) != len(keys):
            raise InvalidInput("a branch appears twice in one publish")
        _ids, given = self._journal.frame_objects(objects)
        named_blocks = self._check_refs_exist(
            changesets, {oid: kind for oid, kind, _f in given},
            {object_id(k, raw): raw for k, raw in objects if k == FILENODE})
        locks = [self._branch_lock(v, b) for v, b in sorted(keys)]
        self._journal.publish_started()
        for lock in locks:
            lock.acquire()
        try:
            trees = Trees(self, self.node_cache)
            trees.new.update({oid: raw for (kind, raw), oid in zip(objects, _ids, strict=True)
                              if kind == TREE})
            results: list[str] = []
            new_objects: list[tuple[int, bytes]] = []
            made: list[SnapshotInfo] = []
            ops: list[list[Any]] = []
            expect: list[tuple[str, str, str | None]] = []
            conflicts: list[str] = []
            for cs in changesets:
                head = self._refs.pending.get((cs.volume, cs.branch))
                if head is None:
                    if cs.volume not in self._refs.pending_vols:
                        raise NotFound(f"no volume {cs.volume!r}")
                    raise NotFound(f"no branch {cs.branch!r} in volume {cs.volume!r}")
                if cs.lease is not None:
                    self._live_lease(cs.volume, cs.branch, cs.lease)
                else:
                    held = self.lease_of(cs.volume, cs.branch)
                    if held is not None:
                        wait = (held.expires_ns - time.time_ns()) / 1e9
                        raise Locked(f"{cs.volume}@{cs.branch} is leased (fencing token "
                                          f"{held.fencing}); retry when it is released",
                                          retry_after=min(max(wait, 0.1), 5.0))
                base_root = self.snapshot(cs.base).root
                head_root = base_root if head == cs.base else self.snapshot(head).root
                try:
                    root = rebase(trees, base_root, head_root, cs.changes,
                                  identical=cs.identical)
                except Conflict as exc:
                    landed = self._landed(changesets, txid) if txid is not None else None
                    if landed is not None:  # a retry of a publish that went through
                        results, ops, conflicts = landed, [], []
                        trees.new.clear()
                        break
                    # Keep checking the other branches: the caller hears every path.
                    label = f"{cs.volume}:" if len(changesets) > 1 else ""
                    conflicts += [label + p for p in exc.paths]
                    continue
                if conflicts:
                    continue
                if root == head_root:
                    results.append(head)
                    continue
                snap = Snapshot(root=root, parent=head, time_ns=time.time_ns(),
                                message=cs.message, meta=cs.meta, tx=txid)
                raw = snap.encode()
                sid = object_id(SNAPSHOT, raw).hex()
                new_objects.append((SNAPSHOT, raw))
                made.append(SnapshotInfo.of(sid, snap))
                ops.append(["ref", cs.volume, cs.branch, head, sid])
                expect.append((cs.volume, cs.branch, head))
                results.append(sid)
            if conflicts:
                raise Conflict(conflicts)
            if ops:
                _ids, frames = self._journal.frame_objects(
                    [(TREE, raw) for raw in trees.new.values()] + new_objects)
                pos = self._journal.commit(ops, expect, given + frames)
            else:
                pos = self._journal.end()
        finally:
            for lock in reversed(locks):
                lock.release()
            self._journal.publish_done()
        self._journal.wait_durable(pos)
        for info in made:  # the next publish on the branch reads it as its base
            self.snapshot_cache_put(info)
        self._unpin_uploaded({e.ref for cs in changesets for e in cs.changes.values()
                       if isinstance(e, Entry) and e.ref is not None} | named_blocks)
        self._release_bases([cs.base for cs in changesets])
        return results, trees.new

    def _landed(self, changesets: Sequence[ChangeSet], txid: bytes) -> list[str] | None:
        """The snapshots an earlier attempt of publish `txid` made, if it went through.

        A retried publish whose first answer was lost meets its own changes
        on the head and would conflict with itself. Its snapshots carry the
        publish id; each branch's history is searched from the head back to
        the change set's base (callers hold the branch locks, and only a
        conflicting publish pays for the walk). A publish is atomic, so it
        landed on every branch or on none.
        """
        found: list[str] = []
        for cs in changesets:
            cur: str | None = self._refs.pending.get((cs.volume, cs.branch))
            while cur is not None and cur != cs.base:
                info = self.snapshot(cur)
                if info.tx == txid:
                    found.append(cur)
                    break
                cur = info.parent
            else:
                return None
        return found

    def check_tree_refs(self, objects: Sequence[tuple[int, bytes]]) -> None:
        """Tree nodes a client sends may refer only to objects that exist (or come along).

        Clients never need to send tree nodes (the store builds them when it
        applies a change set); one that does must not make a branch reach a
        hole. The server calls this on every batch a client sends; in-process
        callers (tests building trees by hand) are trusted. Blocks and file
        nodes may arrive in any order across batches, so their references are
        checked when a publish names them.
        """
        batch = {object_id(k, raw): (k, raw) for k, raw in objects}
        wanted: set[bytes] = set()
        files: list[tuple[bytes, int, bytes]] = []  # (name, size, node) of file entries sent
        for kind, raw in objects:
            if kind == TREE:
                try:
                    wanted.update(oid for _k, oid in references(kind, raw))
                    files.extend((n, e.size, e.ref) for n, e in TreeNode.decode(raw).entries
                                 if e.kind == K_FILE and e.ref is not None)
                except ValueError as exc:
                    raise InvalidInput(f"a tree node does not decode: {exc}") from None
        lacking = [oid for oid in wanted - batch.keys() if not self._indexer.has(oid)]
        if lacking:
            raise InvalidInput(f"a tree node refers to {len(lacking)} object(s) the store "
                               f"lacks, e.g. {lacking[0].hex()}")
        sent = {object_id(k, raw): raw for k, raw in objects if k == TREE}
        for raw in sent.values():
            try:
                check_tree_shape(TreeNode.decode(raw), lambda oid: TreeNode.decode(
                    sent[oid] if oid in sent else self.get_object(oid)))
            except ValueError as exc:  # a child or directory that is no tree node
                raise InvalidInput(f"a tree node names an object that is no tree node: "
                                   f"{exc}") from None
        # A file entry's size is its node's: readers (the web view) trust the node.
        for name, size, ref in files:
            given = batch.get(ref)
            if given is not None and given[0] != FILENODE or (
                    given is None and self.object_kind(ref) != FILENODE):
                raise InvalidInput(f"tree entry {name!r} names {ref.hex()}, not a file node")
            raw = given[1] if given is not None else self.get_object(ref)
            try:
                node = FileNode.decode(raw)
            except ValueError as exc:
                raise InvalidInput(f"file node {ref.hex()} does not decode: {exc}") from None
            check_entry_size(name.decode("utf-8", "surrogateescape"), size, node)

    def check_refs_reachable(self, volume: str, changesets: Sequence[ChangeSet],
                             objects: Sequence[tuple[int, bytes]], *,
                             upload: bool = False) -> None:
        """What a scoped writer of `volume` sends may refer only to what it can reach.

        Otherwise an id learned elsewhere would become readable by naming it in
        a tree or a change set, and whether the publish is accepted would tell
        whether the object exists. Refused references get one answer whether
        the object exists elsewhere or nowhere. Checked, besides whatever comes
        along in `objects`: the references of the change sets' entries, of the
        tree and file nodes sent, and the blocks of the file nodes the change
        sets name. An `upload` ahead of a publish is checked for its tree nodes
        only: blocks may come in a later batch than their file node, and the
        publish that names the file node checks them.
        """
        given = {object_id(k, raw): (k, raw) for k, raw in objects}
        want: dict[bytes, int] = {}
        for cs in changesets:
            if not isinstance(cs.changes, dict):
                raise InvalidInput("changes must map paths to entries")
            for e in cs.changes.values():
                if isinstance(e, Entry) and e.ref is not None and isinstance(e.ref, bytes):
                    want[e.ref] = FILENODE if e.kind == K_FILE else TREE
        for kind, raw in given.values():
            if kind == TREE or (kind == FILENODE and not upload):
                try:
                    want.update((oid, k) for k, oid in references(kind, raw))
                except ValueError as exc:
                    raise InvalidInput(f"an object does not decode: {exc}") from None
        outside = sorted(oid for oid in want if oid not in given)
        for oid, ok in zip(outside, self.reachable(volume, outside), strict=True):
            if not ok:
                raise InvalidInput(f"publish refers to object {oid.hex()} the store lacks")
        if not upload:
            roots = {e.ref: FILENODE if e.kind == K_FILE else TREE for cs in changesets
                     for e in cs.changes.values()
                     if isinstance(e, Entry) and isinstance(e.ref, bytes)}
            self._vet(volume, roots, given)

    def _check_refs_exist(self, changesets: Sequence[ChangeSet], given: dict[bytes, int],
                          nodes: dict[bytes, bytes] | None = None) -> set[bytes]:
        """Check the change sets' references exist; returns the blocks their files name."""
        want: dict[bytes, int] = {}
        named: set[bytes] = set()
        claims: dict[bytes, list[tuple[str, int]]] = {}  # file node -> (path, size) naming it
        for cs in changesets:
            if not isinstance(cs.changes, dict):
                raise InvalidInput("changes must map paths to entries")
            for path, e in cs.changes.items():
                if not isinstance(e, Entry) or e.ref is None:
                    continue  # deletions, inline data; non-entries are refused by rebase
                if e.kind == K_FILE:
                    want[e.ref] = FILENODE
                    claims.setdefault(e.ref, []).append((path, e.size))
                elif e.kind == K_DIR:
                    want[e.ref] = TREE
                else:
                    raise InvalidInput(f"entry for {path!r} has a reference it cannot use")
        for oid, kind in want.items():
            if not isinstance(oid, bytes) or len(oid) != ID_LEN:
                raise InvalidInput("entry reference is not a 32-byte id")
            have = given.get(oid) or self.object_kind(oid)
            if have is None:
                raise InvalidInput(f"change set refers to object {oid.hex()} the store lacks")
            if have != kind:
                raise InvalidInput(f"object {oid.hex()} is a {KIND_NAMES.get(have)}, "
                                   f"not a {KIND_NAMES[kind]}")
            if kind == FILENODE:  # its size is the entry's, and every block it names exists
                raw = (nodes or {}).get(oid) or self.get_object(oid)
                node = FileNode.decode(raw)
                for path, size in claims.get(oid, ()):
                    check_entry_size(path, size, node)
                self._check_file_tree(oid, node, given, nodes or {}, named)
        return named

    def _check_file_tree(self, oid: bytes, node: FileNode, given: dict[bytes, int],
                         nodes: dict[bytes, bytes], named: set[bytes]) -> None:
        """Every chunk and child a file node names exists; children sent along agree with it.

        A child node already in the store was checked when it arrived; one in
        this publish is decoded and checked against its parent's entry (level
        and length), so a reader never meets a tree whose parts disagree.
        """
        stack = [(oid, node)]
        while stack:
            nid, n = stack.pop()
            for i, (_len, b) in enumerate(n.entries):
                if b == ZERO_ID or b in named:
                    continue
                named.add(b)
                if n.level and b in nodes:
                    try:
                        stack.append((b, n.child(i, nodes[b])))
                    except ValueError as exc:
                        raise InvalidInput(f"file node {nid.hex()}: {exc}") from None
                elif b not in given and not self._indexer.has(b):
                    what = "child node" if n.level else "block"
                    raise InvalidInput(f"file node {nid.hex()} names {what} {b.hex()} "
                                       "the store lacks")

    # -- maintenance ---------------------------------------------------------------------

    def sync_index(self) -> None:
        """Write everything durable into LMDB now (normally the indexer does this)."""
        self._indexer.flush()

    def fenced(self) -> str | None:
        """Why this process may no longer write the store, if another owner took it over."""
        if self._tier is None:
            return None
        failed = self._tier.failed
        return str(failed) if isinstance(failed, Fenced) else None

    def unshipped_for(self) -> float:
        """Seconds the oldest byte not yet in the bucket has waited (0: none, or no bucket)."""
        return self._tier.unshipped_for() if self._tier is not None else 0.0

    def set_ack_gate(self, gate: Callable[[], None] | None) -> None:
        """Ask `gate` before acknowledging anything durable (bucket stores; the fleet's lease)."""
        if self._tier is not None:
            self._tier.ack_gate = gate

    def tier_report(self) -> dict[str, Any] | None:
        """The bucket tier's state (None for a store without a bucket)."""
        return self._tier.report() if self._tier is not None else None

    # -- garbage collection (engine/gc.py) ---------------------------------------------

    def gc(self, *, min_age: float = gcmod.DEFAULT_MIN_AGE, dry_run: bool = False,
           progress: gcmod.GcProgress | None = None, full: bool = False) -> dict[str, Any]:
        """One garbage collection pass; returns what it found and freed.

        `full` marks from every retained snapshot and checks the accounting.
        """
        self._check_open()
        return gcmod.collect(self, self._journal, self._packs, min_age=min_age, dry_run=dry_run,
                             progress=progress, full=full)

    def gc_blocked(self) -> str | None:
        """Why GC cannot run now, if it cannot."""
        if self._tier is not None and not self._tier.index_complete():
            return ("the index is still being copied from the bucket after a restore; "
                    "garbage collection waits for it")
        return None

    def opened_for(self) -> float:
        return time.monotonic() - self._opened

    def forget(self, gone: dict[bytes, tuple[Loc, list[bytes]]], expired: list[bytes]) -> None:
        """Drop collected objects (with what each names) from the index.

        Callers hold the gate alone.
        """
        self.index.forget_counted(gone, expired)
        self.node_cache.clear()
        self._snap_cache.clear()

    def remove_pack(self, number: int) -> None:
        """Delete an empty sealed pack, once the whole ref state is in the journal.

        An index rebuild from the packs left must not miss their commit records.
        """
        pos = self._journal.commit(lambda: state_ops(self._refs))
        self._journal.wait_durable(pos)
        self.sync_index()
        self._packs.remove(number)

    def gc_report(self) -> dict[str, Any] | None:
        raw = self.index.get_meta(b"gc-last")
        return json.loads(raw) if raw else None

    def fsck(self, progress: FsckProgress | None = None) -> dict[str, Any]:
        """Verify every record of every pack, the index, and every branch's tree.

        `progress` is told (done, total, phase) as it goes (engine/fsck.py).
        """
        return fsck(self._packs, self._journal, self._refs, self._indexer, self.get_object,
                    self.recovery, self.path, progress)

    def rebuild_index(self) -> dict[str, Any]:
        """Throw the index away and rebuild it by replaying every pack."""
        return rebuild_index(self.index_dir, self._packs, self.recovery, self._journal,
                             self._indexer)

    def close(self) -> None:
        if self._journal.closed:
            return
        if self._tier is not None and self._tier.failed is None:
            # Its last pack goes to the bucket whole (the tier's flush below), so the
            # next restore replays no log tail (Journal.seal_for_close).
            try:
                self._journal.seal_for_close()
            except (StrataError, OSError):
                log.warning("the active pack could not be sealed at close; the next "
                            "restore replays its log tail", exc_info=True)
        self._indexer.stop()
        self._journal.close(self._indexer.flush)
        with contextlib.suppress(OSError):
            self.pins.closed_cleanly()
        self._packs.close()  # the bucket tier ships, uploads and checkpoints first
        self.index.close()
        self._lock.release()


def _check_ttl(ttl: float) -> None:
    if not 0.1 <= ttl <= 86400:
        raise InvalidInput("lease ttl must be between 0.1 s and one day")


def _check_message_meta(message: object, meta: object) -> None:
    # Refused up front: a snapshot that cannot be encoded, or decoded again, would
    # fail mid-publish or leave its branch with an unreadable head.
    if not isinstance(message, str) or not isinstance(meta, dict):
        raise InvalidInput("a snapshot's message must be a string and its meta a mapping")
    try:
        packb(meta)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidInput(f"snapshot meta cannot be stored: {exc}") from exc
