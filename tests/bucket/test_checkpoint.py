"""Checkpoints and index runs: restore reads the fences, lookups read one block each."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import blake3
import msgpack
import pytest

from strata.engine.bucket import Bucket, frame_record
from strata.engine.checkpoint import (
    BLOCK_ENTRIES,
    CHECKPOINT_MAGIC,
    ENTRY,
    GROUP_PARTS,
    PACKS_PER_TABLE,
    RUN_MAGIC,
    Checkpoint,
    Merge,
    Part,
    PartReader,
    encode_part,
    encode_table,
    group_manifest,
    group_packs,
    merged,
)
from strata.engine.errors import Corrupt
from strata.engine.index import Loc


def _entries(n: int) -> list[tuple[bytes, tuple[int, int, int, int]]]:
    ids = sorted(os.urandom(32) for _ in range(n))
    return [(oid, (i % 7 + 1, i * 100, 90 + i % 5, i % 4 + 1)) for i, oid in enumerate(ids)]


def encode_run(entries: list[tuple[bytes, Loc]]) -> tuple[bytes, list[bytes], int]:
    """A version 1 run, as strata wrote before checkpoint version 4: (bytes, fences, count)."""
    out = bytearray(RUN_MAGIC + bytes([1]))
    fences = []
    for first in range(0, len(entries), BLOCK_ENTRIES):
        block = b"".join(ENTRY.pack(oid, *loc) for oid, loc in entries[first:first + BLOCK_ENTRIES])
        fences.append(entries[first][0])
        out += block + blake3.blake3(block).digest()
    return bytes(out), fences, len(entries)


def RunReader(name: str, fences: list[bytes], entries: int,  # noqa: N802 - as it was
              read: Callable[[int, int], bytes]) -> PartReader:
    """A version 1 run, read as a restore reads one from an old checkpoint."""
    return PartReader(Part(name, 0, 0, entries, fences[0], b"".join(fences), version=1), read)


def test_a_checkpoint_round_trips_and_refuses_damage() -> None:
    parts = [Part("runs/a-2-0", 2, 0, 3, b"\x01" * 32, b"\x01" * 32),
             Part("runs/b-1-0", 1, 1, 5000, b"\x00" * 32, b"", 4096, b"h" * 32)]
    cp = Checkpoint(store_id=os.urandom(16), epoch=7, applied=(3, 4096),
                    volumes={"v": "ab" * 16, "w": ""},
                    refs={("v", "live"): "cd" * 32, ("v", "a/b"): "ef" * 32},
                    leases=[["v", "live", 3, 10**18, "host", b"k" * 16]],
                    packs={}, log_from=12, block_size=65536, parts=parts,
                    policies=[[b"v\0", b'{"keep_last": 2}']],
                    tables={"expired": ("tables/x-expired", b"e" * 32)},
                    pack_tables=[("tables/x-packs-0", b"p" * 32)])
    data = cp.encode()
    back = Checkpoint.decode("checkpoints/x", data)
    assert (back.parts, back.tables, back.pack_tables, back.refs, back.policies,
            back.name) == (parts, cp.tables, cp.pack_tables, cp.refs, cp.policies,
                           "checkpoints/x")
    body = msgpack.unpackb(data[37:])
    with pytest.raises(Corrupt, match="checkpoint version 7 .*upgrade"):
        Checkpoint.decode("checkpoints/new", frame_record(CHECKPOINT_MAGIC, 7, body))
    # Versions 4 (no merge in progress) and 5 list every part inline, and still read.
    # and one packs table, named in `tables`: read as one of the packs tables.
    v5 = {k: v for k, v in body.items() if k not in ("manifest", "pack_tables")}
    v5["parts"] = [p.to_list() for p in parts]
    v5["tables"] = {"packs": ["tables/x-packs", b"p" * 32], **v5["tables"]}
    v4 = {k: v for k, v in v5.items() if k != "merge"}
    for version, old in ((4, v4), (5, v5)):
        back = Checkpoint.decode("checkpoints/old", frame_record(CHECKPOINT_MAGIC, version, old))
        assert (back.parts, back.tables, back.pack_tables) == (
            parts, cp.tables, [("tables/x-packs", b"p" * 32)])
    cp.merge = Merge(3, 0, [2, 1], b"\x00" * 31 + b"\x07", drop=True)
    assert Checkpoint.decode("checkpoints/m", cp.encode()).merge == cp.merge
    cp.merge = Merge(3, 0, [2, 9], b"")  # an input the manifest does not hold
    with pytest.raises(Corrupt, match="merge in progress is described wrongly"):
        Checkpoint.decode("checkpoints/m", cp.encode())
    for bad in (data[:-1], b"STRC\x09" + data[5:], data[:40] + bytes([data[40] ^ 1]) + data[41:]):
        with pytest.raises(Corrupt, match="checkpoints/x"):
            Checkpoint.decode("checkpoints/x", bad)
    v4["parts"][0][3] = 0  # a part of no entries
    with pytest.raises(Corrupt, match="described wrongly"):
        Checkpoint.decode("checkpoints/y", frame_record(CHECKPOINT_MAGIC, 4, v4))
    body["manifest"][0][0] = 2  # neither a part nor a table
    with pytest.raises(Corrupt, match="neither a part nor a parts table"):
        Checkpoint.decode("checkpoints/z", frame_record(CHECKPOINT_MAGIC, 6, body))


def _part(run: int, i: int, level: int = 1) -> Part:
    return Part(f"runs/s-{run}-{i}", run, level, 40000, bytes([run, i]) + b"\x00" * 30, b"",
                4096, b"h" * 32)


def test_a_run_of_many_parts_is_named_by_parts_tables() -> None:
    """Version 6: a checkpoint names a few tables where it listed every part.

    Tables are cut from a run's start, so growing a run (a merge in progress)
    leaves its full tables as they were: the next checkpoint names them
    again and writes only the last one. A table read back must be the one
    named, of one run, and a merge's inputs may sit in tables.
    """
    big = [_part(9, i) for i in range(GROUP_PARTS * 2 + 3)]
    small = [_part(10, 0, level=0)]
    parts = small + big + [_part(2, 0), _part(2, 1)]
    store: dict[str, bytes] = {}

    def put(run: int, n: int, data: bytes) -> str:
        name = f"tables/c1-parts-{run}-{n}"
        store[name] = data
        return name

    manifest = group_manifest(parts, {}, put)
    tables = [i for i in manifest if not isinstance(i, Part)]
    assert [i for i in manifest if isinstance(i, Part)] == small + parts[-2:]  # inline
    assert len(tables) == 3 and len(store) == 3
    cp = Checkpoint(store_id=os.urandom(16), epoch=1, applied=(1, 0), volumes={}, refs={},
                    leases=[], packs={}, parts=parts, manifest=manifest,
                    merge=Merge(11, 1, [9, 2], b""),
                    tables={"expired": ("tables/x-expired", b"e" * 32)})
    data = cp.encode()
    assert len(data) < 1000 + 150 * 3  # the 35 parts are not listed
    back = Checkpoint.decode("checkpoints/c1", data)
    assert back.part_tables == tables and back.merge is not None
    packs = encode_table("packs", [])
    expired = encode_table("expired", b"")
    objects = {**store, "tables/x-packs": packs, "tables/x-expired": expired}
    back.tables = {"expired": ("tables/x-expired", blake3.blake3(expired).digest())}
    back.pack_tables = [("tables/x-packs", blake3.blake3(packs).digest())]
    back.load_tables(objects.__getitem__)
    assert back.parts == parts and back.merge == cp.merge
    # The run grows by a part: only its last table is new.
    grown = small + big + [_part(9, len(big))] + parts[-2:]

    def put2(run: int, n: int, data: bytes) -> str:
        store[f"tables/c2-parts-{run}-{n}"] = data
        return f"tables/c2-parts-{run}-{n}"

    again = group_manifest(grown, {h: (n, h) for n, h in tables}, put2)
    assert [i for i in again if not isinstance(i, Part)][:2] == tables[:2]
    assert sorted(store) == sorted([*(n for n, _h in tables), "tables/c2-parts-9-2"])
    # A table that is not the one named, or holds parts of two runs, is refused.
    for name, data in (
            (tables[0][0], store[tables[1][0]]),
            (tables[0][0], encode_table("parts", [p.to_list() for p in parts[:3]]))):
        forged = dict(objects, **{name: data})
        back = Checkpoint.decode("checkpoints/c1", cp.encode())
        back.tables = {"expired": ("tables/x-expired", blake3.blake3(expired).digest())}
        if data != store[tables[1][0]]:  # named with its own digest: the content is judged
            back.manifest = [(name, blake3.blake3(data).digest()) if i == tables[0] else i
                             for i in back.manifest or ()]
        with pytest.raises(Corrupt, match=r"parts table is not the one the checkpoint names"
                                          r"|more than one run"):
            back.load_tables(forged.__getitem__)


def test_the_packs_table_is_cut_by_pack_number() -> None:
    """Version 6: a new pack changes only the last packs table, a removed one only its own."""
    packs = {n: (f"packs/{n:08x}-0-aa.pack", 1000 + n) for n in range(1, 3 * PACKS_PER_TABLE)}
    store: dict[str, bytes] = {}

    def put(k: int, data: bytes) -> str:
        name = f"tables/c{len(store)}-packs-{k}"
        store[name] = data
        return name

    first = group_packs(packs, {}, put)
    assert len(first) == 3
    have = {h: (n, h) for n, h in first}
    packs[3 * PACKS_PER_TABLE] = ("packs/new.pack", 5)   # table 3, new
    del packs[PACKS_PER_TABLE + 7]                        # table 1 changes
    second = group_packs(packs, have, put)
    assert second[0] == first[0] and second[2] == first[2]
    assert second[1] != first[1] and len(second) == 4 and len(store) == 5
    cp = Checkpoint(store_id=os.urandom(16), epoch=1, applied=(1, 0), volumes={}, refs={},
                    leases=[], packs={}, tables={}, pack_tables=second)
    expired = encode_table("expired", b"")
    objects = {**store, "tables/e": expired}
    cp.tables = {"expired": ("tables/e", blake3.blake3(expired).digest())}
    back = Checkpoint.decode("checkpoints/p", cp.encode())
    with pytest.raises(Corrupt, match="checkpoint fields are malformed"):
        Checkpoint.decode("checkpoints/p", frame_record(CHECKPOINT_MAGIC, 6, {
            **msgpack.unpackb(cp.encode()[37:]), "pack_tables": [["t", b"short"]]}))
    back.load_tables(objects.__getitem__)
    assert back.packs == packs
    # A pack in two tables is refused.
    twice = dict(objects, **{second[0][0]: store[second[1][0]]})
    back.pack_tables = [second[1], (second[0][0], second[1][1])]
    with pytest.raises(Corrupt, match="a pack is in two packs tables"):
        back.load_tables(twice.__getitem__)


def test_a_version_3_checkpoint_reads_as_one_run() -> None:
    """Checkpoints before runs: the whole index in one run, fences and tables inline."""
    entries = _entries(3000)
    _run, fences, count = encode_run(entries)
    body = {"v": 3, "store_id": os.urandom(16), "epoch": 7, "applied": [3, 4096],
            "volumes": {"v": ""}, "refs": [["v", "live", b"\xcd" * 32]], "leases": [],
            "packs": [[1, "packs/00000001-aa.pack", 900]], "log_from": 12,
            "block_size": 65536, "run": "runs/x", "fences": b"".join(fences),
            "entries": count, "expired": b"x" * 32, "policies": []}
    cp = Checkpoint.decode("checkpoints/old", frame_record(CHECKPOINT_MAGIC, 3, body))
    assert cp.packs == {1: ("packs/00000001-aa.pack", 900)} and cp.expired == [b"x" * 32]
    (part,) = cp.parts
    assert (part.name, part.entries, part.version, len(part.fences)) == (
        "runs/x", 3000, 1, 32 * len(fences))
    del body["policies"]
    body["v"] = 2  # before policies were journaled: none
    assert Checkpoint.decode("checkpoints/v2", frame_record(CHECKPOINT_MAGIC, 2, body)
                             ).policies == []


def test_parts_keep_tombstones_and_runs_merge_newest_first(tmp_path: Path) -> None:
    bucket = Bucket(f"file://{tmp_path}/b")
    old = _entries(3 * BLOCK_ENTRIES + 5)
    gone = {oid for oid, _l in old[::7]}
    moved = {oid: Loc(99, 1, 2, 3) for oid, _l in old[1::5] if oid not in gone}
    newer = sorted([(oid, None) for oid in gone] + list(moved.items()))
    readers = []
    for name, entries in (("runs/new", newer), ("runs/old", old)):
        data, fences, at = encode_part(entries)  # type: ignore[arg-type]
        bucket.put(name, data)
        part = Part(name, 1, 0, len(entries), entries[0][0], b"", at,
                    blake3.blake3(fences).digest())
        readers.append(PartReader(part, lambda s, e, n=name: bucket.get_range(n, s, e)))
    got = dict(merged([[readers[0]], [readers[1]]]))
    want = {oid: (None if oid in gone else moved.get(oid, loc)) for oid, loc in old}
    assert got == want
    assert readers[0].lookup(next(iter(gone)))[:2] == (True, None)  # a tombstone
    assert readers[1].lookup(os.urandom(32))[0] is False
    data, fences, at = encode_part(old)  # type: ignore[arg-type]
    bucket.put("runs/bad", data)
    bad = Part("runs/bad", 1, 0, len(old), old[0][0], b"", at, b"\0" * 32)
    with pytest.raises(Corrupt, match="fence table"):
        PartReader(bad, lambda s, e: bucket.get_range("runs/bad", s, e)).lookup(old[0][0])


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
        found, got, block = reader.lookup(oid)
        assert found and got == loc and len(reads) == 1 and (oid, loc) in block
    for _ in range(50):
        reads.clear()
        assert reader.lookup(os.urandom(32))[0] is False and len(reads) <= 1


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
    assert reader.lookup(entries[-1][0])[1] == entries[-1][1]  # block 1 is intact
