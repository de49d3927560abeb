"""The index: object id -> pack location, plus refs and volumes, in LMDB.

The index is derived data. Every fact in it can be recomputed by replaying
pack records, and `applied` records how far that replay has come, so after a
crash the store replays only the records past it. LMDB was chosen because it
gives readers MVCC snapshots that never block the single writer, is crash
consistent, and is a single well-kept C library.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, NamedTuple, cast

import lmdb

from strata.engine.objects import BLOCK as _BLOCK

# 2: leases keep the hash of their secret id, volumes their id;
# 3: reference counts, count-zero objects and indexed bytes per pack (GC accounting)
INDEX_VERSION = 3
LOC = struct.Struct("<IQIB")  # pack number, frame offset, frame length, object kind
POS = struct.Struct("<IQ")    # pack number, offset
# fencing token, expiry (ns since the epoch), hash of the lease id (zeros: none); holder follows
LEASE = struct.Struct("<QQ16s")
COUNT = struct.Struct("<Q")   # references to an object from indexed nodes; bytes in a pack
HIST = struct.Struct("<Q")    # a snapshot's time (ns); its parent's id follows (none: a root)
PACKNO = struct.Struct(">I")  # a pack number as a key (big-endian: sorted)
COUNTED = b"gc-counted"       # meta key: the GC accounting tables are exact (see below)
RECOUNT = b"gc-recounting"    # meta key: a recount's token, gone when anything makes it inexact
# A whole-index scan hands its mapped pages back this often (entries): LMDB reads through a
# shared map, and each page touched stays resident in this process until handed back. The
# kernel maps up to 16 neighbouring cached pages on each fault (fault-around), so a scan of
# 4,096 entries can leave ~5 MiB resident; 65,536 left 42 MiB of a 200k-object index.
RELEASE_EVERY = 4_096
# ... and lookups this often: each faults in a few pages and their neighbours (~12 MiB).
RELEASE_LOOKUPS = 64
# GC drops objects in transactions that name at most this many ids together (each costs
# a count update: a dirty page copied in memory until the commit).
FORGET_REFS = 16_384
# (object id, its Loc) -> the ids it names (engine/objects.py `references`), read from its
# frame: the accounting tables need them when an object is first indexed. None: unreadable.
RefsOf = Callable[[bytes, "Loc"], "list[bytes] | None"]


class Loc(NamedTuple):
    """Where an object's frame is: the one definition, read by field name everywhere.

    Stored as `LOC` in the index and as an entry of a checkpoint's index run
    (docs/format.md); the field order is the stored order.
    """

    pack: int    # pack number
    offset: int  # where the frame starts (its sync marker) in the pack
    length: int  # the frame's bytes, marker included
    kind: int    # object kind (engine/objects.py)


# A Loc from an unpacked LOC without NamedTuple's argument handling: index lookups and
# scans make one per entry (about 80 ns here against 160 ns for `Loc(*t)`).
_loc = cast("Callable[[tuple[Any, ...]], Loc]", partial(tuple.__new__, Loc))


class Index:
    """A thin typed wrapper over the LMDB environment."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._touched = 0  # lookups since the map's pages were last handed back
        self._map_span: tuple[int, int] | None = None
        os.makedirs(path, mode=0o700, exist_ok=True)
        self.env = lmdb.open(path, max_dbs=16, map_size=1 << 40, subdir=True, mode=0o600,
                             metasync=False, sync=True, readahead=False, max_readers=512)
        self.objects = self.env.open_db(b"objects")
        self.refs = self.env.open_db(b"refs")
        self.volumes = self.env.open_db(b"volumes")
        self.meta = self.env.open_db(b"meta")
        self.leases = self.env.open_db(b"leases")
        self.reach = self.env.open_db(b"reach")  # derived from the rest: see engine/reach.py
        # Garbage collection (engine/gc.py): snapshots it expired (so reads can say so),
        # and objects it found unreachable, with when it first did.
        self.expired = self.env.open_db(b"expired")
        self.dead = self.env.open_db(b"dead")
        self.policies = self.env.open_db(b"policies")  # retention, from "policy" ops
        # GC accounting (docs/design.md "GC accounting"), exact while meta `gc-counted`
        # is set: how many indexed nodes name each object, the indexed objects no
        # indexed node names, and the indexed bytes of each pack.
        self.counts = self.env.open_db(b"counts")
        self.zero = self.env.open_db(b"zero")
        self.packbytes = self.env.open_db(b"packbytes")
        # What GC's roots need of each snapshot it walked (its parent and time), so a
        # pass reads only snapshots new since the last one (docs/design.md "GC
        # accounting"). A memo of immutable facts: content addressing makes an entry
        # right forever, so it may lag, outlive its snapshot or be empty.
        self.history = self.env.open_db(b"history")
        # Objects indexed, moved or dropped since the bucket checkpoint named by meta
        # `cp-base`: the next checkpoint's own run (engine/tiercheckpoints.py). The value
        # is a change counter, so a checkpoint clears only what it took.
        self.changed = self.env.open_db(b"changed")
        with self.env.begin(write=True) as txn:
            v = txn.get(b"version", db=self.meta)
            if v is None:
                txn.put(b"version", str(INDEX_VERSION).encode(), db=self.meta)
                # New: `changed` holds everything it indexes (an older index lacks this,
                # and its next bucket checkpoint writes the whole index again).
                txn.put(b"cp-base", b"", db=self.meta)
            elif int(v) != INDEX_VERSION:
                raise ValueError(f"index version {v!r} is not {INDEX_VERSION}")

    def close(self) -> None:
        self.env.close()

    def release_pages(self) -> None:
        """Hand back the pages of the map this process has touched (Linux; else nothing).

        Without it a pass over the whole index leaves all of it resident in the
        process: the map of a million-object index is about 350 MiB, counted in
        the server's RSS until the store closes. The pages are clean (the map
        is read-only; LMDB writes with pwrite) and stay in the page cache, so
        a reader in another thread that touches one again just maps it back.
        """
        span = self._span()
        if span is None:
            return
        addr, length = span
        try:
            used = os.stat(os.path.join(self.path, "data.mdb")).st_size
        except OSError:
            return
        _madvise(addr, min(length, -(-used // mmap.PAGESIZE) * mmap.PAGESIZE))

    def touched(self, lookups: int = 1) -> None:
        """`lookups` more random reads of the map: hand its pages back every `RELEASE_LOOKUPS`.

        So a pass that looks up every object (a mark, fsck's walk, a restore's
        checks) keeps at most the pages of a few thousand lookups resident, and a
        server that has served a million lookups does not keep the index it read.
        Counted without a lock: a lost increment only delays a release.
        """
        self._touched += lookups
        if self._touched >= RELEASE_LOOKUPS:
            self._touched = 0
            self.release_pages()

    def _span(self) -> tuple[int, int] | None:
        span = self._map_span
        if span is None:
            span = _mapping_of(os.path.realpath(os.path.join(self.path, "data.mdb")))
            self._map_span = span
        return span if span and span[1] else None

    @staticmethod
    def destroy(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    # -- reads (MVCC: never wait on the writer) ---------------------------------

    def locate(self, oid: bytes) -> Loc | None:
        self.touched()
        with self.env.begin(db=self.objects, buffers=False) as txn:
            v = txn.get(oid)
        return _loc(LOC.unpack(v)) if v is not None else None

    def contains(self, oid: bytes) -> bool:
        """Whether `oid` is indexed: `locate` without making its Loc (uploads ask this a lot)."""
        self.touched()
        with self.env.begin(db=self.objects) as txn:
            return txn.get(oid) is not None

    def locate_many(self, oids: Iterable[bytes]) -> list[bool]:
        out: list[bool] = []
        for chunk in _chunks(oids, RELEASE_LOOKUPS):
            with self.env.begin(db=self.objects) as txn:
                out += [txn.get(o) is not None for o in chunk]
            self.touched(len(chunk))
        return out

    def prefix(self, start: bytes) -> Iterator[tuple[bytes, Loc]]:
        with self.env.begin(db=self.objects) as txn:
            cur = txn.cursor()
            if not cur.set_range(start):
                return
            for k, v in cur:
                yield bytes(k), _loc(LOC.unpack(v))

    def applied(self) -> tuple[int, int] | None:
        with self.env.begin(db=self.meta) as txn:
            v = txn.get(b"applied")
        return POS.unpack(v) if v is not None else None

    def load_volume_ids(self) -> dict[str, str]:
        """Volume name -> the id drawn when it was created ("" for older volumes)."""
        with self.env.begin(db=self.volumes) as txn:
            return {bytes(k).decode(): bytes(v).decode() for k, v in txn.cursor()}

    def load_state(self) -> tuple[set[str], dict[tuple[str, str], str]]:
        vols: set[str] = set()
        refs: dict[tuple[str, str], str] = {}
        with self.env.begin() as txn:
            for k, _v in txn.cursor(db=self.volumes):
                vols.add(bytes(k).decode())
            for k, v in txn.cursor(db=self.refs):
                vol, br = bytes(k).decode().split("\0", 1)
                refs[(vol, br)] = bytes(v).hex()
        return vols, refs

    def load_policies(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(volume, branch or "") -> the policy fields set there."""
        with self.env.begin(db=self.policies) as txn:
            return {_split_key(bytes(k)): json.loads(bytes(v)) for k, v in txn.cursor()}

    def load_leases(self) -> dict[tuple[str, str], tuple[int, int, str, bytes]]:
        out: dict[tuple[str, str], tuple[int, int, str, bytes]] = {}
        with self.env.begin(db=self.leases) as txn:
            for k, v in txn.cursor():
                vol, br = bytes(k).decode().split("\0", 1)
                fencing, expires, key = LEASE.unpack_from(v)
                out[(vol, br)] = (fencing, expires, bytes(v)[LEASE.size:].decode(),
                                  bytes(key).rstrip(b"\0") and bytes(key))
        return out

    def count_objects(self) -> int:
        with self.env.begin(db=self.objects) as txn:
            return int(txn.stat(self.objects)["entries"])

    def iter_objects(self) -> Iterator[tuple[bytes, Loc]]:
        """Every object entry, in id order, from one snapshot (pages handed back as it goes)."""
        unpack, make = LOC.unpack, _loc  # locals: a scan makes one per object
        with self.env.begin(db=self.objects) as txn:
            for i, (k, v) in enumerate(txn.cursor()):
                if i and not i % RELEASE_EVERY:
                    self.release_pages()
                yield bytes(k), make(unpack(v))
        self.release_pages()

    def iter_raw(self) -> Iterator[tuple[bytes, bytes]]:
        """Every object entry as stored (id, `LOC` bytes), in id order, from one snapshot.

        For passes that merge the index with another sorted stream. The mapped pages
        behind the cursor are handed back as it goes (`release_pages`).
        """
        with self.env.begin(db=self.objects, buffers=True) as txn:
            for i, (k, v) in enumerate(txn.cursor()):
                if i and not i % RELEASE_EVERY:
                    self.release_pages()
                yield bytes(k), bytes(v)
        self.release_pages()

    def _tables(self, txn: lmdb.Transaction) -> dict[str, Any]:
        v = txn.get(b"applied", db=self.meta)
        return {
            "applied": POS.unpack(v) if v is not None else (0, 0),
            "volumes": {bytes(k).decode(): bytes(x).decode()
                        for k, x in txn.cursor(db=self.volumes)},
            "refs": {tuple(bytes(k).decode().split("\0", 1)): bytes(x).hex()
                     for k, x in txn.cursor(db=self.refs)},
            "leases": [[bytes(k), bytes(x)] for k, x in txn.cursor(db=self.leases)],
            "expired": [bytes(k) for k, _x in txn.cursor(db=self.expired)],
            "policies": [[bytes(k), bytes(x)] for k, x in txn.cursor(db=self.policies)],
        }

    def checkpoint_view(self, take_changes: Callable[[Iterator[tuple[bytes, Loc | None]]], None]
                        | None,
                        take_all: Callable[[Iterator[tuple[bytes, Loc]]], None] | None
                        ) -> tuple[bytes, int, dict[str, Any]]:
        """Every table at one instant, with what changed since meta `cp-base`.

        `take_changes`, if given, consumes the changes in id order (id, location
        or None if dropped) and `take_all` the whole object index, both in the
        same transaction: nothing is held per entry here. Returns the change
        counter as of that instant (for `checkpoint_done`), how many changes
        there were, and the tables (applied position, volumes, refs, leases,
        expired, policies).
        """
        with self.env.begin() as txn:
            seq = bytes(txn.get(b"change-seq", db=self.meta) or _CHANGE.pack(0))
            count = int(txn.stat(self.changed)["entries"])
            if take_changes is not None:
                def changes() -> Iterator[tuple[bytes, Loc | None]]:
                    for i, k in enumerate(txn.cursor(db=self.changed).iternext(values=False)):
                        if i and not i % RELEASE_EVERY:
                            self.release_pages()
                        v = txn.get(k, db=self.objects)
                        yield bytes(k), _loc(LOC.unpack(v)) if v is not None else None
                take_changes(changes())
            tables = self._tables(txn)
            if take_all is not None:
                def everything() -> Iterator[tuple[bytes, Loc]]:
                    for i, (k, v) in enumerate(txn.cursor(db=self.objects)):
                        if i and not i % RELEASE_EVERY:
                            self.release_pages()
                        yield bytes(k), _loc(LOC.unpack(v))
                take_all(everything())
        self.release_pages()
        return seq, count, tables

    def checkpoint_done(self, seq: bytes, base: str) -> None:
        """Checkpoint `base` holds every change up to counter `seq`: forget those.

        An entry changed again since has a higher counter and stays. One pass
        over the `changed` table, nothing held per entry.
        """
        upto = _CHANGE.unpack(seq)[0]
        with self.env.begin(write=True, db=self.changed) as txn:
            cur = txn.cursor()
            more = cur.first()
            while more:
                if _CHANGE.unpack(cur.value())[0] <= upto:
                    cur.delete()  # and moves to the next entry (none: an empty key)
                    more = bool(cur.key())
                else:
                    more = cur.next()
            txn.put(b"cp-base", base.encode(), db=self.meta)

    def set_checkpoint_base(self, base: str) -> None:
        """This index is the checkpoint `base` plus what `changed` holds (a restore's start)."""
        with self.env.begin(write=True) as txn:
            txn.drop(self.changed, delete=False)
            txn.put(b"cp-base", base.encode(), db=self.meta)

    # -- the one writer -----------------------------------------------------------

    def load_tables(self, applied: tuple[int, int], volumes: dict[str, str],
                    refs: dict[tuple[str, str], str], leases: list[list[Any]],
                    policies: Iterable[list[bytes]] = ()) -> None:
        """Start an empty index from a checkpoint's tables (its objects come lazily)."""
        with self.env.begin(write=True) as txn:
            for k, v in policies:
                txn.put(bytes(k), bytes(v), db=self.policies)
            for name, vid in volumes.items():
                txn.put(name.encode(), vid.encode(), db=self.volumes)
            for (vol, br), sid in refs.items():
                txn.put(_refkey(vol, br), bytes.fromhex(sid), db=self.refs)
            for k, v in leases:
                txn.put(bytes(k), bytes(v), db=self.leases)
            txn.put(b"applied", POS.pack(*applied), db=self.meta)

    def add_objects(self, entries: Iterable[tuple[bytes, Loc]]) -> None:
        """Entries fetched from a checkpoint's index run (older than `applied`)."""
        with self.env.begin(write=True, db=self.objects) as txn:
            _inexact(txn, self)  # not counted: GC marks in full from now on
            n = 0
            for oid, loc in entries:
                txn.put(oid, LOC.pack(*loc), overwrite=False)
                n += 1
        self.touched(n)

    def apply(self, objects: list[tuple[bytes, Loc]],
              ops: list[list[Any]], applied: tuple[int, int],
              refs_of: RefsOf | None = None) -> None:
        """Write a batch of replayed records and the position they reach, atomically.

        A later record of an object wins: compaction copies live objects forward
        and the copy must be the one found, also when the log is replayed.
        The GC accounting changes in the same transaction; without `refs_of` it
        cannot, and is marked inexact (GC then marks in full).
        """
        with self.env.begin(write=True) as txn:
            if objects and refs_of is None:
                _inexact(txn, self)
            delta: dict[int, int] = {}
            mark = _next_change(txn, self) if objects else b""
            for oid, loc in objects:
                self.touched()  # a batch of 16k lookups would otherwise fault the map in
                old = txn.get(oid, db=self.objects)
                txn.put(oid, LOC.pack(*loc), db=self.objects)
                txn.put(oid, mark, db=self.changed)
                delta[loc.pack] = delta.get(loc.pack, 0) + loc.length
                if old is not None:  # a copy (or a second upload) takes over: counted once
                    was = _loc(LOC.unpack(old))
                    delta[was.pack] = delta.get(was.pack, 0) - was.length
                    continue
                if txn.get(oid, db=self.counts) is None:
                    txn.put(oid, b"", db=self.zero)
                if refs_of is not None and loc.kind != _BLOCK:
                    kids = refs_of(oid, loc)
                    if kids is None:  # what it names is unknown: nothing can be trusted
                        _inexact(txn, self)
                    for kid in dict.fromkeys(kids or ()):
                        self._add_count(txn, kid, 1)
            self._add_packbytes(txn, delta)
            for op in ops:
                apply_op_lmdb(txn, op, self)
            txn.put(b"applied", POS.pack(*applied), db=self.meta)


    # -- garbage collection (engine/gc.py) ---------------------------------------------

    def forget_objects(self, oids: Iterable[bytes], expired: Iterable[bytes] = ()) -> None:
        """Drop dead objects from the index, and note expired snapshots, atomically."""
        stamp = struct.pack("<Q", time.time_ns())
        with self.env.begin(write=True) as txn:
            mark = _next_change(txn, self)
            for oid in oids:
                txn.delete(oid, db=self.objects)
                txn.delete(oid, db=self.dead)
                txn.put(oid, mark, db=self.changed)
            for sid in expired:
                txn.put(sid, stamp, db=self.expired)
                txn.delete(sid, db=self.history)

    def expired_items(self) -> list[tuple[bytes, bytes]]:
        with self.env.begin(db=self.expired) as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]

    def note_expired(self, items: Iterable[tuple[bytes, bytes]],
                     refs_of: RefsOf | None = None) -> None:
        with self.env.begin(write=True, db=self.expired) as txn:
            gone: dict[bytes, tuple[Loc, list[bytes]]] = {}
            for k, v in items:
                txn.put(k, v)
                old = txn.get(k, db=self.objects)
                if old is not None:  # its bytes may linger in a pack: still gone
                    loc = _loc(LOC.unpack(old))
                    kids = refs_of(k, loc) if refs_of is not None else None
                    if kids is None:
                        _inexact(txn, self)
                    gone[k] = (loc, kids or [])
            self._forget_locked(txn, gone)

    def expired_with_prefix(self, prefix: str, limit: int = 2) -> list[str]:
        """Expired snapshot ids starting with the hex `prefix` (at most `limit`)."""
        start = bytes.fromhex(prefix[: len(prefix) // 2 * 2])
        out: list[str] = []
        with self.env.begin(db=self.expired) as txn:
            cur = txn.cursor()
            if cur.set_range(start):
                for k in cur.iternext(values=False):
                    h = bytes(k).hex()
                    if not h.startswith(prefix[: len(start) * 2]) or len(out) >= limit:
                        break
                    if h.startswith(prefix):
                        out.append(h)
        return out

    def is_expired(self, sid: bytes) -> bool:
        with self.env.begin(db=self.expired) as txn:
            return txn.get(sid) is not None

    def mark_dead(self, oids: list[bytes], now_ns: int, after: bytes | None = None,
                  last: bool = True) -> list[int]:
        """Note when each object was first found unreachable; returns those times, in order.

        `oids` are one batch of a pass's unreachable objects, in id order, the
        ids after `after` (None: from the first) and up to the batch's last id
        (`last`: to the end). Objects in that range not in the batch (reachable
        again) are forgotten. So a pass hands over its garbage a batch at a time
        and never holds all of it.
        """
        stamp = struct.pack("<Q", now_ns)
        want = dict.fromkeys(oids, now_ns)
        hi = None if last or not oids else oids[-1]
        with self.env.begin(write=True, db=self.dead) as txn:
            cur = txn.cursor()
            more = cur.set_range(after) if after is not None else cur.first()
            if more and after is not None and cur.key() == after:
                more = cur.next()
            while more:
                k = bytes(cur.key())
                if not k or (hi is not None and k > hi):
                    break
                if k in want:
                    want[k] = struct.unpack("<Q", cur.value())[0]
                    more = cur.next()
                else:
                    cur.delete()  # and moves to the next entry (none: an empty key)
                    more = bool(cur.key())
            for oid, when in want.items():
                if when == now_ns:
                    txn.put(oid, stamp)
        return [want[o] for o in oids]

    # -- GC accounting (docs/design.md "GC accounting") ----------------------------------

    def counted(self) -> bool:
        """Whether the accounting tables are exact (set by a replay from the first pack)."""
        with self.env.begin(db=self.meta) as txn:
            return txn.get(COUNTED) is not None

    def set_counted(self) -> None:
        with self.env.begin(write=True, db=self.meta) as txn:
            txn.put(COUNTED, b"1")

    def uncount(self) -> None:
        """The accounting was found wrong: GC marks in full until the index is rebuilt."""
        with self.env.begin(write=True) as txn:
            _inexact(txn, self)

    def ref_counts(self, oids: Iterable[bytes]) -> list[int]:
        """How many indexed tree, file and snapshot nodes name each object."""
        out: list[int] = []
        for chunk in _chunks(oids, RELEASE_LOOKUPS):
            with self.env.begin(db=self.counts) as txn:
                out += [0 if (v := txn.get(o)) is None else COUNT.unpack(v)[0] for o in chunk]
            self.touched(len(chunk))
        return out

    def unnamed(self) -> list[tuple[bytes, Loc]]:
        """Indexed objects no indexed node names: snapshots, and the tops of garbage."""
        out: list[tuple[bytes, Loc]] = []
        with self.env.begin() as txn:
            for k in txn.cursor(db=self.zero).iternext(values=False):
                self.touched()
                v = txn.get(k, db=self.objects)
                if v is not None:
                    out.append((bytes(k), _loc(LOC.unpack(v))))
        return out

    def history_of(self, sid: bytes) -> tuple[bytes | None, int] | None:
        """A snapshot's (parent, time_ns) as GC noted it, or None if it never did."""
        self.touched()
        with self.env.begin(db=self.history) as txn:
            v = txn.get(sid)
        if v is None or len(v) not in (HIST.size, HIST.size + 32):
            return None
        return (bytes(v[HIST.size:]) or None), HIST.unpack_from(v)[0]

    def note_history(self, facts: Iterable[tuple[bytes, bytes | None, int]]) -> None:
        """Note (snapshot, parent, time_ns) of snapshots GC has read."""
        with self.env.begin(write=True, db=self.history) as txn:
            for sid, parent, time_ns in facts:
                txn.put(sid, HIST.pack(time_ns) + (parent or b""))

    def clear_history(self) -> None:
        """Forget every noted snapshot (found wrong): GC reads them again."""
        with self.env.begin(write=True) as txn:
            txn.drop(self.history, delete=False)

    def pack_bytes(self) -> dict[int, int]:
        """Indexed bytes per pack (frames of objects the index points into it)."""
        with self.env.begin(db=self.packbytes) as txn:
            return {PACKNO.unpack(k)[0]: COUNT.unpack(v)[0] for k, v in txn.cursor()}

    # -- recounting in place (engine/recount.py) ---------------------------------------

    def recount_view(self, token: bytes, take_node: Callable[[bytes, Loc], None],
                     take_count: Callable[[bytes, int], None]
                     ) -> tuple[dict[int, int], dict[int, int]]:
        """Start a recount: every indexed node and every count, from one read transaction.

        `token` is noted first (meta `gc-recounting`); anything that makes the
        accounting inexact from then on removes it, and `finish_recount` then
        refuses. Returns the indexed bytes of each pack as that transaction's
        objects add up and as its `packbytes` table says.
        """
        with self.env.begin(write=True, db=self.meta) as txn:
            txn.put(RECOUNT, token)
        per_pack: dict[int, int] = {}
        unpack, make = LOC.unpack, _loc
        with self.env.begin() as txn:
            for i, (k, v) in enumerate(txn.cursor(db=self.objects)):
                if i and not i % RELEASE_EVERY:
                    self.release_pages()
                loc = make(unpack(v))
                per_pack[loc.pack] = per_pack.get(loc.pack, 0) + loc.length
                if loc.kind != _BLOCK:
                    take_node(bytes(k), loc)
            for i, (k, v) in enumerate(txn.cursor(db=self.counts)):
                if i and not i % RELEASE_EVERY:
                    self.release_pages()
                take_count(bytes(k), COUNT.unpack(v)[0])
            table = {PACKNO.unpack(k)[0]: COUNT.unpack(v)[0]
                     for k, v in txn.cursor(db=self.packbytes)}
        self.release_pages()
        return per_pack, table

    def adjust_counts(self, deltas: Iterable[tuple[bytes, int]]) -> None:
        """Add each delta to its object's count, `zero` following (one transaction).

        A count that would go below zero makes the accounting inexact.
        """
        with self.env.begin(write=True) as txn:
            for oid, by in deltas:
                if by:
                    self._add_count(txn, oid, by)

    def adjust_packbytes(self, delta: dict[int, int]) -> None:
        with self.env.begin(write=True) as txn:
            self._add_packbytes(txn, delta)

    def rederive_zero(self, batch: int = RELEASE_EVERY) -> None:
        """Make `zero` the indexed objects without a count, `batch` ids a transaction.

        The indexer and GC keep the rule for the ids they touch meanwhile, so a
        range set right stays right.
        """
        for db in (self.objects, self.zero):
            after = b""
            while True:
                with self.env.begin(write=True) as txn:
                    cur = txn.cursor(db=db)
                    more = cur.set_range(after)
                    keys: list[bytes] = []
                    while more and len(keys) < batch:
                        keys.append(bytes(cur.key()))
                        more = cur.next()
                    for k in keys:
                        if (txn.get(k, db=self.objects) is not None
                                and txn.get(k, db=self.counts) is None):
                            txn.put(k, b"", db=self.zero)
                        else:
                            txn.delete(k, db=self.zero)
                self.touched(len(keys))
                if not more:
                    break
                after = keys[-1] + b"\0"  # the least key after it

    def finish_recount(self, token: bytes) -> bool:
        """Declare the accounting exact, unless something made it inexact since `token`."""
        with self.env.begin(write=True, db=self.meta) as txn:
            if txn.get(RECOUNT) != token:
                return False
            txn.delete(RECOUNT)
            txn.put(COUNTED, b"1")
            return True

    def forget_counted(self, gone: dict[bytes, tuple[Loc, list[bytes]]],
                       expired: Iterable[bytes] = ()) -> None:
        """Drop dead objects (with the ids each names) and note expired snapshots.

        Each object goes in one transaction with the references it names (they
        lose one each) and, if it is a snapshot in `expired`, its expiry; one
        transaction takes objects naming at most `FORGET_REFS` ids in all, so a
        batch of wide trees neither copies a large part of the B-tree into
        dirty pages nor faults the map in (its pages are handed back as it goes).
        """
        stamp = struct.pack("<Q", time.time_ns())
        expired = set(expired)
        items = list(gone.items())
        start = 0
        while True:
            end, refs = start, 0
            while end < len(items) and (end == start
                                        or refs + len(items[end][1][1]) <= FORGET_REFS):
                refs += len(items[end][1][1])
                end += 1
            part = dict(items[start:end])
            last = end >= len(items)
            with self.env.begin(write=True) as txn:
                self._forget_locked(txn, part)
                for sid in [o for o in part if o in expired] + (
                        sorted(expired - gone.keys()) if last else []):
                    txn.put(sid, stamp, db=self.expired)
                    txn.delete(sid, db=self.history)
            if last:
                return
            start = end

    def _forget_locked(self, txn: lmdb.Transaction,
                       gone: dict[bytes, tuple[Loc, list[bytes]]]) -> None:
        delta: dict[int, int] = {}
        # Summed first: the objects of one batch name the same nodes over and over (old
        # root trees name most directories), and each count is then written once.
        lost: dict[bytes, int] = {}
        mark = _next_change(txn, self) if gone else b""
        for oid, (loc, kids) in gone.items():
            self.touched()
            if not txn.delete(oid, db=self.objects):
                continue
            txn.put(oid, mark, db=self.changed)  # the next bucket checkpoint's tombstone
            txn.delete(oid, db=self.dead)
            txn.delete(oid, db=self.zero)
            delta[loc.pack] = delta.get(loc.pack, 0) - loc.length
            for kid in dict.fromkeys(kids):
                lost[kid] = lost.get(kid, 0) - 1
        for kid, by in lost.items():
            self._add_count(txn, kid, by)
        self._add_packbytes(txn, delta)

    def _add_count(self, txn: lmdb.Transaction, oid: bytes, by: int) -> None:
        self.touched()  # pages of three tables, read through the map
        v = txn.get(oid, db=self.counts)
        n = (COUNT.unpack(v)[0] if v is not None else 0) + by
        if n < 0:  # a reference dropped twice: the tables are wrong, never trust them
            _inexact(txn, self)
            n = 0
        if n:
            txn.put(oid, COUNT.pack(n), db=self.counts)
            txn.delete(oid, db=self.zero)
        else:
            txn.delete(oid, db=self.counts)
            if txn.get(oid, db=self.objects) is not None:
                txn.put(oid, b"", db=self.zero)

    def _add_packbytes(self, txn: lmdb.Transaction, delta: dict[int, int]) -> None:
        for pack, by in delta.items():
            if not by:
                continue
            key = PACKNO.pack(pack)
            v = txn.get(key, db=self.packbytes)
            n = (COUNT.unpack(v)[0] if v is not None else 0) + by
            if n > 0:
                txn.put(key, COUNT.pack(n), db=self.packbytes)
            else:
                txn.delete(key, db=self.packbytes)
                if n < 0:
                    _inexact(txn, self)

    def get_meta(self, key: bytes) -> bytes | None:
        with self.env.begin(db=self.meta) as txn:
            v = txn.get(key)
        return bytes(v) if v is not None else None

    def put_meta(self, key: bytes, value: bytes) -> None:
        with self.env.begin(write=True, db=self.meta) as txn:
            txn.put(key, value)


_CHANGE = struct.Struct("<Q")


def _chunks(items: Iterable[bytes], size: int) -> Iterator[list[bytes]]:
    chunk: list[bytes] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _mapping_of(path: str) -> tuple[int, int]:
    """Start and length of this process's mapping of `path` ((0, 0): none or not Linux)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == path:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    return lo, hi - lo
    except OSError:
        pass
    return 0, 0


_libc: Any = None


def _madvise(addr: int, length: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if length > 0:
        _libc.madvise(addr, length, mmap.MADV_DONTNEED)


def _inexact(txn: lmdb.Transaction, ix: Index) -> None:
    """The accounting cannot be trusted from now on: GC marks in full, a recount fails."""
    txn.delete(COUNTED, db=ix.meta)
    txn.delete(RECOUNT, db=ix.meta)


def _next_change(txn: lmdb.Transaction, ix: Index) -> bytes:
    """A new change counter for `changed` entries this transaction writes."""
    v = txn.get(b"change-seq", db=ix.meta)
    mark = _CHANGE.pack((_CHANGE.unpack(v)[0] if v is not None else 0) + 1)
    txn.put(b"change-seq", mark, db=ix.meta)
    return mark


def _refkey(vol: str, br: str) -> bytes:
    return f"{vol}\0{br}".encode()


def _split_key(key: bytes) -> tuple[str, str]:
    vol, _sep, br = key.decode().partition("\0")
    return vol, br


def apply_op_lmdb(txn: lmdb.Transaction, op: list[Any], ix: Index) -> None:
    kind = op[0]
    if kind == "state":  # the whole state follows in the same commit
        for db in (ix.volumes, ix.refs, ix.leases, ix.policies):
            txn.drop(db, delete=False)
    elif kind == "policy":  # the whole policy of one volume or branch; {} clears it
        key = _refkey(str(op[1]), str(op[2] or ""))
        if op[3]:
            txn.put(key, json.dumps(dict(op[3]), sort_keys=True).encode(), db=ix.policies)
        else:
            txn.delete(key, db=ix.policies)
    elif kind == "vol+":
        vid = str(op[2]) if len(op) > 2 and isinstance(op[2], str) else ""
        txn.put(str(op[1]).encode(), vid.encode(), db=ix.volumes)
    elif kind == "vol-":
        vol = str(op[1])
        txn.delete(vol.encode(), db=ix.volumes)
        prefix = f"{vol}\0".encode()
        for db in (ix.refs, ix.policies):
            cur = txn.cursor(db=db)
            if cur.set_range(prefix):
                while bytes(cur.key()).startswith(prefix):
                    if not cur.delete():
                        break
    elif kind == "lease":
        holder = str(op[5]).encode()
        key = op[6] if len(op) > 6 and isinstance(op[6], bytes) else b""
        txn.put(_refkey(str(op[1]), str(op[2])),
                LEASE.pack(int(op[3]), int(op[4]), key) + holder, db=ix.leases)
    elif kind == "ref":
        key = _refkey(str(op[1]), str(op[2]))
        new = op[4]
        if new is None:
            txn.delete(key, db=ix.refs)
        else:
            txn.put(key, bytes.fromhex(str(new)), db=ix.refs)
