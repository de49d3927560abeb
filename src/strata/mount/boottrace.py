"""Boot traces: what an image's first boot read, in order, and prefetching it on later boots.

A step booted from an image (`strata run --image`) reads a few percent of
it, and mostly the same few percent every time: the interpreter, its shared
libraries, the modules it imports. The first boot of an image snapshot on a
host with no trace for that snapshot records, in the mount process, every
first touch of a file range and every directory listing, in order (bounded:
`MAX_ENTRIES`, and only for the first `RECORD_SECONDS`). When the step ends
(or the window closes) the trace is published with the image: a file on the
branch `boot-trace/<snapshot id>` of the image's own volume, so it lives in
the store's packs, goes to the bucket with them, and stays until that branch
is deleted. Later boots of the snapshot read the trace and fetch its ranges
in trace order on a few threads into the mount's content cache, while the
step runs, so the step's own reads find them there.

This module owns the trace format (docs/format.md, "Boot traces"), the
recorder the read path calls, storing and loading traces through the `Store`
interface, and the prefetcher. A trace read back is untrusted input: it is
checked whole (magic, version, checksum, bounds, paths) before use, and a
refused trace only costs the prefetch, never the boot. Recording never
blocks a read on the store; prefetching never serves a byte that was not
checked against its id.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import blake3
import msgpack

from strata.engine.errors import AlreadyExists, Conflict, InvalidInput, NotFound, StrataError
from strata.engine.filetree import CDC_AVG
from strata.engine.interface import Store
from strata.engine.names import check_hex_id
from strata.engine.objects import BLOCK, FILENODE, K_DIR, K_FILE, Entry, FileNode
from strata.engine.tree import Trees
from strata.mount.cache import ContentCache, matches

log = logging.getLogger(__name__)

MAGIC = b"STRATABT"
VERSION = 1
HEADER = struct.Struct("<8sHH32s")  # magic, version, zero, BLAKE3-256 of the body
BRANCH_PREFIX = "boot-trace/"       # boot-trace/<snapshot id> in the image's volume
TRACE_FILE = "boot-trace"           # the trace, at the root of that branch's snapshot

K_LIST = 0   # a directory listed: its tree nodes
K_READ = 1   # bytes [offset, offset + length) of a file read

MAX_ENTRIES = 16384          # entries recorded, and accepted when read back
MAX_PATH = 4096              # bytes of one path
MAX_TRACE_BYTES = 4 << 20    # an encoded trace
MAX_FILE = 1 << 50           # an offset or a length
RECORD_SECONDS = 30.0        # a boot is what the first half minute reads
MERGE_GAP = 64 * 1024        # a read this close after the last range of its file extends it
PREFETCH_WORKERS = 4
PREFETCH_BUDGET = 1 << 30    # bytes one prefetch fetches at most, whatever its trace says
REQUEST_BYTES = 1024 * 1024 - 64 * 1024  # one fetch request's answer, as the read-ahead's


@dataclass(slots=True)
class TraceEntry:
    kind: int       # K_LIST or K_READ
    path: bytes     # in the image, relative, '/'-separated, b"" for its root
    offset: int = 0
    length: int = 0


def trace_branch(snapshot: str) -> str:
    return BRANCH_PREFIX + check_hex_id(snapshot)


# -- the format ---------------------------------------------------------------------


def encode(snapshot: str, entries: Sequence[TraceEntry]) -> bytes:
    body: bytes = msgpack.packb([snapshot, [[e.kind, e.path, e.offset, e.length] for e in entries]],
                         use_bin_type=True)
    return HEADER.pack(MAGIC, VERSION, 0, blake3.blake3(body).digest()) + body


def decode(raw: bytes, snapshot: str) -> list[TraceEntry]:
    """The entries of a trace made for `snapshot`; InvalidInput names what is wrong."""
    if len(raw) > MAX_TRACE_BYTES:
        raise InvalidInput(f"boot trace of {len(raw)} bytes (at most {MAX_TRACE_BYTES})")
    if len(raw) < HEADER.size:
        raise InvalidInput("boot trace shorter than its header")
    magic, version, zero, digest = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise InvalidInput("not a boot trace (bad magic)")
    if version != VERSION or zero != 0:
        raise InvalidInput(f"boot trace version {version} (this strata reads {VERSION})")
    body = raw[HEADER.size:]
    if blake3.blake3(body).digest() != digest:
        raise InvalidInput("boot trace checksum mismatch")
    try:
        doc = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True,
                              max_bin_len=MAX_PATH, max_str_len=128,
                              max_array_len=MAX_ENTRIES, max_map_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        raise InvalidInput(f"boot trace body is not msgpack: {exc}") from None
    if not (isinstance(doc, list) and len(doc) == 2 and isinstance(doc[1], list)):
        raise InvalidInput("boot trace body is not [snapshot, entries]")
    if doc[0] != snapshot:
        raise InvalidInput("boot trace made for another snapshot")
    out = []
    for item in doc[1]:
        if not (isinstance(item, list) and len(item) == 4):
            raise InvalidInput("boot trace entry is not [kind, path, offset, length]")
        kind, path, offset, length = item
        if kind not in (K_LIST, K_READ) or not isinstance(path, bytes):
            raise InvalidInput("boot trace entry of unknown kind")
        for n in (offset, length):
            if type(n) is not int or not 0 <= n <= MAX_FILE:
                raise InvalidInput("boot trace entry with a bad offset or length")
        if path and any(p in (b"", b".", b"..") or b"\0" in p for p in path.split(b"/")):
            raise InvalidInput(f"boot trace names a bad path {path[:80]!r}")
        out.append(TraceEntry(kind, path, offset, length))
    return out


# -- recording ----------------------------------------------------------------------


class Recorder:
    """The first touches of an image's files and directories, in order (thread-safe).

    A read inside a range already recorded for its file is dropped; one that
    starts at most MERGE_GAP after the end of its file's latest range extends
    that range (the kernel reads a file in pieces, a few at a time). Past
    MAX_ENTRIES or `seconds` it records nothing more.
    """

    def __init__(self, seconds: float = RECORD_SECONDS, limit: int = MAX_ENTRIES) -> None:
        self._lock = threading.Lock()
        self.entries: list[TraceEntry] = []
        self._files: dict[bytes, list[TraceEntry]] = {}
        self._dirs: set[bytes] = set()
        self.limit = limit
        self.deadline = time.monotonic() + seconds
        self.active = True

    def _room(self) -> bool:
        if len(self.entries) >= self.limit or time.monotonic() > self.deadline:
            self.active = False
        return self.active

    def listed(self, path: bytes) -> None:
        with self._lock:
            if path in self._dirs or not self._room():
                return
            self._dirs.add(path)
            self.entries.append(TraceEntry(K_LIST, path))

    def read(self, path: bytes, offset: int, end: int) -> None:
        if end <= offset:
            return
        with self._lock:
            if not self.active:
                return
            ranges = self._files.get(path)
            if ranges is not None:
                for r in ranges:
                    if r.offset <= offset and end <= r.offset + r.length:
                        return
                last = ranges[-1]
                if last.offset <= offset <= last.offset + last.length + MERGE_GAP:
                    last.length = max(last.length, end - last.offset)
                    return
            if not self._room():
                return
            e = TraceEntry(K_READ, path, offset, end - offset)
            self.entries.append(e)
            self._files.setdefault(path, []).append(e)

    def stop(self) -> list[TraceEntry]:
        with self._lock:
            self.active = False
            return list(self.entries)


# -- storing and loading ------------------------------------------------------------


def load_trace(store: Store, volume: str, snapshot: str) -> list[TraceEntry] | None:
    """The trace kept for `snapshot` in `volume`; None if there is none.

    InvalidInput when there is one but it is refused (see `decode`).
    """
    try:
        head = store.head(volume, trace_branch(snapshot))
    except NotFound:
        return None
    root = store.snapshot(head).root
    if root.ref is None:
        return None
    e = Trees(store).lookup(root.ref, TRACE_FILE.encode())
    if e is None or e.kind != K_FILE:
        raise InvalidInput(f"branch {trace_branch(snapshot)} holds no {TRACE_FILE} file")
    if e.size > MAX_TRACE_BYTES:
        raise InvalidInput(f"boot trace of {e.size} bytes (at most {MAX_TRACE_BYTES})")
    from strata.engine.txn import ContentWriter
    try:  # the nodes at whatever depth, and the chunks: one round trip from a remote store
        raw = ContentWriter(store).read(e)
    except ValueError as exc:
        raise InvalidInput(f"boot trace's file node: {exc}") from None
    return decode(raw, snapshot)


def save_trace(store: Store, volume: str, snapshot: str, entries: Sequence[TraceEntry]) -> str:
    """Publish the trace on `boot-trace/<snapshot>`; the snapshot that holds it.

    The branch starts at the empty snapshot, not at the image's: a trace never
    keeps an image alive on its own. A trace published meanwhile by another
    first boot wins (Conflict is raised here, and the caller drops its own).
    """
    from strata.engine.txn import Transaction
    branch = trace_branch(snapshot)
    with contextlib.suppress(AlreadyExists):
        store.fork(volume, branch, at=None)
    txn = Transaction(store, volume, branch)
    txn.write(TRACE_FILE, encode(snapshot, entries))
    return txn.commit(f"boot trace of {snapshot[:12]}: {len(entries)} ranges",
                      meta={"boot_trace": snapshot})


# -- prefetching --------------------------------------------------------------------


@dataclass
class PrefetchStats:
    entries: int = 0        # trace entries handled
    objects: int = 0        # objects fetched (blocks, file nodes, tree nodes)
    bytes: int = 0          # their bytes
    skipped: int = 0        # entries whose path the image does not hold (refused quietly)
    seconds: float = 0.0    # from start to the last entry
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {"entries": self.entries, "objects": self.objects, "bytes": self.bytes,
                "skipped": self.skipped, "seconds": round(self.seconds, 4),
                "errors": self.errors[:5]}


class _CountingSource:
    """The store through the content cache, counting what it fetches."""

    def __init__(self, store: Store, cache: ContentCache, stats: PrefetchStats,
                 lock: threading.Lock) -> None:
        self.store, self.cache, self.stats, self._lock = store, cache, stats, lock

    def get_object(self, oid: bytes) -> bytes:
        data = self.cache.load(oid)
        if data is not None:
            return data
        data = self.cache.get(oid, self.store.get_object)
        with self._lock:
            self.stats.objects += 1
            self.stats.bytes += len(data)
        return data


class Prefetcher:
    """Fetch a trace's ranges of one snapshot into a content cache, in order, in parallel.

    `workers` threads share one queue of tasks ordered by trace position:
    resolving an entry (its path in the snapshot, fetching tree nodes and
    the file node through the cache) and fetching a batch of an entry's
    blocks (just under 1 MiB a request, as the read-ahead's). A worker always
    takes the earliest task, so a large file early in the trace is fetched
    by every worker at once, and later entries are resolved meanwhile. Blocks
    in flight are claimed in the cache, so a reader that wants one waits for
    it instead of fetching it again (and the prefetch skips what a reader
    claimed).
    """

    def __init__(self, store: Store, root: Entry, cache: ContentCache, entries: list[TraceEntry],
                 *, workers: int = PREFETCH_WORKERS) -> None:
        self.store, self.root, self.cache = store, root, cache
        self.entries = entries
        self.stats = PrefetchStats()
        self._cond = threading.Condition()
        # (trace position, order of making, block ids or None to resolve the entry)
        self._tasks: list[tuple[int, int, list[bytes] | None]] = [
            (i, 0, None) for i in range(len(entries))]
        self._made = 0
        self._busy = 0
        self._planned = 0  # bytes of blocks put in fetch tasks (PREFETCH_BUDGET)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._source = _CountingSource(store, cache, self.stats, self._lock)
        self._trees = Trees(self._source)
        self._threads = [threading.Thread(target=self._work, name=f"strata-boot-prefetch-{i}",
                                          daemon=True) for i in range(max(1, workers))]
        self._t0 = 0.0
        self._left = len(self._threads)
        self.done = threading.Event()

    def start(self) -> Prefetcher:
        self._t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def _take(self) -> tuple[int, list[bytes] | None] | None:
        """The earliest task; None when none is left and none can be made."""
        with self._cond:
            while True:
                if self._stop.is_set():
                    return None
                if self._tasks:
                    pos, _n, blocks = heapq.heappop(self._tasks)
                    self._busy += 1
                    return pos, blocks
                if not self._busy:
                    self._cond.notify_all()
                    return None
                self._cond.wait()

    def _put(self, pos: int, batches: list[list[bytes]]) -> None:
        with self._cond:
            for b in batches:
                self._made += 1
                heapq.heappush(self._tasks, (pos, self._made, b))
            self._busy -= 1
            self._cond.notify_all()

    def _work(self) -> None:
        try:
            while (task := self._take()) is not None:
                pos, blocks = task
                batches: list[list[bytes]] = []
                try:
                    if blocks is None:
                        batches = self._resolve_entry(self.entries[pos])
                        with self._lock:
                            self.stats.entries += 1
                    else:
                        self._fetch(blocks)
                except (StrataError, OSError, ValueError) as exc:
                    with self._lock:
                        self.stats.errors.append(f"{self.entries[pos].path[:80]!r}: {exc}")
                finally:
                    self._put(pos, batches)
        except Exception as exc:  # a prefetch never fails a boot: the reads fetch for themselves
            log.warning("boot prefetch stopped: %s", exc)
            with self._lock:
                self.stats.errors.append(str(exc))
        finally:
            with self._lock:
                self._left -= 1
                last = self._left == 0
                if last:
                    self.stats.seconds = time.monotonic() - self._t0
            if last:
                self.done.set()

    def _resolve(self, path: bytes) -> Entry | None:
        e: Entry | None = self.root
        for name in path.split(b"/") if path else ():
            if e is None or e.kind != K_DIR or e.ref is None:
                return None
            e = self._trees.lookup(e.ref, name)
        return e

    def _resolve_entry(self, entry: TraceEntry) -> list[list[bytes]]:
        """Batches of the entry's blocks not cached yet; tree nodes fetched on the way."""
        e = self._resolve(entry.path)
        if e is None:
            with self._lock:
                self.stats.skipped += 1
            return []
        if entry.kind == K_LIST:
            if e.kind == K_DIR and e.ref is not None:
                for _ in self._trees.iter_dir(e.ref):
                    pass
            return []
        if e.kind != K_FILE or e.ref is None:
            return []  # inline content came with its directory's node
        raw = self._source.get_object(e.ref)
        if not matches(e.ref, raw, (FILENODE,)):
            raise InvalidInput(f"object {e.ref.hex()} is no file node")
        fnode = FileNode.decode(raw)
        end = min(e.size, entry.offset + entry.length)
        source = self._source

        def get_node(oid: bytes) -> bytes:  # a large file's inner nodes, checked and cached
            return self.cache.get(oid, source.get_object, (FILENODE,))

        want = [oid for oid in fnode.block_ids(entry.offset, end, get_node)
                if not self.cache.has(oid)]
        unit = fnode.block_size or CDC_AVG  # fixed blocks, or chunks of this size on average
        with self._lock:
            room = max(0, PREFETCH_BUDGET - self._planned) // unit
            want = want[:room]  # a trace naming the whole image fetches no more than this
            self._planned += len(want) * unit
        per = max(1, REQUEST_BYTES // unit)
        return [want[i:i + per] for i in range(0, len(want), per)]

    def _fetch(self, oids: list[bytes]) -> None:
        todo = self.cache.claim(list(dict.fromkeys(oids)))
        if not todo:
            return
        try:
            checked = getattr(self.store, "verifies_reads", False) is True
            for oid, data in zip(todo, self.store.get_objects(todo), strict=True):
                if not checked and not matches(oid, data, (BLOCK,)):
                    raise InvalidInput(f"block {oid.hex()} does not match its id")
                self.cache.keep(oid, data)
                with self._lock:
                    self.stats.objects += 1
                    self.stats.bytes += len(data)
        finally:
            self.cache.release(todo)


def prefetch_snapshot(store: Store, volume: str, snapshot: str,
                      cache: ContentCache | None = None, *, workers: int = PREFETCH_WORKERS
                      ) -> Prefetcher | None:
    """Start prefetching `snapshot`'s boot trace into `cache`; None without a usable trace.

    For whoever boots something else from an image snapshot (a workspace
    seeded from an image): call it as the boot starts, `wait` or `stop` the
    result as suits. A refused trace is logged and answered with None.
    """
    try:
        entries = load_trace(store, volume, snapshot)
    except InvalidInput as exc:
        log.warning("boot trace of %s in %s refused: %s", snapshot[:12], volume, exc)
        return None
    if not entries:
        return None
    root = store.snapshot(snapshot).root
    return Prefetcher(store, root, cache or ContentCache(measure=False), entries,
                      workers=workers).start()


# -- one image boot -----------------------------------------------------------------


class ImageBoot:
    """The trace work of one mount of an image: record it, or prefetch from it.

    `begin` turns recording on at once (the step may start reading before
    the trace is found), and looks for a trace on a thread: found and sound,
    recording stops and the prefetch starts; absent or refused, recording
    goes on, and the trace is published when the window closes or the mount
    ends (`finish`), whichever comes first.
    """

    def __init__(self, store: Store, volume: str, snapshot: str, root: Entry,
                 cache: ContentCache, *, seconds: float = RECORD_SECONDS,
                 on_event: Callable[[str, dict[str, object]], None] | None = None) -> None:
        self.store, self.volume, self.snapshot, self.root = store, volume, snapshot, root
        self.cache = cache
        self.recorder: Recorder | None = Recorder(seconds)
        self.prefetcher: Prefetcher | None = None
        self.seconds = seconds
        self.published: str | None = None
        self.refused: str | None = None
        self._saved = threading.Lock()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-boot-trace",
                                        daemon=True)
        self.on_event = on_event

    def begin(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            entries = load_trace(self.store, self.volume, self.snapshot)
        except InvalidInput as exc:
            self.refused = str(exc)
            log.warning("boot trace of %s in %s refused, recording a new one: %s",
                        self.snapshot[:12], self.volume, exc)
            self._emit("refused", {"reason": str(exc)[:200]})
            entries = None
        except StrataError as exc:
            log.warning("boot trace of %s not read: %s", self.snapshot[:12], exc)
            self._stop_recording()  # unknown: neither prefetch nor overwrite
            return
        if entries:
            self._stop_recording()
            self.prefetcher = Prefetcher(self.store, self.root, self.cache, entries).start()
            self._emit("prefetch", {"entries": len(entries)})
            self.prefetcher.wait()
            self._emit("prefetched", self.prefetcher.stats.to_json())
            return
        if not self._finished.wait(self.seconds):
            self._save()

    def _stop_recording(self) -> None:
        rec, self.recorder = self.recorder, None
        if rec is not None:
            rec.stop()  # the read path holds it: it records nothing more

    def _save(self) -> None:
        rec = self.recorder
        if rec is None or not self._saved.acquire(blocking=False):
            return
        entries = rec.stop()
        if not entries:
            return
        try:
            self.published = save_trace(self.store, self.volume, self.snapshot, entries)
            self._emit("recorded", {"entries": len(entries), "snapshot": self.published})
        except Conflict:
            log.info("a boot trace of %s was published meanwhile; keeping that one",
                     self.snapshot[:12])
        except StrataError as exc:  # not allowed, or the store went away: no trace this time
            log.warning("boot trace of %s not published: %s", self.snapshot[:12], exc)

    def finish(self) -> None:
        """The mount ends: publish what was recorded (if no trace was found), stop prefetching."""
        self._finished.set()
        if self.prefetcher is not None:
            self.prefetcher.stop()
        self._thread.join(timeout=3)
        if self.recorder is not None and not self._thread.is_alive():
            self._save()

    def _emit(self, what: str, detail: dict[str, object]) -> None:
        log.info("boot trace %s: %s %s", self.snapshot[:12], what, detail)
        if self.on_event is not None:
            with contextlib.suppress(Exception):
                self.on_event(what, detail)
