"""fsck: every record, the index, the refs and every branch's tree, checked.

It reads the packs itself rather than trusting the index, and compares what
replaying the journal says against what the store serves (docs/design.md,
"fsck"). It only reads; repairs are recovery's (engine/recovery.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from strata.engine import pack as packfmt
from strata.engine.errors import Corrupt
from strata.engine.index import Loc
from strata.engine.indexer import Indexer
from strata.engine.journal import Journal
from strata.engine.objects import (
    BLOCK,
    FILENODE,
    K_DIR,
    KIND_NAMES,
    SNAPSHOT,
    TREE,
    ZERO_ID,
    FileNode,
    Snapshot,
    TreeNode,
    object_id,
    unpackb,
)
from strata.engine.packstore import PackStore
from strata.engine.refs import Key, Refs, apply_op


def fsck(packs: PackStore, journal: Journal, refs: Refs, indexer: Indexer,
         get_object: Callable[[bytes], bytes], recovery: dict[str, Any]) -> dict[str, Any]:
    # History ends where garbage collection expired it (engine/gc.py): not missing.
    """Verify every record of every pack, the index, and every branch's tree."""
    indexer.flush()
    with journal.append_lock:  # a consistent cut: the packs up to here, refs as of here
        limit_pack, limit_off = journal.end()
        refs_then = dict(refs.pending)
        vols_then = set(refs.pending_vols)
    report: dict[str, Any] = {"packs": 0, "records": 0, "objects": 0, "damaged": [],
                              "missing": [], "index_mismatch": 0, "unreachable_refs": [],
                              "index_lacks": 0, "refs_mismatch": []}
    located: dict[bytes, Loc] = {}
    replayed_vols: set[str] = set()
    replayed_refs: dict[Key, str] = {}
    for number in packs.numbers():
        if number > limit_pack:
            break
        name = packfmt.pack_name(number)
        report["packs"] += 1
        try:
            with packs.mapped(number) as data:
                result = packfmt.scan_buffer(data, name)
        except Corrupt as exc:  # a bucket's copy that fails its seal: none of it is read
            report["damaged"].append({"pack": exc.pack or name, "offset": exc.offset,
                                      "reason": exc.detail})
            continue
        if number == limit_pack:
            result.records = [r for r in result.records if r.offset < limit_off]
        for rec in result.records:
            if rec.rtype == packfmt.R_COMMIT:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    for op in unpackb(rec.payload)["ops"]:
                        apply_op(op, replayed_vols, replayed_refs)
        for off, reason in result.damaged:
            report["damaged"].append({"pack": name, "offset": off, "reason": reason})
        if result.torn and number != journal.tail[1]:
            report["damaged"].append({"pack": name, "offset": result.end,
                                      "reason": "truncated tail"})
        for rec in result.records:
            report["records"] += 1
            if rec.rtype != packfmt.R_OBJECT:
                continue
            try:
                kind, oid, raw = packfmt.object_from_record(rec, name)
            except Corrupt as exc:
                report["damaged"].append({"pack": name, "offset": rec.offset,
                                          "reason": exc.detail})
                continue
            if object_id(kind, raw) != oid:
                report["damaged"].append({"pack": name, "offset": rec.offset,
                                          "reason": "content does not match its id"})
                continue
            report["objects"] += 1
            # The newest copy wins, as in the index (compaction copies objects forward).
            located[oid] = Loc(number, rec.offset, rec.length, kind)
    for oid, loc in indexer.index.iter_objects():
        if located.get(oid) != loc:
            report["index_mismatch"] += 1
    # The refs the journal says, against the refs the store serves.
    for key in sorted(replayed_refs.keys() | refs_then.keys()):
        if replayed_refs.get(key) != refs_then.get(key):
            report["refs_mismatch"].append({"branch": f"{key[0]}@{key[1]}",
                                            "journal": replayed_refs.get(key),
                                            "served": refs_then.get(key)})
    if replayed_vols != vols_then:
        report["refs_mismatch"].append({"volumes": sorted(replayed_vols ^ vols_then)})
    seen: set[bytes] = set()
    for (vol, br), sid in sorted(refs_then.items()):  # the cut taken above, not live refs
        _check_reachable(get_object, bytes.fromhex(sid), located, seen, report, f"{vol}@{br}",
                         indexer.index.is_expired)
    # In a pack but unknown to the index: a fault if anything reaches it; otherwise it is
    # garbage collection's, left until its pack is compacted.
    for oid in located:
        if indexer.locate(oid) is None:
            if oid in seen and not indexer.index.is_expired(oid):
                report["index_lacks"] += 1
                report.setdefault("unindexed", [])
                if len(report["unindexed"]) < 5:
                    report["unindexed"].append({"object": oid.hex(),
                                                "kind": KIND_NAMES[located[oid].kind]})
            else:
                report["collected"] = report.get("collected", 0) + 1
    report["ok"] = not (report["damaged"] or report["missing"] or report["index_mismatch"]
                        or report["index_lacks"] or report["refs_mismatch"])
    found = {k: v for k, v in recovery.items() if v}
    if found:
        report["recovery"] = found
    return report


def _check_reachable(get_object: Callable[[bytes], bytes], sid: bytes,
                     located: dict[bytes, Loc], seen: set[bytes], report: dict[str, Any],
                     where: str, expired: Callable[[bytes], bool]) -> None:
    stack: list[tuple[bytes, int]] = [(sid, SNAPSHOT)]
    while stack:
        oid, kind = stack.pop()
        if oid in seen:
            continue
        seen.add(oid)
        if kind == SNAPSHOT and oid != sid and expired(oid):
            report["expired_history"] = report.get("expired_history", 0) + 1
            continue
        if oid not in located:
            report["missing"].append({"object": oid.hex(), "kind": KIND_NAMES[kind],
                                      "from": where})
            continue
        try:
            raw = get_object(oid)
            if kind == SNAPSHOT:
                snap = Snapshot.decode(raw)
                if snap.root.ref is not None:
                    stack.append((snap.root.ref, TREE))
                if snap.parent is not None:
                    stack.append((bytes.fromhex(snap.parent), SNAPSHOT))
            elif kind == TREE:
                node = TreeNode.decode(raw)
                for child in node.children:
                    stack.append((child[1], TREE))
                for _n, e in node.entries:
                    if e.ref is not None:
                        stack.append((e.ref, TREE if e.kind == K_DIR else FILENODE))
            elif kind == FILENODE:
                for b in FileNode.decode(raw).blocks:
                    if b != ZERO_ID:
                        stack.append((b, BLOCK))
        except (Corrupt, ValueError) as exc:
            report["damaged"].append({"object": oid.hex(), "reason": str(exc)})
