"""Jepsen-style fault rounds on a fleet of three hosts, with moto on a fourth.

Three members, each in a network namespace of its own; moto in the bucket's
namespace, which also routes between the hosts and the test's clients, and
reached by the members through a faulty proxy there (fleethosts.BucketProxy).
Clients publish through any member to three stores (two `--sync bucket`,
one default), and GC deletes throughout (fleetutil.Churn), while each round
applies one fault at random (`FAULTS`; docs/fleet.md has the table):

- `kill`, `stop`, `cut`, `cut_bucket` of the owner of a random store: the
  fleet must give the store a new owner, then the fault is undone (a
  restart, SIGCONT, the link healed);
- `cut_clients`: the owner cut from clients and members but not from the
  bucket, for a moment (it keeps its lease: no takeover, the store waits);
- `cut_member`: a random member cut from everyone; its stores move;
- `bucket500`, `slow`, `lose`: the bucket answers 500 to every few requests,
  or slowly, or loses the answers to conditional PUTs, while an owner is
  SIGKILLed (so a failover runs through it);
- `wall`: a random member is SIGKILLed and restarted with its wall clock
  offset by tens of seconds (libfaketime; its monotonic clock untouched).

The checker (fleetutil) then reads each store's final history and checks
every acknowledged publish against it (the default sync: within the loss
window of a fault), heads, epochs, and that GC deleted nothing a fence
depends on; and each store must have served publishes after the last fault.

`make test` runs FLEET_ROUNDS=3 (default); `make fuzz` runs 100. The last
test builds broken stratas (STRATA_TEST_BREAK) and shows that the checker
fails against each.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from fleethosts import BucketProxy, FleetHosts
from fleetutil import (
    OUTAGE_RETRY,
    Churn,
    Faults,
    Fleet,
    History,
    LogWatch,
    Op,
    Publishers,
    check,
    check_fences,
    content,
    final_history,
    gate_tail,
    loss_margins,
    lost,
    make_volume,
    wall_env,
)

from bucketutil import Moto
from strata.engine.errors import StrataError
from strata.engine.txn import Transaction
from strata.fleet.client import FleetStore

pytestmark = pytest.mark.skipif(shutil.which("ip") is None or os.geteuid() != 0,
                                reason="needs iproute2 and root")

NAMES = ["a", "b", "c"]
STRICT = ["s1", "s2"]
DEFAULT = ["s3"]
FAULTS = ["kill", "stop", "cut", "cut_bucket", "cut_clients", "cut_member", "bucket500",
          "slow", "lose", "wall"]


@pytest.fixture
def hosts_moto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
               ) -> Iterator[tuple[FleetHosts, Moto, BucketProxy]]:
    with FleetHosts(NAMES) as h:
        moto = Moto(tmp_path, netns=h.bucket_ns, address=h.bucket_address["test"]).start()
        proxy = BucketProxy(h, moto.port, tmp_path / "proxy.log")
        for k, v in moto.env().items():
            monkeypatch.setenv(k, v)
        try:
            proxy.start(moto.port)
            yield h, moto, proxy
        finally:
            proxy.stop()
            moto.stop()


# Clocks: the rate of each member's monotonic clock (STRATA_TEST_CLOCK_RATE, which
# scales the clock every lease and liveness span is measured on). "skewed" stays
# inside the 5 % bound, and also runs member c with its wall clock 40 s ahead
# (libfaketime, see fleetutil.wall_env); "beyond" breaks the bound.
CLOCKS = {
    "same": {},
    "skewed": {"a": "0.96", "b": "1.04", "c": "1.0"},
    "beyond": {"a": "0.5", "b": "1.6", "c": "1.6"},
}
WALL = {"skewed": {"c": 40.0}}


def start_fleet(h: FleetHosts, moto: Moto, proxy: BucketProxy, tmp_path: Path, *,
                broken: str = "", clocks: str = "same",
                env: dict[str, str] | None = None) -> Fleet:
    fleet = Fleet(f"s3://strata-test/{tmp_path.name}", tmp_path, {**moto.env(), **(env or {})},
                  broken=broken)
    for s in STRICT:
        fleet.records.add_store(s, "bucket")
    for s in DEFAULT:
        fleet.records.add_store(s, "local")
    try:
        return _start(fleet, h, proxy, clocks)
    except BaseException:
        fleet.close()  # members started so far must not outlive the test
        raise


def _start(fleet: Fleet, h: FleetHosts, proxy: BucketProxy, clocks: str) -> Fleet:
    for name in NAMES:
        prefix = h.exec_prefix(name)
        env = {**fleet.env, "AWS_ENDPOINT_URL": proxy.endpoint(name)}
        if name in CLOCKS[clocks]:
            env["STRATA_TEST_CLOCK_RATE"] = CLOCKS[clocks][name]
        if name in WALL.get(clocks, {}):
            env.update(wall_env(WALL[clocks][name]))
        fleet.add(name, ip=h.address[name], prefix=prefix, env=env)
    for s in STRICT + DEFAULT:
        fleet.owner(s, 60)
        make_volume(fleet, s)
    time.sleep(1.0)  # the default sync's volume is in the bucket (shipped twice a second)
    return fleet


def move(fleet: Fleet, store: str, to: str) -> None:
    lease = fleet.records.lease(store)
    assert lease is not None
    req = urllib.request.Request(lease.addr + "/fleet/v1/move",
                                 data=json.dumps({"store": store, "to": to}).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Strata-Fleet-Token": os.environ["STRATA_FLEET_TOKEN"]},
                                 method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()


def owned_by(fleet: Fleet, member: str) -> list[str]:
    out = []
    for store in STRICT + DEFAULT:
        lease = fleet.records.lease(store)
        if lease is not None and lease.holder == member and lease.state == "serving":
            out.append(store)
    return out


def one_round(fleet: Fleet, h: FleetHosts, proxy: BucketProxy, rng: random.Random,
              faults: Faults, log: list[str]) -> None:
    store = rng.choice(STRICT + DEFAULT)
    owner = fleet.owner(store, 60)
    kinds = os.environ.get("FLEET_FAULTS", ",".join(FAULTS)).split(",")
    kind = rng.choice(kinds)
    t0 = time.monotonic()
    moved: list[str] = []
    note = ""
    if kind in ("bucket500", "slow", "lose"):
        setting: dict[str, object] = {
            "bucket500": {"fail_status": 500, "fail_every": rng.randint(3, 9)},
            # A claim's restore makes its requests one after another, and gives up
            # after 30 s (member.CLAIM_TIMEOUT): at 0.3 s a request none finished.
            "slow": {"delay": round(rng.uniform(0.01, 0.04), 3)},
            "lose": {"lose_answers": rng.randint(5, 20)}}[kind]
        note = json.dumps(setting)
        print(f"  {kind} {note}, then kill {owner} (owner of {store})", flush=True)
        f = faults.begin(kind, None, note)
        proxy.set(**setting)  # type: ignore[arg-type]
        time.sleep(rng.uniform(0.5, 1.5))
        k = faults.begin("kill", owner, "under " + kind,
                         slack=OUTAGE_RETRY if kind == "bucket500" else 0.0)
        fleet.kill(owner)
        new = fleet.owner(store, 120, not_=owner)
        time.sleep(rng.uniform(0.2, 1.0))
        proxy.clear()
        faults.end(f)
        faults.end(k)
        fleet.start(owner)
        moved = [store]
    elif kind in ("kill", "stop", "cut", "cut_bucket"):
        f = faults.begin(kind, owner)
        {"kill": fleet.kill, "stop": fleet.pause, "cut": h.cut,
         "cut_bucket": h.cut_bucket}[kind](owner)
        new = fleet.owner(store, 120, not_=owner)
        moved = [store]
        time.sleep(rng.uniform(0.2, 1.5))  # publishes through the new owner, the old one out
        {"kill": fleet.start, "stop": fleet.resume, "cut": h.heal,
         "cut_bucket": h.heal_bucket}[kind](owner)
        faults.end(f)
    elif kind == "cut_clients":
        f = faults.begin(kind, owner)
        h.cut_clients(owner)
        time.sleep(rng.uniform(1.0, 3.0))  # no takeover: it still renews through the bucket
        h.heal_clients(owner)
        faults.end(f)
        new = owner
    elif kind == "cut_member":
        owner = rng.choice(NAMES)
        moved = owned_by(fleet, owner)
        f = faults.begin(kind, owner)
        h.cut(owner)
        for s in moved:
            fleet.owner(s, 120, not_=owner)
        time.sleep(rng.uniform(0.5, 2.0))
        h.heal(owner)
        faults.end(f)
        new = ",".join(fleet.owner(s, 60) for s in moved) or "-"
    else:  # wall: restart a member with its wall clock offset
        owner = rng.choice(NAMES)
        moved = owned_by(fleet, owner)
        offset = rng.choice([-1, 1]) * rng.uniform(20, 90)
        note = f"{offset:+.0f} s"
        f = faults.begin(kind, owner, note)
        fleet.kill(owner)
        fleet.members[owner].env.update(wall_env(offset))
        for s in moved:
            fleet.owner(s, 120, not_=owner)
        fleet.start(owner)
        faults.end(f)
        new = ",".join(fleet.owner(s, 60) for s in moved) or "-"
    took = time.monotonic() - t0
    what = f"owner of {store}" if kind not in ("cut_member", "wall") else \
        f"owner of {','.join(moved) or 'nothing'}"
    log.append(f"{kind} {owner} {note} ({what}): {new} serves "
               f"{','.join(moved) or 'its stores'} after {took:.2f} s")
    time.sleep(rng.uniform(0.5, 1.5))


def served_since(history: History, store: str, since: float, timeout: float) -> bool:
    """Whether some publish to `store` is acknowledged after `since` (waiting up to `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with history.lock:
            if any(o.ok and o.store == store and o.start > since for o in history.ops):
                return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("clocks", ["same", "skewed"])
def test_fault_rounds(hosts_moto: tuple[FleetHosts, Moto, BucketProxy], tmp_path: Path,
                      clocks: str) -> None:
    h, moto, proxy = hosts_moto
    rounds = int(os.environ.get("FLEET_ROUNDS", "3"))
    seed = int(os.environ.get("FLEET_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    fleet = start_fleet(h, moto, proxy, tmp_path, clocks=clocks)
    stores = STRICT + DEFAULT
    log: list[str] = []
    faults = Faults()
    try:
        if clocks in WALL:  # the offset is real: the member's heartbeat says so
            for name, offset in WALL[clocks].items():
                wall = fleet.records.members()[name]["wall"]
                assert abs(wall - time.time() - offset) < 10, (name, wall, time.time())
        churn = Churn(fleet, stores).prepare().start()
        watch = LogWatch(fleet, stores).start()
        pubs = Publishers(fleet, stores, per_store=2).start()
        for i in range(rounds):
            one_round(fleet, h, proxy, rng, faults, log)
            print(f"round {i + 1}: {log[-1]}", flush=True)
        # Liveness: after the last fault, every store serves again.
        healed = time.monotonic()
        stalled = [s for s in stores if not served_since(pubs.history, s, healed, 60)]
        history = pubs.stop()
        churn.stop()
        watch.stop()
        assert stalled == [], f"no publish acknowledged after the last fault: {stalled}" \
            + fleet.logs()
        bad = check(fleet, history, STRICT, strict=True)
        bad += check(fleet, history, DEFAULT, strict=False, faults=faults)
        bad += check_fences(watch, history)
        acked = history.acked()
        position, files = final_history(fleet, DEFAULT[0])
        missing = lost(history, DEFAULT[0], position, files)
        margins = loss_margins(missing, faults)
        tail = gate_tail(missing, history.acked(DEFAULT[0]), faults)
        print(f"clocks {clocks}, seed {seed}: {rounds} rounds {faults.counts()}, "
              f"{len(history.ops)} publishes, {len(acked)} acknowledged, "
              f"epochs {len({o.epoch for o in acked if o.epoch})}; GC passes "
              f"{sum(churn.passes.values())}, objects deleted {churn.deleted}; "
              f"owner-log records {watch.seen}")
        print(f"default sync: {len(missing)} acknowledged publishes lost of "
              f"{len(history.acked(DEFAULT[0]))}, acknowledged at most "
              f"{max(margins, default=0):.2f} s before their fault; {len(tail)} in the "
              "tail the ship-lag gate allows (at most 2 s before their epoch's last "
              "acknowledgement)")
        assert acked, fleet.logs()
        assert bad == [], "\n".join(bad[:20]) + fleet.logs()
        assert sum(churn.deleted.values()) > 0, "GC deleted nothing: the rounds test less"
    finally:
        fleet.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("store", "fault", "broken"), [
    ("s1", "stop", ""),
    # --sync bucket: both guards must go. In `make fuzz` only: in the full suite the
    # broken old owner has twice failed to acknowledge anything within a minute.
    pytest.param("s1", "stop", "fence,lease", marks=pytest.mark.skipif(
        not os.environ.get("FLEET_BROKEN_FENCE"), reason="make fuzz (FLEET_BROKEN_FENCE=1)")),
    # The default sync, its owner cut from the bucket but not from clients: the
    # fence cannot reach it, so the lease window alone keeps it from acknowledging.
    ("s3", "cut_bucket", ""), ("s3", "cut_bucket", "lease"),
    # The clock assumption is load-bearing: an owner whose clock runs at half speed
    # and standbys 60 % fast break it, with no code broken.
    ("s3", "cut_bucket", "clock"),
    # GC that deletes old owner-log records (the claim a stalled owner's next write
    # must meet among them): the fence check finds records gone and the write landing.
    ("s1", "stop", "gc_log"),
    # A default-sync owner that ships every 10 s instead of twice a second: its
    # SIGKILL loses publishes acknowledged long before it, outside the stated window.
    ("s3", "kill", "ship"),
])
def test_the_checker_fails_against_a_broken_build(
        hosts_moto: tuple[FleetHosts, Moto, BucketProxy], tmp_path: Path, store: str,
        fault: str, broken: str) -> None:
    """A stale owner resumes while a client talks to it: only a broken build acknowledges.

    SIGSTOP the owner of the store until another member serves it, then
    SIGCONT it while a client talks to its host (any member answers any
    request); or cut the owner from the bucket only, and keep a client
    talking to it; or SIGKILL it. A correct build refuses (its lease window
    is over, and the fence stops its log writes) and forwards to the new
    owner. A build whose owner writes past the fence and acknowledges after
    its lease could expire (STRATA_TEST_BREAK) acknowledges on its old epoch,
    and the checker must say so. With the default sync, losses are judged
    against the loss window of the fault. The correct build passes the same
    checks in test_fault_rounds (and in the cases here with no break).
    """
    h, moto, proxy = hosts_moto
    beyond = broken == "clock"
    # A default-sync owner acknowledges nothing while a byte waited over 1 s to ship,
    # which alone stops an owner cut from the bucket, or one that ships late: loosened
    # here, so that each case shows the guard it names (the lease, the clocks, the
    # shipper) and the checker catching its failure.
    loose = {"STRATA_FLEET_SHIP_LAG": "60"} if broken in ("lease", "clock", "ship") else {}
    fleet = start_fleet(h, moto, proxy, tmp_path, broken="" if beyond else broken,
                        clocks="beyond" if beyond else "same", env=loose)
    faults = Faults()
    try:
        owner = fleet.owner(store)
        if beyond and owner != "a":  # the slow clock must be the owner's
            move(fleet, store, "a")
            owner = fleet.owner(store, not_=owner)
        old_addr = fleet.members[owner].addr
        watch = LogWatch(fleet, [store]).start()
        pubs = Publishers(fleet, [store], per_store=2).start()
        # Long enough for a broken GC to checkpoint past the claim, and for a broken
        # shipper to hold seconds of acknowledged publishes.
        time.sleep(5.0 if broken in ("gc_log", "ship") else 1.0)
        f = faults.begin(fault, owner)
        if fault == "stop":
            fleet.pause(owner)
        elif fault == "kill":
            fleet.kill(owner)
        else:
            h.cut_bucket(owner)
        new = fleet.owner(store, 120, not_=owner)
        if fault == "stop":
            # The new owner checkpoints (and a broken GC deletes) meanwhile.
            time.sleep(6.0 if broken == "gc_log" else 1.5)
            fleet.resume(owner)
        # Two clients in turn: one on the old owner's host, one on the new owner's.
        # A broken old owner's first write goes around every record its successor
        # wrote, a request or two each, through the bucket's proxy: give it time.
        only_old = FleetStore([old_addr], store, retry_for=5.0, timeout=60.0)
        only_new = FleetStore([fleet.members[new].addr], store, retry_for=5.0, timeout=5.0)
        stale = History()
        # Bounded: a broken old owner may take a minute an answer on a loaded machine;
        # one acknowledgement on its old epoch is all the checker needs.
        enough = time.monotonic() + 150.0
        for i in range(20 if fault != "kill" else 0):
            if time.monotonic() > enough and any(o.ok for o in stale.ops):
                break
            remote = only_old if i % 2 else only_new
            op = Op("stale", store, f"stale-{i:03d}", time.monotonic())
            try:
                t = Transaction(remote, "v")
                t.write(op.path, content(op.path))
                op.head = t.commit()
                op.ok = True
                op.epoch = remote.last.epoch
                op.owner = remote.last.owner
            except StrataError as exc:
                op.error = str(exc)
            op.end = time.monotonic()
            stale.ops.append(op)
        only_old.close()
        only_new.close()
        if fault == "cut_bucket":
            h.heal_bucket(owner)
        faults.end(f)
        time.sleep(1.0)
        history = pubs.stop()
        watch.stop()
        history.ops.extend(stale.ops)
        bad = check(fleet, history, [store], strict=store in STRICT, faults=faults)
        bad += check_fences(watch, history)
        print(f"{store} {fault} broken={broken!r}: {len(bad)} violation(s); the stale "
              "client: " + ", ".join(f"{o.path} {'ok' if o.ok else 'refused'} "
                                     f"{o.owner}/{o.epoch}" for o in stale.ops))
        print("refused: " + "; ".join({o.error[:120] for o in stale.ops if not o.ok}))
        print("\n".join(bad[:5]))
        if broken:
            assert bad, f"the checker passed a broken build ({broken})"
            kind = {"gc_log": "seen written are gone", "ship": "outside the loss window"}
            if broken in kind:  # and it is the check aimed at this break that fails
                assert any(kind[broken] in b for b in bad), bad
        else:
            assert bad == [], "\n".join(bad[:20]) + fleet.logs()
    finally:
        fleet.close()
