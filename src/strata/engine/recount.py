"""Recounting the GC accounting in place, so that a restored store's passes are incremental.

The accounting (docs/design.md "GC accounting") is exact only for an index
that saw every node's frame as it was indexed. A restored store's index
copies its entries from a checkpoint's runs, which carry no counts, so until
now its passes marked in full for good. A recount makes it exact again
without replaying the packs:

1. One read transaction R of the index hands over every indexed node (into a
   scratch table ordered by pack and offset) and every count R holds (into a
   second one, as negative deltas).
2. Each node's frame is read in pack order (a bucket-only pack: one ranged GET
   per window of nodes) and checked against its id; each distinct id it
   names adds one.
3. Each id's sum is its count as R's nodes name it less the count R held, so
   adding it to the live count gives the right count whatever the indexer
   counted since R (nodes indexed after R count their own names; GC does not
   run meanwhile: the caller holds its lock). Then `packbytes` likewise, and
   `zero` is derived again.

A token noted before R and removed by anything that makes the accounting
inexact decides at the end whether it is exact. Memory: two scratch tables
(about 35 MiB each) and a dict of bytes per pack.
"""

from __future__ import annotations

import itertools
import os
import struct
import time
from collections.abc import Iterator
from typing import Any

from strata.engine.errors import Corrupt, NotFound
from strata.engine.index import Index, Loc
from strata.engine.packstore import PackStore
from strata.engine.recovery import frame_refs
from strata.engine.scratch import Scratch

ADJUST_BATCH = 4_096           # count corrections written in one index transaction
FAILED = b"gc-recount-failed"  # meta key: why the last recount could not finish (read once)
_AT = struct.Struct(">IQ")     # pack number, offset: a node's key, in reading order
_NODE = struct.Struct("<IB")   # frame length, kind (after the 32-byte id)
_SEQ = struct.Struct(">Q")     # makes each (id, delta) entry a key of its own
_DELTA = struct.Struct("<q")


def recount(index: Index, packs: PackStore, store_dir: str) -> dict[str, Any]:
    """Make the accounting exact again; a report of what it read and whether it finished.

    The caller holds GC's lock and the index holds every object (no restore's
    copy-in under way). A frame that cannot be read or is not the object its
    entry names leaves the accounting inexact, noted under `FAILED` so that
    later passes do not read everything again for the same end.
    """
    t0 = time.monotonic()
    token = os.urandom(16)
    out: dict[str, Any] = {"nodes": 0, "exact": False, "why": None}
    seq = itertools.count()
    with Scratch(store_dir, "recount-nodes") as nodes, \
            Scratch(store_dir, "recount-deltas") as deltas:
        def take_node(oid: bytes, loc: Loc) -> None:
            nodes.put(_AT.pack(loc.pack, loc.offset), oid + _NODE.pack(loc.length, loc.kind))

        def take_count(oid: bytes, n: int) -> None:
            deltas.put(oid + _SEQ.pack(next(seq)), _DELTA.pack(-n))

        per_pack, table = index.recount_view(token, take_node, take_count)
        refs_of = frame_refs(packs)  # what the indexer reads as it counts: checked frames
        try:
            for key, val in nodes.items():
                oid, loc = val[:32], Loc(*_AT.unpack(key), *_NODE.unpack_from(val, 32))
                kids = refs_of(oid, loc)
                if kids is None:
                    raise Corrupt(packs.label(loc.pack), loc.offset,
                                  f"the frame of node {oid.hex()} is damaged or another object")
                for kid in dict.fromkeys(kids):
                    deltas.put(kid + _SEQ.pack(next(seq)), _DELTA.pack(1))
                out["nodes"] += 1
        except (Corrupt, NotFound) as exc:
            out["why"] = f"a node could not be read: {exc}"
            index.put_meta(FAILED, out["why"].encode())
            index.uncount()
            out["seconds"] = round(time.monotonic() - t0, 3)
            return out
        batch: list[tuple[bytes, int]] = []
        for oid, by in _sums(deltas.items()):
            batch.append((oid, by))
            if len(batch) >= ADJUST_BATCH:
                index.adjust_counts(batch)
                batch = []
        index.adjust_counts(batch)
    index.adjust_packbytes({p: per_pack.get(p, 0) - table.get(p, 0)
                            for p in per_pack.keys() | table.keys()})
    index.rederive_zero()
    out["exact"] = index.finish_recount(token)
    if not out["exact"]:
        out["why"] = "the accounting was found inexact meanwhile"
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _sums(entries: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, int]]:
    """(id, sum of its deltas) from entries keyed id + sequence, in id order; zero sums skipped."""
    cur, total = b"", 0
    for key, val in entries:
        oid = key[:32]
        if oid != cur:
            if total:
                yield cur, total
            cur, total = oid, 0
        total += _DELTA.unpack(val)[0]
    if total:
        yield cur, total
