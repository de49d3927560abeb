"""Read-ahead for large files on the mount: windows fetched in parallel, ahead of the reader.

A cold sequential read used to fetch a 2 MiB window, wait for it, verify it,
write it to the disk cache, read it back and verify it again, then serve it;
the next window started only when the reader reached it. Here:

- Each sequentially read file has a stream: blocks requested ahead of the
  reader, in batched `get_objects` requests of just under 1 MiB, several in
  flight at once on a small thread pool. The distance read ahead starts at
  1 MiB and doubles while the reads stay in order, up to 16 MiB; a read
  elsewhere (random access) starts again small and fetches what it needs.
- A worker checks every block against its id (BLAKE3, which releases the
  GIL, so the workers hash in parallel) before it puts the block in memory
  and marks it ready; from a store that already checked it (RemoteStore's
  `verifies_reads`: the client hashes every object it receives) it is not
  hashed a second time. A reader only ever receives bytes that passed that
  check: it waits on the block's future, never on an unverified buffer.
- The ready block is served from memory; the copy into the shared disk cache
  is written by a writer thread after the block is marked ready, so the disk
  write is off the reader's path (and skipped when the disk falls behind:
  see `_CacheWriter`). With `cache_streams=False` (a server on this machine,
  whose packs already hold these bytes on this disk) only the first
  STREAM_CACHE_BYTES of each stream are cached: a second copy of a file
  streamed from the local server costs a disk write per block (on this
  machine's disk more CPU than the fetch) and saves only a local fetch.
  Blocks already in the disk cache are loaded (and checked) by the workers
  too, so a second mount reads ahead just as well.
- Memory is bounded: at most `hot_limit` bytes of ready blocks (least
  recently used dropped first; a dropped block is read from the disk cache
  again) and at most MAX_AHEAD units (16 MiB) requested ahead of each stream.
- Streams count in 64 KiB units of the file, not in blocks: chunks are cut
  by content and vary in size, so the file's nodes name the chunks under
  each window (`ids_in`), fetching a node only where a window reaches it.

Nothing here knows FUSE; `vfs.SnapshotFS` calls `plan` and `block`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from strata.engine.errors import Corrupt
from strata.engine.filetree import CDC_MAX
from strata.engine.interface import Store
from strata.engine.objects import BLOCK
from strata.mount.cache import ContentCache, matches

log = logging.getLogger(__name__)

UNIT = 64 * 1024    # the stream's unit of file bytes (chunks vary in size; ~ one chunk)
MIN_AHEAD = 16      # units read ahead at first: 1 MiB
MAX_AHEAD = 256     # 16 MiB
# One request's answer stays under 1 MiB: the server (memtrim) maps every buffer of
# 1 MiB or more on its own, and the page faults of a fresh mapping at each copy of a
# large answer cost more than the extra requests.
REQUEST_BYTES = 1024 * 1024 - 64 * 1024
# Units a request covers: a window's chunks may run past its end by up to one
# chunk (the one straddling the start came with the window before), so the
# window leaves room for the largest chunk.
PER_REQUEST = (REQUEST_BYTES - CDC_MAX) // UNIT
WORKERS = 4
HOT_LIMIT = 96 * 1024 * 1024
WRITE_QUEUE_BYTES = 64 * 1024 * 1024
STREAM_CACHE_BYTES = 8 * 1024 * 1024  # cached per stream when the server is local


@dataclass(slots=True)
class _Stream:
    next: int = 0         # first unit not yet requested
    last_read: int = -1   # last unit a read asked for
    ahead: int = MIN_AHEAD  # units requested beyond the last read, doubling while in order
    mark: int = MIN_AHEAD // 2  # the read-ahead doubles when a read reaches this unit
    kept: int = 0         # units of this stream sent to the disk cache
    prev: tuple[int, int] = (-1, -1)  # the last read planned


class ReadAhead:
    def __init__(self, cache: ContentCache, *, workers: int = WORKERS,
                 hot_limit: int = HOT_LIMIT, cache_streams: bool = True) -> None:
        self.cache = cache
        self.cache_streams = cache_streams
        self.hot_limit = hot_limit
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="strata-readahead")
        self._lock = threading.Lock()
        self._hot: OrderedDict[bytes, bytes] = OrderedDict()
        self._hot_bytes = 0
        self._pending: dict[bytes, Future[None]] = {}
        self._streams: dict[int, _Stream] = {}
        self._writer = _CacheWriter(cache, WRITE_QUEUE_BYTES)
        self.windows = 0  # counters, for tests and stats
        self.fetched_blocks = 0  # by the workers (a reader that could not wait fetches its own)

    # -- planning --------------------------------------------------------------------

    def plan(self, key: int, size: int, ids_in: Callable[[int, int], list[bytes]],
             first: int, last: int, store: Store) -> None:
        """Make sure units [first, last] are requested, and more ahead if reads are in order.

        A unit is UNIT bytes of the file; `ids_in(lo, hi)` names the stored
        chunks covering bytes [lo, hi) (chunks have no fixed size, so the
        stream counts in units and asks the file's nodes which chunks they
        are). If `ids_in` raises, nothing is planned and the stream is as before.
        """
        per_request = PER_REQUEST
        units = -(-size // UNIT)
        with self._lock:
            s = self._streams.get(key)
            if s is None:
                s = self._streams[key] = _Stream()
            if s.prev == (first, last):
                return  # the same read planned again (the adapter's retry on a thread)
            saved = dataclasses.replace(s)
            try:
                batches = self._plan(s, ids_in, units, per_request, first, last)
            except BaseException:
                self._streams[key] = saved
                raise
            s.prev = (first, last)
            for batch, _keep in batches:
                for oid in batch:
                    self._pending[oid] = Future()
        for batch, keep in batches:
            self.windows += 1
            self._pool.submit(self._fetch, batch, store, keep)

    def _plan(self, s: _Stream, ids_in: Callable[[int, int], list[bytes]], units: int,
              per_request: int, first: int, last: int) -> list[tuple[list[bytes], bool]]:
        # The kernel sends several reads of one file at once, so they arrive a little
        # out of order: "in order" is anywhere near what this stream has requested.
        again = first == 0 and s.last_read > last + MAX_AHEAD  # from the start again
        sequential = first == 0 or s.last_read - MAX_AHEAD <= first <= s.next + per_request
        if again or not sequential:
            # A jump: start over from here, with a short read-ahead.
            s.next = first
            s.ahead = MIN_AHEAD
            s.last_read = last
            s.mark = last + MIN_AHEAD // 2
        elif last >= s.mark:
            # The reader got halfway through the last growth: it reads in order, so
            # look twice as far ahead (as the kernel's own readahead grows).
            s.ahead = min(s.ahead * 2, MAX_AHEAD)
            s.mark = last + s.ahead // 2
        s.next = max(s.next, first)
        s.last_read = max(s.last_read, last)
        last = s.last_read
        stop = min(units, last + 1 + (s.ahead if sequential else 0))
        batches: list[tuple[list[bytes], bool]] = []
        planned: set[bytes] = set()
        while s.next < stop:
            lo = s.next * UNIT
            batch = [oid for oid in ids_in(lo, lo + per_request * UNIT)
                     if oid not in self._hot and oid not in self._pending
                     and oid not in planned]
            s.next += per_request
            if batch:
                planned.update(batch)
                keep = self.cache_streams or s.kept * UNIT < STREAM_CACHE_BYTES
                s.kept += per_request if keep else 0
                batches.append((batch, keep))
        return batches

    def forget(self, key: int) -> None:
        with self._lock:
            self._streams.pop(key, None)

    # -- serving ---------------------------------------------------------------------

    def ready(self, oid: bytes) -> bytes | None:
        """The block if it is verified and in memory now (never waits)."""
        with self._lock:
            data = self._hot.get(oid)
            if data is not None:
                self._hot.move_to_end(oid)
            return data

    def block(self, oid: bytes, store: Store) -> bytes:
        """A verified block: from memory, from a window in flight, or fetched now."""
        with self._lock:
            data = self._hot.get(oid)
            if data is not None:
                self._hot.move_to_end(oid)
                return data
            fut = self._pending.get(oid)
        if fut is not None:
            try:
                fut.result()
            except Exception as exc:
                # The window failed (a lying server, a lost connection): fetch this
                # block alone below, checked again; its own error, if any, is raised.
                log.debug("read-ahead window failed, fetching %s alone: %s", oid.hex(), exc)
            with self._lock:
                data = self._hot.get(oid)
            if data is not None:
                return data
        return self.cache.get(oid, store.get_object, (BLOCK,))

    # -- workers ---------------------------------------------------------------------

    def _fetch(self, batch: list[bytes], store: Store, keep: bool) -> None:
        ready: list[tuple[bytes, bytes]] = []
        todo: list[bytes] = []
        try:
            for oid in batch:
                data = self.cache.load(oid, (BLOCK,))
                if data is None and self.cache.wait_inflight(oid):  # a boot prefetch has it
                    data = self.cache.load(oid, (BLOCK,))
                if data is None:
                    todo.append(oid)
                else:
                    ready.append((oid, data))
            if ready:
                self._ready(ready, False)  # cached blocks need not wait for the fetch
            fetched: list[tuple[bytes, bytes]] = []
            bad: list[bytes] = []
            if todo:
                # A store that checks what it returns (RemoteStore) is not checked twice.
                checked = getattr(store, "verifies_reads", False) is True
                for oid, data in zip(todo, store.get_objects(todo), strict=True):
                    if checked or matches(oid, data, (BLOCK,)):
                        fetched.append((oid, data))
                    else:
                        bad.append(oid)  # never made ready: its reader fetches it alone
                self._ready(fetched, True)
                if bad:
                    raise Corrupt("remote", 0, f"block {bad[0].hex()} does not match its id")
                for oid, data in fetched if keep else ():  # after the readers are released
                    self._writer.put(oid, data)
        except BaseException as exc:
            with self._lock:
                futs = [self._pending.pop(oid) for oid in batch if oid in self._pending]
            for f in futs:
                f.set_exception(exc)

    def _ready(self, items: list[tuple[bytes, bytes]], fetched: bool) -> None:
        futs: list[Future[None]] = []
        with self._lock:
            self.fetched_blocks += len(items) if fetched else 0
            for oid, data in items:
                if oid not in self._hot:
                    self._hot[oid] = data
                    self._hot_bytes += len(data)
                f = self._pending.pop(oid, None)
                if f is not None:
                    futs.append(f)
            while self._hot_bytes > self.hot_limit and self._hot:
                _oid, old = self._hot.popitem(last=False)
                self._hot_bytes -= len(old)
        for f in futs:
            f.set_result(None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._writer.close()


class _CacheWriter:
    """Writes fetched blocks to the disk cache on its own thread, behind the readers.

    At most `limit` bytes wait. The cache is best effort: when the disk takes
    blocks more slowly than the server sends them (this machine writes small
    files at ~110 MB/s), a block that finds the queue full is not cached
    (`skipped` counts them) rather than slowing the reader down to the disk's
    write speed. A later mount fetches such a block again.
    """

    def __init__(self, cache: ContentCache, limit: int) -> None:
        self.cache = cache
        self.limit = limit
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._bytes = 0
        self._closed = False
        self.skipped = 0
        threading.Thread(target=self._run, name="strata-cache-writer", daemon=True).start()

    def put(self, oid: bytes, data: bytes) -> None:
        with self._cond:
            if self._closed or (self._bytes and self._bytes + len(data) > self.limit):
                self.skipped += 1
                return
            self._queue.append((oid, data))
            self._bytes += len(data)
            self._cond.notify_all()

    def _run(self) -> None:
        # The lowest CPU priority: on a busy machine the readers, the fetch workers and
        # the server come first, and the cache gets what is left (or skips, above).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                oid, data = self._queue.popleft()
            self.cache.keep(oid, data)
            with self._cond:
                self._bytes -= len(data)
                self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every queued block is in the cache (tests)."""
        with self._cond:
            while self._bytes:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
