"""A local, bounded, content-addressed cache of objects, shared between mounts.

Objects are immutable and named by their BLAKE3 id, so a cached copy never
goes stale and any number of mount processes can share one directory: files
are written to a temporary name and renamed into place. When the cache grows
past its limit the least recently used files are removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from strata.engine.errors import Corrupt
from strata.engine.objects import KIND_NAMES, object_id

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 4 * 1024 * 1024 * 1024


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "strata", "objects")


TRIM_EVERY = 600.0  # seconds between the measurements `trim_if_due` makes


def trim_if_due(path: str | None = None, every: float = TRIM_EVERY,
                limit: int = DEFAULT_LIMIT) -> bool:
    """Measure the cache and evict past its limit, unless that was done in the last `every` s.

    For steps: each step's mount lives for a moment and is made without
    measuring (`measure=False`), since walking a large cache on every step
    would cost more than the step. The runner calls this after each step
    instead; the walk happens at most once per `every` seconds per cache (a
    stamp file beside it says when). Returns True if it measured.
    """
    path = path or default_cache_dir()
    stamp = path.rstrip("/") + ".measured"
    try:
        if time.time() - os.stat(stamp).st_mtime < every:
            return False
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "a"):
            pass
        os.utime(stamp)  # first: concurrent steps leave the walk to one of them
    except OSError:
        return False
    cache = ContentCache(path, limit, measure=False)
    cache._init_size()
    return True


class ContentCache:
    def __init__(self, path: str | None = None, limit: int = DEFAULT_LIMIT, *,
                 measure: bool = True) -> None:
        self.path = path or default_cache_dir()
        self.limit = limit
        # It holds every volume's bytes that this machine's mounts read: owner only.
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_mode & 0o077:
                os.chmod(self.path, 0o700)  # made by an older strata, 0755
        self._lock = threading.Lock()
        self._size = 0
        self._dirs: set[str] = set()  # fan-out directories known to exist
        # Measuring a large cache walks every file: do it off the mount's start path
        # (and, with measure=False, not at all: see trim_if_due).
        if measure:
            threading.Thread(target=self._init_size, daemon=True).start()
        self.hits = 0
        self.misses = 0
        self.fetched_bytes = 0
        # Objects a prefetch (mount/boottrace.py) is fetching now: a reader that wants
        # one waits for it rather than fetching the same bytes beside it.
        self._inflight: dict[bytes, threading.Event] = {}

    def _init_size(self) -> None:
        total = self._measure()
        with self._lock:
            self._size += total
            over = self._size > self.limit
        if over:
            self.evict()

    def _measure(self) -> int:
        total = 0
        for root, _dirs, files in os.walk(self.path):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(root, f)).st_size
        return total

    def _file(self, oid: bytes) -> str:
        h = oid.hex()
        return os.path.join(self.path, h[:2], h[2:])

    def get(self, oid: bytes, fetch: Callable[[bytes], bytes], kinds: tuple[int, ...] = ()
            ) -> bytes:
        """The object's bytes, from the cache or fetched (and checked against its id)."""
        data = self.load(oid, kinds)
        if data is not None:
            return data
        if self._inflight and self.wait_inflight(oid):
            data = self.load(oid, kinds)
            if data is not None:
                return data
        data = fetch(oid)
        if not _matches(oid, data, kinds):
            raise Corrupt("remote", 0, f"object {oid.hex()} does not match its id")
        self.keep(oid, data)
        return data

    def load(self, oid: bytes, kinds: tuple[int, ...] = ()) -> bytes | None:
        """The cached copy of `oid`, checked against its id; None if absent or damaged."""
        path = self._file(oid)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        # A cached copy is checked like a fetched one (BLAKE3 costs ~15 µs per
        # 64 KiB): a bad disk or a torn write must not be served, nor copied up
        # and published. A damaged copy is dropped and fetched again.
        if _matches(oid, data, kinds):
            self.hits += 1
            return data
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None

    def keep(self, oid: bytes, data: bytes) -> None:
        """Store a fetched object the caller has already checked against `oid`."""
        self.misses += 1
        self.fetched_bytes += len(data)
        self._put(self._file(oid), data)

    def has(self, oid: bytes) -> bool:
        return os.path.exists(self._file(oid))

    def get_many(self, oids: list[bytes], fetch_many: Callable[[list[bytes]], list[bytes]],
                 kinds: tuple[int, ...] = ()) -> None:
        """Make sure the objects are cached, fetching the missing ones in one batch."""
        todo = [o for o in dict.fromkeys(oids) if not self.has(o)]
        if not todo:
            return
        # Claimed while fetched, so a boot prefetch leaves them to us; those it is
        # fetching already we wait for instead.
        mine = self.claim(todo)
        try:
            if mine:
                for oid, data in zip(mine, fetch_many(mine), strict=True):
                    if not _matches(oid, data, kinds):
                        raise Corrupt("remote", 0, f"object {oid.hex()} does not match its id")
                    self.keep(oid, data)
        finally:
            self.release(mine)
        claimed = set(mine)
        theirs = [o for o in todo if o not in claimed]
        for oid in theirs:
            self.wait_inflight(oid)
        left = [o for o in theirs if not self.has(o)]
        if left:  # their fetch failed: ours, unclaimed
            for oid, data in zip(left, fetch_many(left), strict=True):
                if not _matches(oid, data, kinds):
                    raise Corrupt("remote", 0, f"object {oid.hex()} does not match its id")
                self.keep(oid, data)

    def claim(self, oids: list[bytes]) -> list[bytes]:
        """Of `oids`, those neither cached nor claimed already, now claimed by the caller.

        The caller fetches them, `keep`s them and then `release`s them, whatever happened.
        """
        out = []
        with self._lock:
            for oid in oids:
                if oid not in self._inflight and not self.has(oid):
                    self._inflight[oid] = threading.Event()
                    out.append(oid)
        return out

    def release(self, oids: list[bytes]) -> None:
        with self._lock:
            events = [self._inflight.pop(oid, None) for oid in oids]
        for ev in events:
            if ev is not None:
                ev.set()

    def wait_inflight(self, oid: bytes, timeout: float = 30.0) -> bool:
        """Wait while a prefetch fetches `oid`; True if one was."""
        ev = self._inflight.get(oid)
        if ev is None:
            return False
        ev.wait(timeout)
        return True

    def _put(self, path: str, data: bytes) -> None:
        parent = os.path.dirname(path)
        if parent not in self._dirs:
            os.makedirs(parent, mode=0o700, exist_ok=True)
            self._dirs.add(parent)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._dirs.discard(parent)  # removed under us, perhaps: make it again next time
            return  # a full cache disk only costs a refetch later
        with self._lock:
            self._size += len(data)
            over = self._size > self.limit
        if over:
            self.evict()

    def evict(self) -> None:
        """Remove least recently used files until the cache is at 90% of its limit."""
        files = []
        for root, _dirs, names in os.walk(self.path):
            for n in names:
                p = os.path.join(root, n)
                with contextlib.suppress(OSError):
                    st = os.stat(p)
                    files.append((max(st.st_atime, st.st_mtime), st.st_size, p))
        files.sort()
        total = sum(f[1] for f in files)
        target = int(self.limit * 0.9)
        for _t, size, p in files:
            if total <= target:
                break
            with contextlib.suppress(OSError):
                os.unlink(p)
                total -= size
        with self._lock:
            self._size = total

    def touch(self, oid: bytes) -> None:
        with contextlib.suppress(OSError):
            now = time.time()
            os.utime(self._file(oid), (now, now))


def matches(oid: bytes, data: bytes, kinds: tuple[int, ...] = ()) -> bool:
    """True if `data` is the object `oid` names, as one of `kinds` (any kind if empty)."""
    return _matches(oid, data, kinds)


def _matches(oid: bytes, data: bytes, kinds: tuple[int, ...]) -> bool:
    return any(object_id(k, data) == oid for k in (kinds or tuple(KIND_NAMES)))
