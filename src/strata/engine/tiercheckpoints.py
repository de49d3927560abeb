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
import os
import time

from strata.engine import pack as packfmt
from strata.engine.checkpoint import Checkpoint, encode_run
from strata.engine.errors import BucketUnavailable
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

    def _upload(self, number: int) -> None:
        # A fresh name per attempt: an attempt cut short by an outage can leave an
        # object behind, and a create-only name cannot be written twice.
        name = pack_object_name(number, self.log.epoch or 0, os.urandom(4).hex())
        try:
            size = self.local.size(number)
            with self.local.mapped(number) as data:
                body = bytes(data)
        except FileNotFoundError:
            return  # garbage collection removed it meanwhile: nothing to keep
        self.bucket.put_new(name, body)
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
        """Write a checkpoint of the index as it is now; returns its bucket name."""
        assert self._index is not None
        # A checkpoint's run must hold every object: first the inherited run, whole.
        while self._hydrate_some():
            pass
        (run, fences, entries), tables = self._index.checkpoint_tables(encode_run)
        # Everything up to `applied` was written before this point: ship it first.
        self.ship()
        with self._lock:
            remote = dict(self.remote)
            unsent = [seq for n, seq in self._first_seq.items() if n not in remote]
            self._changed = False
            self._cp_taken += 1  # this checkpoint's view of the packs, numbered
            taken = self._cp_taken
        log_from = min(unsent) if unsent else (self.log.next or 0)
        stamp = f"{self.log.epoch}-{self.log.next}-{os.urandom(4).hex()}"
        run_name = f"runs/{stamp}"
        self.bucket.put_new(run_name, run)
        cp = Checkpoint(store_id=self._store_id, epoch=self.log.epoch or 0,
                        applied=tables["applied"], volumes=tables["volumes"],
                        refs=tables["refs"], leases=tables["leases"], packs=remote,
                        run=run_name, fences=fences, entries=entries, log_from=log_from,
                        block_size=self._block_size, expired=tables["expired"],
                        policies=tables["policies"])
        name = f"checkpoints/{stamp}"
        data = cp.encode()
        self.bucket.put_new(name, data)
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
        with self._lock:
            self._cp_done = max(self._cp_done, taken)
        self.log.write_hint()
        self._hydrated = run_name  # the local index holds all of it
        self._save_state(data)
        with self._lock:
            self._checkpointed = set(remote)
        self._checkpointed_at = time.monotonic()
        self.stats["checkpoints"] += 1
        self.stats["last_checkpoint"] = time.time()
        _log.info("checkpoint %s: applied %s, %d pack(s) in the bucket, log from %d",
                  name, tuple(tables["applied"]), len(remote), log_from)
        return name

    def _save_state(self, checkpoint: bytes | None = None) -> None:
        """Remember locally how far this owner's log reached (and its last checkpoint)."""
        if self._state_dir is None:
            return
        if checkpoint is not None:
            write_durably(os.path.join(self._state_dir, TIER_CHECKPOINT), checkpoint)
        write_durably(os.path.join(self._state_dir, TIER_STATE), json.dumps(
            {"epoch": self.log.epoch, "next": self.log.next,
             "hydrated": self._hydrated, "clean": self._clean,
             "from_log": sorted(self._from_log)}).encode())

    def _delete_doomed(self) -> None:
        with self._lock:
            done = self._cp_done
            ready = [name for name, at in self._doomed if at < done]
            self._doomed = [(n, at) for n, at in self._doomed if at >= done]
        for name in ready:
            try:
                self.bucket.delete(name)
                self.stats["packs_deleted"] += 1
                _log.info("deleted %s: no checkpoint in the log names it", name)
            except BucketUnavailable:
                _log.warning("could not delete %s; trying again next pass", name,
                             exc_info=True)
                with self._lock:
                    self._doomed.append((name, -1))  # again next time
