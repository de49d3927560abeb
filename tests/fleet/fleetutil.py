"""A fleet for tests: members as real processes, clients that keep a history, a checker.

`Fleet` starts `strata fleet join` processes (on loopback, or each in a
network namespace of `Hosts` with moto in the bucket's namespace) and can
SIGKILL, SIGSTOP/SIGCONT and restart them. `Publishers` publish one new
file per commit through any member (`FleetStore`) and record every
attempt: when it started and ended, whether it was acknowledged, the head it
returned and the owner and epoch that answered. `check` is the checker:

1. every acknowledged publish is in the store's final history (`--sync
   bucket`): its head is on the final chain, and its file is in the final
   tree;
2. heads only move forward along one chain: each acknowledged head is an
   ancestor of (or is) the final head, and for two acknowledgements one after
   the other in real time, the later one's head is not behind the earlier's;
3. no two owners acknowledged in overlapping epochs: an acknowledgement by
   epoch e never comes after (in real time) one by a later epoch e' > e;
4. (`check_window`) with the default sync, every acknowledged publish
   missing from the final history was acknowledged within the stated loss
   window of a fault that hit the member that acknowledged it: no earlier
   than `LOSS_WINDOW` before the fault began, no later than the owner's
   lease window (`ACK_WINDOW`) after it (or after a bucket-wide fault ended),
   or within the ship-lag gate's tail of its epoch (`gate_tail`);
5. (`check_fences`) GC never deleted anything a fence depends on: every
   owner-log record `LogWatch` ever saw is still in the bucket, the log has
   no gap, and a stalled old owner's create-only write of its next record
   (the number its successor's claim took: each epoch seen) fails.

`Faults` records when each fault began and ended (for 4); `Churn` keeps GC
deleting throughout (garbage written and dropped under a `keep_last`
policy, and a GC pass with a short `min_age` every three seconds).
"""

from __future__ import annotations

import bisect
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from serverutil import free_port
from strata.engine.bucket import Bucket, OwnerLog, log_name
from strata.engine.errors import AlreadyExists, Expired, NotFound, StrataError
from strata.engine.objects import Snapshot
from strata.engine.seal import new_key, write_key_file
from strata.engine.txn import Transaction
from strata.fleet.client import FleetStore
from strata.fleet.lease import LEASE_TTL, ack_window
from strata.fleet.records import FleetRecords, store_url
from strata_harness import STRATA

FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


def wall_env(offset: float) -> dict[str, str]:
    """What runs a member with its wall clock `offset` seconds off, its monotonic clock not.

    libfaketime (Debian's `faketime`). Its 0.9.10 breaks Python's `time.sleep`
    (EINVAL), so faketime/sitecustomize.py makes that a relative wait.
    """
    assert os.path.exists(FAKETIME_LIB), f"{FAKETIME_LIB} is missing: make deps installs faketime"
    shim = str(Path(__file__).with_name("faketime"))
    return {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"{offset:+.0f}s",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH"))
                                          if p)}


@dataclass
class MemberProc:
    name: str
    ip: str
    port: int
    dir: Path
    prefix: tuple[str, ...]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    stopped: bool = False

    @property
    def addr(self) -> str:
        return f"http://{self.ip}:{self.port}"


class Fleet:
    def __init__(self, url: str, root: Path, env: dict[str, str], *,
                 broken: str = "") -> None:
        self.url = url
        self.root = root
        self.env = env
        self.broken = broken
        self.key = root / "fleet.key"
        if not self.key.exists():
            write_key_file(str(self.key), new_key())
        self.members: dict[str, MemberProc] = {}
        self.records = FleetRecords(url)
        # Each store's final history, read once (`final_history`): after the run only.
        self.finals: dict[tuple[str, str], tuple[dict[str, int], set[str]]] = {}

    def add(self, name: str, *, ip: str = "127.0.0.1", prefix: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> MemberProc:
        m = MemberProc(name, ip, free_port(), self.root / f"member-{name}", prefix,
                       {**self.env, **(env or {})})
        self.members[name] = m
        self.start(name)
        return m

    def start(self, name: str) -> None:
        m = self.members[name]
        m.dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **m.env, "STRATA_GC_INTERVAL": m.env.get("STRATA_GC_INTERVAL",
                                                                      "3")}
        if self.broken:
            env["STRATA_TEST_BREAK"] = self.broken
        log = open(m.dir / "stderr.log", "ab")  # noqa: SIM115 - the process keeps it
        m.proc = subprocess.Popen(
            [*m.prefix, *STRATA, "--log-level", "info", "fleet", "join", self.url,
             "--name", name, "--listen", f"{m.ip}:{m.port}", "--dir", str(m.dir),
             "--key-file", str(self.key)], env=env, stdout=log, stderr=log)
        m.stopped = False

    def kill(self, name: str) -> None:
        m = self.members[name]
        if m.proc is not None:
            if m.stopped:
                m.proc.send_signal(signal.SIGCONT)
            m.proc.kill()
            m.proc.wait()
            m.proc = None

    def pause(self, name: str) -> None:
        m = self.members[name]
        assert m.proc is not None
        m.proc.send_signal(signal.SIGSTOP)
        m.stopped = True

    def resume(self, name: str) -> None:
        m = self.members[name]
        assert m.proc is not None
        m.proc.send_signal(signal.SIGCONT)
        m.stopped = False

    def close(self) -> None:
        for name in list(self.members):
            m = self.members[name]
            if m.proc is not None:
                if m.stopped:
                    m.proc.send_signal(signal.SIGCONT)
                m.proc.terminate()
        for m in self.members.values():
            if m.proc is not None:
                try:
                    m.proc.wait(15)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait()
                m.proc = None

    def addrs(self) -> list[str]:
        return [m.addr for m in self.members.values()]

    def owner(self, store: str, timeout: float = 30.0, *, not_: str | None = None) -> str:
        """The member serving `store`, once one is (and is not `not_`)."""
        deadline = time.monotonic() + timeout
        while True:
            lease = self.records.lease(store)
            if lease is not None and lease.state == "serving" and lease.holder != not_:
                return lease.holder
            if time.monotonic() > deadline:
                raise AssertionError(f"no member serves {store} after {timeout} s: {lease}"
                                     + self.views() + self.logs())
            time.sleep(0.05)

    def views(self) -> str:
        """Each running member's own view (its status), and its threads' stacks in its log."""
        import urllib.request
        out = []
        for m in self.members.values():
            if m.proc is None or m.stopped:
                continue
            req = urllib.request.Request(
                m.addr + "/fleet/v1/status",
                headers={"X-Strata-Fleet-Token": os.environ.get("STRATA_FLEET_TOKEN", "")})
            try:
                with urllib.request.urlopen(req, timeout=3) as resp:  # noqa: S310
                    view = json.loads(resp.read())
                view.pop("traffic", None)
                out.append(f"\n--- {m.name} status ---\n{json.dumps(view)[:3000]}")
            except (OSError, ValueError) as exc:
                out.append(f"\n--- {m.name} status: no answer ({exc}) ---")
            m.proc.send_signal(signal.SIGUSR1)  # faulthandler: stacks to stderr.log
        time.sleep(1.0)
        return "".join(out)

    def logs(self) -> str:
        out = []
        for m in self.members.values():
            for f in (m.dir / "stderr.log", m.dir / "member.log"):
                if f.exists():
                    out.append(f"\n--- {m.name} {f.name} ---\n" + f.read_text()[-3000:])
        return "".join(out)


@dataclass
class Op:
    client: str
    store: str
    path: str
    start: float
    end: float = 0.0
    ok: bool = False
    head: str | None = None
    epoch: int | None = None
    owner: str | None = None
    error: str = ""


@dataclass
class History:
    ops: list[Op] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acked(self, store: str | None = None) -> list[Op]:
        return [o for o in self.ops if o.ok and (store is None or o.store == store)]


def content(path: str) -> bytes:
    return random.Random(path).randbytes(2_000) + path.encode()


class Publishers:
    """Clients publishing one file per commit to `stores` through the fleet's members."""

    def __init__(self, fleet: Fleet, stores: list[str], per_store: int = 1,
                 volume: str = "v") -> None:
        self.fleet, self.volume = fleet, volume
        self.history = History()
        self._stop = threading.Event()
        self.threads = []
        for store in stores:
            for i in range(per_store):
                t = threading.Thread(target=self._run, args=(store, f"{store}-c{i}"),
                                     daemon=True)
                self.threads.append(t)

    def start(self) -> Publishers:
        for t in self.threads:
            t.start()
        return self

    def _run(self, store: str, client: str) -> None:
        addrs = self.fleet.addrs()
        random.shuffle(addrs)
        remote = FleetStore(addrs, store, retry_for=15.0, timeout=5.0)
        n = 0
        try:
            while not self._stop.is_set():
                path = f"{client}-{n:05d}"
                n += 1
                op = Op(client, store, path, time.monotonic())
                try:
                    t = Transaction(remote, self.volume)
                    t.write(path, content(path))
                    op.head = t.commit()
                    op.ok = True
                    op.epoch = getattr(remote.last, "epoch", None)
                    op.owner = getattr(remote.last, "owner", None)
                except (StrataError, OSError) as exc:
                    op.error = str(exc)[:200]
                    time.sleep(0.05)
                op.end = time.monotonic()
                with self.history.lock:
                    self.history.ops.append(op)
        finally:
            remote.close()

    def stop(self) -> History:
        self._stop.set()
        for t in self.threads:
            t.join(90)
        return self.history


def three_members(url: str, root: Path, env: dict[str, str], store: str = "s1"
                  ) -> Iterator[Fleet]:
    """A fleet of members a, b and c with one store, stopped when the caller is done."""
    f = Fleet(url, root, env)
    try:
        f.records.add_store(store, "bucket")
        for name in ("a", "b", "c"):
            f.add(name)
        yield f
    finally:
        f.close()


def make_volume(fleet: Fleet, store: str, volume: str = "v") -> None:
    remote = FleetStore(fleet.addrs(), store, retry_for=60.0)
    try:
        if volume not in remote.list_volumes():
            remote.create_volume(volume)
    finally:
        remote.close()


def final_history(fleet: Fleet, store: str, volume: str = "v",
                  heads: list[str] | None = None) -> tuple[dict[str, int], set[str]]:
    """The store's final chain (snapshot id -> position, 1 the oldest) and its files.

    Read from the owner the bucket names: a broken build's stale owner may
    serve a history of its own. `heads` (the acknowledged heads) are read in
    batches first, so the walk back from the final head asks only for the
    snapshots no client saw: one trip per snapshot made a 100-round history
    (thousands of snapshots, each a forward to the owner) take half an hour.
    Read once per store and kept (`fleet.finals`).
    """
    if (store, volume) in fleet.finals:
        return fleet.finals[store, volume]
    owner = fleet.owner(store, 60)
    remote = FleetStore([fleet.members[owner].addr], store, retry_for=60.0)
    try:
        head = remote.head(volume, "live")
        chain = _chain(remote, head, heads or [])
        position = {sid: len(chain) - i for i, sid in enumerate(chain)}
        tree = Transaction(remote, volume)
        files = {name for name, _e in tree.listdir("")}
    except NotFound:
        position, files = {}, set()  # even the volume was lost: every ack is judged
    finally:
        remote.close()
    fleet.finals[store, volume] = (position, files)
    return position, files


def _chain(remote: FleetStore, head: str, heads: list[str]) -> list[str]:
    """Snapshot ids from `head` back to the first, newest first."""
    parents: dict[str, str | None] = {}
    want = sorted({bytes.fromhex(h) for h in heads})
    gone = set(remote.missing(want))
    have = [oid for oid in want if oid not in gone]
    for start in range(0, len(have), 512):
        batch = have[start:start + 512]
        for oid, raw in zip(batch, remote.get_objects(batch), strict=True):
            parents[oid.hex()] = Snapshot.decode(raw).parent
    out: list[str] = []
    cur: str | None = head
    while cur is not None:
        out.append(cur)
        if cur not in parents:
            try:
                parents[cur] = remote.snapshot(cur).parent
            except Expired:
                break  # older history let go by a retention policy
        cur = parents[cur]
    return out


def lost(history: History, store: str, position: dict[str, int], files: set[str]
         ) -> list[Op]:
    """Acknowledged publishes of `store` that the final history lacks."""
    return [op for op in history.acked(store)
            if op.head not in position or op.path not in files]


def check(fleet: Fleet, history: History, stores: list[str], *, strict: bool = True,
          volume: str = "v", faults: Faults | None = None) -> list[str]:
    """The checker: a list of violations (empty: the history is correct).

    `strict`: every acknowledged publish must be in the final history (`--sync
    bucket`). Otherwise each one missing must be within the loss window of a
    fault in `faults` (`check_window`); with no `faults`, losses are not
    judged here.
    """
    bad: list[str] = []
    for store in stores:
        position, files = final_history(fleet, store, volume,
                                        [o.head for o in history.acked(store) if o.head])
        acked = history.acked(store)
        missing = lost(history, store, position, files)
        if strict:
            for op in missing:
                if op.head not in position:
                    bad.append(f"{store}: acknowledged publish {op.path} (head {op.head}, "
                               f"epoch {op.epoch}, owner {op.owner}) is not in the final "
                               "history")
                else:
                    bad.append(f"{store}: acknowledged file {op.path} is not in the final "
                               "tree")
        elif faults is not None:
            bad += check_window(store, missing, faults, acked)
        # Heads move forward: an ack that began after another ended is not behind it.
        # No overlapping epochs: an older epoch's ack never follows a newer epoch's ack.
        # Both by one pass over the acks sorted by end, keeping the running maximum
        # (O(n log n): a 100-round history has tens of thousands of acks).
        by_end = sorted(acked, key=lambda o: o.end)
        ends = [o.end for o in by_end]
        best_pos: list[tuple[int, Op | None]] = []
        best_epoch: list[tuple[int, Op | None]] = []
        for o in by_end:
            pos = position.get(o.head or "", -1)
            prev_p = best_pos[-1] if best_pos else (-1, None)
            best_pos.append((pos, o) if pos > prev_p[0] else prev_p)
            ep = o.epoch if o.epoch is not None else -1
            prev_e = best_epoch[-1] if best_epoch else (-1, None)
            best_epoch.append((ep, o) if ep > prev_e[0] else prev_e)
        heads_bad = epochs_bad = 0
        for b in acked:
            k = bisect.bisect_left(ends, b.start)  # acks [0, k) ended before b started
            if k == 0:
                continue
            pos, a = best_pos[k - 1]
            if b.head in position and position[b.head] < pos and a is not None \
                    and heads_bad < 20:
                heads_bad += 1
                bad.append(f"{store}: head went back: {b.path} acknowledged "
                           f"{b.head} after {a.path} acknowledged {a.head}")
            ep, a = best_epoch[k - 1]
            if b.epoch is not None and b.epoch < ep and a is not None and epochs_bad < 20:
                epochs_bad += 1
                bad.append(f"{store}: epoch {b.epoch} ({b.owner}) acknowledged {b.path} "
                           f"after epoch {a.epoch} ({a.owner}) acknowledged {a.path}")
    return bad


# -- faults, and what the default sync may lose to them -------------------------------

# The default sync's stated loss window (docs/fleet.md, "Sync modes"): what was
# acknowledged but not yet shipped when its owner stopped. Shipping runs every 0.5 s,
# and a ship itself takes a bucket round trip (1.5 s seen with the two cores at a
# load of 14), so the checker allows 2 s before the fault; while the bucket fails,
# the shipper retries every 2 s at most (OUTAGE_RETRY more).
LOSS_WINDOW = 2.0
OUTAGE_RETRY = 2.0
# An owner cut from the bucket acknowledges until its lease window ends (1.8 s
# after its last renewal, which came before the fault); answers still on their way
# when a fault hits reach their clients a moment later (0.5 s allowed).
ACK_WINDOW = ack_window(LEASE_TTL) + 0.5
# The ship-lag gate's bound (docs/fleet.md, "The ship-lag gate"), which holds however
# slow a ship is: an owner acknowledges nothing while a byte has waited over 1 s to
# ship (SHIP_LAG_MAX's default, not the environment's: a broken build's loosened gate
# must fail this), and it ships in order, so a fault takes a tail of one epoch's
# acknowledgements, each given at most that 1 s (plus its answer's way back to the
# client, GATE_SLACK) before the last acknowledgement of its epoch.
SHIP_LAG = 1.0
GATE_SLACK = 1.0
# Faults that hold back answers an owner already gave: SIGSTOP (sent when it resumes)
# and cut links (TCP retransmits them after the heal).
HOLDS_ANSWERS = frozenset({"stop", "cut", "cut_member", "cut_clients"})


@dataclass
class Fault:
    kind: str
    target: str | None       # the member hit; None: the bucket, for every member
    start: float             # the test's monotonic clock
    end: float | None = None
    note: str = ""
    slack: float = 0.0       # more loss window: the fault came during a bucket outage

    def hits(self, member: str | None) -> bool:
        return self.target is None or self.target == member

    def covers(self, op: Op) -> bool:
        """Whether losing `op` is within the stated window of this fault.

        The window bounds when the owner acknowledged, which the client sees
        as its answer arriving (`op.end`), a moment later. A fault that holds
        the owner's answers back (a paused owner, a cut link: TCP delivers
        them after the heal, seconds later) breaks that: then the owner
        acknowledged somewhere between sending the request and the answer
        arriving, and that span must meet the window.
        """
        if not self.hits(op.owner):
            return False
        until = (self.end or self.start) if self.target is None else self.start
        first, last = self.start - LOSS_WINDOW - self.slack, until + ACK_WINDOW
        if self.kind in HOLDS_ANSWERS:
            return op.start <= last and first <= op.end
        return first <= op.end <= last


@dataclass
class Faults:
    """Every fault a test applied, with when it began and ended."""

    done: list[Fault] = field(default_factory=list)

    def begin(self, kind: str, target: str | None, note: str = "", slack: float = 0.0
              ) -> Fault:
        f = Fault(kind, target, time.monotonic(), note=note, slack=slack)
        self.done.append(f)
        return f

    @staticmethod
    def end(f: Fault) -> None:
        f.end = time.monotonic()

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.done:
            out[f.kind] = out.get(f.kind, 0) + 1
        return dict(sorted(out.items()))


def check_window(store: str, missing: list[Op], faults: Faults,
                 acked: list[Op] | None = None) -> list[str]:
    """Each lost acknowledgement must be within the loss window of a fault on its owner.

    That is the time window (`Fault.covers`), or, given the store's `acked`,
    the gate's: in the tail of its epoch (`gate_tail`) ended by a fault on
    its owner.
    """
    tail = {id(o) for o in gate_tail(missing, acked or [], faults)}
    bad = []
    for op in missing:
        if not any(f.covers(op) for f in faults.done) and id(op) not in tail:
            near = [f"{f.kind} {f.target or 'bucket'} {op.start - f.start:+.2f}.."
                    f"{op.end - f.start:+.2f} s" for f in faults.done if f.hits(op.owner)
                    and -30 < op.end - f.start < 30]
            bad.append(f"{store}: acknowledged publish {op.path} ({op.owner}, epoch "
                       f"{op.epoch}) is lost outside the loss window (sent..acknowledged "
                       f"at {', '.join(near) or 'no fault near'} from the fault's start)")
    return bad


def gate_tail(missing: list[Op], acked: list[Op], faults: Faults) -> list[Op]:
    """The losses the ship-lag gate allows, however long a ship stalled before the fault.

    A loss is in its epoch's tail when it was acknowledged at most `SHIP_LAG` +
    `GATE_SLACK` before the last acknowledgement of the same owner and epoch,
    and a fault hit that owner after it (no earlier than `LOSS_WINDOW` before
    it) and before any later epoch of the store acknowledged anything.
    """
    last: dict[tuple[str | None, int | None], float] = {}
    for o in acked:
        k = (o.owner, o.epoch)
        last[k] = max(last.get(k, o.end), o.end)
    out = []
    for op in missing:
        if op.epoch is None or (op.owner, op.epoch) not in last:
            continue
        if last[op.owner, op.epoch] - op.end > SHIP_LAG + GATE_SLACK:
            continue
        later = min((o.end for o in acked if o.epoch is not None and o.epoch > op.epoch),
                    default=float("inf"))
        if any(f.hits(op.owner) and op.end - LOSS_WINDOW - f.slack <= f.start <= later
               for f in faults.done):
            out.append(op)
    return out


def loss_margins(missing: list[Op], faults: Faults) -> list[float]:
    """For the report: how long before its fault each lost publish was acknowledged."""
    out = []
    for op in missing:
        ds = [f.start - op.end for f in faults.done if f.covers(op)]
        if ds:
            out.append(max(ds))
    return out


# -- what a fence depends on ------------------------------------------------------------


class LogWatch:
    """Notes, once a second, how far each store's owner log reached (the test's own reads)."""

    def __init__(self, fleet: Fleet, stores: list[str]) -> None:
        self.logs = {s: OwnerLog(Bucket(store_url(fleet.url, s))) for s in stores}
        self.seen = dict.fromkeys(stores, 0)   # store -> records seen written (0..n-1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> LogWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.look()

    def look(self) -> None:
        for store, log in self.logs.items():
            try:
                self.seen[store] = max(self.seen[store], log.find_end())
            except StrataError:
                pass  # the bucket cut from the test too, for a moment: next time

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.look()


def check_fences(watch: LogWatch, history: History) -> list[str]:
    """GC never deleted anything a fence depends on (see the module docstring, 5)."""
    bad = []
    for store, log in watch.logs.items():
        names = set(log.bucket.names("log/"))
        gone = [s for s in range(watch.seen[store]) if log_name(s) not in names]
        if gone:
            bad.append(f"{store}: {len(gone)} owner-log record(s) seen written are gone "
                       f"from the bucket (first {log_name(gone[0])})")
        # A stalled owner of epoch e' < e writes next where the claim of epoch e is.
        for epoch in sorted({o.epoch for o in history.acked(store) if o.epoch}):
            try:
                log.bucket.put_new(log_name(epoch), b"a stalled owner's next record")
                bad.append(f"{store}: a stalled owner's create-only write of "
                           f"{log_name(epoch)} (the claim of epoch {epoch}) succeeded")
            except AlreadyExists:
                pass
    return bad


# -- GC throughout ----------------------------------------------------------------------


class Churn:
    """Garbage for GC to delete, and GC passes with a short `min_age`, in every store.

    One client per store writes a 16 KiB file to volume `g` (kept to its last
    snapshot by policy) and deletes it in the next commit, so each pair leaves
    unreachable blocks; another runs `POST /v1/admin/gc` (what `strata gc`
    sends) with `min_age` 1 s on each store every three seconds.
    """

    def __init__(self, fleet: Fleet, stores: list[str], volume: str = "g") -> None:
        self.fleet, self.stores, self.volume = fleet, stores, volume
        self.deleted = dict.fromkeys(stores, 0)
        self.passes = dict.fromkeys(stores, 0)
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._garbage, args=(s,), daemon=True)
                        for s in stores]
        self.threads.append(threading.Thread(target=self._gc, daemon=True))

    def prepare(self) -> Churn:
        for store in self.stores:
            make_volume(self.fleet, store, self.volume)
            remote = FleetStore(self.fleet.addrs(), store, retry_for=60.0)
            try:
                remote._json("POST", "/v1/admin/policy", {"volume": self.volume,
                                                          "keep_last": 1})
            finally:
                remote.close()
        return self

    def start(self) -> Churn:
        for t in self.threads:
            t.start()
        return self

    def _garbage(self, store: str) -> None:
        remote = FleetStore(self.fleet.addrs(), store, retry_for=15.0, timeout=5.0)
        rng = random.Random(store)
        try:
            while not self._stop.wait(0.5):
                try:
                    t = Transaction(remote, self.volume)
                    t.write("scratch", rng.randbytes(16 << 10))
                    t.commit()
                    t = Transaction(remote, self.volume)
                    t.remove("scratch")
                    t.commit()
                except (StrataError, OSError):
                    pass  # a fault: the checker judges the other volume
        finally:
            remote.close()

    def _gc(self) -> None:
        remotes = {s: FleetStore(self.fleet.addrs(), s, retry_for=10.0, timeout=30.0)
                   for s in self.stores}
        try:
            while not self._stop.wait(3.0):
                for store, remote in remotes.items():
                    try:
                        report = remote._json("POST", "/v1/admin/gc", {"min_age": 1})
                    except (StrataError, OSError):
                        continue
                    self.passes[store] += 1
                    self.deleted[store] += int(report.get("objects_deleted", 0))
        finally:
            for remote in remotes.values():
                remote.close()

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(90)
