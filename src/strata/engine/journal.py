"""The journal: appending records to the active pack, sealing, group commit.

Objects and commit records are appended to the newest pack under one short
lock (`append_lock`); `wait_durable` makes them durable with a leader/follower
fdatasync that many publishes share (docs/design.md, "Group commit"), and
only then moves their ops into the refs readers see. A pack past its size or
age limit is sealed and the next one started. The order these steps follow is
docs/design.md's crash-safety rules 1 to 3, 7 and 8; keep the two in step.

The journal reaches pack bytes only through a `PackStore`, and tells the
`Indexer` about every record it appended and `Refs` about every commit.
Those are objects it is handed rather than mixins sharing one `self`, so
that each lock and each piece of state has one owner to read it in.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from strata.engine import pack as packfmt
from strata.engine.errors import InvalidInput, StoreFailed, Unavailable
from strata.engine.index import Loc
from strata.engine.indexer import Indexer
from strata.engine.objects import KIND_NAMES, object_id, packb
from strata.engine.packstore import PackStore, PackWriter
from strata.engine.refs import Refs
from strata.engine.storedir import StoreConfig

# The largest object: a file node naming 128 GiB of 64 KiB blocks. Every record's
# length is checked against the pack payload limit when it is written, never
# discovered on a scan.
MAX_OBJECT = packfmt.MAX_PAYLOAD - packfmt.OBJ_HEAD_SIZE
GROUP_COMMIT_LINGER = 0.001  # seconds a sync leader waits for in-flight publishes
Pos = tuple[int, int]
Frame = tuple[bytes, int, bytes]  # object id, kind, frame without its sync marker
# The active pack: its writer, number, end, and when it was started (monotonic).
Tail = tuple[PackWriter, int, int, float]


class Journal:
    """Appends to the packs of a store recovery has just brought up to date."""

    tail: Tail

    def __init__(self, packs: PackStore, store_id: bytes, config: StoreConfig, refs: Refs,
                 indexer: Indexer) -> None:
        self.packs = packs
        self._store_id = store_id
        self._config = config
        self._refs = refs
        self._indexer = indexer
        self.stats = {"fsyncs": 0, "commits": 0, "objects_written": 0, "bytes_written": 0}
        self.closed = False
        self.failed: BaseException | None = None
        # Append side (guarded by append_lock).
        self.append_lock = threading.Lock()
        self._sync = b""  # the active pack's frame marker (set with the active pack)
        # Durability side (guarded by _cond).
        durability = threading.RLock()
        self._cond = threading.Condition(durability)
        # On the same lock: a sync leader lingering for publishes in flight waits here.
        self._lingering = threading.Condition(durability)
        self._syncing = False
        self._inflight = 0  # publishes between start and commit append
        self._done = 0      # publishes that have appended (or given up), ever
        self.durable: Pos = (0, 0)
        self._tail_closed = False  # the active pack's writer was closed (sealed for close)
        self._open_writer()

    def _open_writer(self) -> None:
        numbers = self.packs.numbers()
        if numbers:
            number = numbers[-1]
            size = self.packs.size(number)
            info = self.packs.info(number)
            # Packs of an older format are read, never appended to: new records
            # go to a new pack of the current format.
            if (info.version == packfmt.PACK_VERSION
                    and not packfmt.is_sealed_at(partial(self.packs.pread, number), size,
                                                 packfmt.pack_name(number))
                    and size < self._config.pack_size_limit):
                writer = self.packs.open_append(number)  # what survived the crash is durable
                self._sync = info.sync
                # Its age is unknown, so it is due: the next append seals it first. Left
                # to count its age from this open, a pack a bucket store's successive
                # owners each inherited (each opened, then failed within the age limit)
                # was never sealed, and every restore replayed its whole log tail: a
                # claim's restore took 0.07 s at the first failover, 3.8 s at the 18th.
                self._set_tail(writer, number, size,
                               time.monotonic() - self._config.pack_age_limit - 1.0)
                self.durable = (number, size)
                return
            # Not appended to again (sealed, full, or of an older format): still make
            # whatever of it survived the crash durable before anything depends on it.
            self.packs.sync(number)
            self.durable = (number, size)
            number += 1
        else:
            number = 1
        self._new_pack(number)

    def _new_pack(self, number: int) -> None:
        sync = packfmt.new_sync()
        writer = self.packs.create(number, packfmt.encode_header(number, self._store_id, sync))
        self._sync = sync  # every frame appended to this pack starts with it
        self._set_tail(writer, number, packfmt.HEADER_SIZE, time.monotonic())

    def _set_tail(self, writer: PackWriter, number: int, offset: int, born: float) -> None:
        # One tuple, swapped whole, so the sync leader can read it without a lock.
        self.tail = (writer, number, offset, born)

    def end(self) -> Pos:
        """Where the next record will be appended."""
        return self.tail[1], self.tail[2]

    def check_usable(self) -> None:
        if self.closed:
            raise Unavailable("store is closed")
        if self.failed is not None:
            raise StoreFailed(f"store refused further writes after an I/O error: {self.failed}")

    # -- appending ---------------------------------------------------------------------

    def frame_objects(self, objects: Sequence[tuple[int, bytes]]
                      ) -> tuple[list[bytes], list[Frame]]:
        """Hash and frame the objects the store lacks (outside any lock)."""
        ids: list[bytes] = []
        frames: list[Frame] = []
        seen: set[bytes] = set()
        for kind, raw in objects:
            if kind not in KIND_NAMES:
                raise InvalidInput(f"unknown object kind {kind}")
            if len(raw) > MAX_OBJECT:
                raise InvalidInput(f"{KIND_NAMES[kind]} of {len(raw)} bytes is over the "
                                   f"{MAX_OBJECT}-byte object limit")
            oid = object_id(kind, raw)
            ids.append(oid)
            if oid in seen or self._indexer.has(oid):
                continue
            seen.add(oid)
            frames.append((oid, kind, packfmt.encode_object(kind, oid, raw,
                                                            self._config.compress)))
        return ids, frames

    def append_records_locked(self, frames: Sequence[Frame], tail: bytes = b"", *,
                              copies: bool = False) -> Pos:
        """Append object frames (skipping any stored meanwhile) and then `tail`.

        One write for all of it; returns the position where `tail` starts.
        Caller holds append_lock. With `copies` (compaction) every frame is
        appended: they are stored already, and the new copy takes over.
        """
        todo = list(frames) if copies else [f for f in frames if not self._indexer.has(f[0])]
        if not todo and not tail:
            return self.end()
        # Seal first if due: every frame must carry the marker of the pack it lands in.
        self._roll_if_due(sum(len(f[2]) for f in todo) + len(tail)
                          + len(self._sync) * (len(todo) + bool(tail)))
        sync = self._sync
        data = b"".join(sync + f[2] for f in todo) + (sync + tail if tail else b"")
        number, offset = self._append(data)
        for oid, kind, frame in todo:
            loc = Loc(number, offset, len(sync) + len(frame), kind)
            offset += loc.length
            self._indexer.appended_object((number, offset), oid, loc)
        self.stats["objects_written"] += len(todo)
        return number, offset

    def commit(self, ops: list[list[Any]] | Callable[[], list[list[Any]]],
               expect: Sequence[tuple[str, str, str | None]] = (),
               frames: Sequence[Frame] = ()) -> Pos:
        """Append objects and one commit record after checking CAS; return its end.

        The objects go first, in the same write, so the commit record never
        reaches the disk before what it refers to.
        """
        with self.append_lock:
            self.check_usable()
            if callable(ops):  # computed under the lock (the whole state: see state_ops)
                ops = ops()
            self._refs.check(ops, expect)
            payload = packb({"t": time.time_ns(), "ops": ops})
            frame = packfmt.encode_frame(packfmt.R_COMMIT, payload)
            number, offset = self.append_records_locked(frames, frame)
            end = (number, offset + len(self._sync) + len(frame))
            self._refs.stage(end, ops)
            self._indexer.appended(end, "commit", ops)
            self.stats["commits"] += 1
        return end

    def _roll_if_due(self, size: int) -> None:
        """Seal the active pack if `size` more bytes would pass its size or age limit."""
        _w, _number, offset, born = self.tail
        if offset > packfmt.HEADER_SIZE and (
                offset + size > self._config.pack_size_limit
                or time.monotonic() - born > self._config.pack_age_limit):
            self._seal_locked()

    def _append(self, data: bytes) -> Pos:
        """Append whole frames to the active pack; caller holds append_lock.

        The frames were built with this pack's marker (`_roll_if_due` first).
        """
        writer, number, offset, born = self.tail
        try:
            view = memoryview(data)
            while view:
                n = writer.write(view)
                view = view[n:]
        except OSError as exc:
            try:
                writer.truncate(offset)
            except OSError:
                self.failed = exc
                raise StoreFailed(f"write to pack failed and could not be undone: {exc}") from exc
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise Unavailable(f"store disk is full: {exc}") from exc
            raise StoreFailed(f"write to pack failed: {exc}") from exc
        self._set_tail(writer, number, offset + len(data), born)
        self.stats["bytes_written"] += len(data)
        return number, offset

    def _seal_locked(self, *, then_new: bool = True) -> None:
        """Seal the active pack and start the next; caller holds append_lock.

        Without `then_new` the journal is left with no pack to append to: only
        `close` may follow.
        """
        writer, number, offset, born = self.tail
        seal = packfmt.seal_frame(offset, self._sync)
        writer.write(seal)
        end = offset + len(seal)
        self._indexer.appended((number, end), "seal", None)
        with self._cond:
            while self._syncing:
                self._cond.wait()
            writer.seal_sync()
            self.stats["fsyncs"] += 1
            self._advance_durable((number, end))
        writer.close()
        self.packs.seal(number)
        if then_new:
            self._new_pack(number + 1)
        else:
            self._set_tail(writer, number, end, born)
            self._tail_closed = True

    def copy_objects(self, frames: Sequence[Frame]) -> Pos:
        """Append copies of stored objects (compaction); returns where they end."""
        with self.append_lock:
            self.check_usable()
            self.append_records_locked(frames, copies=True)
            return self.end()

    def seal_now(self) -> bool:
        """Seal the active pack if it holds any record (GC empties it this way)."""
        with self.append_lock:
            self.check_usable()
            if self.tail[2] <= packfmt.HEADER_SIZE:
                return False
            self._seal_locked()
            return True

    def seal_for_close(self) -> bool:
        """Seal the active pack, if it holds any record, and start none: a close follows.

        A store kept in a bucket does this at a clean close, so its tier's last
        flush uploads the pack whole and the checkpoint's `log_from` passes it:
        whoever restores the store next (a planned move's target) replays no
        log tail. (Its next open starts a new pack, as after any sealed one.)
        """
        with self.append_lock:
            if self.closed or self.failed is not None or self.tail[2] <= packfmt.HEADER_SIZE:
                return False
            self._seal_locked(then_new=False)
            self.closed = True  # nothing may append: there is no pack to append to
            return True

    def maybe_seal_by_age(self) -> None:
        _w, _n, offset, born = self.tail
        if offset > packfmt.HEADER_SIZE and time.monotonic() - born > self._config.pack_age_limit:
            with self.append_lock:
                if self.failed is None and not self.closed:
                    _w, _n, offset, born = self.tail
                    if (offset > packfmt.HEADER_SIZE
                            and time.monotonic() - born > self._config.pack_age_limit):
                        self._seal_locked()

    # -- durability --------------------------------------------------------------------

    def publish_started(self) -> None:
        """A publish will append soon: a sync leader may wait for it (GROUP_COMMIT_LINGER)."""
        with self._cond:
            self._inflight += 1

    def publish_done(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._done += 1
            self._lingering.notify_all()  # a sync leader may be waiting for this one

    def _advance_durable(self, pos: Pos) -> None:
        """Everything up to `pos` is on disk: publish it to readers. Holds _cond."""
        if pos > self.durable:
            self.durable = pos
        self._refs.advance(self.durable)
        self._cond.notify_all()

    def wait_durable(self, pos: Pos) -> None:
        lingered = False
        with self._cond:
            while self.durable < pos:
                if self.failed is not None:
                    raise StoreFailed(f"store failed while syncing: {self.failed}")
                if self._syncing:
                    self._cond.wait()
                    continue
                if self._inflight > 0 and not lingered:
                    # Publishes in flight now are about to append: wait for them
                    # (not for later ones, and at most GROUP_COMMIT_LINGER) so they
                    # join this fsync instead of paying for the next one.
                    lingered = True
                    target = self._done + self._inflight
                    deadline = time.monotonic() + GROUP_COMMIT_LINGER
                    while self._done < target and not self._syncing:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._lingering.wait(left)
                    continue
                # Become the leader: one fdatasync covers every append so far.
                writer, number, offset, _born = self.tail
                self._syncing = True
                self._cond.release()
                err: BaseException | None = None
                later: Unavailable | None = None
                try:
                    writer.datasync()
                except OSError as exc:
                    err = exc
                except Unavailable as exc:
                    # Not durable yet, but nothing is lost either (the bucket tier in
                    # strict mode, during an outage): this publish is not acknowledged,
                    # and the next sync tries again.
                    later = exc
                finally:
                    self._cond.acquire()
                    self._syncing = False
                    # Whatever ended this sync, those waiting on it lead the next one
                    # (or meet the same failure): a StoreFailed from a fenced tier's
                    # datasync left them waiting forever, and a server's drain with them.
                    self._cond.notify_all()
                if later is not None:
                    raise later
                self.stats["fsyncs"] += 1
                if err is not None:
                    self.failed = err
                    self._cond.notify_all()
                    raise StoreFailed(f"fsync of the pack failed: {err}")
                self._advance_durable((number, offset))

    def close(self, flush_index: Callable[[], None]) -> None:
        """Make everything appended durable and indexed (best effort), then stop appending."""
        with self.append_lock:
            writer, number, offset, _b = self.tail
            if self.failed is None:
                try:
                    self.wait_durable((number, offset))
                    flush_index()
                except Exception:  # noqa: BLE001 - e.g. LMDB on a full disk: the next
                    pass           # open replays what the index lacks; close must finish
            self.closed = True
            if not self._tail_closed:
                writer.close()
                self._tail_closed = True
