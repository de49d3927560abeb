"""Scratch tables: one pass's per-object state on disk, in memory bounded by configuration.

GC's mark set, fsck's map of what the packs hold and what the branches
reach, and the like have one entry per object in the store. Held as Python
sets and dicts they cost about 200 bytes an object (940 MiB through fsck at
a million objects); here they live in a throwaway SQLite file under the
store directory's `scratch/`, and memory holds at most `SCRATCH_BATCH`
entries not yet written, SQLite's page cache of `SCRATCH_CACHE_KIB` and a
Bloom filter of `SCRATCH_FILTER_BITS` (most lookups of a key never put are
answered from it): about 35 MiB a table, whatever the size of the store.

SQLite rather than a second LMDB environment: LMDB reads through a shared
map, so every page a pass touches would count in the process's resident
memory until the map is closed; SQLite reads with pread into a page cache of
a fixed size. Nothing here is durable or meant to be: no journal, no fsync,
and the files are removed when the table is closed, or, after a crash, when
the store is next opened (`clear_scratch`). This module must never hold
anything a pass cannot recompute.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterable, Iterator
from types import TracebackType

SCRATCH_DIR = "scratch"     # in the store directory
SCRATCH_BATCH = 65_536      # entries buffered in memory before they are written (~10 MiB)
SCRATCH_CACHE_KIB = 16_384  # SQLite's page cache per table
SCRATCH_FILTER_BITS = 26    # a Bloom filter of 2**26 bits (8 MiB) spares misses the disk
LOOKUP_BATCH = 500          # ids asked in one query by `contains_many` (SQLite allows 32766)


def clear_scratch(store_dir: str) -> None:
    """Remove scratch tables a crashed process left (the caller owns the store)."""
    shutil.rmtree(os.path.join(store_dir, SCRATCH_DIR), ignore_errors=True)


class Scratch:
    """A key -> value table on disk for one pass (a set when every value is empty).

    Later `put`s of a key win. `items` comes in key order (bytes compared
    as unsigned, as LMDB orders its keys), so it merges with an index cursor.
    Not shared between threads.
    """

    def __init__(self, store_dir: str, purpose: str) -> None:
        directory = os.path.join(store_dir, SCRATCH_DIR)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, self.path = tempfile.mkstemp(dir=directory, prefix=f"{purpose}-", suffix=".db")
        os.close(fd)
        # The bounds are read when a table is made, so a test can lower them.
        self._batch = SCRATCH_BATCH
        self._buf: dict[bytes, bytes] = {}
        self._written = 0  # puts written (a key put twice counts twice)
        # Object ids are hashes already; Python's hash of them spreads as well. Three bits
        # a key: at 10M keys about 6% of misses still ask SQLite, at 1M about 0.1%.
        self._bits_log = SCRATCH_FILTER_BITS
        self._mask = (1 << self._bits_log) - 1
        self._filter = bytearray()  # allocated at the first put: some tables stay empty
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        for pragma in ("journal_mode=OFF", "synchronous=OFF", "locking_mode=EXCLUSIVE",
                       "temp_store=FILE", "mmap_size=0", f"cache_size=-{int(SCRATCH_CACHE_KIB)}"):
            self._db.execute(f"PRAGMA {pragma}")
        self._db.execute("CREATE TABLE t (k BLOB PRIMARY KEY, v BLOB NOT NULL) WITHOUT ROWID")

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._buf.clear()
        self._db.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _bits(self, key: bytes) -> tuple[int, int, int]:
        h, m = hash(key) & 0xFFFF_FFFF_FFFF_FFFF, self._mask
        return h & m, (h >> 21) & m, ((h >> 42) | (h << 22)) & m

    def put(self, key: bytes, value: bytes = b"") -> None:
        f = self._filter
        if not f:
            f = self._filter = bytearray(1 << (self._bits_log - 3))
        for b in self._bits(key):
            f[b >> 3] |= 1 << (b & 7)
        self._buf[key] = value
        if len(self._buf) >= self._batch:
            self.flush()

    def add_all(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self.put(k)

    def flush(self) -> None:
        """Write what is buffered (one transaction)."""
        if not self._buf:
            return
        self._db.execute("BEGIN")
        self._db.executemany("INSERT OR REPLACE INTO t (k, v) VALUES (?, ?)",
                             sorted(self._buf.items()))  # in key order: B-tree appends stay cheap
        self._db.execute("COMMIT")
        self._written += len(self._buf)
        self._buf.clear()

    def get(self, key: bytes) -> bytes | None:
        v = self._buf.get(key)
        if v is not None:
            return v
        if not self._written or not self._maybe(key):
            return None
        row = self._db.execute("SELECT v FROM t WHERE k = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def _maybe(self, key: bytes) -> bool:
        a, b, c = self._bits(key)
        f = self._filter
        return bool(f[a >> 3] & (1 << (a & 7)) and f[b >> 3] & (1 << (b & 7))
                    and f[c >> 3] & (1 << (c & 7)))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(key) is not None

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """`key in self` for each key, asking the disk a batch at a time."""
        out = [k in self._buf for k in keys]
        if not self._written:
            return out
        ask = [k for k, hit in zip(keys, out, strict=True) if not hit and self._maybe(k)]
        found: set[bytes] = set()
        for i in range(0, len(ask), LOOKUP_BATCH):
            chunk = ask[i:i + LOOKUP_BATCH]
            marks = ",".join("?" * len(chunk))
            found.update(bytes(r[0]) for r in
                         self._db.execute(f"SELECT k FROM t WHERE k IN ({marks})", chunk))
        return [hit or k in found for k, hit in zip(keys, out, strict=True)]

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every entry in key order (written first: no `put` while this runs)."""
        self.flush()
        for k, v in self._db.execute("SELECT k, v FROM t ORDER BY k"):
            yield bytes(k), bytes(v)

    def __len__(self) -> int:
        self.flush()
        return int(self._db.execute("SELECT count(*) FROM t").fetchone()[0])
