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

Durability ordering is in docs/design.md ("The bucket tier").
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from strata.engine import pack as packfmt
from strata.engine.bucket import Bucket, BucketUnavailable, Exists, Fenced, OwnerLog, log_name
from strata.engine.checkpoint import Checkpoint, RunReader, encode_run
from strata.engine.errors import Corrupt, InvalidInput, NotFound, StoreFailed, StrataError
from strata.engine.index import Index
from strata.engine.packstore import LocalPacks, PackStore, PackWriter
from strata.engine.seal import KEY_FILE, BucketKey, read_key_file
from strata.engine.seal import MAGIC as SEAL_MAGIC
from strata.engine.storedir import init_store, write_durably

SHIP_INTERVAL = 0.5        # default mode: seconds between segment records
SHIP_BYTES = 8 << 20       # ... or sooner once this much is pending
SEGMENT_MAX = 32 << 20     # bytes of chunks in one segment record
RESHIP_CHUNK = 4 << 20     # an unsealed pack shipped again at open goes in chunks this big
CHECKPOINT_INTERVAL = 2.0  # seconds between checkpoints while the store changes
WINDOW = 1 << 20           # ranged reads of bucket-only packs, in aligned windows
WINDOW_CACHE = 64          # windows kept in memory
HYDRATE_BLOCKS = 64        # blocks of an inherited index run copied in per background pass
FETCH_BACK_AFTER = 2       # window misses of one bucket-only pack before it is fetched whole
EVICT_INTERVAL = 1.0       # seconds between checks of the local budget
FENCE_CHECK_INTERVAL = 1.0  # an idle owner looks for a successor's claim this often
Progress = Callable[[int, int, int], None]  # records done, records in all, bytes so far
Chunk = tuple[int, int, bytes | None]  # pack, offset, bytes (None: cut the pack here)
Loc = tuple[int, int, int, int]
BUCKET_META = "strata-bucket"
BUCKET_FORMAT = 2          # 2: every object sealed with the store's key; 1: none was
TIER_STATE = "tier.json"              # in the store: this owner's epoch and log position
TIER_CHECKPOINT = "tier-checkpoint"   # in the store: the last checkpoint it wrote or read


def pack_object_name(number: int, epoch: int, attempt: str) -> str:
    """A sealed pack's bucket name, unique to its uploader's epoch.

    Owners never share a name: a pack rebuilt by a restore may differ from the
    same-numbered pack its old owner went on writing.
    """
    return f"packs/{packfmt.pack_name(number)[:-5]}-{epoch}-{attempt}.pack"


class TieredPacks(PackStore):
    """Local packs, with every byte also shipped to the bucket (see the module docstring)."""

    def __init__(self, local: LocalPacks, bucket: Bucket, log: OwnerLog, *, strict: bool,
                 checkpoint: Checkpoint | None = None, cache_size: int | None = None,
                 hydrated: str | None = None, clean: bool = False,
                 from_log: set[int] | None = None) -> None:
        self.local = local
        self.bucket = bucket
        self.log = log
        self.strict = strict
        self.cache_size = cache_size
        self.failed: BaseException | None = None
        self._lock = threading.Lock()          # pending chunks and the maps below
        self._ship_lock = threading.Lock()     # one segment write at a time, in order
        self._work_lock = threading.Lock()     # the background pass, or a flush
        self._pending: list[Chunk] = []
        self._pending_bytes = 0
        self._shipped_at = time.monotonic()
        self._pending_since: float | None = None
        # Packs in the bucket: number -> (object name, size). From the checkpoint a
        # restore started from, then each upload.
        self.remote: dict[int, tuple[str, int]] = dict(checkpoint.packs) if checkpoint else {}
        self._first_seq: dict[int, int] = {}   # pack -> first segment holding its bytes
        self._uploads: collections.deque[int] = collections.deque()
        self._windows: collections.OrderedDict[tuple[int, int], bytes] = \
            collections.OrderedDict()
        # The object index of the checkpoint this store started from, until the local
        # index holds all of it (`hydrated` names the run it holds whole): misses read
        # it a block at a time meanwhile, and the background loop copies it in.
        self._run: RunReader | None = None
        self._hydrated = hydrated
        # Whether the last owner of this directory shipped everything it wrote (a clean
        # close, or a restore, whose packs come from the log): if not, reship at attach.
        self._clean_at_open = clean
        self._clean = False
        # Packs a restore rebuilt from log segments: their bytes came from the bucket,
        # so objects read from them are checked against their ids like bucket packs.
        self._from_log: set[int] = set(from_log or ())
        self._hydrating: Iterator[list[tuple[bytes, Loc]]] | None = None
        if checkpoint is not None and checkpoint.run and checkpoint.run != hydrated:
            run = checkpoint.run
            self._run = RunReader(run, checkpoint.fences, checkpoint.entries,
                                  lambda s, e: self.bucket.get_range(run, s, e))
        self._run_blocks: set[int] = set()
        # The local directory, as the tier sees it: which packs are there, which reads
        # are using one (eviction waits for them), when each was last read.
        self._local: set[int] = set(local.numbers())
        self._reading: collections.Counter[int] = collections.Counter()
        self._last_read: dict[int, float] = {}
        self._misses: collections.Counter[int] = collections.Counter()
        self._fetches: collections.deque[int] = collections.deque()
        # Bucket objects of packs garbage collection removed: (name, checkpoints written
        # before the removal). Deleted once a later checkpoint is in the log.
        self._doomed: list[tuple[str, float]] = []
        self._cp_taken = 0  # checkpoints that took their view of the packs
        self._cp_done = 0   # the newest of those views that is in the log
        # Packs the last checkpoint this owner saved names as uploaded: only these may
        # be evicted, since a reopened store learns where packs are from that file.
        self._checkpointed: set[int] = set(checkpoint.packs) if checkpoint else set()
        self._evict_checked = 0.0
        self._log_from_at_open = checkpoint.log_from if checkpoint is not None else 0
        self._index: Index | None = None
        self._state_dir: str | None = None
        self._store_id = b""
        self._block_size = 0
        self._changed = False
        self._checkpointed_at = 0.0
        self.stats = {"segments": 0, "segment_bytes": 0, "packs_uploaded": 0,
                      "bytes_uploaded": 0, "checkpoints": 0, "ranged_reads": 0,
                      "last_checkpoint": 0.0, "last_ship": 0.0, "max_unshipped_ms": 0.0,
                      "outages": 0, "evicted": 0, "evicted_bytes": 0, "fetched_back": 0,
                      "index_entries_hydrated": 0, "packs_deleted": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fence_thread: threading.Thread | None = None

    # -- wiring ----------------------------------------------------------------------

    def attach(self, index: Index, store_id: bytes, block_size: int, state_dir: str) -> None:
        """Start the background work once the store's index is open."""
        self._index = index
        self._state_dir = state_dir
        self._save_state()  # not clean from here on, until a close has shipped it all
        self._store_id = store_id
        self._block_size = block_size
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
        self._thread = threading.Thread(target=self._loop, name="strata-tier", daemon=True)
        self._thread.start()
        self._fence_thread = threading.Thread(target=self._watch_successor,
                                              name="strata-tier-fence", daemon=True)
        self._fence_thread.start()

    def _reship(self, number: int) -> None:
        """Ship an unsealed pack whole again, as it is after recovery.

        A killed owner may have written bytes it never shipped (the default mode
        ships after acknowledging), and appends from here on ship only what is
        new: without this, a restore would rebuild the pack with a hole. Chunks
        apply in log order, so this copy wins over whatever was shipped before.
        """
        size = self.local.size(number)
        for offset in range(0, size, RESHIP_CHUNK):
            self._record((number, offset, self.local.pread(number, RESHIP_CHUNK, offset)))
        self._record((number, size, None))  # and nothing past it

    def _sealed(self, number: int) -> bool:
        return packfmt.is_sealed_at(lambda n, o: self.local.pread(number, n, o),
                                    self.local.size(number), packfmt.pack_name(number))

    def _check(self) -> None:
        if self.failed is not None:
            raise StoreFailed(f"the bucket tier stopped: {self.failed}")

    # -- shipping ----------------------------------------------------------------------

    def _record(self, chunk: Chunk) -> None:
        with self._lock:
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(chunk)
            self._pending_bytes += len(chunk[2] or b"")
            self._changed = True

    def ship(self) -> None:
        """Write every pending chunk to the log, in order (one record per SEGMENT_MAX)."""
        with self._ship_lock:
            self._check()
            with self._lock:
                todo, self._pending, self._pending_bytes = self._pending, [], 0
                since = self._pending_since if todo else None
            try:
                while todo:
                    size, cut = 0, 0
                    while cut < len(todo) and (cut == 0 or size < SEGMENT_MAX):
                        size += len(todo[cut][2] or b"")
                        cut += 1
                    part = todo[:cut]
                    seq = self.log.append("segment", chunks=[list(c) for c in part])
                    todo = todo[cut:]  # only once it is in the bucket
                    with self._lock:
                        for n, _o, _d in part:
                            self._first_seq.setdefault(n, seq)
                    self.stats["segments"] += 1
                    self.stats["segment_bytes"] += size
            except BucketUnavailable as exc:
                # An outage: keep the chunks, in order, for the next try. Strict mode's
                # publish is not acknowledged (it may land once the bucket is back, so a
                # retry with the same txid is the safe one); the default mode goes on.
                with self._lock:
                    self._pending[:0] = todo
                    self._pending_bytes += sum(len(c[2] or b"") for c in todo)
                    if self._pending_since is None:
                        self._pending_since = since
                self.stats["outages"] += 1
                raise BucketUnavailable(f"the bucket is unavailable: {exc}") from exc
            except BaseException as exc:
                self.failed = exc
                raise StoreFailed(f"the bucket tier stopped: {exc}") from exc
            self._shipped_at = time.monotonic()
            self.stats["last_ship"] = time.time()
            if since is not None:
                # The loss window: how long a written byte waited to be in the bucket.
                self.stats["max_unshipped_ms"] = max(self.stats["max_unshipped_ms"],
                                                     (self._shipped_at - since) * 1000)

    # -- uploads and checkpoints ----------------------------------------------------------

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

    def _hydrate_some(self) -> bool:
        """Copy the next block of the inherited index run into the local index.

        Returns whether any of it is left to copy.
        """
        run = self._run
        if run is None:
            return False
        assert self._index is not None
        if self._hydrating is None:
            self._hydrating = run.read_all()
        block = next(self._hydrating, None)
        if block is not None:
            self._index.add_objects(block)
            self.stats["index_entries_hydrated"] += len(block)
            return True
        self._run, self._hydrating, self._hydrated = None, None, run.name
        self._save_state()
        return False

    def _loop(self) -> None:
        pause = 0.1
        while not self._stop.wait(pause):
            try:
                self._work()
                pause = 0.1
            except BucketUnavailable:
                pause = min(pause * 2, 2.0)  # an outage: try again, less often
            except BaseException as exc:  # noqa: BLE001 - a fenced or broken tier stops
                if self.failed is None:
                    self.failed = exc

    def _work(self) -> None:
        with self._work_lock:
            self._work_locked()

    def _work_locked(self) -> None:
        if self.failed is not None:
            return
        now = time.monotonic()
        if self._pending and (now - self._shipped_at >= SHIP_INTERVAL
                              or self._pending_bytes >= SHIP_BYTES):
            self.ship()
        self._upload_queued()
        if self._run is not None:
            # A part at a time, so shipping is not held up; checkpoints wait for it.
            for _ in range(HYDRATE_BLOCKS):
                if not self._hydrate_some():
                    break
        elif self._changed and now - self._checkpointed_at >= CHECKPOINT_INTERVAL:
            self.checkpoint()
        if self._doomed:
            self._delete_doomed()
        while self._fetches:
            self._fetch_back(self._fetches[0])
            self._fetches.popleft()
        if self.cache_size is not None and now - self._evict_checked >= EVICT_INTERVAL:
            self._evict_checked = now
            self.evict(self.cache_size)

    def _watch_successor(self) -> None:
        """While idle, look for a successor's claim once a second.

        In a thread of its own: a check stuck in an outage's retries must not
        hold up shipping.
        """
        while not self._stop.wait(FENCE_CHECK_INTERVAL):
            if self.failed is not None:
                return
            if time.monotonic() - self._shipped_at < FENCE_CHECK_INTERVAL:
                continue  # a write just succeeded: it would have met a claim
            try:
                self.log.check_owner()
            except BucketUnavailable:
                continue
            except BaseException as exc:  # noqa: BLE001 - fenced (or broken): stop
                if self.failed is None:
                    self.failed = exc
                return

    # -- the local directory as a cache ---------------------------------------------------

    def evict(self, budget: int) -> list[int]:
        """Drop checkpointed packs, least recently read first, until local bytes fit."""
        with self._lock:
            local = sorted(self._local)
            candidates = [n for n in local if n in self._checkpointed]
        sizes = {}
        for n in local:
            with contextlib.suppress(FileNotFoundError):
                sizes[n] = self.local.size(n)
        total = sum(sizes.values())
        dropped: list[int] = []
        candidates.sort(key=lambda n: (self._last_read.get(n, 0.0), n))
        for n in candidates:
            if total <= budget:
                break
            with self._lock:
                if self._reading[n] or n not in self._local:
                    continue  # in use: a later pass takes it
                self._local.discard(n)  # new reads go to the bucket from now on
            with contextlib.suppress(FileNotFoundError):  # or collected meanwhile
                self.local.remove(n)
            total -= sizes.get(n, 0)
            self.stats["evicted"] += 1
            self.stats["evicted_bytes"] += sizes.get(n, 0)
            dropped.append(n)
        return dropped

    def _fetch_back(self, number: int) -> None:
        with self._lock:
            if number in self._local or number not in self.remote:
                return
        self._download(number)
        self.stats["fetched_back"] += 1

    @contextlib.contextmanager
    def _using(self, number: int) -> Iterator[bool]:
        """Whether `number` is read locally; if so, eviction leaves it alone meanwhile."""
        with self._lock:
            local = number in self._local or number not in self.remote
            if local:
                self._reading[number] += 1
        try:
            yield local
        finally:
            if local:
                self._last_read[number] = time.monotonic()
                with self._lock:
                    self._reading[number] -= 1
                    if not self._reading[number]:
                        del self._reading[number]

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

    # -- the index a restore has not fetched -------------------------------------------

    def locate(self, oid: bytes) -> tuple[Loc | None, list[tuple[bytes, Loc]]]:
        """Where the checkpoint's index run puts `oid`, and the block read to find it."""
        run = self._run
        if run is None:
            return None, []
        i = run.block_of(oid)
        if i is None or i in self._run_blocks:
            return None, []  # fetched before: the caller's index already holds it all
        loc, block = run.lookup(oid)
        self._run_blocks.add(i)
        return loc, block

    # -- PackStore ------------------------------------------------------------------------

    def numbers(self) -> list[int]:
        with self._lock:
            return sorted(self._local | set(self.remote))

    def size(self, number: int) -> int:
        with self._using(number) as local:
            if local:
                return self.local.size(number)
            return self.remote[number][1]

    def label(self, number: int) -> str:
        with self._lock:
            if number in self._local or number not in self.remote:
                return super().label(number)
            return f"bucket object {self.remote[number][0]}"

    def verify_reads(self, number: int) -> bool:
        # What came from the bucket, now or before (fetched back, or rebuilt from the
        # log by a restore), is checked against ids: the seal proves who wrote the
        # bytes, the id that they are the object the index names.
        return number in self.remote or number in self._from_log

    def pread(self, number: int, length: int, offset: int) -> bytes:
        with self._using(number) as local:
            if local:
                return self.local.pread(number, length, offset)
        name, size = self.remote[number]
        end = min(offset + length, size)
        out = bytearray()
        w = offset // WINDOW
        while w * WINDOW < end:
            window = self._window(number, name, size, w)
            lo = max(offset, w * WINDOW) - w * WINDOW
            hi = min(end, (w + 1) * WINDOW) - w * WINDOW
            out += window[lo:hi]
            w += 1
        return bytes(out)

    def _window(self, number: int, name: str, size: int, w: int) -> bytes:
        key = (number, w)
        with self._lock:
            data = self._windows.get(key)
            if data is not None:
                self._windows.move_to_end(key)
                return data
        data = self.bucket.get_range(name, w * WINDOW, min((w + 1) * WINDOW, size))
        self.stats["ranged_reads"] += 1
        if len(data) != min(WINDOW, size - w * WINDOW):
            raise NotFound(f"bucket object {name} is shorter than the checkpoint says")
        with self._lock:
            self._windows[key] = data
            while len(self._windows) > WINDOW_CACHE:
                self._windows.popitem(last=False)
            self._misses[number] += 1
            if self._misses[number] == FETCH_BACK_AFTER:  # read again and again: keep it
                self._fetches.append(number)
        return data

    def info(self, number: int) -> packfmt.PackInfo:
        with self._using(number) as local:
            if local:
                return self.local.info(number)
        name = packfmt.pack_name(number)
        return packfmt.read_header(self.pread(number, packfmt.HEADER_SIZE, 0), name)

    @contextlib.contextmanager
    def mapped(self, number: int) -> Iterator[packfmt.Buffer]:
        while True:
            with self._using(number) as local:
                if local:
                    with self.local.mapped(number) as data:
                        yield data
                    return
            self._download(number)  # a scan reads it all: fetch it back first

    def _download(self, number: int) -> None:
        name, size = self.remote[number]
        data = self.bucket.get(name)
        if len(data) != size:
            raise Corrupt(name, 0, f"the bucket object is {len(data)} bytes, not {size}")
        if not packfmt.is_sealed_at(lambda n, o: data[o:o + n], size,
                                    packfmt.pack_name(number)):
            raise Corrupt(name, 0, "the bucket object does not end with a valid seal")
        with self._lock:
            if number in self._local:
                return  # another reader fetched it meanwhile
        self.local.adopt(number, data)
        with self._lock:
            self._local.add(number)
            self._misses.pop(number, None)
            for key in [k for k in self._windows if k[0] == number]:
                del self._windows[key]

    def create(self, number: int, header: bytes) -> PackWriter:
        self._check()
        w = self.local.create(number, header)
        with self._lock:
            self._local.add(number)
        self._record((number, 0, header))
        return _TierWriter(self, w, number, len(header))

    def open_append(self, number: int) -> PackWriter:
        self._check()
        return _TierWriter(self, self.local.open_append(number), number,
                           self.local.size(number))

    def sync(self, number: int) -> None:
        with self._using(number) as local:
            if local:
                self.local.sync(number)
        # Otherwise only in the bucket: sealed, and durable there.

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

    def index_complete(self) -> bool:
        """Whether the local index holds every object (after a restore it comes lazily)."""
        return self._run is None

    def _delete_doomed(self) -> None:
        with self._lock:
            done = self._cp_done
            ready = [name for name, at in self._doomed if at < done]
            self._doomed = [(n, at) for n, at in self._doomed if at >= done]
        for name in ready:
            try:
                self.bucket.delete(name)
                self.stats["packs_deleted"] += 1
            except BucketUnavailable:
                with self._lock:
                    self._doomed.append((name, -1))  # again next time


    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # The fence watcher may be in a retry; it is a daemon and only reads.
        if self.failed is None:
            with contextlib.suppress(Exception):
                self.flush()
                if not self._pending:  # every byte written is in the bucket
                    self._clean = True
                    self._save_state()
        self.local.close()


class _TierWriter(PackWriter):
    def __init__(self, tier: TieredPacks, inner: PackWriter, number: int, offset: int) -> None:
        self.tier = tier
        self.inner = inner
        self.number = number
        self.offset = offset

    def write(self, data: bytes | memoryview) -> int:
        self.tier._check()
        n = self.inner.write(data)
        self.tier._record((self.number, self.offset, bytes(data[:n])))
        self.offset += n
        return n

    def truncate(self, size: int) -> None:
        self.inner.truncate(size)
        self.offset = size
        self.tier._record((self.number, size, None))

    def datasync(self) -> None:
        if not self.tier.strict:
            self.inner.datasync()
            self.tier._check()
            return
        # Acknowledged means on the disk and in the bucket: the two at once.
        failed: list[BaseException] = []

        def local() -> None:
            try:
                self.inner.datasync()
            except BaseException as exc:  # noqa: BLE001 - raised below, in order
                failed.append(exc)

        sync = threading.Thread(target=local, name="strata-datasync")
        sync.start()
        try:
            self.tier.ship()
        finally:
            sync.join()
        if failed:
            raise failed[0]

    def close(self) -> None:
        self.inner.close()


def apply_segments(local: LocalPacks, log: OwnerLog, start: int, end: int,
                   skip: set[int], progress: Progress | None = None) -> dict[str, Any]:
    """Rebuild, byte for byte, the packs the log holds from record `start` to `end`.

    Packs in `skip` (uploaded whole) are left alone. Chunks are applied in log
    order, so a cut or a rewrite after a crash wins over what came before.
    """
    files: dict[int, int] = {}
    report: dict[str, Any] = {"segments": 0, "bytes": 0, "packs": 0}
    try:
        for seq in range(start, end):
            if progress is not None:
                progress(seq - start, end - start, report["bytes"])
            body = log.read(seq)
            if body["kind"] != "segment":
                continue
            report["segments"] += 1
            for n, offset, data in body["chunks"]:
                n, offset = int(n), int(offset)
                if n in skip:
                    continue
                fd = files.get(n)
                if fd is None:
                    fd = files[n] = local.open_raw(n)
                if data is None:
                    os.ftruncate(fd, offset)
                else:
                    os.pwrite(fd, bytes(data), offset)
                    report["bytes"] += len(data)
        for fd in files.values():
            os.fsync(fd)
    finally:
        for fd in files.values():
            os.close(fd)
    for n in files:
        if local.size(n) == 0:  # removed by its owner (garbage collection): not a pack
            local.remove(n)
    report["packs"] = len(files)
    kept = set(local.numbers())
    report["rebuilt"] = [n for n in sorted(files) if n in kept]
    return report


def iter_log_back(log: OwnerLog, end: int) -> Iterator[tuple[int, dict[str, Any]]]:
    seq = end - 1
    while seq >= 0:
        yield seq, log.read(seq)
        seq -= 1




# -- a store with a bucket: opening and restoring ---------------------------------------



def store_key(store_dir: str, meta: dict[str, Any]) -> BucketKey | None:
    """The key a store's bucket is sealed with (None: a bucket of format 1, unauthenticated).

    Whether there must be one comes from the store's own settings, never from
    the bucket: a bucket rewritten to look older is not read without a key.
    """
    fmt = int(meta.get("bucket_format", 1))
    if fmt == 1:
        return None
    if fmt != BUCKET_FORMAT:
        raise InvalidInput(f"the store's bucket format is {fmt}; this strata reads 1 and "
                           f"{BUCKET_FORMAT}: upgrade strata")
    path = os.path.join(store_dir, KEY_FILE)
    try:
        secret = read_key_file(path)
    except NotFound:
        raise NotFound(f"{path} is missing: the store's bucket is sealed with the key kept "
                       "there (restore the store with --key-file to make it again)") from None
    return BucketKey(secret, encrypt=meta.get("encrypt") is not False)


def bucket_meta(bucket: Bucket, store_id: str, block_size: int) -> None:
    """Bind the bucket to this store (create-only), or check it is bound to it."""
    fields: dict[str, Any] = {"format": 1, "store_id": store_id, "block_size": block_size}
    if bucket.key is not None:
        fields.update(format=BUCKET_FORMAT, encrypted=bucket.key.encrypt)
    try:
        bucket.put_new(BUCKET_META, json.dumps(fields, sort_keys=True).encode())
        return
    except Exists:
        pass
    theirs = read_meta(bucket)
    if theirs["store_id"] != store_id:
        raise InvalidInput(f"the bucket at {bucket.url} holds another store "
                           f"({theirs['store_id']}), not {store_id}")


def read_meta(bucket: Bucket) -> dict[str, Any]:
    """The bucket's binding to its store, of the format the reader's key calls for.

    With a key it must be sealed under that key (format 2); without one it
    must be a format 1 binding, which nothing authenticates.
    """
    stored = bucket.get_stored(BUCKET_META)
    sealed = stored[:4] == SEAL_MAGIC
    if bucket.key is None and sealed:
        raise InvalidInput(f"the store in the bucket at {bucket.url} is sealed with a key "
                           f"(bucket format {BUCKET_FORMAT}): give its key file (--key-file "
                           "or STRATA_BUCKET_KEY_FILE)")
    if bucket.key is not None and not sealed:
        raise InvalidInput(
            f"{BUCKET_META} in {bucket.url} is not sealed: the bucket holds a store made "
            "before bucket keys (bucket format 1, unauthenticated), not one of this key. If "
            "the store was made with a key, someone rewrote the bucket; if not, restore it "
            "without a key, with --unauthenticated")
    data = bucket.key.open(BUCKET_META, stored) if bucket.key is not None else stored
    try:
        meta = json.loads(data)
        fmt = meta.get("format")
    except (ValueError, TypeError, AttributeError) as exc:
        raise Corrupt(BUCKET_META, 0, f"does not decode: {exc}") from None
    want = BUCKET_FORMAT if bucket.key is not None else 1
    if fmt != want:
        if isinstance(fmt, int) and fmt > BUCKET_FORMAT:
            raise InvalidInput(f"{BUCKET_META} in {bucket.url} has bucket format {fmt}; "
                               f"this strata reads 1 and {BUCKET_FORMAT}: upgrade strata")
        raise Corrupt(BUCKET_META, 0, f"format {fmt!r} where {want} belongs")
    if not isinstance(meta.get("store_id"), str) or not isinstance(meta.get("block_size"), int):
        raise Corrupt(BUCKET_META, 0, "lacks store_id or block_size")
    return dict(meta)


def newest_checkpoint(bucket: Bucket, log: OwnerLog, end: int) -> Checkpoint | None:
    """The checkpoint named by the last `checkpoint` record before `end`."""
    for _seq, body in iter_log_back(log, end):
        if body["kind"] == "checkpoint":
            name = str(body["name"])
            return Checkpoint.decode(name, bucket.get(name))
    return None


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
    cp_path = os.path.join(store_dir, TIER_CHECKPOINT)
    if os.path.exists(cp_path):
        with open(cp_path, "rb") as f:
            cp = Checkpoint.decode(cp_path, f.read())
    log.claim(socket.gethostname())
    cache = meta.get("cache_size")
    hydrated = state.get("hydrated")
    return TieredPacks(local, bucket, log, strict=meta.get("sync") == "bucket", checkpoint=cp,
                       cache_size=int(cache) if cache is not None else None,
                       hydrated=str(hydrated) if hydrated else None,
                       clean=state.get("clean") is True,
                       from_log={int(n) for n in state.get("from_log") or ()})


def _check_ours(log: OwnerLog, seq: int, epoch: Any) -> None:
    """The last record this store wrote is still there, and still its own.

    Records are never deleted by strata, so a missing one means the bucket's
    newest records were deleted: a rollback, which only state kept outside
    the bucket (here, tier.json) can show.
    """
    if seq < 0:
        return
    try:
        body = log.read(seq)
    except NotFound:
        raise Corrupt(log_name(seq), 0, "this store wrote this log record and it is gone "
                                        "from the bucket: the log was rolled back (its "
                                        "newest records deleted)") from None
    if body["epoch"] != epoch:
        raise Corrupt(log_name(seq), 0, f"this store (epoch {epoch}) wrote this log record, "
                                        f"and the bucket holds one of epoch {body['epoch']}")


def restore(url: str, store_dir: str, *, key: bytes | None = None,
            unauthenticated: bool = False, sync: str = "local",
            cache_size: int | None = None, progress: Progress | None = None
            ) -> dict[str, Any]:
    """Make `store_dir` a copy of the store in the bucket, downloading no packs.

    `key` is the store's bucket key; a bucket of format 1 (made before keys)
    is read without one only with `unauthenticated`, since nothing in it can
    be told from a forgery. Claims the log first, so the old owner is fenced
    before the tail is read. Then: the newest checkpoint (its tables; the
    object index stays in the bucket and is read a block at a time), and the
    log's segments from the checkpoint's `log_from`, rebuilding the packs that
    were not uploaded. Opening the store replays what lies past the checkpoint.
    """
    if os.path.exists(os.path.join(store_dir, "STRATA")):
        raise InvalidInput(f"{store_dir} is already a store")
    t0 = time.monotonic()
    bucket = Bucket(url, BucketKey(key) if key is not None else None)
    bucket.check_conditional()
    try:
        meta = read_meta(bucket)
    except NotFound:
        raise NotFound(f"no strata store in the bucket at {url}") from None
    if bucket.key is None and not unauthenticated:
        raise InvalidInput(
            f"the bucket at {url} holds an unauthenticated store (bucket format 1, made "
            "before bucket keys): anyone who can write to the bucket could have changed "
            "it unseen. Restore it anyway with --unauthenticated")
    if bucket.key is not None:
        bucket.key.encrypt = meta.get("encrypted") is not False  # write as it was written
    log = OwnerLog(bucket)
    epoch = log.claim(socket.gethostname())
    cp = newest_checkpoint(bucket, log, epoch)
    if cp is not None and cp.store_id.hex() != meta["store_id"]:
        raise Corrupt(BUCKET_META, 0, "the checkpoint belongs to another store")
    init_store(store_dir, block_size=int(meta["block_size"]), store_id=str(meta["store_id"]),
               bucket=url, sync=sync, cache_size=cache_size, bucket_key=key,
               encrypt=bucket.key.encrypt if bucket.key is not None else False,
               unauthenticated=bucket.key is None)
    local = LocalPacks(os.path.join(store_dir, "packs"))
    try:
        report = apply_segments(local, log, cp.log_from if cp else 0, epoch,
                                set(cp.packs) if cp else set(), progress)
    finally:
        local.close()
    if cp is not None:
        index = Index(os.path.join(store_dir, "index"))
        try:
            index.load_tables(cp.applied, cp.volumes, cp.refs, cp.leases, cp.policies)
            stamp = struct.pack("<Q", time.time_ns())
            index.note_expired((sid, stamp) for sid in cp.expired)
        finally:
            index.close()
        write_durably(os.path.join(store_dir, TIER_CHECKPOINT), cp.encode())
    # The fenced owner's pins are unknown here: nothing is deleted while they may last.
    from strata.engine.gc import inherit_unknown_pins
    inherit_unknown_pins(store_dir)
    # Clean: the packs rebuilt here are what the log holds, so nothing needs shipping.
    rebuilt = report.pop("rebuilt")
    write_durably(os.path.join(store_dir, TIER_STATE), json.dumps(
        {"epoch": epoch, "next": epoch + 1, "clean": True, "from_log": rebuilt}).encode())
    report.update(epoch=epoch, checkpoint=bool(cp), seconds=time.monotonic() - t0,
                  packs_in_bucket=len(cp.packs) if cp else 0,
                  authenticated=bucket.key is not None,
                  encrypted=bucket.key is not None and bucket.key.encrypt)
    return report


def prepare(store_dir: str, url: str, *, takeover: bool, key: bytes | None = None,
            unauthenticated: bool = False, encrypt: bool = True, sync: str = "local",
            cache_size: int | None = None, progress: Progress | None = None) -> str:
    """Make `store_dir` ready to serve the store kept at `url` (`strata serve --bucket`).

    An existing store must be kept in that bucket. Otherwise an empty bucket
    gets a new store (sealed with `key`, or a new key), and a bucket that
    already holds one is restored here only with `takeover`, since restoring
    fences the owner serving it now. Returns what was done: "opened",
    "created" or "restored".
    """
    if os.path.exists(os.path.join(store_dir, "STRATA")):
        from strata.engine.storedir import read_store_meta
        have = read_store_meta(store_dir).get("bucket")
        if have != url:
            raise InvalidInput(f"{store_dir} is kept in {have or 'no bucket'}, not {url}")
        return "opened"
    bucket = Bucket(url, BucketKey(key) if key is not None else None)
    bucket.check_conditional()
    if not bucket.exists(BUCKET_META):
        init_store(store_dir, bucket=url, sync=sync, cache_size=cache_size, bucket_key=key,
                   encrypt=encrypt)
        return "created"
    if not takeover:
        owner: Any = "?"
        host: Any = "?"
        with contextlib.suppress(StrataError):  # without the key, or damaged: who is unsaid
            log = OwnerLog(bucket)
            end = log.find_end()
            owner = log.read(end - 1)["epoch"] if end else None
            host = (log.read(owner).get("host") if owner is not None else None) or "?"
        raise InvalidInput(f"the bucket at {url} already holds a store (owner epoch {owner}, "
                           f"host {host}); pass --takeover to fence that owner and serve the "
                           "store here")
    restore(url, store_dir, key=key, unauthenticated=unauthenticated, sync=sync,
            cache_size=cache_size, progress=progress)
    return "restored"
