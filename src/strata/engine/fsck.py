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
from strata.engine.index import LOC, RELEASE_EVERY, Index, _loc
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
from strata.engine.scratch import LOOKUP_BATCH, Scratch

PLACES_SHOWN = 20  # affected paths named per damaged object; the rest are counted


# (done, total, phase): how far fsck got, for a caller that shows it (total 0: not known).
FsckProgress = Callable[[int, int, str], None]
PHASES = ("scanning packs", "checking the index", "walking branches", "naming places",
          "checking unindexed objects")


def fsck(packs: PackStore, journal: Journal, refs: Refs, indexer: Indexer,
         get_object: Callable[[bytes], bytes], recovery: dict[str, Any], scratch_dir: str,
         progress: FsckProgress | None = None) -> dict[str, Any]:
    # History ends where garbage collection expired it (engine/gc.py): not missing.
    """Verify every record of every pack, the index, and every branch's tree.

    It streams: the packs are read a record at a time, what they hold and
    what the branches reach go to scratch tables on disk (engine/scratch.py)
    under `scratch_dir`, and the index is compared with the packs by merging
    the two in id order. Memory is bounded by configuration (the scratch
    tables' buffers and caches, the mapped pages a scan keeps, one tree node's
    references per level of a walk), not by the store: see docs/design.md.
    """
    say = progress or (lambda _d, _t, _p: None)
    indexer.flush()
    with journal.append_lock:  # a consistent cut: the packs up to here, refs as of here
        limit_pack, limit_off = journal.end()
        refs_then = dict(refs.pending)
        vols_then = set(refs.pending_vols)
    report: dict[str, Any] = {"packs": 0, "records": 0, "objects": 0, "damaged": [],
                              "missing": [], "index_mismatch": 0, "unreachable_refs": [],
                              "index_lacks": 0, "refs_mismatch": []}
    with contextlib.ExitStack() as stack:
        # Where each object's newest good copy is (the LMDB location layout, so it compares
        # with the index's bytes as they are), and what a branch reaches.
        located = stack.enter_context(Scratch(scratch_dir, "fsck-located"))
        seen = stack.enter_context(Scratch(scratch_dir, "fsck-seen"))
        unindexed = stack.enter_context(Scratch(scratch_dir, "fsck-unindexed"))
        mismatched = stack.enter_context(Scratch(scratch_dir, "fsck-mismatched"))
        damaged_packs, damaged_at, replayed_vols, replayed_refs = _scan_packs(
            packs, journal, limit_pack, limit_off, located, report, say)
        say(0, 0, PHASES[1])
        bad = _compare_index(indexer.index, located, unindexed, mismatched, damaged_packs,
                             damaged_at, report)
        # The refs the journal says, against the refs the store serves.
        for key in sorted(replayed_refs.keys() | refs_then.keys()):
            if replayed_refs.get(key) != refs_then.get(key):
                report["refs_mismatch"].append({"branch": f"{key[0]}@{key[1]}",
                                                "journal": replayed_refs.get(key),
                                                "served": refs_then.get(key)})
        if replayed_vols != vols_then:
            report["refs_mismatch"].append({"volumes": sorted(replayed_vols ^ vols_then)})
        heads = sorted(refs_then.items())
        present = _Present(indexer.index, located, mismatched)
        for i, ((vol, br), sid) in enumerate(heads):  # the cut taken above, not live refs
            say(i, len(heads), PHASES[2])
            _check_reachable(get_object, bytes.fromhex(sid), present, seen, report,
                             f"{vol}@{br}", indexer.index.is_expired, bad)
        if bad:
            say(0, 0, PHASES[3])
            _name_places(get_object, refs_then, bad, indexer.index.is_expired, scratch_dir)
        # In a pack but unknown to the index: a fault if anything reaches it; otherwise it
        # is garbage collection's, left until its pack is compacted.
        say(0, 0, PHASES[4])
        for oid, raw in unindexed.items():
            if indexer.locate(oid) is not None:  # recent, or still in an inherited run
                continue
            if oid in seen and not indexer.index.is_expired(oid):
                report["index_lacks"] += 1
                report.setdefault("unindexed", [])
                if len(report["unindexed"]) < 5:
                    report["unindexed"].append({"object": oid.hex(),
                                                "kind": KIND_NAMES[LOC.unpack(raw)[3]]})
            else:
                report["collected"] = report.get("collected", 0) + 1
    report["ok"] = not (report["damaged"] or report["missing"] or report["index_mismatch"]
                        or report["index_lacks"] or report["refs_mismatch"])
    found = {k: v for k, v in recovery.items() if v}
    if found:
        report["recovery"] = found
    return report


def _scan_packs(packs: PackStore, journal: Journal, limit_pack: int, limit_off: int,
                located: Scratch, report: dict[str, Any], say: FsckProgress
                ) -> tuple[dict[int, dict[str, Any]], dict[tuple[int, int], dict[str, Any]],
                           set[str], dict[Key, str]]:
    """Read every record up to the cut, once: replay the commits, note where objects are.

    Returns which report entry each damaged pack and damaged spot is (to name its
    object from the index later), and the volumes and refs the commits replay to.
    """
    damaged_packs: dict[int, dict[str, Any]] = {}
    damaged_at: dict[tuple[int, int], dict[str, Any]] = {}
    replayed_vols: set[str] = set()
    replayed_refs: dict[Key, str] = {}
    numbers = [n for n in packs.numbers() if n <= limit_pack]
    for i, number in enumerate(numbers):
        say(i, len(numbers), PHASES[0])
        name = packfmt.pack_name(number)
        report["packs"] += 1
        bad_objects: list[dict[str, Any]] = []
        try:
            with packs.mapped(number) as data:
                result, records = packfmt.scan_stream(data, name)
                for rec in records:
                    if number == limit_pack and rec.offset >= limit_off:
                        continue  # past the cut (the scan goes on for its damage report)
                    report["records"] += 1
                    if rec.rtype == packfmt.R_COMMIT:
                        with contextlib.suppress(ValueError, KeyError, TypeError):
                            for op in unpackb(rec.payload)["ops"]:
                                apply_op(op, replayed_vols, replayed_refs)
                        continue
                    if rec.rtype != packfmt.R_OBJECT:
                        continue
                    reason = None
                    try:
                        kind, oid, raw = packfmt.object_from_record(rec, name)
                        if object_id(kind, raw) != oid:
                            reason = "content does not match its id"
                    except Corrupt as exc:
                        reason = exc.detail
                    if reason is not None:
                        damaged_at[number, rec.offset] = {"pack": name, "offset": rec.offset,
                                                          "reason": reason}
                        bad_objects.append(damaged_at[number, rec.offset])
                        continue
                    report["objects"] += 1
                    # The newest copy wins, as in the index (compaction copies objects
                    # forward): packs and records come in order, and a later put wins.
                    located.put(oid, LOC.pack(number, rec.offset, rec.length, kind))
        except Corrupt as exc:  # a bucket's copy that fails its seal: none of it is read
            damaged_packs[number] = {"pack": exc.pack or name, "offset": exc.offset,
                                     "reason": exc.detail}
            report["damaged"].append(damaged_packs[number])
            continue
        for off, reason in result.damaged:
            damaged_at[number, off] = {"pack": name, "offset": off, "reason": reason}
            report["damaged"].append(damaged_at[number, off])
        if result.torn and number != journal.tail[1]:
            report["damaged"].append({"pack": name, "offset": result.end,
                                      "reason": "truncated tail"})
        report["damaged"].extend(bad_objects)
    say(len(numbers), len(numbers), PHASES[0])
    return damaged_packs, damaged_at, replayed_vols, replayed_refs


def _compare_index(index: Index, located: Scratch, unindexed: Scratch, mismatched: Scratch,
                   damaged_packs: dict[int, dict[str, Any]],
                   damaged_at: dict[tuple[int, int], dict[str, Any]],
                   report: dict[str, Any]) -> dict[bytes, dict[str, Any]]:
    """Merge the index with what the packs hold, both in id order.

    Counts index entries the packs disagree with (and puts them in `mismatched`);
    puts what the packs hold and the index lacks into `unindexed`. Returns the
    objects that cannot be read, each with the report entry that names it: a
    damaged record's id comes from the index (its own bytes are not trusted).
    """
    bad: dict[bytes, dict[str, Any]] = {}
    packed = located.items()
    pk, pv = next(packed, (None, b""))
    for oid, v in index.iter_raw():
        while pk is not None and pk < oid:
            unindexed.put(pk, pv)
            pk, pv = next(packed, (None, b""))
        if pk == oid:
            same = pv == v
            pk, pv = next(packed, (None, b""))
            if same:
                continue
        report["index_mismatch"] += 1
        mismatched.put(oid)
        loc = _loc(LOC.unpack(v))
        entry = damaged_at.get((loc.pack, loc.offset))
        if entry is not None:
            entry["object"], entry["kind"] = oid.hex(), KIND_NAMES.get(loc.kind, "?")
            bad[oid] = entry
        elif loc.pack in damaged_packs:
            entry = damaged_packs[loc.pack]
            entry["objects"] = entry.get("objects", 0) + 1
            bad[oid] = entry
    while pk is not None:
        unindexed.put(pk, pv)
        pk, pv = next(packed, (None, b""))
    return bad


class _Present:
    """Whether objects are in the packs (as of the cut), asked a batch at a time.

    After the index was compared with the scan, an indexed object whose entry
    agreed is in the packs: the index answers (LMDB, fast) and the scan's
    scratch table is asked only about the rest.
    """

    def __init__(self, index: Index, located: Scratch, mismatched: Scratch) -> None:
        self.index, self.located, self.mismatched = index, located, mismatched
        self.asked = 0

    def many(self, ids: list[bytes]) -> list[bool]:
        self.asked += len(ids)
        if self.asked >= RELEASE_EVERY:  # the lookups' mapped index pages: hand them back
            self.index.release_pages()
            self.asked = 0
        out = self.index.locate_many(ids)
        rest = [i for i, (o, hit) in enumerate(zip(ids, out, strict=True))
                if not hit or o in self.mismatched]
        if rest:
            for i, hit in zip(rest, self.located.contains_many([ids[i] for i in rest]),
                              strict=True):
                out[i] = hit
        return out


def _check_reachable(get_object: Callable[[bytes], bytes], sid: bytes,
                     present: _Present, seen: Scratch, report: dict[str, Any],
                     where: str, expired: Callable[[bytes], bool],
                     bad: dict[bytes, dict[str, Any]]) -> None:
    """Walk what `sid` reaches (depth first), noting what is missing or unreadable.

    Each node's references are looked up together, and an object goes into
    `seen` when it is first pushed, so the stack holds one node's new
    references per level. Blocks are not read: the scan checked each one's
    content against its id and the index was compared with the scan, so only
    a block whose index entry disagrees is read here; the rest are checked
    `LOOKUP_BATCH` at a time.
    """
    if sid in seen:
        return
    seen.put(sid)
    stack: list[tuple[bytes, int]] = [(sid, SNAPSHOT)]
    blocks: list[bytes] = []

    def fresh(refs: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        refs = list(dict.fromkeys(refs))
        new = [(r, k) for (r, k), old in
               zip(refs, seen.contains_many([r for r, _k in refs]), strict=True) if not old]
        for r, _k in new:
            seen.put(r)
        return new

    while stack or blocks:
        if blocks and (not stack or len(blocks) >= LOOKUP_BATCH):
            new = fresh([(b, BLOCK) for b in blocks])
            blocks.clear()
            for (b, k), here in zip(new, present.many([b for b, _k in new]), strict=True):
                if not here:
                    _missing(b, k, where, bad, report)
                elif b in present.mismatched:
                    stack.append((b, k))  # read it: the index may point at a bad copy
            continue
        oid, kind = stack.pop()
        if kind == SNAPSHOT:  # found expired before it is found missing
            if oid != sid and expired(oid):
                report["expired_history"] = report.get("expired_history", 0) + 1
                continue
            if not present.many([oid])[0]:
                _missing(oid, kind, where, bad, report)
                continue
        refs: list[tuple[bytes, int]] = []
        try:
            raw = get_object(oid)
            if kind == SNAPSHOT:
                snap = Snapshot.decode(raw)
                if snap.parent is not None:
                    refs.append((bytes.fromhex(snap.parent), SNAPSHOT))
                if snap.root.ref is not None:
                    refs.append((snap.root.ref, TREE))
            elif kind == TREE:
                node = TreeNode.decode(raw)
                for _n, e in reversed(node.entries):
                    if e.ref is not None:
                        refs.append((e.ref, TREE if e.kind == K_DIR else FILENODE))
                refs.extend((child[1], TREE) for child in reversed(node.children))
            elif kind == FILENODE:
                fnode = FileNode.decode(raw)
                kids = [b for _n, b in fnode.entries if b != ZERO_ID]
                if fnode.level:  # inner nodes are read and followed like trees
                    refs.extend((b, FILENODE) for b in reversed(kids))
                else:
                    blocks.extend(kids)
        except (Corrupt, ValueError) as exc:
            bad[oid] = {"object": oid.hex(), "reason": str(exc)}
            report["damaged"].append(bad[oid])
            continue
        if not refs:
            continue
        new = fresh(refs)
        for (r, k), here in zip(new, present.many([r for r, _k in new]), strict=True):
            if k == SNAPSHOT:
                stack.append((r, k))  # may be expired rather than missing: checked above
            elif not here:
                _missing(r, k, where, bad, report)
            else:
                stack.append((r, k))


def _missing(oid: bytes, kind: int, where: str, bad: dict[bytes, dict[str, Any]],
             report: dict[str, Any]) -> None:
    if oid not in bad:  # else a damaged record: its entry names it already
        bad[oid] = {"object": oid.hex(), "kind": KIND_NAMES[kind], "from": where}
        report["missing"].append(bad[oid])


def _name_places(get_object: Callable[[bytes], bytes], heads: dict[Key, str],
                 bad: dict[bytes, dict[str, Any]], expired: Callable[[bytes], bool],
                 scratch_dir: str, shown: int = PLACES_SHOWN) -> None:
    """Add to each entry of `bad` the places that reach its object: `affected`, `affected_more`.

    A place is a branch head ({"volume", "branch", "path"}) or an older snapshot
    kept in a branch's history ({"volume", "snapshot", "path"}), each snapshot
    named once. One flag per tree and file node (does anything bad lie under
    it?), kept in a scratch table on disk as the walk above keeps what it saw,
    and at most `shown` places per entry; the walk descends only where the flag
    is set.
    """
    for entry in bad.values():
        entry.setdefault("affected", [])
        entry.setdefault("affected_more", 0)
    with Scratch(scratch_dir, "fsck-tainted") as flags:
        _name_places_in(get_object, heads, bad, expired, flags, shown)


def _name_places_in(get_object: Callable[[bytes], bytes], heads: dict[Key, str],
                    bad: dict[bytes, dict[str, Any]], expired: Callable[[bytes], bool],
                    flags: Scratch, shown: int) -> None:
    yes, no = b"\x01", b"\x00"

    def has_bad(oid: bytes, kind: int) -> bool:
        # Post-order without recursion: a directory may be deeper than Python's stack.
        if oid in bad:
            return True
        if kind == BLOCK:
            return False
        stack: list[tuple[bytes, int, list[tuple[int, bytes]] | None]] = [(oid, kind, None)]
        while stack:
            cur, ckind, refs = stack.pop()
            if cur in flags:
                continue
            if refs is None:
                try:
                    refs = references(ckind, get_object(cur))
                except (Corrupt, ValueError, KeyError):
                    flags.put(cur, no)  # unreadable but not known bad: nothing to name
                    continue
                stack.append((cur, ckind, refs))
                stack.extend((r, k, None) for k, r in refs
                             if k != BLOCK and r not in bad and r not in flags)
                continue
            flags.put(cur, yes if any(r in bad or (k != BLOCK and flags.get(r) == yes)
                                      for k, r in refs) else no)
        return flags.get(oid) == yes

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
