"""The in-process store: one directory, one owner, packs as the journal.

`LocalStore` owns a store directory while it is open (an exclusive lock). It
appends objects and commit records to the active pack, makes commits durable
with group-commit fsync, keeps refs in memory (the durable view for readers,
the pending view for compare-and-swap), and feeds a background indexer that
writes LMDB off the commit path. The crash-safety order it follows is written
out in docs/design.md; keep the two in step.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hmac
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import blake3

from strata.engine import pack as packfmt
from strata.engine.changes import rebase
from strata.engine.errors import (
    AlreadyExists,
    Conflict,
    Corrupt,
    Forbidden,
    InvalidInput,
    Locked,
    NotFound,
    StoreFailed,
    StrataError,
    Unavailable,
    no_object,
)
from strata.engine.index import Index
from strata.engine.interface import ChangeSet, Lease, SnapshotInfo, Store
from strata.engine.names import check_branch, check_hex_id, check_volume
from strata.engine.objects import (
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
    object_id,
    packb,
    references,
    unpackb,
)
from strata.engine.reach import Reach, volume_key
from strata.engine.storedir import (
    StoreConfig,
    StoreLock,
    init_store,
    make_private,
    read_store_meta,
)
from strata.engine.storedir import fsync_dir as _fsync_dir
from strata.engine.tree import NodeCache, Trees

__all__ = ["MAX_OBJECT", "LocalStore", "StoreConfig", "init_store", "read_store_meta"]

# The largest object: a file node naming 128 GiB of 64 KiB blocks. Every record's
# length is checked against the pack payload limit when it is written, never
# discovered on a scan.
MAX_OBJECT = packfmt.MAX_PAYLOAD - packfmt.OBJ_HEAD_SIZE
GROUP_COMMIT_LINGER = 0.001  # seconds a sync leader waits for in-flight publishes
Pos = tuple[int, int]
Loc = tuple[int, int, int, int]


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
        self._closed = False
        self._failed: BaseException | None = None
        self.packs_dir = os.path.join(self.path, "packs")
        self.index_dir = os.path.join(self.path, "index")
        for d in (self.path, self.packs_dir):  # stores made before 0700 was the rule
            make_private(d)
        self.node_cache = NodeCache()
        self._snap_cache: dict[str, SnapshotInfo] = {}
        self.stats = {"fsyncs": 0, "commits": 0, "objects_written": 0, "bytes_written": 0}
        self.recovery: dict[str, Any] = {"truncated": [], "damaged": [], "replayed": 0}
        # Append side (guarded by _append_lock).
        self._append_lock = threading.Lock()
        self._recent: dict[bytes, Loc] = {}
        self._unindexed: collections.deque[tuple[Pos, str, Any]] = collections.deque()
        self._undurable: collections.deque[tuple[Pos, list[list[Any]]]] = collections.deque()
        self._pending_refs: dict[tuple[str, str], str] = {}
        self._pending_vols: set[str] = set()
        self._leases: dict[tuple[str, str], Lease] = {}
        self._vol_ids: dict[str, str] = {}  # volume -> id drawn at its creation
        # Durability side (guarded by _cond).
        self._cond = threading.Condition()
        self._syncing = False
        self._inflight = 0  # publishes between start and commit append
        self._durable: Pos = (0, 0)
        self._refs: dict[tuple[str, str], str] = {}
        self._vols: set[str] = set()
        self._branch_locks: dict[tuple[str, str], threading.Lock] = {}
        self._branch_locks_guard = threading.Lock()
        self._read_fds: dict[int, int] = {}
        self._read_fds_guard = threading.Lock()
        self._pack_infos: dict[int, packfmt.PackInfo] = {}
        self._sync = b""  # the active pack's frame marker (set with the active pack)
        self._index_lock = threading.Lock()
        try:
            self._open_index_and_recover()
        except BaseException:
            self._lock.release()
            raise
        self._stop = threading.Event()
        self._indexer = threading.Thread(target=self._index_loop, name="strata-indexer",
                                         daemon=True)
        self._indexer.start()

    # -- opening and recovery -----------------------------------------------------

    def _pack_numbers(self) -> list[int]:
        out = []
        for name in os.listdir(self.packs_dir):
            if name.endswith(".pack") and len(name) == 13:
                try:
                    out.append(int(name[:8], 16))
                except ValueError:
                    continue
        return sorted(out)

    def _pack_path(self, number: int) -> str:
        return os.path.join(self.packs_dir, packfmt.pack_name(number))

    def _open_index_and_recover(self) -> None:
        try:
            self.index = Index(self.index_dir)
            start = self.index.applied()
        except Exception:  # a damaged or foreign index is rebuilt from the packs
            Index.destroy(self.index_dir)
            self.index = Index(self.index_dir)
            start = None
            self.recovery["index_rebuilt"] = True
        self._replay(start)
        self._reach = Reach(self.index)
        self._vols, self._refs = self.index.load_state()
        self._leases = {k: Lease(*v) for k, v in self.index.load_leases().items()}
        self._vol_ids = self.index.load_volume_ids()
        self._pending_vols = set(self._vols)
        self._pending_refs = dict(self._refs)
        self._open_writer()
        if EMPTY_SNAPSHOT_ID not in {r for r in self._refs.values()} and not self._has(
                bytes.fromhex(EMPTY_SNAPSHOT_ID)):
            self.put_objects([(TREE, EMPTY_TREE), (SNAPSHOT, EMPTY_SNAPSHOT_RAW)])
            self._commit([])

    def _replay(self, start: Pos | None, into: Index | None = None, *,
                repair: bool = True) -> None:
        """Bring the index up to the end of the packs, truncating a torn tail.

        Only recovery on open repairs (`repair`): it owns the packs and nothing
        appends meanwhile. A rebuild of the index under a running store only
        reads; a torn tail it meets is reported, never cut.
        """
        index = into if into is not None else self.index
        numbers = self._pack_numbers()
        for number in numbers:
            if start is not None and number < start[0]:
                continue
            offset = start[1] if start is not None and number == start[0] else None
            path = self._pack_path(number)
            name = packfmt.pack_name(number)
            size = os.path.getsize(path)
            if repair and number == numbers[-1] and packfmt.header_incomplete(path):
                # Created, then a crash before its header was written: it holds nothing.
                self.recovery["truncated"].append({"pack": name, "offset": 0, "bytes": size})
                os.remove(path)
                _fsync_dir(self.packs_dir)
                continue
            result = packfmt.scan(path, offset)
            for off, reason in result.damaged:
                self.recovery["damaged"].append({"pack": name, "offset": off, "reason": reason})
            if result.torn and not repair:
                self.recovery["damaged"].append(
                    {"pack": name, "offset": result.end, "reason": "torn tail (left alone)"})
            elif result.torn:
                size = os.path.getsize(path)
                self.recovery["truncated"].append(
                    {"pack": name, "offset": result.end, "bytes": size - result.end})
                if packfmt.complete_frame_at(path, result.end):
                    # A whole frame that fails its checksum is not an unfinished
                    # append but damage: it is cut like a torn tail, and reported.
                    self.recovery["damaged"].append(
                        {"pack": name, "offset": result.end,
                         "reason": "last record damaged (cut on open)"})
                if os.stat(path).st_mode & 0o200 == 0:
                    os.chmod(path, 0o600)
                with open(path, "r+b") as f:
                    f.truncate(result.end)
                    f.flush()
                    os.fsync(f.fileno())
            objs: list[tuple[bytes, Loc]] = []
            ops: list[list[Any]] = []
            for rec in result.records:
                if rec.rtype == packfmt.R_OBJECT:
                    kind, oid, _n = packfmt.OBJ_HEAD.unpack_from(rec.payload)
                    objs.append((oid, (number, rec.offset, rec.length, kind)))
                elif rec.rtype == packfmt.R_COMMIT:
                    try:
                        ops.extend(unpackb(rec.payload)["ops"])
                    except (ValueError, KeyError, TypeError):
                        self.recovery["damaged"].append(
                            {"pack": name, "offset": rec.offset, "reason": "bad commit payload"})
            self.recovery["replayed"] += len(result.records)
            index.apply(objs, ops, (number, result.end))

    def _open_writer(self) -> None:
        numbers = self._pack_numbers()
        if numbers:
            number = numbers[-1]
            path = self._pack_path(number)
            size = os.path.getsize(path)
            info = self._pack_info(number)
            # Packs of an older format are read, never appended to: new records
            # go to a new pack of the current format.
            if (info.version == packfmt.PACK_VERSION and not packfmt.is_sealed(path)
                    and size < self.config.pack_size_limit):
                fd = os.open(path, os.O_WRONLY | os.O_APPEND)
                os.fsync(fd)  # whatever survived the crash is now durable
                self._sync = info.sync
                self._set_tail(fd, number, size, time.monotonic())
                self._durable = (number, size)
                return
            # Not appended to again (sealed, full, or of an older format): still make
            # whatever of it survived the crash durable before anything depends on it.
            rfd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(rfd)
            finally:
                os.close(rfd)
            self._durable = (number, size)
            number += 1
        else:
            number = 1
        self._new_pack(number)

    def _new_pack(self, number: int) -> None:
        path = self._pack_path(number)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
        sync = packfmt.new_sync()
        packfmt.write_header(fd, number, self.store_id, sync)
        os.fsync(fd)
        _fsync_dir(self.packs_dir)
        self._sync = sync  # every frame appended to this pack starts with it
        self._set_tail(fd, number, packfmt.HEADER_SIZE, time.monotonic())

    def _set_tail(self, fd: int, number: int, offset: int, born: float) -> None:
        # One tuple, swapped whole, so the sync leader can read it without a lock.
        self._tail = (fd, number, offset, born)

    # -- low-level append and durability -------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise Unavailable("store is closed")
        if self._failed is not None:
            raise StoreFailed(f"store refused further writes after an I/O error: {self._failed}")

    def _roll_if_due(self, size: int) -> None:
        """Seal the active pack if `size` more bytes would pass its size or age limit."""
        _fd, _number, offset, born = self._tail
        if offset > packfmt.HEADER_SIZE and (
                offset + size > self.config.pack_size_limit
                or time.monotonic() - born > self.config.pack_age_limit):
            self._seal_locked()

    def _append(self, data: bytes) -> tuple[int, int]:
        """Append whole frames to the active pack; caller holds _append_lock.

        The frames were built with this pack's marker (`_roll_if_due` first).
        """
        fd, number, offset, born = self._tail
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError as exc:
            try:
                os.ftruncate(fd, offset)
            except OSError:
                self._failed = exc
                raise StoreFailed(f"write to pack failed and could not be undone: {exc}") from exc
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise Unavailable(f"store disk is full: {exc}") from exc
            raise StoreFailed(f"write to pack failed: {exc}") from exc
        self._set_tail(fd, number, offset + len(data), born)
        self.stats["bytes_written"] += len(data)
        return number, offset

    def _seal_locked(self) -> None:
        """Seal the active pack and start the next; caller holds _append_lock."""
        fd, number, offset, _born = self._tail
        seal = packfmt.seal_frame(offset, self._sync)
        os.write(fd, seal)
        end = offset + len(seal)
        self._unindexed.append(((number, end), "seal", None))
        with self._cond:
            while self._syncing:
                self._cond.wait()
            os.fdatasync(fd)
            self.stats["fsyncs"] += 1
            self._advance_durable((number, end))
        os.close(fd)
        os.chmod(self._pack_path(number), 0o400)
        self._new_pack(number + 1)

    def _advance_durable(self, pos: Pos) -> None:
        """Everything up to `pos` is on disk: publish it to readers. Holds _cond."""
        if pos > self._durable:
            self._durable = pos
        if self._undurable and self._undurable[0][0] <= self._durable:
            # Copy, change, swap: readers iterate the old dicts without a lock.
            vols, refs = set(self._vols), dict(self._refs)
            while self._undurable and self._undurable[0][0] <= self._durable:
                _p, ops = self._undurable.popleft()
                for op in ops:
                    _apply_op(op, vols, refs)
            self._vols, self._refs = vols, refs
        self._cond.notify_all()

    def _wait_durable(self, pos: Pos) -> None:
        lingered = False
        with self._cond:
            while self._durable < pos:
                if self._failed is not None:
                    raise StoreFailed(f"store failed while syncing: {self._failed}")
                if self._syncing:
                    self._cond.wait()
                    continue
                if self._inflight > 0 and not lingered:
                    # Other publishes are about to append: give them a moment to
                    # join this fsync instead of paying for the next one.
                    lingered = True
                    self._cond.wait(GROUP_COMMIT_LINGER)
                    continue
                # Become the leader: one fdatasync covers every append so far.
                fd, number, offset, _born = self._tail
                self._syncing = True
                self._cond.release()
                try:
                    os.fdatasync(fd)
                    err: BaseException | None = None
                except OSError as exc:
                    err = exc
                finally:
                    self._cond.acquire()
                    self._syncing = False
                self.stats["fsyncs"] += 1
                if err is not None:
                    self._failed = err
                    self._cond.notify_all()
                    raise StoreFailed(f"fsync of the pack failed: {err}")
                self._advance_durable((number, offset))

    def _commit(self, ops: list[list[Any]],
                expect: Sequence[tuple[str, str, str | None]] = (),
                frames: Sequence[tuple[bytes, int, bytes]] = ()) -> Pos:
        """Append objects and one commit record after checking CAS; return its end.

        The objects go first, in the same write, so the commit record never
        reaches the disk before what it refers to.
        """
        with self._append_lock:
            self._check_usable()
            for vol, br, old in expect:
                cur = self._pending_refs.get((vol, br))
                if cur != old:
                    raise _CasMismatch(vol, br, old, cur)
            created = {op[1] for op in ops if op[0] == "vol+"}
            for op in ops:
                if op[0] in ("ref", "lease") and op[1] not in self._pending_vols | created:
                    raise NotFound(f"no volume {op[1]!r}")  # deleted under our feet
            payload = packb({"t": time.time_ns(), "ops": ops})
            frame = packfmt.encode_frame(packfmt.R_COMMIT, payload)
            number, offset = self._append_records_locked(frames, frame)
            end = (number, offset + len(self._sync) + len(frame))
            for op in ops:
                _apply_op(op, self._pending_vols, self._pending_refs)
                if op[0] == "lease":
                    self._leases[(op[1], op[2])] = Lease(op[3], op[4], op[5], op[6])
                elif op[0] == "vol+":
                    self._vol_ids[op[1]] = op[2]
                elif op[0] == "vol-":
                    self._vol_ids.pop(op[1], None)
            self._undurable.append((end, ops))
            self._unindexed.append((end, "commit", ops))
            self.stats["commits"] += 1
        return end

    # -- the indexer (off the commit path) -------------------------------------------

    def _index_loop(self) -> None:
        while not self._stop.wait(self.config.index_interval):
            try:
                self._flush_index()
                self._maybe_seal_by_age()
            except StrataError:
                continue
            except Exception as exc:  # keep serving reads; report through fsck
                errs = self.recovery.setdefault("indexer_errors", [])
                errs.append(str(exc))
                del errs[:-10]

    def _maybe_seal_by_age(self) -> None:
        _fd, _n, offset, born = self._tail
        if offset > packfmt.HEADER_SIZE and time.monotonic() - born > self.config.pack_age_limit:
            with self._append_lock:
                if self._failed is None and not self._closed:
                    _fd, _n, offset, born = self._tail
                    if (offset > packfmt.HEADER_SIZE
                            and time.monotonic() - born > self.config.pack_age_limit):
                        self._seal_locked()

    def _flush_index(self) -> None:
        # One flusher at a time: batches must reach LMDB in order, or `applied`
        # could pass a batch another thread has popped but not yet written.
        with self._index_lock:
            self._flush_index_locked()

    def _flush_index_locked(self) -> None:
        durable = self._durable
        objs: list[tuple[bytes, Loc]] = []
        ops: list[list[Any]] = []
        reached: Pos | None = None
        batch = []
        while self._unindexed and self._unindexed[0][0] <= durable:
            batch.append(self._unindexed.popleft())
            pos, what, payload = batch[-1]
            if what == "object":
                objs.append(payload)
            elif what == "commit":
                ops.extend(payload)
            reached = pos
        if reached is None:
            return
        try:
            self.index.apply(objs, ops, reached)
        except BaseException:
            # Put the batch back, in order, for the next flush: dropped, a later
            # batch would mark the index applied past records it never got.
            self._unindexed.extendleft(reversed(batch))
            raise
        for oid, _loc in objs:
            self._recent.pop(oid, None)

    # -- objects --------------------------------------------------------------------

    def _locate(self, oid: bytes) -> Loc | None:
        loc = self._recent.get(oid)
        if loc is None:
            loc = self.index.locate(oid)
        return loc

    def _has(self, oid: bytes) -> bool:
        return oid in self._recent or self.index.locate(oid) is not None

    def missing(self, ids: Sequence[bytes]) -> list[bytes]:
        self._check_open()
        out = []
        for oid in ids:
            if not isinstance(oid, bytes) or len(oid) != ID_LEN:
                raise InvalidInput("object ids are 32 bytes")
            if not self._has(oid):
                out.append(oid)
        return out

    def put_objects(self, objects: Sequence[tuple[int, bytes]]) -> list[bytes]:
        self._check_usable()
        ids, frames = self._frame_objects(objects)
        if frames:
            with self._append_lock:
                self._check_usable()
                self._append_records_locked(frames)
        return ids

    def _frame_objects(self, objects: Sequence[tuple[int, bytes]]
                       ) -> tuple[list[bytes], list[tuple[bytes, int, bytes]]]:
        """Hash and frame the objects the store lacks (outside any lock)."""
        ids: list[bytes] = []
        frames: list[tuple[bytes, int, bytes]] = []
        seen: set[bytes] = set()
        for kind, raw in objects:
            if kind not in KIND_NAMES:
                raise InvalidInput(f"unknown object kind {kind}")
            if len(raw) > MAX_OBJECT:
                raise InvalidInput(f"{KIND_NAMES[kind]} of {len(raw)} bytes is over the "
                                   f"{MAX_OBJECT}-byte object limit")
            oid = object_id(kind, raw)
            ids.append(oid)
            if oid in seen or self._has(oid):
                continue
            seen.add(oid)
            frames.append((oid, kind, packfmt.encode_object(kind, oid, raw,
                                                            self.config.compress)))
        return ids, frames

    def _append_records_locked(self, frames: Sequence[tuple[bytes, int, bytes]],
                               tail: bytes = b"") -> Pos:
        """Append object frames (skipping any stored meanwhile) and then `tail`.

        One write for all of it; returns the position where `tail` starts.
        Caller holds _append_lock.
        """
        todo = [f for f in frames if not self._has(f[0])]
        if not todo and not tail:
            return (self._tail[1], self._tail[2])
        # Seal first if due: every frame must carry the marker of the pack it lands in.
        self._roll_if_due(sum(len(f[2]) for f in todo) + len(tail)
                          + len(self._sync) * (len(todo) + bool(tail)))
        sync = self._sync
        data = b"".join(sync + f[2] for f in todo) + (sync + tail if tail else b"")
        number, offset = self._append(data)
        for oid, kind, frame in todo:
            loc = (number, offset, len(sync) + len(frame), kind)
            self._recent[oid] = loc
            offset += loc[2]
            self._unindexed.append(((number, offset), "object", (oid, loc)))
        self.stats["objects_written"] += len(todo)
        return number, offset

    def _read_fd(self, number: int) -> int:
        fd = self._read_fds.get(number)
        if fd is None:
            with self._read_fds_guard:
                fd = self._read_fds.get(number)
                if fd is None:
                    fd = os.open(self._pack_path(number), os.O_RDONLY)
                    self._read_fds[number] = fd
        return fd

    def _pack_info(self, number: int) -> packfmt.PackInfo:
        """A pack's header (its format and sync marker), read once."""
        info = self._pack_infos.get(number)
        if info is None:
            info = packfmt.read_info(self._pack_path(number))
            if info.number != number:
                raise Corrupt(packfmt.pack_name(number), 0,
                              f"header names pack {info.number}")
            self._pack_infos[number] = info
        return info

    def _read_frame(self, loc: Loc) -> bytes:
        number, offset, length, _kind = loc
        return os.pread(self._read_fd(number), length, offset)

    def get_object(self, oid: bytes) -> bytes:
        self._check_open()
        loc = self._locate(oid)
        if loc is None:
            raise no_object(oid)
        frame = self._read_frame(loc)
        name = packfmt.pack_name(loc[0])
        kind, stored_id, raw = packfmt.decode_object(frame, self._pack_info(loc[0]).sync,
                                                     name, loc[1])
        if stored_id != oid:
            raise Corrupt(name, loc[1], f"index points at {stored_id.hex()}, not {oid.hex()}")
        return raw

    def reachable(self, volume: str, oids: Sequence[bytes]) -> list[bool]:
        """Whether each object is reachable from `volume`'s history or was given to it.

        The object half of a token's scope (see engine/reach.py): a miss walks
        only the snapshots the volume gained since the last miss.
        """
        key = volume_key(volume, self.volume_id(volume))
        got = self._reach.marked(key, oids)
        if not all(got):
            self._reach.extend(key, self.list_branches(volume).values(),
                               lambda sid: self.snapshot(sid).parent, self.get_object)
            got = self._reach.marked(key, oids)
        return got

    def give(self, volume: str, oids: Sequence[bytes]) -> None:
        """Make objects a writer of `volume` uploaded reachable for it (it has their bytes)."""
        self._reach.give(volume_key(volume, self.volume_id(volume)), oids)

    def object_size(self, oid: bytes) -> int:
        """An object's raw size from its frame header, read without its body."""
        self._check_open()
        loc = self._locate(oid)
        if loc is None:
            raise no_object(oid)
        return packfmt.peek_object_size(self._read_fd(loc[0]), loc[1],
                                        self._pack_info(loc[0]).sync)

    def object_kind(self, oid: bytes) -> int | None:
        loc = self._locate(oid)
        return loc[3] if loc is not None else None

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("store is closed")

    # -- volumes and branches ----------------------------------------------------------

    def list_volumes(self) -> list[str]:
        self._check_open()
        return sorted(self._vols)

    def list_branches(self, volume: str) -> dict[str, str]:
        self._check_open()
        check_volume(volume)
        if volume not in self._vols:
            raise NotFound(f"no volume {volume!r}")
        return {br: sid for (v, br), sid in sorted(self._refs.items()) if v == volume}

    def head(self, volume: str, branch: str) -> str:
        return self.heads([(volume, branch)])[0]

    def volume_id(self, volume: str) -> str:
        """The id drawn when `volume` was created; a volume made again gets a new one."""
        check_volume(volume)
        if volume not in self._vols:
            raise NotFound(f"no volume {volume!r}")
        return self._vol_ids.get(volume, "")

    def heads(self, refs: Sequence[tuple[str, str]]) -> list[str]:
        self._check_open()
        current = self._refs  # swapped whole when commits become durable: one instant
        out = []
        for volume, branch in refs:
            check_volume(volume)
            check_branch(branch)
            sid = current.get((volume, branch))
            if sid is None:
                if volume not in self._vols:
                    raise NotFound(f"no volume {volume!r}")
                raise NotFound(f"no branch {branch!r} in volume {volume!r}")
            out.append(sid)
        return out

    def create_volume(self, name: str) -> str:
        check_volume(name)
        with self._branch_lock(name, "live"):
            if name in self._pending_vols:
                raise AlreadyExists(f"volume {name!r} already exists")
            # A fresh id per creation: a volume deleted and created again under the
            # same name is another volume (tokens bound to the old one stop working).
            pos = self._commit([["vol+", name, uuid.uuid4().hex],
                                ["ref", name, "live", None, EMPTY_SNAPSHOT_ID]])
        self._wait_durable(pos)
        return EMPTY_SNAPSHOT_ID

    def delete_volume(self, name: str) -> None:
        check_volume(name)
        with self._append_lock:
            if name not in self._pending_vols:
                raise NotFound(f"no volume {name!r}")
        pos = self._commit_retry(lambda: [["vol-", name]] + [
            ["ref", v, b, old, None] for (v, b), old in sorted(self._pending_refs.items())
            if v == name])
        self._wait_durable(pos)

    def _commit_retry(self, make_ops: Any) -> Pos:
        # Ops computed from pending state, then committed only if it did not move.
        for _ in range(100):
            ops = make_ops()
            expect = [(str(op[1]), str(op[2]), op[3]) for op in ops if op[0] == "ref"]
            try:
                return self._commit(ops, expect)
            except _CasMismatch:
                continue
        raise Unavailable("store too busy to apply the change; retry")

    def fork(self, volume: str, new_branch: str, *, at: str | None) -> str:
        check_volume(volume)
        check_branch(new_branch)
        sid = EMPTY_SNAPSHOT_ID if at is None else check_hex_id(at)
        if self.object_kind(bytes.fromhex(sid)) != SNAPSHOT:
            raise NotFound(f"no snapshot {sid}")
        with self._branch_lock(volume, new_branch):
            if volume not in self._pending_vols:
                raise NotFound(f"no volume {volume!r}")
            if (volume, new_branch) in self._pending_refs:
                raise AlreadyExists(f"branch {new_branch!r} already exists in {volume!r}")
            pos = self._commit([["ref", volume, new_branch, None, sid]],
                               [(volume, new_branch, None)])
        self._wait_durable(pos)
        return sid

    def delete_branch(self, volume: str, branch: str) -> None:
        check_volume(volume)
        check_branch(branch)
        with self._branch_lock(volume, branch):
            old = self._pending_refs.get((volume, branch))
            if old is None:
                raise NotFound(f"no branch {branch!r} in volume {volume!r}")
            pos = self._commit([["ref", volume, branch, old, None]], [(volume, branch, old)])
        self._wait_durable(pos)

    # -- leases ------------------------------------------------------------------------

    def acquire_lease(self, volume: str, branch: str, ttl: float, holder: str = "") -> Lease:
        check_volume(volume)
        check_branch(branch)
        _check_ttl(ttl)
        with self._branch_lock(volume, branch):
            if (volume, branch) not in self._pending_refs:
                raise NotFound(f"no branch {branch!r} in volume {volume!r}")
            now = time.time_ns()
            cur = self._leases.get((volume, branch))
            if cur is not None and cur.expires_ns > now:
                wait = (cur.expires_ns - now) / 1e9
                raise Locked(f"{volume}@{branch} is leased (fencing token {cur.fencing}) "
                                  f"for {wait:.1f}s more", retry_after=min(wait, 5.0))
            fencing = (cur.fencing if cur else 0) + 1
            secret = os.urandom(16)
            lease = Lease(fencing, now + int(ttl * 1e9), holder, _lease_key(secret))
            pos = self._commit([["lease", volume, branch, *lease[:4]]])
        self._wait_durable(pos)
        return lease._replace(id=f"{fencing}.{secret.hex()}")

    def renew_lease(self, volume: str, branch: str, lease: str, ttl: float) -> Lease:
        check_volume(volume)
        check_branch(branch)
        _check_ttl(ttl)
        with self._branch_lock(volume, branch):
            cur = self._live_lease(volume, branch, lease)
            new = cur._replace(expires_ns=time.time_ns() + int(ttl * 1e9))
            pos = self._commit([["lease", volume, branch, *new[:4]]])
        self._wait_durable(pos)
        return new._replace(id=lease)

    def release_lease(self, volume: str, branch: str, lease: str) -> None:
        check_volume(volume)
        check_branch(branch)
        with self._branch_lock(volume, branch):
            cur = self._leases.get((volume, branch))
            if cur is None or cur.expires_ns == 0:
                return  # already released, or never held
            if not _lease_matches(cur, lease):
                if _lease_fencing(lease) < cur.fencing:
                    return  # expired and taken over since: nothing of ours to release
                raise Forbidden(f"that is not the id of the lease on {volume}@{branch}")
            pos = self._commit([["lease", volume, branch, cur.fencing, 0, cur.holder,
                                 cur.key]])
        self._wait_durable(pos)

    def lease_of(self, volume: str, branch: str) -> Lease | None:
        cur = self._leases.get((volume, branch))
        return cur if cur is not None and cur.expires_ns > time.time_ns() else None

    def _live_lease(self, volume: str, branch: str, lease: str) -> Lease:
        cur = self._leases.get((volume, branch))
        if (cur is None or not _lease_matches(cur, lease)
                or cur.expires_ns <= time.time_ns()):
            raise Forbidden(f"lease {_lease_fencing(lease)} on {volume}@{branch} has expired, "
                            "been superseded, or is not yours")
        return cur

    def find_snapshot(self, prefix: str) -> str:
        matches = self.snapshots_with_prefix(prefix, limit=2)
        if not matches:
            raise NotFound(f"no snapshot matches {prefix}")
        if len(matches) > 1:
            raise InvalidInput(f"snapshot prefix {prefix} is ambiguous")
        return matches[0]

    def snapshots_with_prefix(self, prefix: str, limit: int = 64) -> list[str]:
        """Durable snapshot ids starting with `prefix` (at most `limit`), sorted."""
        self._check_open()
        prefix = check_hex_id(prefix, min_len=8)
        matches: set[str] = set()
        durable = self._durable
        for oid, loc in list(self._recent.items()):
            if (loc[3] == SNAPSHOT and (loc[0], loc[1] + loc[2]) <= durable
                    and oid.hex().startswith(prefix)):
                matches.add(oid.hex())
        start = bytes.fromhex(prefix[: len(prefix) // 2 * 2])
        for oid, loc in self.index.prefix(start):
            h = oid.hex()
            if not h.startswith(prefix[: len(start) * 2]):
                break
            if loc[3] == SNAPSHOT and h.startswith(prefix):
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
        nodes the client reads next.
        """
        self._check_usable()
        if not changesets:
            raise InvalidInput("nothing to publish")
        if txid is not None and (not isinstance(txid, bytes) or len(txid) != TXID_LEN):
            raise InvalidInput(f"a publish id is {TXID_LEN} bytes")
        keys = []
        for cs in changesets:
            check_volume(cs.volume)
            check_branch(cs.branch)
            check_hex_id(cs.base)
            _check_message_meta(cs.message, cs.meta)
            keys.append((cs.volume, cs.branch))
        if len(set(keys)) != len(keys):
            raise InvalidInput("a branch appears twice in one publish")
        _ids, given = self._frame_objects(objects)
        self._check_refs_exist(changesets, {oid: kind for oid, kind, _f in given},
                               {object_id(k, raw): raw for k, raw in objects if k == FILENODE})
        locks = [self._branch_lock(v, b) for v, b in sorted(keys)]
        with self._cond:
            self._inflight += 1
        for lock in locks:
            lock.acquire()
        try:
            trees = Trees(self, self.node_cache)
            trees.new.update({oid: raw for (kind, raw), oid in zip(objects, _ids, strict=True)
                              if kind == TREE})
            results: list[str] = []
            new_objects: list[tuple[int, bytes]] = []
            ops: list[list[Any]] = []
            expect: list[tuple[str, str, str | None]] = []
            conflicts: list[str] = []
            for cs in changesets:
                head = self._pending_refs.get((cs.volume, cs.branch))
                if head is None:
                    if cs.volume not in self._pending_vols:
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
                raw = Snapshot(root=root, parent=head, time_ns=time.time_ns(),
                               message=cs.message, meta=cs.meta, tx=txid).encode()
                sid = object_id(SNAPSHOT, raw).hex()
                new_objects.append((SNAPSHOT, raw))
                ops.append(["ref", cs.volume, cs.branch, head, sid])
                expect.append((cs.volume, cs.branch, head))
                results.append(sid)
            if conflicts:
                raise Conflict(conflicts)
            if ops:
                _ids, frames = self._frame_objects(
                    [(TREE, raw) for raw in trees.new.values()] + new_objects)
                pos = self._commit(ops, expect, given + frames)
            else:
                pos = (self._tail[1], self._tail[2])
        finally:
            for lock in reversed(locks):
                lock.release()
            self._publish_done()
        self._wait_durable(pos)
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
            cur: str | None = self._pending_refs.get((cs.volume, cs.branch))
            while cur is not None and cur != cs.base:
                info = self.snapshot(cur)
                if info.tx == txid:
                    found.append(cur)
                    break
                cur = info.parent
            else:
                return None
        return found

    def _publish_done(self) -> None:
        with self._cond:
            self._inflight -= 1
            if self._inflight == 0:
                self._cond.notify_all()

    def check_tree_refs(self, objects: Sequence[tuple[int, bytes]]) -> None:
        """Tree nodes a client sends may refer only to objects that exist (or come along).

        Clients never need to send tree nodes (the store builds them when it
        applies a change set); one that does must not make a branch reach a
        hole. The server calls this on every batch a client sends; in-process
        callers (tests building trees by hand) are trusted. Blocks and file
        nodes may arrive in any order across batches, so their references are
        checked when a publish names them.
        """
        batch = {object_id(k, raw) for k, raw in objects}
        wanted: set[bytes] = set()
        for kind, raw in objects:
            if kind == TREE:
                try:
                    wanted.update(oid for _k, oid in references(kind, raw))
                except ValueError as exc:
                    raise InvalidInput(f"a tree node does not decode: {exc}") from None
        lacking = [oid for oid in wanted - batch if not self._has(oid)]
        if lacking:
            raise InvalidInput(f"a tree node refers to {len(lacking)} object(s) the store "
                               f"lacks, e.g. {lacking[0].hex()}")

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
        named = sorted(oid for oid, k in want.items() if k == FILENODE and oid not in given)
        blocks: set[bytes] = set()
        for oid in named:
            try:
                blocks.update(b for _k, b in references(FILENODE, self.get_object(oid)))
            except ValueError as exc:
                raise InvalidInput(f"file node {oid.hex()} does not decode: {exc}") from None
        outside = sorted(blocks - given.keys())
        for oid, ok in zip(outside, self.reachable(volume, outside), strict=True):
            if not ok:
                raise InvalidInput(f"publish refers to object {oid.hex()} the store lacks")

    def _check_refs_exist(self, changesets: Sequence[ChangeSet], given: dict[bytes, int],
                          nodes: dict[bytes, bytes] | None = None) -> None:
        want: dict[bytes, int] = {}
        for cs in changesets:
            if not isinstance(cs.changes, dict):
                raise InvalidInput("changes must map paths to entries")
            for path, e in cs.changes.items():
                if not isinstance(e, Entry) or e.ref is None:
                    continue  # deletions, inline data; non-entries are refused by rebase
                if e.kind == K_FILE:
                    want[e.ref] = FILENODE
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
            if kind == FILENODE:  # and every block the file node names
                raw = (nodes or {}).get(oid) or self.get_object(oid)
                for b in set(FileNode.decode(raw).blocks):
                    if b != ZERO_ID and b not in given and not self._has(b):
                        raise InvalidInput(f"file node {oid.hex()} names block {b.hex()} "
                                           "the store lacks")

    # -- maintenance ---------------------------------------------------------------------

    def sync_index(self) -> None:
        """Write everything durable into LMDB now (normally the indexer does this)."""
        self._flush_index()

    def fsck(self) -> dict[str, Any]:
        """Verify every record of every pack, the index, and every branch's tree."""
        self.sync_index()
        with self._append_lock:  # a consistent cut: the packs up to here, refs as of here
            _fd, limit_pack, limit_off, _b = self._tail
            refs_then = dict(self._pending_refs)
            vols_then = set(self._pending_vols)
        report: dict[str, Any] = {"packs": 0, "records": 0, "objects": 0, "damaged": [],
                                  "missing": [], "index_mismatch": 0, "unreachable_refs": [],
                                  "index_lacks": 0, "refs_mismatch": []}
        located: dict[bytes, Loc] = {}
        replayed_vols: set[str] = set()
        replayed_refs: dict[tuple[str, str], str] = {}
        for number in self._pack_numbers():
            if number > limit_pack:
                break
            name = packfmt.pack_name(number)
            path = self._pack_path(number)
            report["packs"] += 1
            result = packfmt.scan(path)
            if number == limit_pack:
                result.records = [r for r in result.records if r.offset < limit_off]
            for rec in result.records:
                if rec.rtype == packfmt.R_COMMIT:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        for op in unpackb(rec.payload)["ops"]:
                            _apply_op(op, replayed_vols, replayed_refs)
            for off, reason in result.damaged:
                report["damaged"].append({"pack": name, "offset": off, "reason": reason})
            if result.torn and number != self._tail[1]:
                report["damaged"].append({"pack": name, "offset": result.end,
                                          "reason": "truncated tail"})
            for rec in result.records:
                report["records"] += 1
                if rec.rtype != packfmt.R_OBJECT:
                    continue
                try:
                    kind, oid, raw = packfmt.object_from_record(rec, name)
                except Corrupt as exc:
                    report["damaged"].append({"pack": name, "offset": rec.offset,
                                              "reason": exc.detail})
                    continue
                if object_id(kind, raw) != oid:
                    report["damaged"].append({"pack": name, "offset": rec.offset,
                                              "reason": "content does not match its id"})
                    continue
                report["objects"] += 1
                located.setdefault(oid, (number, rec.offset, rec.length, kind))
        indexed = 0
        for oid, loc in self.index.iter_objects():
            indexed += 1
            if located.get(oid) != loc:
                report["index_mismatch"] += 1
        for oid in located:
            if self._locate(oid) is None:
                report["index_lacks"] += 1  # in a pack, unknown to the index
        # The refs the journal says, against the refs the store serves.
        for key in sorted(replayed_refs.keys() | refs_then.keys()):
            if replayed_refs.get(key) != refs_then.get(key):
                report["refs_mismatch"].append({"branch": f"{key[0]}@{key[1]}",
                                                "journal": replayed_refs.get(key),
                                                "served": refs_then.get(key)})
        if replayed_vols != vols_then:
            report["refs_mismatch"].append({"volumes": sorted(replayed_vols ^ vols_then)})
        seen: set[bytes] = set()
        for (vol, br), sid in sorted(refs_then.items()):  # the cut taken above, not live refs
            self._check_reachable(bytes.fromhex(sid), located, seen, report, f"{vol}@{br}")
        report["ok"] = not (report["damaged"] or report["missing"] or report["index_mismatch"]
                            or report["index_lacks"] or report["refs_mismatch"])
        recovery = {k: v for k, v in self.recovery.items() if v}
        if recovery:
            report["recovery"] = recovery
        return report

    def _check_reachable(self, sid: bytes, located: dict[bytes, Loc], seen: set[bytes],
                         report: dict[str, Any], where: str) -> None:
        stack: list[tuple[bytes, int]] = [(sid, SNAPSHOT)]
        while stack:
            oid, kind = stack.pop()
            if oid in seen:
                continue
            seen.add(oid)
            if oid not in located:
                report["missing"].append({"object": oid.hex(), "kind": KIND_NAMES[kind],
                                          "from": where})
                continue
            try:
                raw = self.get_object(oid)
                if kind == SNAPSHOT:
                    snap = Snapshot.decode(raw)
                    if snap.root.ref is not None:
                        stack.append((snap.root.ref, TREE))
                    if snap.parent is not None:
                        stack.append((bytes.fromhex(snap.parent), SNAPSHOT))
                elif kind == TREE:
                    from strata.engine.objects import TreeNode
                    node = TreeNode.decode(raw)
                    for child in node.children:
                        stack.append((child[1], TREE))
                    for _n, e in node.entries:
                        if e.ref is not None:
                            stack.append((e.ref, TREE if e.kind == K_DIR else FILENODE))
                elif kind == FILENODE:
                    from strata.engine.objects import BLOCK, ZERO_ID, FileNode
                    for b in FileNode.decode(raw).blocks:
                        if b != ZERO_ID:
                            stack.append((b, BLOCK))
            except (Corrupt, ValueError) as exc:
                report["damaged"].append({"object": oid.hex(), "reason": str(exc)})

    def rebuild_index(self) -> dict[str, Any]:
        """Throw the index away and rebuild it by replaying every pack."""
        with self._append_lock:
            # Nothing is appended meanwhile, and everything appended is durable
            # first: the rebuilt index must not name records a crash could cut.
            fd, number, offset, _b = self._tail
            self._wait_durable((number, offset))
            with self._index_lock:
                self._flush_index_locked()
                tmp = self.index_dir + ".rebuild"
                Index.destroy(tmp)
                fresh = Index(tmp)
                self._replay(None, into=fresh, repair=False)
                fresh.close()
                self.index.close()  # readers racing this admin call may see an error
                Index.destroy(self.index_dir)
                os.rename(tmp, self.index_dir)
                self.index = Index(self.index_dir)
                self._reach = Reach(self.index)
            vols, refs = self.index.load_state()
        return {"volumes": len(vols), "branches": len(refs),
                "objects": self.index.count_objects()}

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        self._indexer.join()
        with self._append_lock:
            fd, number, offset, _b = self._tail
            if self._failed is None:
                try:
                    self._wait_durable((number, offset))
                    self._flush_index()
                except Exception:  # noqa: BLE001 - e.g. LMDB on a full disk: the next
                    pass           # open replays what the index lacks; close must finish
            self._closed = True
            os.close(fd)
        for rfd in self._read_fds.values():
            os.close(rfd)
        self._read_fds.clear()
        self.index.close()
        self._lock.release()


def _lease_key(secret: bytes) -> bytes:
    return blake3.blake3(b"strata lease\0" + secret).digest(length=16)


def _lease_fencing(lease: object) -> int:
    """The fencing number a lease id names (0 if it is not a lease id)."""
    if not isinstance(lease, str):
        return 0
    head, _, _ = lease.partition(".")
    return int(head) if head.isdigit() and len(head) < 20 else 0


def _lease_matches(cur: Lease, lease: object) -> bool:
    """True if `lease` is the id of `cur`: its fencing number and its secret."""
    if not isinstance(lease, str) or not cur.key:
        return False
    head, _, secret_hex = lease.partition(".")
    if not head.isdigit() or int(head) != cur.fencing or len(secret_hex) != 32:
        return False
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        return False
    return hmac.compare_digest(_lease_key(secret), cur.key)


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


class _CasMismatch(NotFound):
    # Retried by _commit_retry. Elsewhere the branch locks rule it out except when
    # the volume was deleted meanwhile, which is what callers then see: NotFound.
    def __init__(self, vol: str, br: str, old: str | None, cur: str | None) -> None:
        super().__init__(f"{vol}@{br} was moved or deleted meanwhile "
                         f"(expected {old}, found {cur})")


def _apply_op(op: list[Any], vols: set[str], refs: dict[tuple[str, str], str]) -> None:
    kind = op[0]
    if kind == "vol+":
        vols.add(op[1])
    elif kind == "vol-":
        vols.discard(op[1])
        for key in [k for k in refs if k[0] == op[1]]:
            del refs[key]
    elif kind == "ref":
        if op[4] is None:
            refs.pop((op[1], op[2]), None)
        else:
            refs[(op[1], op[2])] = op[4]

