"""Checkpoints: what a new owner needs to serve a store from its bucket, read lazily.

A checkpoint names a journal position P: every record before P is in sealed
packs that are in the bucket, and its tables hold what replaying them gives
(refs, volumes, leases, and the object index). The object index can be
large, so it is not in the checkpoint object itself but in an index run: a
sorted table of (object id, location) cut into fixed blocks, with the first
id of each block (the fences) kept in the checkpoint. A restore downloads
the checkpoint alone; a lookup bisects the fences and fetches one block
with a ranged GET. The fences cost 32 bytes per 1,024 objects, so a store
ten times larger restores in about the same time.

Formats (docs/format.md, "The bucket"): a checkpoint is a record framed as
the log's are ("STRC" magic); an index run is "STRI", a version byte, then
blocks of `BLOCK_ENTRIES` entries of 49 bytes (id, then the LMDB location
layout `<IQIB`), each block followed by its BLAKE3-256 (so a ranged GET of
one block is verified alone).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import blake3

from strata.engine.bucket import frame_record, open_record
from strata.engine.errors import Corrupt
from strata.engine.index import Loc

CHECKPOINT_MAGIC = b"STRC"
CHECKPOINT_VERSION = 3           # 3: `policies`; 2: `expired`, the snapshots GC removed
CHECKPOINT_VERSIONS = (1, 2, 3)  # what this strata reads
RUN_MAGIC = b"STRI"
RUN_VERSION = 1
RUN_HEAD = 5
ENTRY = struct.Struct("<32sIQIB")  # id, pack number, frame offset, frame length, kind
BLOCK_ENTRIES = 1024
BLOCK_BYTES = BLOCK_ENTRIES * ENTRY.size + 32  # a full block and its hash


@dataclass(slots=True)
class Checkpoint:
    """The tables at journal position `applied`, and where the rest lives."""

    store_id: bytes
    epoch: int
    applied: tuple[int, int]
    volumes: dict[str, str]                      # name -> volume id
    refs: dict[tuple[str, str], str]             # (volume, branch) -> snapshot id
    leases: list[list[Any]]                      # the leases table's rows
    packs: dict[int, tuple[str, int]]            # sealed pack -> (bucket name, size)
    log_from: int = 0                            # first log record holding other packs' bytes
    block_size: int = 0
    run: str = ""                                # bucket name of the index run
    fences: list[bytes] = field(default_factory=list)
    entries: int = 0
    expired: list[bytes] = field(default_factory=list)  # snapshot ids GC removed
    policies: list[list[bytes]] = field(default_factory=list)  # the policies table's rows

    def encode(self) -> bytes:
        return frame_record(CHECKPOINT_MAGIC, CHECKPOINT_VERSION, {
            "v": CHECKPOINT_VERSION, "store_id": self.store_id, "epoch": self.epoch,
            "applied": list(self.applied), "volumes": self.volumes,
            "refs": [[v, b, bytes.fromhex(s)] for (v, b), s in sorted(self.refs.items())],
            "leases": self.leases,
            "packs": [[n, name, size] for n, (name, size) in sorted(self.packs.items())],
            "log_from": self.log_from, "block_size": self.block_size,
            "run": self.run, "fences": b"".join(self.fences), "entries": self.entries,
            "expired": b"".join(self.expired), "policies": self.policies})

    @classmethod
    def decode(cls, name: str, data: bytes) -> Checkpoint:
        b = open_record(name, data, CHECKPOINT_MAGIC, CHECKPOINT_VERSIONS, "checkpoint")
        try:
            fences = bytes(b["fences"])
            expired = bytes(b.get("expired", b""))
            if len(fences) % 32 or len(expired) % 32:
                raise ValueError("fences or expired are not 32-byte ids")
            return cls(
                store_id=bytes(b["store_id"]), epoch=int(b["epoch"]),
                applied=(int(b["applied"][0]), int(b["applied"][1])),
                volumes={str(k): str(v) for k, v in b["volumes"].items()},
                refs={(str(v), str(br)): bytes(s).hex() for v, br, s in b["refs"]},
                leases=list(b["leases"]),
                packs={int(n): (str(p), int(z)) for n, p, z in b["packs"]},
                log_from=int(b["log_from"]), block_size=int(b["block_size"]),
                run=str(b["run"]), entries=int(b["entries"]),
                fences=[fences[i:i + 32] for i in range(0, len(fences), 32)],
                expired=[expired[i:i + 32] for i in range(0, len(expired), 32)],
                policies=[[bytes(k), bytes(v)] for k, v in b.get("policies", [])])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise Corrupt(name, 0, f"checkpoint fields are malformed: {exc}") from None


def encode_run(entries: Iterable[tuple[bytes, Loc]]) -> tuple[bytes, list[bytes], int]:
    """An index run from entries sorted by id: (bytes, fences, entry count)."""
    out = bytearray(RUN_MAGIC + bytes([RUN_VERSION]))
    fences: list[bytes] = []
    block = bytearray()
    count = 0
    for oid, loc in entries:
        if count % BLOCK_ENTRIES == 0:
            if block:
                out += block + blake3.blake3(block).digest()
                block = bytearray()
            fences.append(oid)
        block += ENTRY.pack(oid, *loc)
        count += 1
    if block:
        out += block + blake3.blake3(block).digest()
    return bytes(out), fences, count


class RunReader:
    """Lookups in an index run, one verified block per ranged read."""

    def __init__(self, name: str, fences: list[bytes], entries: int,
                 read_range: Callable[[int, int], bytes]) -> None:
        self.name = name
        self.fences = fences
        self.entries = entries
        self._read = read_range

    def block_of(self, oid: bytes) -> int | None:
        i = bisect.bisect_right(self.fences, oid) - 1
        return i if i >= 0 else None

    def read_block(self, i: int) -> list[tuple[bytes, Loc]]:
        """Every entry of block `i` (a caller caches them all: neighbours come next)."""
        n = min(BLOCK_ENTRIES, self.entries - i * BLOCK_ENTRIES)
        start = RUN_HEAD + i * BLOCK_BYTES
        return self._decode_block(i, start, self._read(start, start + n * ENTRY.size + 32), n)

    def read_all(self, blocks_per_read: int = 64) -> Iterator[list[tuple[bytes, Loc]]]:
        """Every entry, a verified block at a time, `blocks_per_read` blocks per ranged read."""
        nblocks = -(-self.entries // BLOCK_ENTRIES)
        for first in range(0, nblocks, blocks_per_read):
            last = min(first + blocks_per_read, nblocks)
            start = RUN_HEAD + first * BLOCK_BYTES
            n_last = self.entries - (last - 1) * BLOCK_ENTRIES
            end = RUN_HEAD + (last - 1) * BLOCK_BYTES + min(n_last, BLOCK_ENTRIES) * ENTRY.size + 32
            data = self._read(start, end)
            for i in range(first, last):
                at = (i - first) * BLOCK_BYTES
                n = min(BLOCK_ENTRIES, self.entries - i * BLOCK_ENTRIES)
                yield self._decode_block(i, RUN_HEAD + i * BLOCK_BYTES,
                                         data[at:at + n * ENTRY.size + 32], n)

    def _decode_block(self, i: int, start: int, data: bytes, n: int
                      ) -> list[tuple[bytes, Loc]]:
        body, digest = data[:-32], data[-32:]
        if len(body) != n * ENTRY.size or blake3.blake3(body).digest() != digest:
            raise Corrupt(self.name, start, f"index block {i} is damaged or short")
        out = []
        for k in range(n):
            oid, pack, offset, length, kind = ENTRY.unpack_from(body, k * ENTRY.size)
            out.append((oid, Loc(pack, offset, length, kind)))
        return out

    def lookup(self, oid: bytes) -> tuple[Loc | None, list[tuple[bytes, Loc]]]:
        """Where `oid` is (None: not in this run), and the block read to find it."""
        i = self.block_of(oid)
        if i is None:
            return None, []
        block = self.read_block(i)
        ids = [e[0] for e in block]
        j = bisect.bisect_left(ids, oid)
        if j < len(ids) and ids[j] == oid:
            return block[j][1], block
        return None, block
