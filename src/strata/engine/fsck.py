"""fsck: every record, the index, the refs and every branch's tree, checked.

It reads the packs itself rather than trusting the index, and compares what
replaying the journal says against what the store serves (docs/design.md,
"fsck"). It only reads; repairs are recovery's (engine/recovery.py).

A damaged or missing object is named with what it costs the user: the paths
of the branch heads and kept snapshots that reach it (`_name_places`).
"""

from __future__ import annotations

import contextlib
import os
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
    K_FILE,
    KIND_NAMES,
    SNAPSHOT,
    TREE,
    ZERO_ID,
    FileNode,
    Snapshot,
    TreeNode,
    object_id,
    references,
    unpackb,
)
from strata.engine.packstore import PackStore
from strata.engine.refs import Key, Refs, apply_op

PLACES_SHOWN = 20  # affected paths named per damaged object; the rest are counted


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
    # Which report entry each damaged spot belongs to, to name its object from the index.
    damaged_packs: dict[int, dict[str, Any]] = {}
    damaged_at: dict[tuple[int, int], dict[str, Any]] = {}
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
            damaged_packs[number] = {"pack": exc.pack or name, "offset": exc.offset,
                                     "reason": exc.detail}
            report["damaged"].append(damaged_packs[number])
            continue
        if number == limit_pack:
            result.records = [r for r in result.records if r.offset < limit_off]
        for rec in result.records:
            if rec.rtype == packfmt.R_COMMIT:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    for op in unpackb(rec.payload)["ops"]:
                        apply_op(op, replayed_vols, replayed_refs)
        for off, reason in result.damaged:
            damaged_at[number, off] = {"pack": name, "offset": off, "reason": reason}
            report["damaged"].append(damaged_at[number, off])
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
                damaged_at[number, rec.offset] = {"pack": name, "offset": rec.offset,
                                                  "reason": exc.detail}
                report["damaged"].append(damaged_at[number, rec.offset])
                continue
            if object_id(kind, raw) != oid:
                damaged_at[number, rec.offset] = {"pack": name, "offset": rec.offset,
                                                  "reason": "content does not match its id"}
                report["damaged"].append(damaged_at[number, rec.offset])
                continue
            report["objects"] += 1
            # The newest copy wins, as in the index (compaction copies objects forward).
            located[oid] = Loc(number, rec.offset, rec.length, kind)
    # Objects that cannot be read, each with the report entry that names it. A damaged
    # record's id comes from the index (its own bytes are not to be trusted).
    bad: dict[bytes, dict[str, Any]] = {}
    for oid, loc in indexer.index.iter_objects():
        if located.get(oid) != loc:
            report["index_mismatch"] += 1
            entry = damaged_at.get((loc.pack, loc.offset))
            if entry is not None:
                entry["object"], entry["kind"] = oid.hex(), KIND_NAMES.get(loc.kind, "?")
                bad[oid] = entry
            elif loc.pack in damaged_packs:
                entry = damaged_packs[loc.pack]
                entry["objects"] = entry.get("objects", 0) + 1
                bad[oid] = entry
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
                         indexer.index.is_expired, bad)
    if bad:
        _name_places(get_object, refs_then, bad, indexer.index.is_expired)
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
                     where: str, expired: Callable[[bytes], bool],
                     bad: dict[bytes, dict[str, Any]]) -> None:
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
            if oid not in bad:  # else a damaged record: its entry names it already
                bad[oid] = {"object": oid.hex(), "kind": KIND_NAMES[kind], "from": where}
                report["missing"].append(bad[oid])
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
                fnode = FileNode.decode(raw)
                for b in dict.fromkeys(b for _n, b in fnode.entries):
                    if b != ZERO_ID:
                        stack.append((b, FILENODE if fnode.level else BLOCK))
        except (Corrupt, ValueError) as exc:
            bad[oid] = {"object": oid.hex(), "reason": str(exc)}
            report["damaged"].append(bad[oid])


def _name_places(get_object: Callable[[bytes], bytes], heads: dict[Key, str],
                 bad: dict[bytes, dict[str, Any]], expired: Callable[[bytes], bool],
                 shown: int = PLACES_SHOWN) -> None:
    """Add to each entry of `bad` the places that reach its object: `affected`, `affected_more`.

    A place is a branch head ({"volume", "branch", "path"}) or an older snapshot
    kept in a branch's history ({"volume", "snapshot", "path"}), each snapshot
    named once. Memory stays bounded by the objects, as the walk above: one
    flag per tree and file node (does anything bad lie under it?), and at most
    `shown` places per entry; the walk descends only where the flag is set.
    """
    for entry in bad.values():
        entry.setdefault("affected", [])
        entry.setdefault("affected_more", 0)
    tainted: dict[bytes, bool] = {}

    def has_bad(oid: bytes, kind: int) -> bool:
        # Post-order without recursion: a directory may be deeper than Python's stack.
        if oid in bad:
            return True
        if kind == BLOCK:
            return False
        stack: list[tuple[bytes, int, list[tuple[int, bytes]] | None]] = [(oid, kind, None)]
        while stack:
            cur, ckind, refs = stack.pop()
            if cur in tainted:
                continue
            if refs is None:
                try:
                    refs = references(ckind, get_object(cur))
                except (Corrupt, ValueError, KeyError):
                    tainted[cur] = False  # unreadable but not known bad: nothing to name
                    continue
                stack.append((cur, ckind, refs))
                stack.extend((r, k, None) for k, r in refs
                             if k != BLOCK and r not in bad and r not in tainted)
                continue
            tainted[cur] = any(r in bad or (k != BLOCK and tainted.get(r, False))
                               for k, r in refs)
        return tainted.get(oid, False)

    def note(oid: bytes, place: dict[str, str]) -> None:
        entry = bad[oid]
        if len(entry["affected"]) < shown:
            entry["affected"].append(place)
        else:
            entry["affected_more"] += 1

    def walk(root: bytes, label: dict[str, str]) -> None:
        stack: list[tuple[bytes, int, bytes]] = [(root, TREE, b"/")]
        while stack:
            oid, kind, path = stack.pop()
            if oid in bad:
                note(oid, {**label, "path": os.fsdecode(path)})
                continue
            try:
                raw = get_object(oid)
                if kind == FILENODE:
                    fnode = FileNode.decode(raw)
                    for b in dict.fromkeys(b for _n, b in fnode.entries):
                        if b in bad:
                            note(b, {**label, "path": os.fsdecode(path)})
                        elif fnode.level and has_bad(b, FILENODE):
                            stack.append((b, FILENODE, path))  # the same file, a level down
                    continue
                node = TreeNode.decode(raw)
            except (Corrupt, ValueError, KeyError):
                continue
            # Pushed last to first, so that places come out in name order.
            for child in reversed(node.children):  # the same directory, split: same path
                if has_bad(child[1], TREE):
                    stack.append((child[1], TREE, path))
            for name, e in reversed(node.entries):
                if e.ref is None or e.kind not in (K_DIR, K_FILE):
                    continue
                ekind = TREE if e.kind == K_DIR else FILENODE
                if has_bad(e.ref, ekind):
                    stack.append((e.ref, ekind, path.rstrip(b"/") + b"/" + name))

    head_of: dict[str, list[Key]] = {}
    for key, sid in sorted(heads.items()):
        head_of.setdefault(sid, []).append(key)
    done: set[str] = set()
    for (vol, _br), head in sorted(heads.items()):
        cur: str | None = head
        while cur is not None and cur not in done:
            done.add(cur)
            oid = bytes.fromhex(cur)
            if cur != head and expired(oid):
                break  # history garbage collection took: fsck's walk ends here too
            labels = ([{"volume": v, "branch": b} for v, b in head_of[cur]]
                      if cur in head_of else [{"volume": vol, "snapshot": cur}])
            if oid in bad:
                for label in labels:
                    note(oid, {**label, "path": ""})
                break  # an unreadable snapshot: its parent is not known
            try:
                snap = Snapshot.decode(get_object(oid))
            except (Corrupt, ValueError, KeyError):
                break
            root = snap.root.ref
            if root is not None and has_bad(root, TREE):
                for label in labels:
                    walk(root, label)
            cur = snap.parent
