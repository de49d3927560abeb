"""The mount's read-ahead (mount/readahead.py) against a real store and a real disk cache.

No FUSE here: `SnapshotFS` is the mount's core, read the way the adapter
reads it (128 KiB requests, `read_nowait` first). The store is a real
`LocalStore`; the one wrapper below only counts requests or, for the
lying-server test, changes the bytes a batch read returns.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from strata.engine.errors import Corrupt
from strata.engine.filetree import CDC_MAX
from strata.engine.local import LocalStore, init_store
from strata.engine.txn import Transaction
from strata.mount.cache import ContentCache
from strata.mount.readahead import (
    MAX_AHEAD,
    PER_REQUEST,
    REQUEST_BYTES,
    STREAM_CACHE_BYTES,
    UNIT,
)
from strata.mount.vfs import SnapshotFS, Volume

MIB = 1024 * 1024
BLOCK = 64 * 1024
SIZE = 24 * MIB


class Counting(LocalStore):
    """A LocalStore that records each batch read, and can lie about one block."""

    batches: list[int]
    batch_bytes: list[int]
    lie_about: bytes | None = None

    def get_objects(self, ids: Sequence[bytes]) -> list[bytes]:
        self.batches.append(len(ids))
        out = [self.get_object(oid) for oid in ids]
        self.batch_bytes.append(sum(map(len, out)))
        return out

    def get_object(self, oid: bytes) -> bytes:
        return self._lie(oid, super().get_object(oid))

    def _lie(self, oid: bytes, raw: bytes) -> bytes:
        return bytes([raw[0] ^ 1]) + raw[1:] if oid == self.lie_about else raw


@functools.cache
def _content() -> bytes:
    """Random bytes: chunks of every size FastCDC cuts (~78 KiB on average)."""
    return random.Random(24).randbytes(SIZE)


def _chunks(fs: SnapshotFS, store: Counting) -> list[tuple[int, int, bytes]]:
    """(offset, length, id) of each chunk of the big file."""
    fnode = fs.file_node(fs.lookup(1, b"big").ino)
    assert fnode is not None
    return list(fnode.spans(0, fnode.size, store.get_object))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Counting]:
    init_store(str(tmp_path / "store"))
    s = Counting(str(tmp_path / "store"))
    s.batches = []
    s.batch_bytes = []
    s.create_volume("v")
    t = Transaction(s, "v")
    t.write("big", _content())
    t.write("small", b"hello")
    t.commit()
    yield s
    s.close()


def _fs(store: Counting, cache: Path, **kw: bool) -> SnapshotFS:
    return SnapshotFS([Volume("v", store, store.head("v", "live"))], ContentCache(str(cache)),
                      **kw)


def _read(fs: SnapshotFS, offset: int, length: int, step: int = 128 * 1024) -> bytes:
    """Read as the FUSE adapter does: from memory when ready, else on a thread."""
    node = fs.lookup(1, b"big")
    fnode = fs.file_node(node.ino)
    out = bytearray()
    pos = offset
    while pos < offset + length:
        n = min(step, offset + length - pos)
        data = fs.read_nowait(node.ino, pos, n, fnode)
        if data is None:
            data = fs.read(node.ino, pos, n, fnode)
        out += data
        pos += n
    return bytes(out)


def test_sequential_read_is_exact_and_batched(store: Counting, tmp_path: Path) -> None:
    fs = _fs(store, tmp_path / "cache")
    assert _read(fs, 0, SIZE) == _content()
    chunks = len({oid for _o, _n, oid in _chunks(fs, store)})
    # Every chunk fetched once, in answers under 1 MiB, far fewer requests than
    # one per chunk (or per 128 KiB read).
    assert fs.readahead.fetched_blocks == chunks
    assert max(store.batch_bytes) <= REQUEST_BYTES
    assert len(store.batches) <= SIZE // (PER_REQUEST * UNIT) + 4
    fs.readahead.close()


def test_a_jump_fetches_a_short_window(store: Counting, tmp_path: Path) -> None:
    fs = _fs(store, tmp_path / "cache")
    offset = 13 * MIB + 5 * BLOCK
    assert _read(fs, offset, 100) == _content()[offset:offset + 100]
    # One block needed: the jump's short read-ahead at most, not the file.
    assert 1 <= fs.readahead.fetched_blocks <= REQUEST_BYTES // BLOCK
    fs.readahead.close()


def test_a_lying_server_never_reaches_a_reader(store: Counting, tmp_path: Path) -> None:
    fs = _fs(store, tmp_path / "cache")
    bad, length, oid = next(c for c in _chunks(fs, store) if c[0] >= 3 * MIB)
    store.lie_about = oid
    # Everything before the lie reads fine; the read that needs the bad chunk fails
    # with Corrupt (EIO on the mount), from memory or not, and never returns bytes.
    assert _read(fs, 0, bad) == _content()[:bad]
    with pytest.raises(Corrupt):
        _read(fs, bad, length)
    assert fs.readahead.ready(oid) is None
    assert not list((tmp_path / "cache").rglob(oid.hex()[2:] + "*"))
    # A good chunk fetched in the same request as the bad one reads fine: a fresh
    # reader's first read starts a window 192 KiB before that holds the bad chunk.
    fresh = _fs(store, tmp_path / "cache2")
    good = bad - 3 * BLOCK
    assert _read(fresh, good, BLOCK) == _content()[good:good + BLOCK]
    with pytest.raises(Corrupt):
        _read(fresh, bad, 100)
    fresh.readahead.close()
    # The server stops lying: the chunk is fetched again, checked, and served.
    store.lie_about = None
    assert _read(fs, bad, length) == _content()[bad:bad + length]
    fs.readahead.close()


def _cached(fs: SnapshotFS, store: Counting, cache: Path) -> int:
    """How many bytes of the big file's chunks the disk cache holds."""
    return sum(n for _o, n, oid in _chunks(fs, store)
               if (cache / oid.hex()[:2] / oid.hex()[2:]).is_file())


def test_streams_from_a_local_server_cache_only_their_start(store: Counting,
                                                            tmp_path: Path) -> None:
    fs = _fs(store, tmp_path / "local", cache_streams=False)
    assert _read(fs, 0, SIZE) == _content()
    fs.readahead._writer.flush()
    kept = _cached(fs, store, tmp_path / "local")
    # The stream's first STREAM_CACHE_BYTES (in whole requests), not the whole file.
    assert STREAM_CACHE_BYTES - CDC_MAX <= kept <= STREAM_CACHE_BYTES + REQUEST_BYTES
    fs.readahead.close()

    fs = _fs(store, tmp_path / "remote")  # a remote server: every block is kept
    assert _read(fs, 0, SIZE) == _content()
    fs.readahead._writer.flush()
    assert _cached(fs, store, tmp_path / "remote") == SIZE
    fs.readahead.close()

    # A second reader on the shared cache reads the cached blocks without a fetch.
    store.batches.clear()
    fs = _fs(store, tmp_path / "remote")
    assert _read(fs, 0, SIZE) == _content()
    assert fs.readahead.fetched_blocks == 0 and store.batches == []
    fs.readahead.close()


def test_read_ahead_stays_bounded(store: Counting, tmp_path: Path) -> None:
    fs = _fs(store, tmp_path / "cache")
    _read(fs, 0, 2 * MIB)
    stream = fs.readahead._streams[fs.lookup(1, b"big").ino]
    # Never more than MAX_AHEAD units (plus one request) requested past the reader.
    assert stream.next - stream.last_read <= MAX_AHEAD + PER_REQUEST
    assert os.path.isdir(tmp_path / "cache")
    fs.readahead.close()
