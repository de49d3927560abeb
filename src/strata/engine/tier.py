"""The bucket tier: a PackStore that keeps a copy of every pack byte in a bucket.

The engine reaches pack bytes only through a `PackStore` (engine/packstore.py),
so the whole tier is this one implementation wrapped around `LocalPacks`:

- **Every byte written is shipped to the owner log.** The writer records each
  append (and each cut) as a chunk (pack number, offset, bytes); a `segment`
  log record carries the chunks written since the last one. In the default
  mode a background thread ships about twice a second, so a lost disk loses at
  most the last fraction of a second of publishes. With `strict` (`--sync
  bucket`) a writer's `datasync` ships before it returns: group commit already
  makes one datasync serve many publishes, so they share one PUT, and nothing
  is acknowledged that the bucket does not hold.
- **Sealed packs are uploaded whole** (`packs/<number>-<sync marker>.pack`,
  create-only; the marker is random per pack, so two owners' packs of one
  number never share a name) and checked by size.
- **Checkpoints** follow every couple of seconds while the store changes: the
  index's tables at its applied position Q, with the object index as a run of
  verified blocks (engine/checkpoint.py), and `log_from`, the first log record
  holding bytes of a pack not uploaded at that time. Restore needs nothing
  else: the checkpoint, the segments from `log_from`, and ranged reads of
  uploaded packs when something in them is read.
- **Fencing**: every log write goes through `OwnerLog`, so an owner taken over
  fails its next ship or checkpoint, marks the tier failed, and the journal
  refuses to acknowledge anything more (its datasync raises).

Everything it puts in the bucket is sealed with the store's key (the `Bucket`
does it, engine/seal.py), and everything read back is verified, chunk by
chunk. Pack bytes of packs that are only in the bucket are read with ranged
GETs in aligned windows kept in a bounded memory cache, and every object
read from them, or from packs a restore rebuilt from the log, is checked
against its id as well (`verify_reads`). A pack read again and again
is fetched back whole into the local directory in the background, and a scan
(`mapped`) fetches it first.

**Eviction** keeps the local directory under a budget (`cache_size`): packs
named by the last checkpoint this owner wrote (so a reopened store still knows
they are in the bucket) are dropped, least recently read first, once no read
is using them.

The class is put together from one part per job, each in a module of its own
(restic splits prune, repack and upload the same way):

- tierstate.py: the state the parts share, and the files kept in the store;
- tiership.py: chunks and segment records (shipping), and the pack writer;
- tiercheckpoints.py: uploads of sealed packs, checkpoints, deleting old objects;
- tierdrop.py: log segments a checkpoint made redundant, overwritten small;
- tiersweep.py: objects no checkpoint names, left by work that never finished;
- tierhydrate.py: the inherited object index, copied in after a restore;
- tierfence.py: the idle owner's watch for a successor's claim;
- tierevict.py: the local directory as a cache under a budget;
- tierreads.py: windowed reads of bucket-only packs, and fetching back;
- tierrestore.py: binding a bucket, `restore` and `prepare`.

What stays here is the assembled `TieredPacks` (wiring, the background pass,
the write half of `PackStore`, closing) and `open_tier`.

Durability ordering is in docs/design.md ("The bucket tier").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from strata.engine.bucket import BROKEN, Bucket, OwnerLog
from strata.engine.checkpoint import Checkpoint
from strata.engine.errors import BucketUnavailable, Fenced
from strata.engine.index import Index
from strata.engine.packstore import LocalPacks, PackWriter
from strata.engine.tiercheckpoints import CHECKPOINT_INTERVAL, Checkpoints, pack_object_name
from strata.engine.tierdrop import Dropping
from strata.engine.tierevict import EVICT_INTERVAL, Eviction
from strata.engine.tierfence import FenceWatch
from strata.engine.tierhydrate import HYDRATE_BLOCKS, Hydration
from strata.engine.tierreads import WindowedReads
from strata.engine.tierrestore import (
    _check_ours,
    apply_segments,
    bucket_meta,
    prepare,
    read_meta,
    restore,
    store_key,
)
from strata.engine.tiership import SHIP_BYTES, SHIP_INTERVAL, Shipping, TierWriter
from strata.engine.tierstate import BUCKET_FORMAT, BUCKET_META, TIER_CHECKPOINT, TIER_STATE
from strata.engine.tiersweep import SWEEP_FIRST, SWEEP_INTERVAL, Sweeping

_log = logging.getLogger(__name__)  # `_log`: `self.log` is the owner log

__all__ = [
    "BUCKET_FORMAT", "BUCKET_META", "TIER_CHECKPOINT", "TIER_STATE", "TieredPacks",
    "apply_segments", "bucket_meta", "open_tier", "pack_object_name", "prepare",
    "read_meta", "restore", "store_key",
]


class TieredPacks(Shipping, Checkpoints, Dropping, Sweeping, Hydration, FenceWatch,
                  Eviction, WindowedReads):
    """Local packs, with every byte also shipped to the bucket (see the module docstring)."""

    def attach(self, index: Index, store_id: bytes, block_size: int, state_dir: str) -> None:
        """Start the background work once the store's index is open."""
        self._index = index
        self._state_dir = state_dir
        self._save_state()  # not clean from here on, until a close has shipped it all
        self._store_id = store_id
        self._block_size = block_size
        # The first sweep for objects nothing names comes soon after open: a kill
        # or a takeover is when they are left.
        self._swept_at = time.monotonic() - SWEEP_INTERVAL + SWEEP_FIRST
        inherited = self._log_from_at_open
        for n in sorted(self._local):
            if n in self.remote:
                continue
            # Bytes written before this open are in the log from the last checkpoint's
            # `log_from` on (or from the start): a restore must begin there for them.
            self._first_seq[n] = inherited
            if self._sealed(n):  # sealed, and a previous run did not upload it
                self._uploads.append(n)
            elif not self._clean_at_open:
                self._reship(n)
        _log.info("bucket tier attached to %s: epoch %s, %d pack(s) to upload, %d local, "
                  "%d in the bucket", self.bucket.url, self.log.epoch, len(self._uploads),
                  len(self._local), len(self.remote))
        self._thread = threading.Thread(target=self._loop, name="strata-tier", daemon=True)
        self._thread.start()
        self._fence_thread = threading.Thread(target=self._watch_successor,
                                              name="strata-tier-fence", daemon=True)
        self._fence_thread.start()

    def _loop(self) -> None:
        pause = 0.1
        while not self._stop.wait(pause):
            try:
                self._work()
                if pause > 0.1:
                    _log.info("the bucket answers again; shipping resumes")
                pause = 0.1
            except BucketUnavailable:
                # An outage: try again, less often. Its first failure is logged whole,
                # the retries briefly (one a second or two for as long as it lasts).
                if pause == 0.1:
                    _log.warning("the bucket is unavailable; retrying", exc_info=True)
                else:
                    _log.debug("the bucket is still unavailable", exc_info=True)
                pause = min(pause * 2, 2.0)
            except BaseException as exc:  # noqa: BLE001 - a fenced or broken tier stops
                _log.error("the bucket tier stopped: %s", exc, exc_info=True)
                if self.failed is None:
                    self.failed = exc

    def _work(self) -> None:
        with self._work_lock:
            self._work_locked()

    def _work_locked(self) -> None:
        if self.failed is not None:
            return
        now = time.monotonic()
        if "ship" in BROKEN and now - self._shipped_at < 10.0:
            return  # test-only (tests/fleet): nothing reaches the bucket for 10 s at a time
        if self._pending and (now - self._shipped_at >= SHIP_INTERVAL
                              or self._pending_bytes >= SHIP_BYTES):
            self.ship()
        self._upload_queued()
        if self._inherited_index is not None:
            # A part at a time, so shipping is not held up; checkpoints wait for it.
            for _ in range(HYDRATE_BLOCKS):
                if not self._hydrate_some():
                    break
        elif self._changed and now - self._checkpointed_at >= CHECKPOINT_INTERVAL:
            self.checkpoint()
        if self._doomed:
            self._delete_doomed()
        if self._dropped_to is None or self._dropped_to < self._drop_upto:
            self._drop_some()
        if now - self._swept_at >= SWEEP_INTERVAL and self._inherited_index is None:
            self.sweep()
        while self._fetches:
            self._fetch_back(self._fetches[0])
            self._fetches.popleft()
        if self.cache_size is not None and now - self._evict_checked >= EVICT_INTERVAL:
            self._evict_checked = now
            self.evict(self.cache_size)

    def flush(self) -> None:
        """Ship, upload and checkpoint everything now (close, tests, `strata stats`)."""
        with self._work_lock:
            self.ship()
            self._upload_queued()
            if self._changed:
                self.checkpoint()

    def report(self) -> dict[str, Any]:
        """What `strata stats` shows of the tier."""
        with self._lock:
            pending, remote = self._pending_bytes, dict(self.remote)
        with self._lock:
            local = sorted(self._local)
        now = time.time()
        last = self.stats["last_checkpoint"]
        key = self.bucket.key
        return {"bucket": self.bucket.url, "sync": "bucket" if self.strict else "local",
                "bucket_format": BUCKET_FORMAT if key is not None else 1,
                "authenticated": key is not None,
                "encrypted": key is not None and key.encrypt,
                "epoch": self.log.epoch, "log_next": self.log.next,
                "failed": str(self.failed) if self.failed else None,
                "local_bytes": sum(self._local_size(n) for n in local),
                "packs_local": len(local),
                "packs_in_bucket": len(remote),
                "packs_only_in_bucket": len(set(remote) - set(local)),
                "bucket_pack_bytes": sum(size for _n, size in remote.values()),
                "unshipped_bytes": pending, "uploads_queued": len(self._uploads),
                "upload_queued_bytes": sum(self._local_size(n) for n in list(self._uploads)),
                "cache_size": self.cache_size,
                "last_checkpoint_age": round(now - last, 3) if last else None,
                **{k: v for k, v in self.stats.items() if k != "last_checkpoint"}}

    def _local_size(self, number: int) -> int:
        try:
            return self.local.size(number)
        except FileNotFoundError:
            return 0  # evicted meanwhile

    def numbers(self) -> list[int]:
        with self._lock:
            return sorted(self._local | set(self.remote))

    def create(self, number: int, header: bytes) -> PackWriter:
        self._check()
        w = self.local.create(number, header)
        with self._lock:
            self._local.add(number)
        self._record((number, 0, header))
        return TierWriter(self, w, number, len(header))

    def open_append(self, number: int) -> PackWriter:
        self._check()
        return TierWriter(self, self.local.open_append(number), number,
                           self.local.size(number))

    def sync(self, number: int) -> None:
        with self._using(number) as local:
            if local:
                self.local.sync(number)

    def seal(self, number: int) -> None:
        self.local.seal(number)
        self._uploads.append(number)

    def cut(self, number: int, size: int) -> None:
        self.local.cut(number, size)
        self._record((number, size, None))

    def remove(self, number: int) -> None:
        """Drop a pack: recovery's empty new pack, or one garbage collection emptied.

        A pack in the bucket leaves the next checkpoint, and its object is deleted
        only once a checkpoint written after that is in the log (restores read the
        newest checkpoint, so none needs it then).
        """
        with self._lock:
            here = number in self._local
            self._local.discard(number)
            if number in self.remote:
                # Deletable once a checkpoint that took its view after this is in the log.
                self._doomed.append((self.remote.pop(number)[0], self._cp_taken))
                self._changed = True
            with contextlib.suppress(ValueError):
                self._uploads.remove(number)
        if here:
            with contextlib.suppress(FileNotFoundError):  # or evicted meanwhile
                self.local.remove(number)
        self._record((number, 0, None))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # The fence watcher may be in a retry; it is a daemon and only reads.
        if self.failed is None:
            try:
                self.flush()
                if not self._pending:  # every byte written is in the bucket
                    self._clean = True
                    self._save_state()
            except Exception:  # noqa: BLE001 - the next open reships what is not there
                _log.warning("the bucket tier could not ship everything at close; the "
                             "next open ships it again", exc_info=True)
        self.local.close()


def open_tier(store_dir: str, meta: dict[str, Any], local: LocalPacks) -> TieredPacks:
    """The pack store of a store kept in a bucket: check the bucket, claim the log.

    Refuses to open a store whose log another owner has written to since this
    store last wrote it: that store was taken over (restore from the bucket
    instead), and writing on would fork the store's history. Refuses too if
    the last record this store wrote is gone: the log was rolled back.
    """
    bucket = Bucket(str(meta["bucket"]), store_key(store_dir, meta))
    bucket.check_conditional()
    bucket_meta(bucket, str(meta["id"]), int(meta["block_size"]))
    log = OwnerLog(bucket)
    state_path = os.path.join(store_dir, TIER_STATE)
    state: dict[str, Any] = {}
    if os.path.exists(state_path):
        with open(state_path, "rb") as f:
            state = json.loads(f.read())
        if state.get("next") is not None:
            _check_ours(log, int(state["next"]) - 1, state.get("epoch"))
            for seq, body in log.records(int(state["next"])):
                if body["epoch"] != state["epoch"]:
                    raise Fenced(f"this store was taken over (epoch {body['epoch']} wrote "
                                 f"log record {seq}); restore it from {bucket.url} instead")
    elif log.find_end() > 0 and local.numbers():
        raise Fenced(f"the bucket at {bucket.url} already has a log, and this store "
                     "never wrote it: restore from the bucket instead")
    cp: Checkpoint | None = None
    cp_name: str | None = None
    cp_path = os.path.join(store_dir, TIER_CHECKPOINT)
    if os.path.exists(cp_path):
        with open(cp_path, "rb") as f:
            cp = Checkpoint.decode(cp_path, f.read())
        cp.load_tables(bucket.get)
        # Its bucket name; a store an older strata kept did not record it, and then
        # no index table counts from there (the next checkpoint writes it all).
        cp_name = str(state.get("checkpoint") or "(unnamed)")
    log.claim(socket.gethostname())
    cache = meta.get("cache_size")
    hydrated = state.get("hydrated")
    return TieredPacks(local, bucket, log, strict=meta.get("sync") == "bucket", checkpoint=cp,
                       cache_size=int(cache) if cache is not None else None,
                       hydrated=str(hydrated) if hydrated else None,
                       clean=state.get("clean") is True,
                       from_log={int(n) for n in state.get("from_log") or ()},
                       cp_name=cp_name, dropped_to=_int_or_none(state.get("dropped_to")))


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None
