"""Uploads and checkpoints: what a restore reads besides the log.

Sealed packs are uploaded whole under a name unique to the attempt
(`pack_object_name`) and checked by size. A checkpoint holds the index's
tables, the object index as a run of verified blocks (engine/checkpoint.py),
the packs uploaded, and `log_from`; it is written only after everything it
covers is shipped. Bucket objects of packs garbage collection removed are
deleted once a later checkpoint is in the log. This module never reads the
bucket back.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import blake3

from strata.engine import pack as packfmt
from strata.engine.bucket import BROKEN, log_name
from strata.engine.checkpoint import (
    FANOUT,
    INLINE_FENCES,
    MERGE_BACKLOG,
    MERGE_FLOOR,
    MERGE_RATE,
    PART_ENTRIES,
    Checkpoint,
    Merge,
    Part,
    PartReader,
    PartWriter,
    group_manifest,
    group_packs,
    merged,
    runs_of,
    size_level,
    table_ref,
)
from strata.engine.errors import AlreadyExists, BucketUnavailable
from strata.engine.index import Loc
from strata.engine.storedir import write_durably
from strata.engine.tierstate import TIER_CHECKPOINT, TIER_STATE, TierState

_log = logging.getLogger(__name__)  # `_log`: `self.log` is the owner log

CHECKPOINT_INTERVAL = 2.0  # seconds between checkpoints while the store changes


def pack_object_name(number: int, epoch: int, attempt: str) -> str:
    """A sealed pack's bucket name, unique to its uploader's epoch.

    Owners never share a name: a pack rebuilt by a restore may differ from the
    same-numbered pack its old owner went on writing.
    """
    return f"packs/{packfmt.pack_name(number)[:-5]}-{epoch}-{attempt}.pack"


class Checkpoints(TierState):
    """Uploading sealed packs, writing checkpoints, deleting what no checkpoint needs."""

    # The merge work a checkpoint may do (engine/checkpoint.py); tests lower the floor
    # to catch a merge in progress with a small store.
    merge_floor = MERGE_FLOOR
    merge_rate = MERGE_RATE

    def _put_ours(self, name: str, data: bytes) -> None:
        """Create `name` (a fresh, random name); a put sent again after a lost answer is ours.

        The client retries a put whose answer was lost, and the retry finds the
        object there: `AlreadyExists`, which stopped the tier. No other writer
        uses this name, so if the bucket holds our bytes the write happened.
        """
        try:
            self.bucket.put_new(name, data)
        except AlreadyExists:
            if self.bucket.get(name) != data:  # verified and opened, with a key
                raise

    def _upload(self, number: int) -> None:
        # A fresh name per attempt: an attempt cut short by an outage can leave an
        # object behind, and a create-only name cannot be written twice.
        name = pack_object_name(number, self.log.epoch or 0, os.urandom(4).hex())
        try:
            size = self.local.size(number)
            with self.local.mapped(number) as data:
                # Sealed and handed over a chunk at a time, the mapped pages behind
                # released as it goes: the pack is never copied whole here.
                self.bucket.put_new_from(name, size, _reader(data))
        except FileNotFoundError:
            return  # garbage collection removed it meanwhile: nothing to keep
        except AlreadyExists:
            # The name is this attempt's alone: the client sent the put again after
            # its answer was lost, and found its own object. The size check judges it.
            pass
        if self.bucket.size(name) != self.bucket.stored_size(size):
            raise BucketUnavailable(f"bucket copy of {name} has the wrong size; "
                                    "uploading it again")
        with self._lock:
            if number not in self._local:  # removed while it was uploading
                self._doomed.append((name, self._cp_taken))
                return
            self.remote[number] = (name, size)
            self._changed = True
        self.stats["packs_uploaded"] += 1
        self.stats["bytes_uploaded"] += size
        _log.info("uploaded pack %d (%d bytes) as %s", number, size, name)

    def _upload_queued(self) -> None:
        while True:
            with self._lock:
                if not self._uploads:
                    return
                n = self._uploads[0]
            self._upload(n)
            with self._lock:  # garbage collection may have taken it off the queue
                if self._uploads and self._uploads[0] == n:
                    self._uploads.popleft()

    def checkpoint(self) -> str:
        """Write a checkpoint of the index as it is now; returns its bucket name.

        Its runs are the last checkpoint's plus one of what changed since (or,
        when this index cannot tell what changed, one run of everything), merged
        as `_merge` decides. Parts, tables and checkpoints that no longer count
        are deleted once this checkpoint is in the log.
        """
        assert self._index is not None
        stamp = f"{self.log.epoch}-{self.log.next}-{os.urandom(4).hex()}"
        base = self._index.get_meta(b"cp-base")
        full = base is None or base.decode() != (self._cp_name or "")
        if full:  # a run of everything replaces every run: the inherited one is read first
            while self._hydrate_some():
                pass
        written: list[Part] = []

        def take(entries: Iterator[tuple[bytes, Loc | None]]) -> None:
            written.extend(self._write_run(entries, 0, stamp))

        # The run is written as the index is read, a part at a time: nothing is held
        # per entry (docs/design.md, "Memory through a pass").
        seq, changed, tables = self._index.checkpoint_view(None if full else take,
                                                           take if full else None)
        # Everything up to `applied` was written before this point: ship it first.
        self.ship()
        with self._lock:
            remote = dict(self.remote)
            # A pack uploaded, or removed (garbage collection), needs no segment any
            # more: only packs still local and not in the bucket hold `log_from` back.
            for n in [n for n in self._first_seq if n in remote or n not in self._local]:
                del self._first_seq[n]
            unsent = list(self._first_seq.values())
            self._changed = False
            self._cp_taken += 1  # this checkpoint's view of the packs, numbered
            taken = self._cp_taken
        old = list(self._manifest)
        # A run sits where runs of its size would (a run of everything, or the delta of
        # a bulk load), so it is merged with runs like it, not rewritten by the next few
        # small deltas; never above the newest run's level, so levels only grow with
        # age and a level's runs stay adjacent.
        level = size_level(sum(p.entries for p in written))
        if not full and old:
            level = min(level, old[0].level)
        written = [replace(p, level=level) for p in written]
        # The merge state changes with the manifest, once this checkpoint is in the log:
        # a checkpoint that fails leaves both as the last one named them.
        merging = None if full else self._merging
        parts = written if full else written + old
        if self.index_complete():
            budget = max(self.merge_floor, self.merge_rate * sum(p.entries for p in written))
            parts, merging = self._merge(parts, merging, stamp, budget)
        log_from = min(unsent) if unsent else (self.log.next or 0)
        tables_ref = {"expired": self._table("expired", b"".join(tables["expired"]), stamp)}
        pack_tables = group_packs(remote, {h: (n, h) for n, h in self._pack_tables},
                                  lambda k, data: self._put_table(
                                      f"tables/{stamp}-packs-{k}", data))
        manifest = group_manifest(parts, {h: (n, h) for n, h in self._part_tables},
                                  lambda run, n, data: self._put_table(
                                      f"tables/{stamp}-parts-{run}-{n}", data))
        part_tables = [i for i in manifest if not isinstance(i, Part)]
        cp = Checkpoint(store_id=self._store_id, epoch=self.log.epoch or 0,
                        applied=tables["applied"], volumes=tables["volumes"],
                        refs=tables["refs"], leases=tables["leases"], packs=remote,
                        parts=parts, log_from=log_from, block_size=self._block_size,
                        expired=tables["expired"], policies=tables["policies"],
                        tables=tables_ref, merge=merging, manifest=manifest,
                        pack_tables=pack_tables)
        name = f"checkpoints/{stamp}"
        data = cp.encode()
        self._put_ours(name, data)
        with self._ship_lock:
            self._check()
            try:
                self.log.append("checkpoint", name=name)
            except BucketUnavailable:
                raise
            except BaseException as exc:
                _log.error("checkpoint %s could not enter the log: %s; the bucket tier stops",
                           name, exc, exc_info=True)
                self.failed = exc
                raise
        self._index.checkpoint_done(seq, name)
        # Restores start at `log_from` or later from now on: the segments before it
        # may give their bytes back (engine/tierdrop.py).
        self._drop_upto = max(self._drop_upto, log_from)
        # What only earlier checkpoints name goes once this one is in the log.
        keep = {p.name for p in parts} | {n for n, _h in tables_ref.values()} \
            | {n for n, _h in part_tables} | {n for n, _h in pack_tables}
        # Earlier runs it merged, runs this checkpoint wrote then merged again, and
        # what a checkpoint that failed wrote.
        gone = [p.name for p in old if p.name not in keep]
        gone += [n for n in self._written_bytes
                 if n.startswith(("runs/", "tables/")) and n not in keep]
        gone += [n for n, _h in [*self._tables_ref.values(), *self._part_tables,
                                 *self._pack_tables] if n not in keep]
        if self._cp_name and self._cp_name.startswith("checkpoints/"):
            gone.append(self._cp_name)
        if "gc_log" in BROKEN:
            # Test-only (tests/fleet): the bug this design rules out ("What may be
            # deleted"): log records before `log_from`, this owner's claim among them.
            start = int(getattr(self, "_broken_log_from", self.log.epoch or 0))
            gone += [log_name(s) for s in range(start, log_from)]
            self._broken_log_from = max(start, log_from)
        with self._lock:
            self._cp_done = max(self._cp_done, taken)
            self._doomed.extend((g, taken - 1) for g in gone)
        self._manifest, self._tables_ref, self._cp_name = parts, tables_ref, name
        self._part_tables, self._pack_tables = part_tables, pack_tables
        self._merging = merging
        self.log.write_hint()
        if self.index_complete():
            self._hydrated = name  # the local index holds all of it
        self._save_state(data)
        with self._lock:
            self._checkpointed = set(remote)
        self._checkpointed_at = time.monotonic()
        self.stats["checkpoints"] += 1
        self.stats["checkpoint_bytes"] = len(data) + sum(
            self._written_bytes.pop(n, 0) for n in list(self._written_bytes))
        self.stats["checkpoint_bytes_total"] += self.stats["checkpoint_bytes"]
        self.stats["delta_entries"] += sum(p.entries for p in written)
        self.stats["index_runs"] = len(runs_of(parts))
        self.stats["index_parts"] = len(parts)
        self.stats["last_checkpoint"] = time.time()
        _log.info("checkpoint %s: applied %s, %d change(s)%s, %d run(s), %d pack(s) in the "
                  "bucket, log from %d", name, tuple(tables["applied"]), changed,
                  " (the whole index)" if full else "", len(runs_of(parts)), len(remote),
                  log_from)
        return name

    def _write_run(self, entries: Iterable[tuple[bytes, Loc | None]], level: int, stamp: str
                   ) -> list[Part]:
        """Upload sorted `entries` as a new run's parts (none if there are no entries)."""
        run = self._next_run  # above every run of the manifest (tierstate.py)
        parts = self._write_parts(entries, run, level, stamp)
        if parts:
            self._next_run = run + 1
        return parts

    def _write_parts(self, entries: Iterable[tuple[bytes, Loc | None]], run: int, level: int,
                     stamp: str) -> list[Part]:
        """Upload sorted `entries` as parts of run `run` (a stamp is never used twice)."""
        parts: list[Part] = []

        def put(writer: PartWriter) -> None:
            count, first = writer.entries, writer.first or b""
            data, fences, at = writer.finish()
            name = f"runs/{stamp}-{run}-{len(parts)}"
            self._put_ours(name, data)
            self._written_bytes[name] = len(data)
            inline = len(fences) <= 32 * INLINE_FENCES
            parts.append(Part(name, run, level, count, first,
                              fences if inline else b"", at,
                              blake3.blake3(fences).digest()))

        # Encoded as they come: a part's bytes are held, never its entries.
        writer = PartWriter()
        for oid, loc in entries:
            writer.add(oid, loc)
            if writer.entries >= PART_ENTRIES:
                put(writer)
                writer = PartWriter()
        if writer.entries:
            put(writer)
        return parts

    def _merge(self, parts: list[Part], m: Merge | None, stamp: str, budget: int
               ) -> tuple[list[Part], Merge | None]:
        """Merge runs while `FANOUT` of them share a level, `budget` ids at most.

        Tiered (engine/checkpoint.py); a level's backlog lifts the bound. One merge
        is in progress at a time; what is left of it waits for the next checkpoint,
        named in this one's manifest (`Merge`): `m` is the one in progress, and the
        runs and the merge in progress after are returned.
        """
        runs = runs_of(parts)
        bound: int | None = budget
        while True:
            busy = set(m.inputs) | {m.out} if m is not None else set()
            counts = Counter(r[0].level for r in runs if r[0].run not in busy)
            if m is not None and any(c >= MERGE_BACKLOG for c in counts.values()):
                bound = None  # a level waited too long: finish this merge now
            if bound is not None and bound <= 0:
                break
            if m is None:
                full = next((lv for lv in sorted(counts) if counts[lv] >= FANOUT), None)
                if full is None:
                    break
                at = [i for i, r in enumerate(runs) if r[0].level == full]
                first = len(at) - 1  # the oldest adjacent stretch of that level's runs
                while first > 0 and at[first - 1] == at[first] - 1:
                    first -= 1
                chosen = at[first:]
                if len(chosen) < 2:
                    break
                m = Merge(self._next_run, full, [runs[i][0].run for i in chosen],
                          drop=chosen[-1] == len(runs) - 1)  # nothing older: tombstones go
                self._next_run += 1
            runs, m, done = self._merge_some(runs, m, bound, stamp)
            if bound is not None:
                bound -= done
            elif m is None:
                bound = 0  # the backlog's merge ended: the next one starts paced
        return [p for r in runs for p in r], m

    def _merge_some(self, runs: list[list[Part]], m: Merge, bound: int | None, stamp: str
                    ) -> tuple[list[list[Part]], Merge | None, int]:
        """Go on with merge `m` for at most `bound` ids.

        Returns the runs after, the merge still in progress (None: it ended), and the
        ids merged.
        """
        ids = [r[0].run for r in runs]
        if any(r not in ids for r in m.inputs):  # cannot happen: runs leave only by merges
            _log.error("the merge into run %d lost its inputs; abandoned", m.out)
            return [r for r in runs if r[0].run != m.out], None, 0
        readers = [[self._part_reader(p) for p in r] for r in runs if r[0].run in m.inputs]
        entries = merged(readers, m.after)
        count, last, done = 0, m.after, True

        def limited() -> Iterator[tuple[bytes, Loc | None]]:
            nonlocal count, last, done
            for oid, loc in entries:
                if bound is not None and count >= bound:
                    done = False  # `oid` is read again next time
                    return
                count += 1
                last = oid
                if loc is None and m.drop:
                    continue
                yield oid, loc

        out = next((r for r in runs if r[0].run == m.out), [])
        new = self._write_parts(limited(), m.out, m.level + 1, f"{stamp}-{len(out)}")
        out = out + new
        first_in = ids.index(m.inputs[0])
        newer = [r for r in runs[:first_in] if r[0].run != m.out]
        older = runs[first_in:]
        after: Merge | None = None
        if done:
            older = [r for r in older if r[0].run not in m.inputs]
            _log.info("merged %d index run(s) of level %d into run %d of %d part(s)",
                      len(m.inputs), m.level, m.out, len(out))
        else:
            after = replace(m, after=last)
            _log.info("merging %d index run(s) of level %d: %d id(s) more, %d part(s) so far",
                      len(m.inputs), m.level, count, len(out))
        self.stats["merged_entries"] += count
        return newer + ([out] if out else []) + older, after, count

    def _part_reader(self, part: Part) -> PartReader:
        return PartReader(part, lambda s, e: self.bucket.get_range(part.name, s, e))

    def _table(self, kind: str, rows: Any, stamp: str) -> tuple[str, bytes]:
        """The table object holding `rows`: the last one if they did not change."""
        have = self._tables_ref.get(kind)
        return table_ref(kind, rows, {have[1]: have} if have else {},
                         partial(self._put_table, f"tables/{stamp}-{kind}"))

    def _put_table(self, name: str, data: bytes) -> str:
        self._put_ours(name, data)
        self._written_bytes[name] = len(data)
        return name

    def _save_state(self, checkpoint: bytes | None = None) -> None:
        """Remember locally how far this owner's log reached (and its last checkpoint)."""
        if self._state_dir is None:
            return
        if checkpoint is not None:
            write_durably(os.path.join(self._state_dir, TIER_CHECKPOINT), checkpoint)
        write_durably(os.path.join(self._state_dir, TIER_STATE), json.dumps(
            {"epoch": self.log.epoch, "next": self.log.next,
             "hydrated": self._hydrated, "clean": self._clean, "checkpoint": self._cp_name,
             "from_log": sorted(self._from_log), "dropped_to": self._dropped_to}).encode())

    def _delete_doomed(self) -> None:
        with self._lock:
            done = self._cp_done
            ready = [name for name, at in self._doomed if at < done]
            self._doomed = [(n, at) for n, at in self._doomed if at >= done]
        for name in ready:
            try:
                self.bucket.delete(name)
                self.stats["packs_deleted" if name.startswith("packs/") else
                           "index_objects_deleted"] += 1
                _log.info("deleted %s: no checkpoint in the log names it", name)
            except BucketUnavailable:
                _log.warning("could not delete %s; trying again next pass", name,
                             exc_info=True)
                with self._lock:
                    self._doomed.append((name, -1))  # again next time


def _reader(data: Any) -> Callable[[int, int], bytes]:
    """Reads of a mapped pack in order, handing back the pages behind them every 16 MiB."""
    released = [0]

    def read(at: int, size: int) -> bytes:
        piece = bytes(data[at:at + size])
        if isinstance(data, mmap.mmap) and at - released[0] >= 16 << 20:
            upto = at // mmap.PAGESIZE * mmap.PAGESIZE
            data.madvise(mmap.MADV_DONTNEED, 0, upto)
            released[0] = upto
        return piece
    return read
