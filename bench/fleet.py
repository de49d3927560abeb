"""Fleet benchmarks: failover, planned move, routing overhead (three members on loopback).

- failover: SIGKILL the owner of a `--sync bucket` store while a client
  publishes through the other members; the time from the kill to the first
  publish acknowledged by another owner, over KILLS kills (the killed member
  is restarted between kills, so the fleet stays at three).
- planned move: `fleet move` to the next member while a client publishes;
  the gap is the longest wait between two acknowledgements around the move.
- routing: the same small read (list branches), and a 4 KiB publish (the
  publish request alone, and a transaction begun and published), through
  the owner and through another member, interleaved, on a default-sync store; p50 of each and the
  difference. Through the other member twice: with the tunnel `FleetStore`
  asks for (the member carries the connection to the owner, fleet/tunnel.py),
  and with every request forwarded (no tunnel).
- moving to the work: on a fresh two-member fleet whose move policy is
  quick (2 s window, 20 requests, 15 s cooldown), a 4 KiB publish through
  the member that does not own the store, until the store moves to it, then
  through it again (after 3 s of warm-up: the new owner restored without
  downloading); each interleaved with the same publish straight to the
  current owner's own unix socket, the baseline.
- a workspace's fsync, moving to the work: on a fresh two-member fleet
  with the same quick policy and a `--sync bucket` store, a workspace
  attached through the member that does not own the store (`strata --fleet`,
  that member first); a 4 KiB write + fsync of a file in it, timed until the
  store moved to that member, then again after 3 s of warm-up. Beside each:
  the same write + fsync on the local disk (the bench directory), in turn.

moto runs on loopback and shares the two cores with the three members.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.engine import _pct
from bench.report import row
from strata.engine.errors import StrataError
from strata.engine.txn import Transaction
from strata.fleet.client import FleetStore
from strata.server.client import RemoteStore, default_socket

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fleet"))
from fleetutil import Fleet, make_volume  # noqa: E402

from bucketutil import BUCKET, Moto  # noqa: E402


class Acks:
    """A client publishing one small file per commit; records (time, owner) of each ack."""

    def __init__(self, addrs: list[str], store: str) -> None:
        self.remote = FleetStore(addrs, store, retry_for=30.0, timeout=3.0)
        self.acks: list[tuple[float, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                t = Transaction(self.remote, "v")
                t.write(f"f{n % 50}", os.urandom(512))
                t.commit()
                self.acks.append((time.monotonic(), getattr(self.remote.last, "owner", None)))
            except StrataError:
                time.sleep(0.01)
            n += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.remote.close()


def _others(fleet: Fleet, owner: str) -> list[str]:
    return [m.addr for n, m in fleet.members.items() if n != owner]


def bench_failover(fleet: Fleet, kills: int) -> list[float]:
    out = []
    for _ in range(kills):
        owner = fleet.owner("s")
        client = Acks(_others(fleet, owner), "s")
        time.sleep(0.5)
        t0 = time.monotonic()
        fleet.kill(owner)
        deadline = t0 + 60
        served = None
        while served is None and time.monotonic() < deadline:
            served = next((t for t, o in list(client.acks) if t > t0 and o and o != owner),
                          None)
            time.sleep(0.01)
        client.stop()
        if served is None:
            raise RuntimeError("no publish served after the owner was killed" + fleet.logs())
        out.append(served - t0)
        fleet.start(owner)
        time.sleep(1.5)  # the restarted member is live again before the next kill
    return out


def _move(fleet: Fleet, store: str, to: str) -> None:
    lease = fleet.records.lease(store)
    assert lease is not None
    req = urllib.request.Request(lease.addr + "/fleet/v1/move",
                                 data=json.dumps({"store": store, "to": to}).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Strata-Fleet-Token": os.environ["STRATA_FLEET_TOKEN"]},
                                 method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - loopback
        resp.read()


def bench_moves(fleet: Fleet, moves: int) -> list[float]:
    gaps = []
    names = list(fleet.members)
    for _ in range(moves):
        owner = fleet.owner("s")
        to = names[(names.index(owner) + 1) % len(names)]
        client = Acks(fleet.addrs(), "s")
        time.sleep(0.5)
        t0 = time.monotonic()
        _move(fleet, "s", to)
        fleet.owner("s", 30, not_=owner)
        time.sleep(0.5)
        client.stop()
        times = [t0] + [t for t, _o in client.acks if t > t0 - 0.2]
        after = [t for t, o in client.acks if t > t0 and o == to]
        if not after:
            raise RuntimeError("no publish through the new owner after a move")
        window = [t for t in times if t <= after[0]]
        gaps.append(max(b - a for a, b in zip(window, window[1:], strict=False))
                    if len(window) > 1 else after[0] - t0)
    return gaps


def bench_routing(fleet: Fleet, n: int, pubs: int) -> dict[str, float]:
    """p50 of the same small read, and of a 4 KiB publish, through the owner and another.

    On store `r`, in the default sync mode: a `--sync bucket` publish waits ~20 ms for
    the bucket, whose swings would hide the hop. Each client publishes into a volume
    of its own, so each publish is the steady case, not a catch-up on what the
    others wrote.

    A publish is timed twice: the publish request alone (the transaction begun
    and its file written before, as a run's or a mount's base is read when it
    starts), and the whole transaction, begun and published (two requests: the
    branch's head, then the publish). The publishes run in a loop of their own,
    `pubs` per client, interleaved: a publish's fsync swings by milliseconds,
    far more than the hop, so the p50 needs many (2,000: its error is then
    near 0.1 ms on this machine).

    Three clients, in turn: one connected to the owner, one to another member that
    carries its connection to the owner (a tunnel, fleet/tunnel.py: how `FleetStore`
    connects), and one to that member without a tunnel (each request forwarded).
    """
    owner = fleet.owner("r", 60)
    other = _others(fleet, owner)[:1]
    clients = {"owner": FleetStore([fleet.members[owner].addr], "r"),
               "tunnel": FleetStore(other, "r"),
               "forward": FleetStore(other, "r", tunnel=False)}
    for what, remote in clients.items():  # each publishes into its own volume
        if f"p-{what}" not in remote.list_volumes():
            remote.create_volume(f"p-{what}")
    reads: dict[str, list[float]] = {k: [] for k in clients}
    publishes: dict[str, list[float]] = {k: [] for k in clients}
    transactions: dict[str, list[float]] = {k: [] for k in clients}
    try:
        for _i in range(n):
            for what, remote in clients.items():
                t = time.perf_counter()
                remote.list_branches("v")
                reads[what].append(time.perf_counter() - t)
        for i in range(pubs):
            for what, remote in clients.items():
                whole, alone = _transaction_4k(remote, i, f"p-{what}")
                transactions[what].append(whole)
                publishes[what].append(alone)
        assert clients["tunnel"]._local.conn.carried_to == owner, "not carried"
    finally:
        for remote in clients.values():
            remote.close()
    out = {f"read_{k}": _pct(v, 0.5) for k, v in reads.items()}
    out.update({f"publish_{k}": _pct(v, 0.5) for k, v in publishes.items()})
    out.update({f"transaction_{k}": _pct(v, 0.5) for k, v in transactions.items()})
    return out


def _transaction_4k(store: RemoteStore, n: int, volume: str) -> tuple[float, float]:
    """(begun and published, the publish request alone) of one 4 KiB write."""
    t0 = time.perf_counter()
    txn = Transaction(store, volume)
    txn.write(f"f{n % 64}", os.urandom(4096))
    t1 = time.perf_counter()
    txn.commit()
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


MOVE_ENV = {"STRATA_FLEET_MOVE_WINDOW": "2", "STRATA_FLEET_MOVE_MIN": "20",
            "STRATA_FLEET_MOVE_COOLDOWN": "15"}


def _publish_4k(store: RemoteStore, n: int, volume: str = "w") -> float:
    t = time.perf_counter()
    txn = Transaction(store, volume)
    txn.write(f"f{n % 64}", os.urandom(4096))
    txn.commit()
    return time.perf_counter() - t


def bench_move_to_work(fleet: Fleet, n: int) -> dict[str, list[float]]:
    """4 KiB publishes via the non-owner, before and after the store moves to it."""
    owner = fleet.owner("m", 60)
    other = next(name for name in fleet.members if name != owner)
    via = FleetStore([fleet.members[other].addr], retry_for=30.0)
    via.create_volume("w")
    times: dict[str, list[float]] = {"before": [], "before_direct": [], "after": [],
                                     "after_direct": []}

    def direct(member: str) -> RemoteStore:
        return RemoteStore("unix:" + default_socket(str(fleet.members[member].dir / "stores"
                                                        / "m")))
    here = direct(owner)
    i = 0
    deadline = time.monotonic() + 120
    try:
        while True:  # before: until the store moved (samples served elsewhere only)
            took = _publish_4k(via, i)
            i += 1
            moved = getattr(via.last, "owner", None) == other
            if moved:
                break
            if len(times["before"]) < n:
                times["before"].append(took)
                try:
                    times["before_direct"].append(_publish_4k(here, i))
                except StrataError:
                    pass  # the owner is handing it over right now
            if time.monotonic() > deadline:
                raise RuntimeError("the store did not move to the member doing its work"
                                   + fleet.logs())
        here.close()
        here = direct(other)
        # The new owner restored without downloading: its first publishes fetch the
        # volume's tree from the bucket. Steady state is what the move is for.
        warm = time.monotonic() + 3.0
        while time.monotonic() < warm:
            _publish_4k(via, i)
            _publish_4k(here, i + 1)
            i += 2
        for _ in range(n):
            times["after"].append(_publish_4k(via, i))
            times["after_direct"].append(_publish_4k(here, i + 1))
            i += 2
    finally:
        here.close()
        via.close()
    return times


def run_move_to_work(work: str, moto: Moto, quick: bool) -> list[dict[str, Any]]:
    os.makedirs(Path(work) / "move", exist_ok=True)
    fleet = Fleet(f"s3://{BUCKET}/fleet-move", Path(work) / "move", {**moto.env(), **MOVE_ENV})
    rows: list[dict[str, Any]] = []
    try:
        fleet.records.add_store("m")
        for name in ("d", "e"):
            fleet.add(name)
        t = bench_move_to_work(fleet, 50 if quick else 200)
        for phase, what in (("before", "via a non-owner member, before the move"),
                            ("after", "via the same member, after the store moved to it")):
            for q in (0.5, 0.99):
                v, base = _pct(t[phase], q), _pct(t[f"{phase}_direct"], q)
                rows.append(row(f"fleet: 4 KiB publish {what} p{int(q * 100)} "
                                f"({len(t[phase])})", v * 1e3, "ms", base * 1e3,
                                "the owner's unix socket", "", met=None))
    finally:
        fleet.close()
    return rows


def _write_fsync(path: Path, n: int) -> float:
    t = time.perf_counter()
    fd = os.open(path / f"f{n % 64}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, os.urandom(4096))
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def _cli(env: dict[str, str], *args: str) -> None:
    import subprocess

    from bench.cli_env import STRATA
    p = subprocess.run([*STRATA, *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env})
    if p.returncode != 0:
        raise RuntimeError(f"strata {' '.join(args)}: {p.stderr}")


def bench_ws_move(fleet: Fleet, work: Path, n: int) -> dict[str, list[float]]:
    """A workspace's 4 KiB write + fsync via the non-owner, before and after the move."""
    owner = fleet.owner("w", 60)
    here = next(name for name in fleet.members if name != owner)
    env = {"STRATA_FLEET": f"{fleet.members[here].addr},{fleet.members[owner].addr}",
           "STRATA_FLEET_STORE": "w", "STRATA_WORKSPACE_STATE": str(work / "ws-state")}
    _cli(env, "workspace", "create", "ws", "--size", "1G")
    mnt, disk = work / "ws", work / "disk"
    mnt.mkdir()
    disk.mkdir()
    _cli(env, "workspace", "attach", "ws", str(mnt))
    times: dict[str, list[float]] = {"before": [], "before_disk": [], "after": [],
                                     "after_disk": []}
    try:
        i, deadline = 0, time.monotonic() + 180
        while True:
            if i % 5 == 0:
                lease = fleet.records.lease("w")
                if lease is not None and lease.holder == here:
                    break
            took = _write_fsync(mnt, i)
            if len(times["before"]) < n:
                times["before"].append(took)
                times["before_disk"].append(_write_fsync(disk, i))
            i += 1
            if time.monotonic() > deadline:
                raise RuntimeError("the store did not move to the workspace's member"
                                   + fleet.logs())
        fleet.owner("w", 60)
        warm = time.monotonic() + 3.0
        while time.monotonic() < warm:
            _write_fsync(mnt, i)
            i += 1
        for _ in range(n):
            times["after"].append(_write_fsync(mnt, i))
            times["after_disk"].append(_write_fsync(disk, i))
            i += 1
    finally:
        _cli(env, "workspace", "detach", str(mnt))
    return times


def run_ws_move(work: str, moto: Moto, quick: bool) -> list[dict[str, Any]]:
    os.makedirs(Path(work) / "wsm", exist_ok=True)
    fleet = Fleet(f"s3://{BUCKET}/fleet-ws", Path(work) / "wsm", {**moto.env(), **MOVE_ENV})
    rows: list[dict[str, Any]] = []
    try:
        fleet.records.add_store("w", "bucket")
        for name in ("f", "g"):
            fleet.add(name)
        t = bench_ws_move(fleet, Path(work) / "wsm", 50 if quick else 200)
        for phase, what in (("before", "on a member not owning its store, before the move"),
                            ("after", "on the same member, after the store moved to it")):
            for q in (0.5, 0.99):
                v, base = _pct(t[phase], q), _pct(t[f"{phase}_disk"], q)
                rows.append(row(f"fleet: workspace 4 KiB write + fsync {what} "
                                f"p{int(q * 100)} ({len(t[phase])})", v * 1e3, "ms",
                                base * 1e3, "local disk", "", met=None))
    finally:
        fleet.close()
    return rows


def run_move(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    """Only the move to the work (`python -m bench --only fleet-move`)."""
    work = os.path.join(root, "strata-bench-fleet")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    moto = Moto(Path(work)).start()
    os.environ.update(moto.env())
    os.environ.setdefault("STRATA_FLEET_TOKEN", secrets.token_hex(16))
    try:
        return run_move_to_work(work, moto, quick) + run_ws_move(work, moto, quick)
    finally:
        moto.stop()


def run(root: str, *, quick: bool = False, to_work: bool = True) -> list[dict[str, Any]]:
    """Every fleet figure; without `to_work`, only routing, failover and the planned move."""
    work = os.path.join(root, "strata-bench-fleet")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    moto = Moto(Path(work)).start()
    os.environ.update(moto.env())
    os.environ.setdefault("STRATA_FLEET_TOKEN", secrets.token_hex(16))  # members and clients
    # Moving to the work is off here: these figures time one owner at a time.
    fleet = Fleet(f"s3://{BUCKET}/fleet", Path(work), {**moto.env(), "STRATA_FLEET_MOVE": "0"})
    rows: list[dict[str, Any]] = []
    try:
        if to_work:
            rows += run_move_to_work(work, moto, quick)
            rows += run_ws_move(work, moto, quick)
        fleet.records.add_store("s", "bucket")
        fleet.records.add_store("r")  # routing's (default sync)
        for name in ("a", "b", "c"):
            fleet.add(name)
        fleet.owner("s", 60)
        make_volume(fleet, "s")
        make_volume(fleet, "r")
        kills = bench_failover(fleet, 5 if quick else 20)
        p50, p99 = _pct(kills, 0.5), _pct(kills, 0.99)
        rows.append(row(f"fleet: owner SIGKILL -> first publish via another member p50 "
                        f"({len(kills)} kills)", p50, "s", None, "", "", met=None))
        rows.append(row(f"fleet: owner SIGKILL -> first publish via another member p99 "
                        f"({len(kills)} kills)", p99, "s", None, "", "<= 5 s", met=p99 <= 5.0))
        gaps = bench_moves(fleet, 5 if quick else 20)
        g50, g99 = _pct(gaps, 0.5), _pct(gaps, 0.99)
        rows.append(row(f"fleet: planned move gap p50 ({len(gaps)} moves)", g50, "s", None,
                        "", "", met=None))
        rows.append(row(f"fleet: planned move gap p99 ({len(gaps)} moves)", g99, "s", None,
                        "", "<= 1 s", met=g99 <= 1.0))
        # Last: its 6,000 publishes fill moto's bucket, whose listings then slow the
        # claims above.
        r = bench_routing(fleet, 100 if quick else 600, 100 if quick else 2000)
        for what, label in (("read", "small read"),
                            ("publish", "4 KiB publish (the publish request)"),
                            ("transaction", "4 KiB transaction (begin + publish)")):
            own, carried, forwarded = (r[f"{what}_{k}"] for k in ("owner", "tunnel", "forward"))
            rows.append(row(f"fleet: routing overhead, {label} p50 (through another "
                            "member - through the owner)", (carried - own) * 1e3, "ms",
                            own * 1e3, "through the owner p50",
                            "<= 0.3 ms" if what != "transaction" else "",
                            met=carried - own <= 0.0003 if what != "transaction" else None))
            rows.append(row(f"fleet: the same, {label}, each request forwarded (no tunnel)",
                            (forwarded - own) * 1e3, "ms", own * 1e3, "through the owner p50",
                            "", met=None))
        print("failover (s):", " ".join(f"{k:.2f}" for k in kills), file=sys.stderr)
        print("move gaps (s):", " ".join(f"{g:.2f}" for g in gaps), file=sys.stderr)
    finally:
        fleet.close()
        moto.stop()
    return rows
