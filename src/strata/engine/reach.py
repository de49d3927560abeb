"""Which objects a volume can reach: the object half of a token's scope, kept on disk.

A token scoped to a volume may read an object only if the object is
reachable from a snapshot in that volume's history, or was uploaded by a
writer of that volume (whoever sends the bytes has them). Everything else is
answered exactly as an object that does not exist, so an object id learned
elsewhere is not a capability.

Facts are kept in the index's `reach` table, per volume identity:
`o` + object id (reachable or given) and `s` + snapshot id (its whole tree
is marked). An object's value says how it came: empty when a snapshot's walk
reached it or a publish checked everything under it (vetted), `g` when a
writer uploaded it and nothing below it has been checked yet. A publish that
makes a given object reachable checks its subtree first (LocalStore.
check_refs_reachable): an uploaded tree or file node may name anything.
A volume deleted and made anew under the same name has another identity
and starts empty.

The table grows lazily: a miss walks each branch head back to the first
snapshot already marked, and marks the new snapshots' trees, descending only
into objects not yet marked. Marks are written as the walk goes, in post-order
(an object after everything under it), `MARK_BATCH` a transaction, and the
snapshot mark last, so a crash in the middle leaves only facts that are true
and a walk holds one node's references per level, never a whole tree. A marked object's subtree is
either marked or was never the volume's to see: an uploaded file node that
names another volume's block keeps that block out of reach, because the walk
stops at the file node the uploader was given.

The table is derived data: a rebuilt index starts it empty, and it refills
on the next miss (objects uploaded but not yet published are then uploaded
again, because `missing` reports them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from strata.engine.index import Index
from strata.engine.objects import BLOCK, SNAPSHOT, references

Fetch = Callable[[bytes], bytes]
VETTED, GIVEN = b"", b"g"  # an object's mark: its subtree checked, or only uploaded
MARK_BATCH = 4_096  # marks a walk writes per transaction (children before their parents)


def volume_key(volume: str, volume_id: str) -> bytes:
    """The table prefix of one volume identity (name only for volumes made before ids)."""
    ident = (volume_id or "name:" + volume).encode()
    return len(ident).to_bytes(1, "big") + ident


class Reach:
    def __init__(self, index: Index) -> None:
        self._env = index.env
        self._db = index.reach
        self._walk_lock = threading.Lock()

    def marked(self, key: bytes, oids: Sequence[bytes]) -> list[bool]:
        with self._env.begin(db=self._db) as txn:
            return [txn.get(key + b"o" + oid) is not None for oid in oids]

    def give(self, key: bytes, oids: Iterable[bytes]) -> None:
        """Record objects a writer of the volume uploaded (it holds their bytes)."""
        with self._env.begin(write=True, db=self._db) as txn:
            for oid in oids:
                txn.put(key + b"o" + oid, GIVEN, overwrite=False)

    def states(self, key: bytes, oids: Sequence[bytes]) -> list[bytes | None]:
        """Each object's mark: None (out of reach), GIVEN, or VETTED."""
        with self._env.begin(db=self._db) as txn:
            return [None if (v := txn.get(key + b"o" + oid)) is None else bytes(v)
                    for oid in oids]

    def vet(self, key: bytes, oids: Iterable[bytes]) -> None:
        """Record that everything under these objects is in the volume's reach."""
        with self._env.begin(write=True, db=self._db) as txn:
            for oid in oids:
                txn.put(key + b"o" + oid, VETTED)

    def extend(self, key: bytes, heads: Iterable[str], parent_of: Callable[[str], str | None],
               fetch: Fetch) -> None:
        """Mark every snapshot in the history of `heads`, and its tree, not marked yet."""
        with self._walk_lock:
            todo: list[str] = []
            with self._env.begin(db=self._db) as txn:
                seen: set[str] = set()
                for head in heads:
                    cur: str | None = head
                    while cur is not None and cur not in seen:
                        if txn.get(key + b"s" + bytes.fromhex(cur)) is not None:
                            break
                        seen.add(cur)
                        todo.append(cur)
                        cur = parent_of(cur)
            for sid in reversed(todo):  # oldest first: later snapshots share its marks
                self._mark_snapshot(key, sid, fetch)

    def _mark_snapshot(self, key: bytes, sid: str, fetch: Fetch) -> None:
        # Depth first, marks in post-order: an object is marked only after everything
        # under it, so a mark written (in batches, a crash between them) is never
        # above an unmarked hole. Held in memory: one node's references per level and
        # at most MARK_BATCH marks not yet written, never the snapshot's whole tree.
        buf: dict[bytes, None] = {}
        stack: list[tuple[int, bytes, bool]] = [(SNAPSHOT, bytes.fromhex(sid), False)]
        txn = self._env.begin(db=self._db)
        try:
            while stack:
                kind, oid, below_done = stack.pop()
                if not below_done:
                    if oid in buf or txn.get(key + b"o" + oid) is not None:
                        continue
                    if kind != BLOCK:  # a block refers to nothing: no need to read it
                        stack.append((kind, oid, True))
                        stack.extend((k, o, False) for k, o in references(kind, fetch(oid)))
                        continue
                buf[oid] = None
                if len(buf) >= MARK_BATCH:
                    self._write_marks(key, buf)
                    txn.abort()  # a new snapshot of the table: it sees the marks just written
                    txn = self._env.begin(db=self._db)
        finally:
            txn.abort()
        self._write_marks(key, buf, snapshot=bytes.fromhex(sid))

    def _write_marks(self, key: bytes, oids: dict[bytes, None],
                     snapshot: bytes | None = None) -> None:
        with self._env.begin(write=True, db=self._db) as txn:
            for oid in oids:
                txn.put(key + b"o" + oid, b"", overwrite=False)
            if snapshot is not None:
                txn.put(key + b"s" + snapshot, b"")
        oids.clear()
