"""Checkpoints: what a new owner needs to serve a store from its bucket, read lazily.

A checkpoint names a journal position P: every record before P is in sealed
packs that are in the bucket, and its tables hold what replaying them gives
(refs, volumes, leases, and the object index). The object index can be
large, so it is not in the checkpoint object itself but in index runs: sorted
tables of (object id, location) cut into fixed blocks, each block verified
alone. A lookup bisects a run's fences (the first id of each block) and
fetches one block with a ranged GET.

Since checkpoint version 4 the index is an LSM of runs (the checkpoint's
`parts` are its manifest). Each checkpoint adds a small run of what changed
since the one before: objects indexed, moved or dropped (a tombstone). Runs
are merged in the background, tiered: when `FANOUT` runs share a level they
become one run of the next level, so an entry is rewritten about once per
level, log_FANOUT(objects / change) times in all. Since version 5 a merge may
span checkpoints: each does a bounded share of it (`MERGE_FLOOR`, `MERGE_RATE`)
and names what is left (`Merge`), so no one checkpoint rewrites most of the
index (docs/design.md, "Merge pacing"). A run is cut into parts of
at most `PART_ENTRIES` entries, so a merge holds one part's bytes in memory, not a
run. The packs table and the expired snapshots are objects of their own,
written only when they change. Since version 6 the manifest itself is no
longer listed whole: a run of more than `INLINE_RUN_PARTS` parts is named by
parts tables of `GROUP_PARTS` parts each, objects of their own too, so a
checkpoint names a few tables where it listed every part (a 10M-object store
has hundreds), and writes only the table whose parts changed (a merge in
progress adds parts to its last one). The packs table is cut the same way,
into tables of `PACKS_PER_TABLE` pack numbers each: a new pack changes only
the last, a pack GC removed only its own. So the bytes a checkpoint writes
grow with the change, not with the store.

Formats (docs/format.md, "The bucket"): a checkpoint is a record framed as
the log's are ("STRC" magic); a part is "STRI", a version byte, then blocks
of `BLOCK_ENTRIES` entries of 49 bytes (id, then the LMDB location layout
`<IQIB`; kind 0 is a tombstone), each block followed by its BLAKE3-256, and
(version 2) the fence table with its own BLAKE3-256; a table object is
"STRT".
"""

from __future__ import annotations

import bisect
import heapq
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import blake3

from strata.engine.bucket import frame_record, open_record
from strata.engine.errors import Corrupt
from strata.engine.index import Loc

CHECKPOINT_MAGIC = b"STRC"
# 6: the manifest names parts tables, the packs table is cut by pack number; 5: a merge
# in progress (`merge`); 4: runs (the manifest), tables apart; 3: `policies`; 2: `expired`
CHECKPOINT_VERSION = 6
CHECKPOINT_VERSIONS = (1, 2, 3, 4, 5, 6)  # what this strata reads
RUN_MAGIC = b"STRI"
RUN_VERSION = 2          # 2: tombstones, and the fence table at the end
RUN_VERSIONS = (1, 2)
RUN_HEAD = 5
TABLE_MAGIC = b"STRT"
TABLE_VERSION = 1
ENTRY = struct.Struct("<32sIQIB")  # id, pack number, frame offset, frame length, kind
BLOCK_ENTRIES = 1024
BLOCK_BYTES = BLOCK_ENTRIES * ENTRY.size + 32  # a full block and its hash
TOMBSTONE = 0            # an entry's kind: the object left the index
PART_ENTRIES = 256 * BLOCK_ENTRIES  # a part's most entries: 12.6 MB, what a merge holds
INLINE_FENCES = 16       # parts with at most this many blocks carry their fences inline
FANOUT = 8               # runs of one level merged into one of the next
# A checkpoint merges at most max(MERGE_FLOOR, MERGE_RATE x its own entries) entries
# (docs/design.md, "Index runs"): the floor keeps merges ahead of the incoming rate, and
# cuts a merged run into parts of 32 blocks, so their fences are not inline in the
# manifest (1M objects: about 31 parts of 150 bytes each in every checkpoint).
MERGE_FLOOR = 32 * BLOCK_ENTRIES
MERGE_RATE = 4
# A level that collects this many runs while another level's merge is in progress
# lifts the bound: that merge finishes in this checkpoint, so lookups stay bounded.
MERGE_BACKLOG = 2 * FANOUT
# Version 6: a run of more than INLINE_RUN_PARTS parts (a checkpoint's own delta is
# one) is listed in parts tables of GROUP_PARTS parts each, so a checkpoint names a
# table (about 70 bytes) where it listed parts (about 150 bytes each), and a run's
# tables are written once: only a merge in progress rewrites its last table, at most
# GROUP_PARTS parts (2.4 KB), whatever the store's size.
INLINE_RUN_PARTS = 2
GROUP_PARTS = 16
# And the packs table (since version 6) is cut into tables of PACKS_PER_TABLE pack
# numbers each (numbers n with n // PACKS_PER_TABLE = k go to table k): packs are
# numbered in order, so a new pack changes only the last table.
PACKS_PER_TABLE = 256
TableRef = tuple[str, bytes]  # a table object's name and BLAKE3-256


@dataclass(frozen=True, slots=True)
class Part:
    """One object of an index run, as the checkpoint names it.

    Parts of one run (`run`) hold disjoint, ascending id ranges; a run's
    parts are listed in id order, and runs newest first, so the first run
    that has an id decides where it is (or, with a tombstone, that it is gone).
    """

    name: str
    run: int                  # run id, unique in the store's history of checkpoints
    level: int                # 0 for a checkpoint's own changes; a merge adds one
    entries: int
    first: bytes              # the part's first id
    fences: bytes = b""       # its fences, when it has at most INLINE_FENCES blocks
    fences_at: int = 0        # else: where the fence table starts in the object
    fences_hash: bytes = b""  # and that table's BLAKE3-256
    version: int = RUN_VERSION

    @property
    def blocks(self) -> int:
        return -(-self.entries // BLOCK_ENTRIES)

    def to_list(self) -> list[Any]:
        return [self.name, self.run, self.level, self.entries, self.first, self.fences,
                self.fences_at, self.fences_hash, self.version]

    @classmethod
    def from_list(cls, raw: list[Any]) -> Part:
        name, run, level, entries, first, fences, at, digest, version = raw
        part = cls(str(name), int(run), int(level), int(entries), bytes(first), bytes(fences),
                   int(at), bytes(digest), int(version))
        if (part.version not in RUN_VERSIONS or len(part.first) != 32 or part.entries <= 0
                or len(part.fences) % 32 or part.level < 0
                or (not part.fences and len(part.fences_hash) != 32)
                or (part.fences and len(part.fences) != 32 * part.blocks)):
            raise ValueError(f"index part {part.name!r} is described wrongly")
        return part


@dataclass(slots=True)
class Merge:
    """A merge in progress (checkpoint version 5): runs `inputs` into run `out`.

    `out` holds the merged entries of every id up to and including `after`, and
    sits in the manifest just before its inputs, which stay whole until the merge
    ends. A lookup reads runs newest first, so ids up to `after` are answered by
    `out` (or, for a tombstone it dropped, by the inputs' own tombstone), and
    later ids by the inputs, as before the merge began.
    """

    out: int                  # the output run's id
    level: int                # the inputs' level; `out` is one above it
    inputs: list[int]         # the input runs' ids, newest first, adjacent in the manifest
    after: bytes = b""        # the last id merged (b"": none yet)
    drop: bool = False        # the inputs include the oldest run: tombstones go

    def to_list(self) -> list[Any]:
        return [self.out, self.level, self.inputs, self.after, self.drop]

    @classmethod
    def from_list(cls, raw: list[Any], parts: list[Part] | None) -> Merge:
        """The merge `raw` describes, among the runs of `parts` (None: not known yet)."""
        out, level, inputs, after, drop = raw
        merge = cls(int(out), int(level), [int(r) for r in inputs], bytes(after), bool(drop))
        runs = [r[0].run for r in runs_of(parts)] if parts is not None else merge.inputs
        if (len(merge.after) not in (0, 32) or len(merge.inputs) < 2
                or any(r not in runs for r in merge.inputs)):
            raise ValueError("the merge in progress is described wrongly")
        return merge


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
    parts: list[Part] = field(default_factory=list)  # the object index: runs, newest first
    expired: list[bytes] = field(default_factory=list)  # snapshot ids GC removed
    policies: list[list[bytes]] = field(default_factory=list)  # the policies table's rows
    # Version 4: the packs table and the expired snapshots are objects of their own
    # (name, BLAKE3-256), shared by checkpoints until they change; `load_tables` reads them.
    # Since version 6, `tables` holds only "expired", and the packs table is cut into
    # `pack_tables` (a version 4 or 5 checkpoint's one packs table is read as one).
    tables: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    pack_tables: list[TableRef] = field(default_factory=list)
    merge: Merge | None = None                   # version 5: a merge in progress
    # Version 6: the manifest as encoded, in order: parts, and parts tables standing
    # for GROUP_PARTS parts each (see `group_manifest`); `load_tables` resolves the
    # tables into `parts`. None when encoding: every part is listed.
    manifest: list[Part | TableRef] | None = None
    name: str = ""                               # its bucket name (not encoded)
    version: int = CHECKPOINT_VERSION            # what it was read as
    raw: bytes = b""                             # the bytes it was read from

    def encode(self) -> bytes:
        if set(self.tables) != {"expired"}:
            raise ValueError("a checkpoint names its expired table (and its packs tables)")
        return frame_record(CHECKPOINT_MAGIC, CHECKPOINT_VERSION, {
            "v": CHECKPOINT_VERSION, "store_id": self.store_id, "epoch": self.epoch,
            "applied": list(self.applied), "volumes": self.volumes,
            "refs": [[v, b, bytes.fromhex(s)] for (v, b), s in sorted(self.refs.items())],
            "leases": self.leases, "log_from": self.log_from, "block_size": self.block_size,
            "manifest": [[0, i.to_list()] if isinstance(i, Part) else [1, i[0], i[1]]
                         for i in (self.parts if self.manifest is None else self.manifest)],
            "policies": self.policies,
            "tables": {k: [n, h] for k, (n, h) in sorted(self.tables.items())},
            "pack_tables": [[n, h] for n, h in self.pack_tables],
            "merge": self.merge.to_list() if self.merge is not None else None})

    @property
    def part_tables(self) -> list[TableRef]:
        """The parts tables this checkpoint names (version 6)."""
        return [i for i in self.manifest or () if not isinstance(i, Part)]

    @classmethod
    def decode(cls, name: str, data: bytes) -> Checkpoint:
        b = open_record(name, data, CHECKPOINT_MAGIC, CHECKPOINT_VERSIONS, "checkpoint")
        version = data[4]
        try:
            cp = cls(
                store_id=bytes(b["store_id"]), epoch=int(b["epoch"]),
                applied=(int(b["applied"][0]), int(b["applied"][1])),
                volumes={str(k): str(v) for k, v in b["volumes"].items()},
                refs={(str(v), str(br)): bytes(s).hex() for v, br, s in b["refs"]},
                leases=list(b["leases"]), packs={},
                log_from=int(b["log_from"]), block_size=int(b["block_size"]),
                policies=[[bytes(k), bytes(v)] for k, v in b.get("policies", [])],
                name=name, version=version, raw=data)
            if version >= 4:
                if version >= 6:
                    cp.manifest = [_manifest_item(list(i)) for i in b["manifest"]]
                    cp.parts = [i for i in cp.manifest if isinstance(i, Part)]
                else:
                    cp.parts = [Part.from_list(list(p)) for p in b["parts"]]
                cp.tables = {str(k): (str(v[0]), bytes(v[1])) for k, v in b["tables"].items()}
                if version >= 6:
                    cp.pack_tables = [_ref(r) for r in b["pack_tables"]]
                    if set(cp.tables) != {"expired"}:
                        raise ValueError("tables are not the expired table")
                else:
                    if set(cp.tables) != {"packs", "expired"}:
                        raise ValueError("tables are not packs and expired")
                    cp.pack_tables = [cp.tables.pop("packs")]
                if version >= 5 and b["merge"] is not None:  # checked again once loaded
                    cp.merge = Merge.from_list(list(b["merge"]),
                                               None if cp.part_tables else cp.parts)
                return cp
            cp.packs = _packs_of(b["packs"])
            cp.expired = _ids(bytes(b.get("expired", b"")))
            fences = bytes(b["fences"])
            if len(fences) % 32:
                raise ValueError("fences are not 32-byte ids")
            entries = int(b["entries"])
            if b["run"] and entries:  # the whole index as one run (version 1 parts)
                cp.parts = [Part(str(b["run"]), 0, 0, entries, fences[:32], fences,
                                 version=1)]
                if -(-entries // BLOCK_ENTRIES) * 32 != len(fences):
                    raise ValueError("fences do not match the entries")
            return cp
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise Corrupt(name, 0, f"checkpoint fields are malformed: {exc}") from None

    def load_tables(self, get: Callable[[str], bytes]) -> None:
        """Read a version 4 checkpoint's tables (`get`: a bucket GET).

        Those are the packs tables, expired, and (version 6) the parts tables
        of its manifest, into `parts`: 8 GETs in flight.
        """
        if self.version < 4:
            return
        refs = [*((r, "parts") for r in self.part_tables),
                *((r, "packs") for r in self.pack_tables),
                (self.tables["expired"], "expired")]
        with ThreadPoolExecutor(min(8, len(refs))) as pool:
            got = list(pool.map(lambda rk: read_table(rk[0], rk[1], get), refs))
        tables = len(self.part_tables)  # read first, then the packs tables, then expired
        rows = dict(zip(self.part_tables, got[:tables], strict=True))
        self.packs = {}
        try:
            for some in map(_packs_of, got[tables:-1]):
                if some.keys() & self.packs.keys():
                    raise ValueError("a pack is in two packs tables")
                self.packs.update(some)
            self.expired = _ids(bytes(got[-1]))
        except (TypeError, ValueError, IndexError) as exc:
            raise Corrupt(self.name, 0, f"a packs or expired table is malformed: {exc}"
                          ) from None
        if self.part_tables:
            try:
                self.parts = [p for i in self.manifest or () for p in (
                    [i] if isinstance(i, Part) else _parts_of(rows[i]))]
                if self.merge is not None:  # its runs are known only now
                    self.merge = Merge.from_list(self.merge.to_list(), self.parts)
            except (TypeError, ValueError, IndexError) as exc:
                raise Corrupt(self.name, 0, f"a parts table is malformed: {exc}") from None


def _manifest_item(raw: list[Any]) -> Part | TableRef:
    if raw[0] == 0 and len(raw) == 2:
        return Part.from_list(list(raw[1]))
    if raw[0] == 1 and len(raw) == 3 and len(bytes(raw[2])) == 32:
        return str(raw[1]), bytes(raw[2])
    raise ValueError("a manifest item is neither a part nor a parts table")


def _ref(raw: Any) -> TableRef:
    name, digest = raw
    if len(bytes(digest)) != 32:
        raise ValueError("a table's hash is not 32 bytes")
    return str(name), bytes(digest)


def group_packs(packs: dict[int, tuple[str, int]], have: dict[bytes, TableRef],
                put: Callable[[int, bytes], str]) -> list[TableRef]:
    """The version 6 packs tables of `packs`: `PACKS_PER_TABLE` pack numbers each.

    A table whose bytes `have` holds (by BLAKE3-256) is named again; else
    `put(k, bytes)` stores table k and returns its name.
    """
    cut: dict[int, dict[int, tuple[str, int]]] = {}
    for n, where in packs.items():
        cut.setdefault(n // PACKS_PER_TABLE, {})[n] = where
    return [table_ref("packs", packs_rows(cut[k]), have, partial(put, k)) for k in sorted(cut)]


def _parts_of(rows: Any) -> list[Part]:
    parts = [Part.from_list(list(r)) for r in rows]
    if not 0 < len(parts) <= GROUP_PARTS or len({p.run for p in parts}) != 1:
        raise ValueError(f"a parts table holds {len(parts)} part(s) of more than one run, "
                         f"or none, or over {GROUP_PARTS}")
    return parts


def group_manifest(parts: list[Part], have: dict[bytes, TableRef],
                   put: Callable[[int, int, bytes], str]) -> list[Part | TableRef]:
    """The version 6 manifest of `parts`: runs of many parts listed in parts tables.

    A run of more than INLINE_RUN_PARTS parts is cut into tables of GROUP_PARTS
    parts from its start, so a run's tables stay the same as it grows (a merge
    in progress) but for its last. A table whose bytes `have` holds (by
    BLAKE3-256) is named again; else `put(run, n, bytes)` stores the run's
    n-th table and returns its name.
    """
    out: list[Part | TableRef] = []
    for run in runs_of(parts):
        if len(run) <= INLINE_RUN_PARTS:
            out.extend(run)
            continue
        out += [table_ref("parts", [p.to_list() for p in run[i:i + GROUP_PARTS]], have,
                          partial(put, run[0].run, i // GROUP_PARTS))
                for i in range(0, len(run), GROUP_PARTS)]
    return out


def _packs_of(rows: Any) -> dict[int, tuple[str, int]]:
    return {int(n): (str(p), int(z)) for n, p, z in rows}


def _ids(raw: bytes) -> list[bytes]:
    if len(raw) % 32:
        raise ValueError("ids are not 32 bytes each")
    return [raw[i:i + 32] for i in range(0, len(raw), 32)]


def table_ref(kind: str, rows: Any, have: dict[bytes, TableRef],
              put: Callable[[bytes], str]) -> TableRef:
    """The table object of `rows`, as (name, BLAKE3-256).

    One `have` holds with these bytes (by hash) is named again; else `put`
    stores the bytes and returns the new name.
    """
    data = encode_table(kind, rows)
    digest = blake3.blake3(data).digest()
    return have.get(digest) or (put(data), digest)


def encode_table(kind: str, rows: Any) -> bytes:
    """A table object: the packs table (rows), the expired snapshots (joined ids).

    Or (version 6 checkpoints) a parts table (rows).
    """
    return frame_record(TABLE_MAGIC, TABLE_VERSION, {"kind": kind, "rows": rows})


def packs_rows(packs: dict[int, tuple[str, int]]) -> list[list[Any]]:
    return [[n, name, size] for n, (name, size) in sorted(packs.items())]


def read_table(ref: tuple[str, bytes], kind: str, get: Callable[[str], bytes]) -> Any:
    name, digest = ref
    data = get(name)
    if blake3.blake3(data).digest() != digest:
        raise Corrupt(name, 0, f"the {kind} table is not the one the checkpoint names")
    body = open_record(name, data, TABLE_MAGIC, TABLE_VERSION, "checkpoint table")
    if body.get("kind") != kind:
        raise Corrupt(name, 0, f"the table holds {body.get('kind')!r}, not {kind}")
    return body["rows"]


Entry = tuple[bytes, Loc | None]  # None: a tombstone


def encode_part(entries: list[Entry]) -> tuple[bytes, bytes, int]:
    """A version 2 part from entries sorted by id: (bytes, fence table, fences' offset)."""
    writer = PartWriter()
    for oid, loc in entries:
        writer.add(oid, loc)
    return writer.finish()


class PartWriter:
    """A version 2 part encoded as its entries come (sorted by id).

    It holds the part's bytes (49 bytes an entry: 12.6 MB for `PART_ENTRIES`),
    never the entries themselves, which as Python objects take four times that.
    """

    def __init__(self) -> None:
        self._out = bytearray(RUN_MAGIC + bytes([RUN_VERSION]))
        self._fences = bytearray()
        self._block = bytearray()
        self.entries = 0
        self.first: bytes | None = None  # the part's first id

    def add(self, oid: bytes, loc: Loc | None) -> None:
        if self.entries % BLOCK_ENTRIES == 0:
            self._end_block()
            self._fences += oid
            if self.first is None:
                self.first = oid
        self._block += ENTRY.pack(oid, *(loc if loc is not None else (0, 0, 0, TOMBSTONE)))
        self.entries += 1

    def _end_block(self) -> None:
        if self._block:
            self._out += self._block
            self._out += blake3.blake3(self._block).digest()
            self._block = bytearray()

    def finish(self) -> tuple[bytes, bytes, int]:
        """(the part's bytes, its fence table, the fences' offset)."""
        self._end_block()
        at = len(self._out)
        self._out += self._fences
        self._out += blake3.blake3(self._fences).digest()
        return bytes(self._out), bytes(self._fences), at


class PartReader:
    """Lookups in one part, one verified block per ranged read; its fences read once."""

    def __init__(self, part: Part, read_range: Callable[[int, int], bytes]) -> None:
        self.part = part
        self.name = part.name
        self.entries = part.entries
        self._read = read_range
        self._fences: list[bytes] | None = (
            [part.fences[i:i + 32] for i in range(0, len(part.fences), 32)]
            if part.fences else None)

    @property
    def fences(self) -> list[bytes]:
        if self._fences is None:
            n = self.part.blocks * 32
            raw = self._read(self.part.fences_at, self.part.fences_at + n + 32)
            if len(raw) != n + 32 or blake3.blake3(raw[:n]).digest() != raw[n:] \
                    or raw[n:] != self.part.fences_hash:
                raise Corrupt(self.name, self.part.fences_at, "index fence table is damaged")
            self._fences = [raw[i:i + 32] for i in range(0, n, 32)]
        return self._fences

    def block_of(self, oid: bytes) -> int | None:
        i = bisect.bisect_right(self.fences, oid) - 1
        return i if i >= 0 else None

    def read_block(self, i: int) -> list[Entry]:
        """Every entry of block `i` (a caller caches them all: neighbours come next)."""
        n = min(BLOCK_ENTRIES, self.entries - i * BLOCK_ENTRIES)
        start = RUN_HEAD + i * BLOCK_BYTES
        return self._decode_block(i, start, self._read(start, start + n * ENTRY.size + 32), n)

    def read_all(self, blocks_per_read: int = 64, start: int = 0) -> Iterator[list[Entry]]:
        """Every entry from block `start` on, a verified block at a time.

        `blocks_per_read` blocks come in one ranged read.
        """
        nblocks = self.part.blocks
        for first in range(start, nblocks, blocks_per_read):
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

    def _decode_block(self, i: int, start: int, data: bytes, n: int) -> list[Entry]:
        body, digest = data[:-32], data[-32:]
        if len(body) != n * ENTRY.size or blake3.blake3(body).digest() != digest:
            raise Corrupt(self.name, start, f"index block {i} is damaged or short")
        out: list[Entry] = []
        for k in range(n):
            oid, pack, offset, length, kind = ENTRY.unpack_from(body, k * ENTRY.size)
            if kind == TOMBSTONE and self.part.version >= 2:
                out.append((oid, None))
            else:
                out.append((oid, Loc(pack, offset, length, kind)))
        return out

    def lookup(self, oid: bytes) -> tuple[bool, Loc | None, list[Entry]]:
        """(whether this part has `oid`, its location or None for a tombstone, the block)."""
        i = self.block_of(oid)
        if i is None:
            return False, None, []
        block = self.read_block(i)
        return (*find_in_block(block, oid), block)


def find_in_block(block: list[Entry], oid: bytes) -> tuple[bool, Loc | None]:
    """Whether a block (sorted by id) has `oid`, and its location (None: a tombstone)."""
    j = bisect.bisect_left(block, oid, key=lambda e: e[0])
    if j < len(block) and block[j][0] == oid:
        return True, block[j][1]
    return False, None


def size_level(entries: int) -> int:
    """The level a run of `entries` gets when it is written whole (not by a merge)."""
    level = 0
    while entries > BLOCK_ENTRIES * FANOUT ** level:
        level += 1
    return level


def runs_of(parts: list[Part]) -> list[list[Part]]:
    """The manifest's parts grouped by run, newest run first, each run's parts by id."""
    out: list[list[Part]] = []
    for p in parts:
        if out and out[-1][0].run == p.run:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def merged(runs: list[list[PartReader]], after: bytes = b"") -> Iterator[Entry]:
    """Every id of `runs` (newest first) above `after` once, as the newest run that has it says.

    Parts and blocks wholly at or below `after` are not read.
    """
    def stream(rank: int, readers: list[PartReader]) -> Iterator[tuple[bytes, int, Loc | None]]:
        for j, r in enumerate(readers):
            if after and j + 1 < len(readers) and readers[j + 1].part.first <= after:
                continue  # every id of this part is below the next part's first
            start = max(r.block_of(after) or 0, 0) if after else 0
            for block in r.read_all(start=start):
                for oid, loc in block:
                    if oid > after:
                        yield oid, rank, loc

    last: bytes | None = None
    for oid, _rank, loc in heapq.merge(*(stream(i, rs) for i, rs in enumerate(runs))):
        if oid != last:  # equal ids come newest (lowest rank) first
            last = oid
            yield oid, loc
