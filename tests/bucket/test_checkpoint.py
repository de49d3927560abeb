"""Checkpoints and index runs: restore reads the fences, lookups read one block each."""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgpack
import pytest

from strata.engine.bucket import Bucket, frame_record
from strata.engine.checkpoint import (
    BLOCK_ENTRIES,
    CHECKPOINT_MAGIC,
    Checkpoint,
    RunReader,
    encode_run,
)
from strata.engine.errors import Corrupt


def _entries(n: int) -> list[tuple[bytes, tuple[int, int, int, int]]]:
    ids = sorted(os.urandom(32) for _ in range(n))
    return [(oid, (i % 7 + 1, i * 100, 90 + i % 5, i % 4 + 1)) for i, oid in enumerate(ids)]


def test_a_checkpoint_round_trips_and_refuses_damage() -> None:
    entries = _entries(3000)
    _run, fences, count = encode_run(entries)
    cp = Checkpoint(store_id=os.urandom(16), epoch=7, applied=(3, 4096),
                    volumes={"v": "ab" * 16, "w": ""},
                    refs={("v", "live"): "cd" * 32, ("v", "a/b"): "ef" * 32},
                    leases=[["v", "live", 3, 10**18, "host", b"k" * 16]],
                    packs={1: ("packs/00000001-aa.pack", 900), 2: ("packs/00000002-bb.pack", 77)},
                    log_from=12, block_size=65536,
                    run="runs/x", fences=fences, entries=count, expired=[b"x" * 32],
                    policies=[[b"v\0", b'{"keep_last": 2}']])
    data = cp.encode()
    assert Checkpoint.decode("checkpoints/x", data) == cp
    # A version 2 checkpoint (before policies were journaled) reads as having none.
    body = msgpack.unpackb(data[37:])
    del body["policies"]
    body["v"] = 2
    old = frame_record(CHECKPOINT_MAGIC, 2, body)
    assert Checkpoint.decode("checkpoints/old", old).policies == []
    with pytest.raises(Corrupt, match="checkpoint version 4 .*upgrade"):
        Checkpoint.decode("checkpoints/new", frame_record(CHECKPOINT_MAGIC, 4, body))
    assert len(fences) == -(-3000 // BLOCK_ENTRIES)
    for bad in (data[:-1], b"STRC\x09" + data[5:], data[:40] + bytes([data[40] ^ 1]) + data[41:]):
        with pytest.raises(Corrupt, match="checkpoints/x"):
            Checkpoint.decode("checkpoints/x", bad)


@pytest.mark.parametrize("n", [1, BLOCK_ENTRIES, 5 * BLOCK_ENTRIES + 17])
def test_every_id_is_found_with_one_block_read(tmp_path: Path, n: int) -> None:
    bucket = Bucket(f"file://{tmp_path}/b")
    entries = _entries(n)
    run, fences, count = encode_run(entries)
    bucket.put("runs/r", run)
    reads: list[tuple[int, int]] = []

    def read(start: int, end: int) -> bytes:
        reads.append((start, end))
        return bucket.get_range("runs/r", start, end)

    reader = RunReader("runs/r", fences, count, read)
    for oid, loc in random.sample(entries, min(n, 200)):
        reads.clear()
        got, block = reader.lookup(oid)
        assert got == loc and len(reads) == 1 and (oid, loc) in block
    for _ in range(50):
        reads.clear()
        assert reader.lookup(os.urandom(32))[0] is None and len(reads) <= 1


def test_a_damaged_block_names_the_run(tmp_path: Path) -> None:
    bucket = Bucket(f"file://{tmp_path}/b")
    entries = _entries(2 * BLOCK_ENTRIES)
    run, fences, count = encode_run(entries)
    broken = bytearray(run)
    broken[10] ^= 1  # inside block 0
    bucket.put("runs/r", bytes(broken))
    reader = RunReader("runs/r", fences, count,
                       lambda s, e: bucket.get_range("runs/r", s, e))
    with pytest.raises(Corrupt, match="runs/r"):
        reader.lookup(entries[5][0])
    assert reader.lookup(entries[-1][0])[0] == entries[-1][1]  # block 1 is intact
