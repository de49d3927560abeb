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
   epoch e never comes after (in real time) one by a later epoch e' > e.
"""

from __future__ import annotations

import bisect
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from serverutil import free_port
from strata.engine.errors import StrataError
from strata.engine.seal import new_key, write_key_file
from strata.engine.txn import Transaction
from strata.fleet.client import FleetStore
from strata.fleet.records import FleetRecords
from strata_harness import STRATA


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
                                     + self.logs())
            time.sleep(0.05)

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


def make_volume(fleet: Fleet, store: str, volume: str = "v") -> None:
    remote = FleetStore(fleet.addrs(), store, retry_for=60.0)
    try:
        if volume not in remote.list_volumes():
            remote.create_volume(volume)
    finally:
        remote.close()


def check(fleet: Fleet, history: History, stores: list[str], *, strict: bool = True,
          volume: str = "v") -> list[str]:
    """The checker: a list of violations (empty: the history is correct)."""
    bad: list[str] = []
    for store in stores:
        # Read from the owner the bucket names: a broken build's stale owner may serve
        # a history of its own.
        owner = fleet.owner(store, 60)
        remote = FleetStore([fleet.members[owner].addr], store, retry_for=60.0)
        try:
            head = remote.head(volume, "live")
            chain = remote.log(head)
            position = {s.id: len(chain) - i for i, s in enumerate(chain)}
            tree = Transaction(remote, volume)
            files: set[str] | None = {name for name, _e in tree.listdir("")}
        finally:
            remote.close()
        acked = history.acked(store)
        for op in acked:
            if op.head not in position:
                bad.append(f"{store}: acknowledged publish {op.path} (head {op.head}, "
                           f"epoch {op.epoch}, owner {op.owner}) is not in the final history")
            elif files is not None and op.path not in files:
                bad.append(f"{store}: acknowledged file {op.path} is not in the final tree")
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
        if not strict:
            pass  # the default sync's window is checked by the caller
    return bad
