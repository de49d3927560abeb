"""Garbage collection: expiry, mark and sweep, compaction (docs/design.md, "Garbage collection").

One pass (`collect`):

1. **Expire.** `run/*` and `rejected/*` branches whose head is older than
   their volume's `expire_runs` (default one day) are deleted. A leased
   branch is left alone.
2. **Roots.** Every branch head; for branches (not tags) the history the
   volume's policy keeps (`keep_last` snapshots, or those newer than
   `keep_newer` seconds; neither set keeps all history); live pins (mounts
   and steps, through the server); snapshots of leased branches.
3. **Mark** everything the roots reach, reading tree and file nodes only. When
   the index's accounting is exact (reference counts, `index.py`) and no full
   mark was asked for, the pass is incremental instead: under the gate it
   starts from the objects no indexed node names and takes what no root keeps,
   reading only that garbage (`_unreachable`; docs/design.md "GC accounting").
   A count found wrong makes it mark in full, never delete on a guess.
4. **Sweep**, with publishes held off for a moment (`Gate`): mark again from
   whatever moved meanwhile (only new nodes are read), then every indexed
   object that is unmarked, was stored before the pass began, was not
   uploaded or found present by `missing` within `UPLOAD_PIN` seconds, and
   was found unreachable at least `min_age` seconds ago, leaves the index.
   Its snapshots are remembered as expired (reads say so).
5. **Compact.** Live bytes per pack come from the index (no pack is read
   for it; incremental: its `packbytes` table less the garbage). A sealed
   pack under half live has its live objects copied to the active pack
   (their frames as they are); the copies take over in the index.
   With `min_age` 0 the active pack is sealed first, so garbage written
   seconds ago is reclaimed at once.
6. **Delete** packs found empty by an earlier pass (deferred one pass), and
   only once no checkpoint names them (the bucket tier keeps that rule).

Nothing is deleted in the first `PIN_LIFETIME` seconds after the store was
opened unless `min_age` is shorter: pins held through a server that died are
not known to the new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from strata.engine import pack as packfmt
from strata.engine.errors import InvalidInput, NotFound, Unavailable
from strata.engine.index import COUNT, LOC, Index, Loc, _loc
from strata.engine.interface import Lease, SnapshotInfo
from strata.engine.journal import Journal
from strata.engine.objects import BLOCK, FILENODE, ID_LEN, SNAPSHOT, TREE, references
from strata.engine.packstore import PackStore
from strata.engine.recount import FAILED, recount
from strata.engine.refs import Refs
from strata.engine.scratch import Scratch
from strata.engine.storedir import write_durably

DEFAULT_MIN_AGE = 300.0       # seconds an object stays unreachable before it is deleted
DEFAULT_EXPIRE_RUNS = 86400.0  # run/* and rejected/* branches live this long by default
PIN_LIFETIME = 120.0           # pins must be renewed within this
MAX_PINS = 100_000         # the owner's own pins (its mounts and steps)
TOKEN_PINS = 4_096         # one token's pins at once
ALL_TOKEN_PINS = 50_000    # every token's together: never the owner's share
# (done, total, phase): the phases of one pass as they start, for a caller that shows them.
GcProgress = Callable[[int, int, str], None]
PHASES = ("expiring branches", "marking", "sweeping", "compacting")
UPLOAD_PIN = 600.0             # objects uploaded or found present stay this long unpublished
NAMES_BYTES = 16 << 20        # ... and the ids its first taken nodes name, for the sweep
MEMO_ENTRIES = 65_536          # counts and drops an incremental pass keeps in dicts (~10 MiB each)
SWEEP_BATCH = 4_096            # unreachable objects decided and dropped per index transaction
COMPACT_BELOW = 0.5            # a sealed pack under this fraction live is compacted
POLICIES = "policies.json"     # where policies lived before the journal held them
POLICY_FIELDS = ("keep_last", "keep_newer", "expire_runs")
PINS_UNTIL = "pins-until"      # in the store directory: how long granted pins may last
TEMP_PREFIXES = ("run/", "rejected/")
TAG_PREFIX = "tags/"


@dataclass
class Policy:
    keep_last: int | None = None      # snapshots of each branch's history kept
    keep_newer: float | None = None   # seconds: snapshots newer than this are kept
    expire_runs: float = DEFAULT_EXPIRE_RUNS

    def keeps(self, depth: int, age: float) -> bool:
        """Whether the snapshot `depth` steps behind a head (0: the head), `age` s old, stays."""
        if depth == 0 or (self.keep_last is None and self.keep_newer is None):
            return True
        return ((self.keep_last is not None and depth < self.keep_last)
                or (self.keep_newer is not None and age < self.keep_newer))


class Policies:
    """Retention policies per volume and branch, kept in the journal ("policy" ops).

    So they are in the packs, replayed by an index rebuild, named by GC's
    `["state"]` commit and carried by bucket checkpoints: a store restored
    from its bucket keeps them. None set keeps every snapshot: when in doubt, keep.
    """

    def __init__(self, refs: Refs, journal: Journal) -> None:
        self._refs = refs
        self._journal = journal

    def load(self) -> dict[str, dict[str, Any]]:
        """Every policy set, by `volume` or `volume@branch`."""
        return {f"{v}@{b}" if b else v: dict(f)
                for (v, b), f in sorted(self._refs.policies.items())}

    def get(self, volume: str, branch: str) -> Policy:
        pols = self._refs.policies
        merged: dict[str, Any] = {}
        merged.update(pols.get((volume, ""), {}))
        merged.update(pols.get((volume, branch), {}))
        return Policy(**{k: v for k, v in merged.items() if k in POLICY_FIELDS})

    def set(self, volume: str, branch: str | None, **fields: Any) -> Policy:
        """Change some fields (None unsets one); durable when this returns."""
        for k, v in fields.items():
            if k not in POLICY_FIELDS:
                raise InvalidInput(f"unknown policy field {k!r}")
            if v is not None and (not isinstance(v, (int, float)) or v < (1 if k == "keep_last"
                                                                          else 0)):
                raise InvalidInput(f"policy {k} must be a positive number")
        refs = self._refs

        def ops() -> list[list[Any]]:  # under the journal's append lock: no lost update
            cur = dict(refs.pending_policies.get((volume, branch or ""), {}))
            cur.update(fields)
            return [["policy", volume, branch or None,
                     {k: v for k, v in sorted(cur.items()) if v is not None}]]

        journal = self._journal
        journal.wait_durable(journal.commit(ops))
        return self.get(volume, branch or "")

    def migrate_file(self, store_dir: str) -> None:
        """Move a `policies.json` (where policies lived before the journal) into the journal."""
        path = os.path.join(store_dir, POLICIES)
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read())
        except FileNotFoundError:
            return
        if not isinstance(data, dict) or data.get("version") != 1:
            raise InvalidInput(f"{path}: unknown policy file version")
        for key, fields in sorted(dict(data["policies"]).items()):
            volume, _sep, branch = str(key).partition("@")
            if volume in self._refs.pending_vols:  # a deleted volume's went with it
                self.set(volume, branch or None,
                         **{k: v for k, v in dict(fields).items() if k in POLICY_FIELDS})
        os.unlink(path)  # every policy it held is durable in the journal now


class Gate:
    """Publishes share it; the sweep holds it alone for a moment (readers never wait)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True  # new publishes wait from now on
            while self._shared:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class Pins:
    """Snapshots held by running mounts and steps (through the server), renewed or lost.

    Pins live in memory only; the store directory remembers how long they may
    last (`PINS_UNTIL`, written before a pin or renewal is granted that outlives
    what it says), so that the next owner of the store, after a crash or a
    restart, deletes nothing while a pin granted by this one may still be held.
    """

    def __init__(self, store_dir: str | None = None) -> None:
        self._lock = threading.Lock()
        self._pins: dict[str, tuple[str, float]] = {}  # id -> (snapshot, expiry)
        # Who holds each pin: "" the owner, else a token id. A token holder pins up to
        # TOKEN_PINS, all tokens together ALL_TOKEN_PINS; the owner's share is apart.
        self._holder: dict[str, str] = {}
        self._held: dict[str, int] = {}  # holder -> pins it holds
        self._path = os.path.join(store_dir, PINS_UNTIL) if store_dir else None
        # Wall clock: the earlier owner's pins may be held until then (0: none).
        self.inherited = _read_until(self._path) if self._path else 0.0
        self._until = self.inherited
        # Asked before a pin is granted or renewed for that many seconds, outside the
        # lock: a fleet member records the pin in its lease first (fleet/lease.py).
        self.cover: Callable[[float], None] | None = None

    def pin(self, sid: str, ttl: float, holder: str = "") -> str:
        """Pin `sid`; `holder` is the token id asking ("": the owner)."""
        pid = os.urandom(16).hex()
        if self.cover is not None:
            self.cover(_ttl(ttl))
        with self._lock:
            if self._full_locked(holder):
                self.live_locked()
                if self._full_locked(holder):
                    if holder:
                        raise Unavailable(f"this token holds {self._held.get(holder, 0)} pins "
                                          f"(tokens may hold {TOKEN_PINS} each, "
                                          f"{ALL_TOKEN_PINS} together): release some first")
                    raise Unavailable(f"{MAX_PINS} pins are held: release some first")
            ttl = _ttl(ttl)
            self._extend_locked(ttl)
            self._pins[pid] = (sid, time.monotonic() + ttl)
            self._holder[pid] = holder
            self._held[holder] = self._held.get(holder, 0) + 1
        return pid

    def _full_locked(self, holder: str) -> bool:
        if not holder:
            return self._held.get("", 0) >= MAX_PINS
        tokens = len(self._pins) - self._held.get("", 0)
        return self._held.get(holder, 0) >= TOKEN_PINS or tokens >= ALL_TOKEN_PINS

    def _drop_locked(self, pid: str) -> None:
        if self._pins.pop(pid, None) is None:
            return
        holder = self._holder.pop(pid, "")
        left = self._held.get(holder, 1) - 1
        if left:
            self._held[holder] = left
        else:
            self._held.pop(holder, None)

    def renew(self, pid: str, ttl: float) -> None:
        if self.cover is not None:
            self.cover(_ttl(ttl))
        with self._lock:
            cur = self._pins.get(pid)
            if cur is None or cur[1] < time.monotonic():
                self._drop_locked(pid)
                raise NotFound("no such pin (expired or released)")
            ttl = _ttl(ttl)
            self._extend_locked(ttl)
            self._pins[pid] = (cur[0], time.monotonic() + ttl)

    def grace_left(self) -> float:
        """Seconds an earlier owner's pins may still be held (0: none can be)."""
        return max(0.0, self.inherited - time.time())

    def _extend_locked(self, ttl: float) -> None:
        # Half a lifetime of slack: at most one write (three fsyncs) a minute.
        if self._path is None or time.time() + ttl <= self._until:
            return
        until = time.time() + ttl + PIN_LIFETIME / 2
        _write_until(self._path, until)
        self._until = until

    def closed_cleanly(self) -> None:
        """The owner is closing: no pin lives on in anyone's memory but the holders'."""
        # An earlier owner's horizon still running stays for the next one.
        if self._path is not None and not self.live() and self.inherited <= time.time():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)

    def release(self, pid: str) -> None:
        with self._lock:
            self._drop_locked(pid)

    def live(self) -> set[str]:
        with self._lock:
            return self.live_locked()

    def live_locked(self) -> set[str]:
        now = time.monotonic()
        for pid in [p for p, (_s, exp) in self._pins.items() if exp < now]:
            self._drop_locked(pid)
        return {sid for sid, _exp in self._pins.values()}


def inherit_unknown_pins(store_dir: str) -> None:
    """A store restored from elsewhere: its last owner's pins are unknown, so wait them out.

    Restore and takeover call this: the owner being replaced may have granted
    pins (to mounts and steps on other machines) that this store directory
    never heard of, and they may be renewed against the new owner.
    """
    _write_until(os.path.join(store_dir, PINS_UNTIL), time.time() + 1.5 * PIN_LIFETIME)


def inherit_pins(store_dir: str, seconds: float) -> None:
    """A restored store whose last owner's pins are known to last `seconds` more at most.

    Replaces the blanket wait of `inherit_unknown_pins` (a fleet lease records
    the span, fleet/lease.py); 0 lets GC delete at once.
    """
    _write_until(os.path.join(store_dir, PINS_UNTIL), time.time() + max(0.0, seconds))


def _read_until(path: str) -> float:
    """The pin horizon an earlier owner left; a damaged file waits the longest."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return 0.0
    except (OSError, ValueError):
        return time.time() + 1.5 * PIN_LIFETIME  # when in doubt, keep
    if not isinstance(data, dict) or data.get("version") != 1:
        raise InvalidInput(f"{path}: unknown pin horizon file version")
    until = data.get("until")
    if not isinstance(until, (int, float)):
        return time.time() + 1.5 * PIN_LIFETIME
    # A clock set back must not stretch the wait past what a pin can last.
    return min(float(until), time.time() + 1.5 * PIN_LIFETIME)


def _write_until(path: str, until: float) -> None:
    write_durably(path, json.dumps({"version": 1, "until": until}).encode())


def _ttl(ttl: float) -> float:
    if not isinstance(ttl, (int, float)) or not 0 < ttl <= PIN_LIFETIME:
        raise InvalidInput(f"a pin lasts more than 0 and at most {PIN_LIFETIME:g} seconds")
    return float(ttl)


@dataclass
class Report:
    dry_run: bool
    min_age: float
    started: float = field(default_factory=time.time)
    seconds: float = 0.0
    branches_expired: list[str] = field(default_factory=list)
    snapshots_retained: int = 0
    objects_live: int = 0
    objects_unreachable: int = 0
    objects_deleted: int = 0
    snapshots_expired: int = 0
    bytes_freed: int = 0          # of objects dropped (reclaimed once their packs go)
    packs_compacted: list[int] = field(default_factory=list)
    bytes_copied: int = 0
    packs_deleted: list[int] = field(default_factory=list)
    bytes_reclaimed: int = 0      # pack bytes given back to the disk (and the bucket)
    live_bytes: int = 0
    dead_bytes: int = 0
    waiting: str | None = None    # why nothing was deleted yet
    mode: str = "incremental"     # or "full": every retained snapshot's tree was marked
    objects_examined: int = 0     # index entries looked at (full: all of them)
    fallback: str | None = None   # why a pass meant to be incremental marked in full
    checked: dict[str, int] | None = None  # a full pass's check of the accounting
    recount: dict[str, Any] | None = None  # the accounting recounted first (engine/recount.py)
    # Packs this pass emptied (or compacted): deleted by the next pass, once nothing that
    # began before this one can still read them. Their bytes are still on disk now.
    packs_pending: list[int] = field(default_factory=list)
    bytes_pending: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Collectable(Protocol):
    """What a GC pass uses of a store (engine/local.py's `LocalStore` is the one).

    Named here so this module needs nothing above it: the store passes its
    journal and packs in beside itself, as engine/fsck.py gets them.
    """

    gc_lock: threading.Lock
    gate: Gate
    path: str  # the store directory: a full mark keeps its set in its scratch/
    pins: Pins
    policies: Policies

    @property
    def index(self) -> Index: ...
    def gc_blocked(self) -> str | None: ...
    def sync_index(self) -> None: ...
    def opened_for(self) -> float: ...
    def upload_pins(self) -> set[bytes]: ...
    def list_volumes(self) -> list[str]: ...
    def list_branches(self, volume: str) -> dict[str, str]: ...
    def snapshot(self, sid: str) -> SnapshotInfo: ...
    def lease_of(self, volume: str, branch: str) -> Lease | None: ...
    def delete_branch(self, volume: str, branch: str) -> None: ...
    def object_kind(self, oid: bytes) -> int | None: ...
    def get_object(self, oid: bytes) -> bytes: ...
    def forget(self, gone: dict[bytes, tuple[Loc, list[bytes]]],
               expired: list[bytes]) -> None: ...
    def remove_pack(self, number: int) -> None: ...


def collect(store: Collectable, journal: Journal, packs: PackStore, *,
            min_age: float = DEFAULT_MIN_AGE, dry_run: bool = False,
            progress: GcProgress | None = None, full: bool = False) -> dict[str, Any]:
    """One GC pass over `store` (see the module docstring); returns its report.

    `journal` and `packs` are the store's own: the pass seals and copies
    through the one and sizes and reads packs through the other. `full` marks
    from every root even when the accounting would do, and checks the one
    against the other.
    """
    if min_age < 0:
        raise InvalidInput("min age cannot be negative")
    with store.gc_lock:
        report = Report(dry_run=dry_run, min_age=min_age)
        t0 = time.monotonic()
        _pass(store, journal, packs, report, min_age, dry_run,
              progress or (lambda _d, _t, _p: None), full)
        report.seconds = round(time.monotonic() - t0, 4)
        out = report.as_dict()
        if not dry_run:
            store.index.put_meta(b"gc-last", json.dumps(out).encode())
        return out


def _pass(store: Collectable, journal: Journal, packs: PackStore, report: Report,
          min_age: float, dry_run: bool, progress: GcProgress, full: bool) -> None:
    blocked = store.gc_blocked()
    if blocked is not None:
        raise Unavailable(blocked)
    if not dry_run and min_age == 0:
        journal.seal_now()  # garbage in the active pack becomes compactable
    store.sync_index()
    start = journal.end()  # objects stored from here on are never this pass's garbage
    now = time.time()

    # 1. expire temporary branches
    progress(0, len(PHASES), PHASES[0])
    for vol in store.list_volumes():
        for br, head in sorted(store.list_branches(vol).items()):
            if not br.startswith(TEMP_PREFIXES):
                continue
            pol = store.policies.get(vol, br)
            age = now - store.snapshot(head).time_ns / 1e9
            if age > pol.expire_runs and store.lease_of(vol, br) is None:
                report.branches_expired.append(f"{vol}@{br}")
                if not dry_run:
                    with contextlib.suppress(NotFound):
                        store.delete_branch(vol, br)

    # 2.-4. roots, mark and sweep. Incremental when the accounting is exact and no full
    # mark was asked for: only what no indexed node names is examined (docs/design.md,
    # "GC accounting"); otherwise, or when the accounting is found wrong, a full mark.
    progress(1, len(PHASES), PHASES[1])
    skip = set(report.branches_expired) if dry_run else set()
    if (not dry_run and not store.index.counted()
            and store.index.get_meta(FAILED) is None):
        # A restored index (or accounting found wrong): recount it in place rather
        # than mark in full for good. It reads every indexed node once.
        report.recount = recount(store.index, packs, store.path)
    counted = store.index.counted()
    report.mode = "incremental" if counted and not full else "full"
    with contextlib.ExitStack() as scratch:
        # A full mark's set, on disk (engine/scratch.py): memory stays bounded whatever
        # the store holds. Made only when a full mark runs.
        marks: list[Scratch] = []

        def live() -> Scratch:
            if not marks:
                marks.append(scratch.enter_context(Scratch(store.path, "gc-marked")))
            return marks[0]

        roots: set[bytes] = set()
        if report.mode == "full":
            roots = _roots(store, now, report, skip=skip, noted=not full)
            _mark(store, roots, live())
            report.snapshots_retained = len(roots)
        progress(2, len(PHASES), PHASES[2])
        young_pins = store.upload_pins()
        # Pins an earlier owner granted are not known here: wait them out. Without any
        # (a clean close with none held), only `min_age` shortens the wait after opening.
        inherited = store.pins.grace_left()
        grace = inherited > 0 or store.opened_for() < min(PIN_LIFETIME, min_age)
        with store.gate.exclusive():
            store.sync_index()
            pinned = store.upload_pins() | young_pins
            incr: Unreachable | None = None
            if counted:
                keep = _roots(store, now, report if report.mode == "incremental" else None,
                              skip=skip)
                if report.mode == "incremental":
                    report.snapshots_retained = len(keep)
                try:
                    incr = _unreachable(store, keep | pinned, start, scratch,
                                        names=report.mode == "incremental")
                except _Inexact as exc:
                    incr = None
                    report.fallback = f"the accounting is inexact ({exc}): marked in full"
            live_bytes: dict[int, int] = {}
            compare: _Compare | None = None
            candidates: Iterator[tuple[bytes, Loc]]
            if report.mode == "full" or incr is None:
                if report.mode == "incremental":  # fall back: mark everything now
                    report.mode = "full"
                    roots = _roots(store, now, None, skip=skip)
                    _mark(store, roots, live())
                if full:  # read every snapshot; the history memo must have kept the same
                    kept = _kept(store, now, skip, noted=False)
                    _check_history(store, _kept(store, now, skip, noted=True), kept, report)
                    again = kept | {bytes.fromhex(s) for s in store.pins.live()}
                else:
                    again = _roots(store, now, None, skip=skip)
                _mark(store, again - roots, live())
                _mark_nodes(store, pinned, live())
                report.objects_live = len(live())
                candidates = _unmarked(store, live(), start, live_bytes, report)
                if incr is not None:
                    compare = _Compare(incr)  # checked as the sweep goes
                elif report.fallback is not None and not dry_run:
                    store.index.uncount()  # found wrong: full marks until a rebuild
            else:
                report.objects_examined = incr.examined
                live_bytes = store.index.pack_bytes()
                for _o, loc in incr.items():
                    live_bytes[loc.pack] = live_bytes.get(loc.pack, 0) - loc.length
                report.objects_live = store.index.count_objects() - incr.count
                candidates = incr.items()
            waiting = _sweep(store, candidates, counted, grace, inherited, min_age, report,
                             compare, incr if compare is None else None)
            if compare is not None:
                compare.finish(store, report)
    report.live_bytes = sum(live_bytes.values())

    # 5.-6. compaction and deferred deletion
    progress(3, len(PHASES), PHASES[3])
    active = journal.end()[0]
    empty_before = _load_empty(store)
    empty_now: list[int] = []
    compact: list[int] = []
    for n in packs.numbers():
        if n >= active or waiting.get(n):
            continue
        size = packs.size(n)
        live_b = live_bytes.get(n, 0)
        if live_b == 0:
            if n in empty_before and not dry_run:  # a bucket's copy: see TieredPacks.remove
                store.remove_pack(n)
                report.packs_deleted.append(n)
                report.bytes_reclaimed += size
            else:
                empty_now.append(n)  # deleted by the next pass
        elif live_b < COMPACT_BELOW * size:
            compact.append(n)
            report.packs_compacted.append(n)
            report.bytes_copied += live_b
    if not dry_run:
        if compact:
            _compact(store, journal, packs, set(compact))
            empty_now += compact
        store.index.put_meta(b"gc-empty", json.dumps(empty_now).encode())
    for n in empty_now if not dry_run else empty_now + compact:
        report.packs_pending.append(n)
        report.bytes_pending += packs.size(n)
    progress(len(PHASES), len(PHASES), "done")


def _load_empty(store: Collectable) -> set[int]:
    raw = store.index.get_meta(b"gc-empty")
    return set(json.loads(raw)) if raw else set()


def _roots(store: Collectable, now: float, report: Report | None, skip: set[str],
           *, noted: bool = True) -> set[bytes]:
    """Snapshot ids every retention rule and pin keeps."""
    out = _kept(store, now, skip, noted=noted)
    out.update(bytes.fromhex(s) for s in store.pins.live())
    return out


def _kept(store: Collectable, now: float, skip: set[str], *, noted: bool) -> set[bytes]:
    """Every branch head and the history each branch's policy keeps.

    A branch's history is walked by parent links from its head until the policy
    lets a snapshot go or one is gone (expired by an earlier pass). With `noted`,
    a snapshot's parent and time come from the index's `history` memo when an
    earlier walk noted them, so a pass reads only the snapshots published since
    the last one; the memo holds immutable facts of content-addressed objects,
    and whether each snapshot is still there is asked of the index, as reading
    it would. Without `noted` every snapshot is read (a full pass, as a check).
    """
    ix = store.index
    new: list[tuple[bytes, bytes | None, int]] = []

    def facts(sid: bytes) -> tuple[bytes | None, int] | None:
        if noted:
            if store.object_kind(sid) is None:
                return None  # as reading it would say: NotFound
            got = ix.history_of(sid)
            if got is not None:
                return got
        try:
            info = store.snapshot(sid.hex())
        except NotFound:
            return None
        parent = bytes.fromhex(info.parent) if info.parent else None
        if noted:  # a check (not `noted`) must not mend what it checks
            new.append((sid, parent, info.time_ns))
        return parent, info.time_ns

    out: set[bytes] = set()
    for vol in store.list_volumes():
        for br, head in store.list_branches(vol).items():
            if f"{vol}@{br}" in skip:
                continue
            sid = bytes.fromhex(head)
            out.add(sid)
            if br.startswith(TAG_PREFIX):
                continue  # a tag keeps its snapshot, not that snapshot's history
            pol = store.policies.get(vol, br)
            got = facts(sid)
            if got is None:
                store.snapshot(head)  # a head that is gone: say so, as reading it does
                continue
            cur, depth = got[0], 1
            while cur is not None:
                got = facts(cur)
                if got is None or not pol.keeps(depth, now - got[1] / 1e9):
                    break
                out.add(cur)
                cur, depth = got[0], depth + 1
    if new:
        ix.note_history(new)
    return out


def _check_history(store: Collectable, noted: set[bytes], read: set[bytes],
                   report: Report) -> None:
    """A full pass compares the roots found through the history memo with those it read."""
    wrong = len(read ^ noted)
    report.checked = {**(report.checked or {}), "history_roots_wrong": wrong}
    if wrong and not report.dry_run:
        store.index.clear_history()
        report.fallback = (f"the history memo gave {wrong} roots that reading the "
                           "snapshots did not: it is cleared")


def _mark(store: Collectable, snapshots: set[bytes], live: Scratch) -> None:
    _walk(store, [(SNAPSHOT, s) for s in snapshots], live)


def _mark_nodes(store: Collectable, oids: set[bytes], live: Scratch) -> None:
    """Objects pinned by uploads: keep them and what they refer to."""
    todo = []
    for oid in oids:
        kind = store.object_kind(oid)
        if kind is not None:
            todo.append((kind, oid))
    _walk(store, todo, live)


def _walk(store: Collectable, todo: list[tuple[int, bytes]], live: Scratch) -> None:
    # Depth first: the stack holds the references of one node per level (a tree node's
    # entries), never a level of the whole store, as a breadth-first walk would.
    while todo:
        kind, oid = todo.pop()
        if oid in live:
            continue
        live.put(oid)
        if kind in (TREE, SNAPSHOT, FILENODE):  # blocks refer to nothing
            try:
                raw = store.get_object(oid)
            except NotFound:
                continue  # already gone (a hole fsck reports); nothing to follow
            todo.extend(references(kind, raw))


def _unmarked(store: Collectable, live: Scratch, start: tuple[int, int],
              live_bytes: dict[int, int], report: Report) -> Iterator[tuple[bytes, Loc]]:
    """Indexed objects stored before `start` that the mark did not reach, in id order.

    Adds up the indexed bytes of the rest per pack into `live_bytes` as it goes.
    The mark set is asked `SWEEP_BATCH` ids at a time.
    """
    batch: list[tuple[bytes, Loc]] = []

    def sort_out() -> Iterator[tuple[bytes, Loc]]:
        marked = live.contains_many([o for o, _l in batch])
        for (oid, loc), reached in zip(batch, marked, strict=True):
            if reached or (loc.pack, loc.offset) >= start:
                live_bytes[loc.pack] = live_bytes.get(loc.pack, 0) + loc.length
            else:
                yield oid, loc
        batch.clear()

    for item in store.index.iter_objects():
        report.objects_examined += 1
        batch.append(item)
        if len(batch) >= SWEEP_BATCH:
            yield from sort_out()
    yield from sort_out()


def _sweep(store: Collectable, candidates: Iterator[tuple[bytes, Loc]],
           counted: bool, grace: bool, inherited: float,
           min_age: float, report: Report, compare: _Compare | None,
           incr: Unreachable | None) -> dict[int, int]:
    """Decide on the unreachable `candidates` (in id order) and drop those due, in batches.

    A batch of `SWEEP_BATCH` is noted in the `dead` table, and those unreachable
    for `min_age` leave the index, in a transaction or two of its own: the pass
    never holds its whole garbage (the caller holds the gate throughout).
    Returns the bytes per pack of those left waiting (unreachable but not for
    long enough: still indexed, so their packs stay whole). `incr`, when the
    candidates are its own, gives what the nodes it kept the names of name.
    """
    dry_run = report.dry_run
    waiting: dict[int, int] = {}
    now_ns = time.time_ns()
    cutoff = now_ns - int(min_age * 1e9)
    after: list[bytes] = []  # the last id of the batch before
    batch: list[tuple[bytes, Loc]] = []

    def decide(last: bool) -> None:
        ids = [o for o, _l in batch]
        since = (store.index.mark_dead(ids, now_ns, after[0] if after else None, last)
                 if not dry_run else [0] * len(ids))
        if compare is not None:
            compare.saw(ids)
        report.objects_unreachable += len(batch)
        report.dead_bytes += sum(loc.length for _o, loc in batch)
        doomed = [(o, loc) for (o, loc), t in zip(batch, since, strict=True) if t <= cutoff]
        if grace and doomed:
            report.waiting = (
                f"pins granted before the store was opened may be held for {inherited:.0f} s "
                "more: nothing is deleted until then" if inherited > 0 else
                f"the store opened {store.opened_for():.0f} s ago: nothing is "
                f"deleted before one pin lifetime ({PIN_LIFETIME:g} s)")
            doomed = []
        gone_ids = {o for o, _l in doomed}
        for o, loc in batch:
            if o not in gone_ids:
                waiting[loc.pack] = waiting.get(loc.pack, 0) + loc.length
        report.objects_deleted += len(doomed)
        report.bytes_freed += sum(loc.length for _o, loc in doomed)
        expired = [o for o, loc in doomed if loc.kind == SNAPSHOT]
        report.snapshots_expired += len(expired)
        if not dry_run and doomed:
            gone: dict[bytes, tuple[Loc, list[bytes]]] = {}
            for o, loc in doomed:
                known = incr.names.pop(o, None) if incr is not None else None
                names = ([known[i:i + ID_LEN] for i in range(0, len(known), ID_LEN)] if known
                         else _names(store, loc, o, counted))  # else read again
                if names is None:  # unreadable: what it names cannot be let go exactly
                    store.index.uncount()
                gone[o] = (loc, names or [])
            store.forget(gone, expired)
        if batch:
            after[:] = [batch[-1][0]]
        batch.clear()

    for item in candidates:
        batch.append(item)
        if len(batch) >= SWEEP_BATCH:
            decide(False)
    decide(True)
    return waiting


def _compact(store: Collectable, journal: Journal, packs: PackStore,
             numbers: set[int]) -> None:
    """Copy the live objects of packs `numbers` forward; the copies take over in the index.

    Frames are copied as they are (their checksums do not cover the pack's marker),
    each given the marker of the pack it lands in.
    The old packs stay until a later pass finds them empty. Each pack's records
    are scanned and kept where the index still points at them: the work grows
    with the packs compacted, not with the index.
    """
    batch: list[tuple[bytes, int, bytes]] = []
    for oid, loc in _indexed_in(store, packs, sorted(numbers)):
        frame = packs.pread(loc.pack, loc.length, loc.offset)
        if len(frame) != loc.length:
            raise NotFound(f"pack {packfmt.pack_name(loc.pack)} is shorter than its index says")
        # Without its marker, which is the pack's own: 16 random bytes, or a version 1
        # pack's 2-byte "SR" (cutting 16 there once left copies no reader could parse).
        batch.append((oid, loc.kind, frame[len(packs.info(loc.pack).sync):]))
        if len(batch) >= 256:
            journal.wait_durable(journal.copy_objects(batch))
            batch = []
    if batch:
        journal.wait_durable(journal.copy_objects(batch))
    store.sync_index()


def _indexed_in(store: Collectable, packs: PackStore, numbers: list[int]
                ) -> Iterator[tuple[bytes, Loc]]:
    """The objects of packs `numbers` whose index entry points at that very frame.

    Each pack is scanned a record at a time (its mapped pages handed back as the
    scan goes), not read into a list of its records.
    """
    for n in numbers:
        with packs.mapped(n) as data:
            _result, records = packfmt.scan_stream(data, packfmt.pack_name(n))
            for r in records:
                if r.rtype != packfmt.R_OBJECT:
                    continue
                _kind, oid, _n = packfmt.OBJ_HEAD.unpack_from(r.payload)
                loc = store.index.locate(oid)
                if loc is not None and loc.pack == n and loc.offset == r.offset:
                    yield oid, loc


class _Inexact(Exception):
    """The accounting disagrees with what the objects say: mark in full instead."""


@dataclass
class Unreachable:
    objects: Scratch    # unreachable, stored before the pass began: id -> its `LOC` bytes
    count: int = 0      # how many
    examined: int = 0   # index entries looked at
    # What the first taken nodes name (their ids joined), up to `NAMES_BYTES`: the
    # sweep lets those references go without reading the nodes a second time.
    names: dict[bytes, bytes] = field(default_factory=dict)
    names_bytes: int = 0

    def items(self) -> Iterator[tuple[bytes, Loc]]:
        """The objects in id order, with where each is."""
        for oid, raw in self.objects.items():
            yield oid, _loc(LOC.unpack(raw))


def _unreachable(store: Collectable, keep: set[bytes], start: tuple[int, int],
                 scratch: contextlib.ExitStack, *, names: bool = True) -> Unreachable:
    """Every indexed object stored before `start` that nothing in `keep` reaches.

    Proportional to the garbage in time, bounded in memory: it starts from the
    objects no indexed node names (the `zero` table: snapshots and the tops of
    garbage), takes those not kept, and follows their references down, taking an
    object once every indexed node that names it is taken (its reference count
    equals the references dropped). What it took and the references dropped so
    far are scratch tables on disk (`scratch` closes them); the stack holds the
    names of one node per level. Objects in `keep` the index lacks yet (uploads
    not durable) are read, and what they name is kept too. Raises `_Inexact`
    when a count is below what was dropped or a taken node cannot be read.
    With `names`, what the first taken nodes name is kept for the sweep.
    """
    ix = store.index
    keep = set(keep)
    todo_keep = [o for o in keep if not ix.contains(o)]
    while todo_keep:  # unindexed roots: what they name is not counted, so keep it
        oid = todo_keep.pop()
        kind = store.object_kind(oid)
        if kind is None or kind == BLOCK:
            continue
        try:
            refs = references(kind, store.get_object(oid))
        except (NotFound, ValueError):
            continue
        for _k, o in refs:
            if o not in keep:
                keep.add(o)
                if not ix.contains(o):
                    todo_keep.append(o)
    out = Unreachable(scratch.enter_context(Scratch(store.path, "gc-unreachable")))
    dropped = scratch.enter_context(Scratch(store.path, "gc-dropped"))
    taken = out.objects
    # The same nodes are named by many garbage nodes (every old root tree names most
    # directories): their counts, which hold still under the gate, and the references
    # dropped so far are kept in dicts of at most `MEMO_ENTRIES` (then the counts are
    # asked again, and the drops go to `dropped`). At a million objects, with the
    # sweep's summed count updates, this took the index lookups of a pass after 1,000
    # publishes from about 300k to about 100k.
    counts: dict[bytes, int] = {}
    drops: dict[bytes, int] = {}

    def count_of(named: list[bytes]) -> list[int]:  # `named` holds each id once
        ask = [o for o in named if o not in counts]
        if len(counts) + len(ask) > MEMO_ENTRIES:
            counts.clear()
            ask = named
        counts.update(zip(ask, ix.ref_counts(ask), strict=True))
        return [counts[o] for o in named]

    def drop(o: bytes) -> int:
        n = drops.get(o)
        if n is None:
            raw = dropped.get(o)
            n = COUNT.unpack(raw)[0] if raw else 0
        drops[o] = n + 1
        if len(drops) >= MEMO_ENTRIES:
            for k, v in drops.items():
                dropped.put(k, COUNT.pack(v))
            drops.clear()
        return n + 1

    def take(first: bytes, first_loc: Loc) -> None:
        stack = [(first, first_loc)]
        while stack:
            oid, loc = stack.pop()
            if oid in taken:
                continue
            taken.put(oid, LOC.pack(*loc))
            out.count += 1
            named = _names(store, loc, oid, True)
            if named is None:
                raise _Inexact(f"object {oid.hex()} cannot be read")
            if names and named and out.names_bytes < NAMES_BYTES:  # for the sweep
                out.names[oid] = b"".join(named)
                out.names_bytes += ID_LEN * len(named) + 160  # and the entry's own cost
            named = [o for o in named if o not in keep and o not in taken]
            out.examined += len(named)
            for o, count in zip(named, count_of(named), strict=True):
                n = drop(o)
                if n > count:
                    raise _Inexact(f"object {o.hex()} is named more often than counted")
                if n == count:  # its last namer taken: it is garbage too
                    oloc = ix.locate(o)
                    if oloc is not None and (oloc.pack, oloc.offset) < start:
                        stack.append((o, oloc))

    for oid, loc in ix.unnamed():
        out.examined += 1
        if oid not in keep and (loc.pack, loc.offset) < start:
            take(oid, loc)
    return out


def _names(store: Collectable, loc: Loc, oid: bytes, counted: bool) -> list[bytes] | None:
    """The distinct ids an object names ([] for a block or when nothing is counted)."""
    if loc.kind == BLOCK or not counted:
        return []
    try:
        return list(dict.fromkeys(o for _k, o in references(loc.kind, store.get_object(oid))))
    except (NotFound, ValueError):
        return None


class _Compare:
    """A full mark checks the accounting; one it would have let delete a live object is dropped.

    Fed the full mark's unreachable objects a batch at a time by the sweep. The
    full mark may find more (an object named only by a node stored during the
    pass, which the accounting counts): that is reported, never wrong.
    """

    def __init__(self, incr: Unreachable) -> None:
        self.incr = incr
        self.full = 0      # unreachable by the full mark
        self.matched = 0   # of those, taken by the accounting too

    def saw(self, ids: list[bytes]) -> None:
        self.full += len(ids)
        self.matched += sum(self.incr.objects.contains_many(ids))

    def finish(self, store: Collectable, report: Report) -> None:
        wrong = self.incr.count - self.matched
        report.checked = {**(report.checked or {}),
                          "incremental_unreachable": self.incr.count,
                          "full_unreachable": self.full, "live_in_full_mark": wrong,
                          "missed_by_accounting": self.full - self.matched}
        if wrong and not report.dry_run:
            store.index.uncount()
            report.fallback = (f"the accounting took {wrong} live objects for garbage: "
                               "it is dropped, and passes mark in full until the index is "
                               "rebuilt")
