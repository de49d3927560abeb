"""Reads: pack bytes served from the local directory, or from the bucket.

A pack only in the bucket is read with ranged GETs in aligned windows, kept
in a bounded memory cache; a pack missed again and again is queued to be
fetched back whole, and a scan (`mapped`) fetches it first. What came from
the bucket is checked against object ids by the reader (`verify_reads`).
This module never writes the bucket.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from strata.engine import pack as packfmt
from strata.engine.errors import Corrupt, NotFound
from strata.engine.tierstate import TierState

WINDOW = 1 << 20           # ranged reads of bucket-only packs, in aligned windows
WINDOW_CACHE = 64          # windows kept in memory
FETCH_BACK_AFTER = 2       # window misses of one bucket-only pack before it is fetched whole
WINDOW_WAIT = 30.0         # seconds a reader waits for another's GET of the same window


class WindowedReads(TierState):
    """The read half of `PackStore` over local files and bucket objects."""

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
            loading = self._window_loads.get(key)
            if loading is None:
                self._window_loads[key] = mine = threading.Event()
        if loading is not None:
            # Another reader is fetching this window (parallel readers of one file, a
            # boot prefetch beside the step's reads): one GET serves both.
            loading.wait(WINDOW_WAIT)
            with self._lock:
                data = self._windows.get(key)
            if data is not None:
                return data
            return self._fetch_window(number, name, size, w)  # theirs failed: ours
        try:
            return self._fetch_window(number, name, size, w)
        finally:
            with self._lock:
                self._window_loads.pop(key, None)
            mine.set()

    def _fetch_window(self, number: int, name: str, size: int, w: int) -> bytes:
        key = (number, w)
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
