"""Recovery: bringing the index up to the end of the packs, on open or on demand.

On open the store owns its packs and nothing appends yet, so recovery may
repair them: a pack created without its header is removed, a torn tail is
cut (docs/design.md, crash-safety rules 5 and 6). A rebuild of the index
under a running store only reads: what looks torn is reported, never cut.
What was repaired or found goes into the store's `recovery` report.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from strata.engine import pack as packfmt
from strata.engine.errors import Corrupt
from strata.engine.index import Index, Loc, RefsOf
from strata.engine.indexer import Indexer
from strata.engine.journal import Journal
from strata.engine.objects import object_id, references, unpackb
from strata.engine.packstore import PackStore

Pos = tuple[int, int]
REPLAY_BATCH = 16_384  # objects and ops replayed into the index per transaction


def open_index(path: str, packs: PackStore, report: dict[str, Any]) -> Index:
    """The index at `path` replayed up to the end of the packs, repairing them."""
    try:
        index = Index(path)
        start = index.applied()
    except Exception:  # a damaged or foreign index is rebuilt from the packs
        Index.destroy(path)
        index = Index(path)
        start = None
        report["index_rebuilt"] = True
    if start is None:  # every record goes through the accounting (a failure clears it)
        index.set_counted()
    replay(packs, index, start, report)
    return index


def frame_refs(packs: PackStore) -> RefsOf:
    """What an indexed object names, read from its frame (the GC accounting's input).

    None when the frame is not the object `oid` (bytes from the bucket are
    hashed, as reads hash them) or does not decode.
    """
    def refs_of(oid: bytes, loc: Loc) -> list[bytes] | None:
        name = packfmt.pack_name(loc.pack)
        try:
            kind, stored, raw = packfmt.decode_object(
                packs.pread(loc.pack, loc.length, loc.offset), packs.info(loc.pack).sync,
                name, loc.offset)
            if stored != oid or (packs.verify_reads(loc.pack) and object_id(kind, raw) != oid):
                return None
            return [o for _k, o in references(kind, raw)]
        except (Corrupt, ValueError):  # fsck names it; what it names is unknown
            return None
    return refs_of


def replay(packs: PackStore, index: Index, start: Pos | None, report: dict[str, Any], *,
           repair: bool = True) -> None:
    """Bring `index` up to the end of the packs from `start`, truncating a torn tail.

    Only recovery on open repairs (`repair`): it owns the packs and nothing
    appends meanwhile. A rebuild of the index under a running store only
    reads; a torn tail it meets is reported, never cut.
    """
    numbers = packs.numbers()
    refs_of = frame_refs(packs)
    for number in numbers:
        if start is not None and number < start[0]:
            continue
        offset = start[1] if start is not None and number == start[0] else None
        name = packfmt.pack_name(number)
        size = packs.size(number)
        if repair and number == numbers[-1] and packfmt.header_incomplete(
                packs.pread(number, packfmt.HEADER_SIZE, 0)):
            # Created, then a crash before its header was written: it holds nothing.
            report["truncated"].append({"pack": name, "offset": 0, "bytes": size})
            packs.remove(number)
            continue
        objs: list[tuple[bytes, Loc]] = []
        ops: list[list[Any]] = []
        replayed = 0
        with packs.mapped(number) as data:
            # A record at a time, applied REPLAY_BATCH at a time (each batch with the
            # position it reaches): a pack's records are never all in memory.
            result, records = packfmt.scan_stream(data, name, offset)
            for rec in records:
                replayed += 1
                if rec.rtype == packfmt.R_OBJECT:
                    kind, oid, _n = packfmt.OBJ_HEAD.unpack_from(rec.payload)
                    objs.append((oid, Loc(number, rec.offset, rec.length, kind)))
                elif rec.rtype == packfmt.R_COMMIT:
                    try:
                        ops.extend(unpackb(rec.payload)["ops"])
                    except (ValueError, KeyError, TypeError):
                        report["damaged"].append(
                            {"pack": name, "offset": rec.offset, "reason": "bad commit payload"})
                if len(objs) + len(ops) >= REPLAY_BATCH:
                    index.apply(objs, ops, (number, rec.offset + rec.length), refs_of)
                    objs, ops = [], []
        for off, reason in result.damaged:
            report["damaged"].append({"pack": name, "offset": off, "reason": reason})
        if result.torn and not repair:
            report["damaged"].append(
                {"pack": name, "offset": result.end, "reason": "torn tail (left alone)"})
        elif result.torn:
            size = packs.size(number)
            report["truncated"].append(
                {"pack": name, "offset": result.end, "bytes": size - result.end})
            if packfmt.complete_frame_at(partial(packs.pread, number), size, result.end, name):
                # A whole frame that fails its checksum is not an unfinished
                # append but damage: it is cut like a torn tail, and reported.
                report["damaged"].append(
                    {"pack": name, "offset": result.end,
                     "reason": "last record damaged (cut on open)"})
            packs.cut(number, result.end)
        report["replayed"] += replayed
        index.apply(objs, ops, (number, result.end), refs_of)


def rebuild_index(path: str, packs: PackStore, report: dict[str, Any], journal: Journal,
                  indexer: Indexer) -> dict[str, Any]:
    """Throw the index at `path` away and rebuild it by replaying every pack."""
    with journal.append_lock:
        # Nothing is appended meanwhile, and everything appended is durable
        # first: the rebuilt index must not name records a crash could cut.
        journal.wait_durable(journal.end())
        with indexer.lock:
            indexer.flush_locked()
            tmp = path + ".rebuild"
            Index.destroy(tmp)
            fresh = Index(tmp)
            fresh.set_counted()  # every record goes through the accounting
            replay(packs, fresh, None, report, repair=False)
            # Which snapshots garbage collection expired is not in the packs: keep it.
            fresh.note_expired(indexer.index.expired_items(), frame_refs(packs))
            fresh.close()
            indexer.index.close()  # readers racing this admin call may see an error
            Index.destroy(path)
            os.rename(tmp, path)
            indexer.replace(Index(path))
        vols, refs = indexer.index.load_state()
    return {"volumes": len(vols), "branches": len(refs),
            "objects": indexer.index.count_objects()}
