"""Jepsen-style fault rounds on a fleet of three hosts, with moto on a fourth.

Three members, each in a network namespace of its own; moto in the bucket's
namespace, which also routes between the hosts and the test's clients.
Clients publish through any member to three stores (two `--sync bucket`,
one default) while each round applies one fault to the owner of a random
store: SIGKILL (and a restart later), SIGSTOP then SIGCONT, or a cut of
its link to everyone, healed later. Between rounds the fleet must give the
store a new owner. The checker (fleetutil.check) then reads each store's
final history from its owner and checks every acknowledged publish against
it, that heads moved forward along one chain, and that no older epoch
acknowledged after a newer one had.

`make test` runs FLEET_ROUNDS=3 (default); `make fuzz` runs 100. The last
test builds a broken strata (STRATA_TEST_BREAK=fence,lease: an owner that
writes past the fence and acknowledges after its lease could expire) and
shows that the checker fails against it.
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
from fleethosts import FleetHosts
from fleetutil import Fleet, History, Op, Publishers, check, content, make_volume

from bucketutil import Moto
from strata.engine.errors import StrataError
from strata.engine.txn import Transaction
from strata.fleet.client import FleetStore

pytestmark = pytest.mark.skipif(shutil.which("ip") is None or os.geteuid() != 0,
                                reason="needs iproute2 and root")

NAMES = ["a", "b", "c"]
STRICT = ["s1", "s2"]
DEFAULT = ["s3"]


@pytest.fixture
def hosts_moto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
               ) -> Iterator[tuple[FleetHosts, Moto]]:
    with FleetHosts(NAMES) as h:
        moto = Moto(tmp_path, netns=h.bucket_ns, address=h.bucket_address["test"]).start()
        for k, v in moto.env().items():
            monkeypatch.setenv(k, v)
        try:
            yield h, moto
        finally:
            moto.stop()


# Clocks: the rate of each member's monotonic clock (STRATA_TEST_CLOCK_RATE, which
# scales the clock every lease and liveness span is measured on). "skewed" stays
# inside the 5 % bound; "beyond" breaks it. Wall-clock offsets are not applied:
# under faketime (even with the monotonic clock left alone) obstore's HTTP client
# failed every request after a minute or so, on every member.
CLOCKS = {
    "same": {},
    "skewed": {"a": "0.96", "b": "1.04", "c": "1.0"},
    "beyond": {"a": "0.5", "b": "1.6", "c": "1.6"},
}


def start_fleet(h: FleetHosts, moto: Moto, tmp_path: Path, *, broken: str = "",
                clocks: str = "same") -> Fleet:
    fleet = Fleet(f"s3://strata-test/{tmp_path.name}", tmp_path, moto.env(), broken=broken)
    for s in STRICT:
        fleet.records.add_store(s, "bucket")
    for s in DEFAULT:
        fleet.records.add_store(s, "local")
    try:
        return _start(fleet, h, moto, clocks)
    except BaseException:
        fleet.close()  # members started so far must not outlive the test
        raise


def _start(fleet: Fleet, h: FleetHosts, moto: Moto, clocks: str) -> Fleet:
    for name in NAMES:
        prefix = h.exec_prefix(name)
        env = moto.env(f"http://{h.bucket_address[name]}:{moto.port}")
        if name in CLOCKS[clocks]:
            env["STRATA_TEST_CLOCK_RATE"] = CLOCKS[clocks][name]
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


def one_round(fleet: Fleet, h: FleetHosts, rng: random.Random, log: list[str]) -> None:
    store = rng.choice(STRICT + DEFAULT)
    owner = fleet.owner(store, 60)
    fault = rng.choice(os.environ.get("FLEET_FAULTS", "kill,stop,cut").split(","))
    t0 = time.monotonic()
    if fault == "kill":
        fleet.kill(owner)
    elif fault == "stop":
        fleet.pause(owner)
    else:
        h.cut(owner)
    new = fleet.owner(store, 60, not_=owner)
    took = time.monotonic() - t0
    time.sleep(rng.uniform(0.2, 1.5))  # publishes through the new owner, the old one out
    if fault == "kill":
        fleet.start(owner)
    elif fault == "stop":
        fleet.resume(owner)
    else:
        h.heal(owner)
    log.append(f"{fault} {owner} (owner of {store}): {new} serves it after {took:.2f} s")
    time.sleep(rng.uniform(0.5, 1.5))


@pytest.mark.parametrize("clocks", ["same", "skewed"])
def test_fault_rounds(hosts_moto: tuple[FleetHosts, Moto], tmp_path: Path,
                      clocks: str) -> None:
    h, moto = hosts_moto
    rounds = int(os.environ.get("FLEET_ROUNDS", "3"))
    seed = int(os.environ.get("FLEET_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    fleet = start_fleet(h, moto, tmp_path, clocks=clocks)
    log: list[str] = []
    try:
        pubs = Publishers(fleet, STRICT + DEFAULT, per_store=2).start()
        for _ in range(rounds):
            one_round(fleet, h, rng, log)
        history = pubs.stop()
        bad = check(fleet, history, STRICT, strict=True)
        acked = history.acked()
        print(f"clocks {clocks}, seed {seed}: {rounds} rounds, {len(history.ops)} publishes, "
              f"{len(acked)} acknowledged, epochs {sorted({o.epoch for o in acked if o.epoch})}")
        print("\n".join(log))
        assert acked, fleet.logs()
        assert bad == [], "\n".join(bad[:20]) + fleet.logs()
        # The default sync may lose what was not shipped when its owner died; the
        # rest of the checker holds for it all the same.
        lossy = check(fleet, history, DEFAULT, strict=False)
        lost = [b for b in lossy if "not in the final" in b]
        print(f"default sync: {len(lost)} acknowledged publishes lost (window) of "
              f"{len(history.acked(DEFAULT[0]))}")
        assert [b for b in lossy if b not in lost] == [], "\n".join(lossy[:20])
    finally:
        fleet.close()


@pytest.mark.parametrize(("store", "fault", "broken"), [
    ("s1", "stop", ""), ("s1", "stop", "fence,lease"),  # --sync bucket: both guards must go
    # The default sync, its owner cut from the bucket but not from clients: the
    # fence cannot reach it, so the lease window alone keeps it from acknowledging.
    ("s3", "cut_bucket", ""), ("s3", "cut_bucket", "lease"),
    # The clock assumption is load-bearing: an owner whose clock runs at half speed
    # and standbys 60 % fast break it, with no code broken.
    ("s3", "cut_bucket", "clock"),
])
def test_the_checker_fails_against_a_broken_build(hosts_moto: tuple[FleetHosts, Moto],
                                                  tmp_path: Path, store: str, fault: str,
                                                  broken: str) -> None:
    """A stale owner resumes while a client talks to it: only a broken build acknowledges.

    SIGSTOP the owner of the store until another member serves it, then
    SIGCONT it while a client talks to its host (any member answers any
    request); or cut the owner from the bucket only, and keep a client
    talking to it. A correct build refuses (its lease window is over, and the
    fence stops its log writes) and forwards to the new owner. A build whose
    owner writes past the fence and acknowledges after its lease could expire
    (STRATA_TEST_BREAK) acknowledges on its old epoch, and the checker must
    say so. With the default sync, lost acknowledgements within the window
    are allowed, so there only the epoch and head rules are asked.
    """
    h, moto = hosts_moto
    beyond = broken == "clock"
    fleet = start_fleet(h, moto, tmp_path, broken="" if beyond else broken,
                        clocks="beyond" if beyond else "same")
    try:
        owner = fleet.owner(store)
        if beyond and owner != "a":  # the slow clock must be the owner's
            move(fleet, store, "a")
            owner = fleet.owner(store, not_=owner)
        old_addr = fleet.members[owner].addr
        pubs = Publishers(fleet, [store], per_store=2).start()
        time.sleep(1.0)
        if fault == "stop":
            fleet.pause(owner)
        else:
            h.cut_bucket(owner)
        new = fleet.owner(store, 60, not_=owner)
        if fault == "stop":
            time.sleep(1.5)
            fleet.resume(owner)
        # Two clients in turn: one on the old owner's host, one on the new owner's.
        only_old = FleetStore([old_addr], store, retry_for=5.0, timeout=5.0)
        only_new = FleetStore([fleet.members[new].addr], store, retry_for=5.0, timeout=5.0)
        stale = History()
        for i in range(20):
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
        time.sleep(1.0)
        history = pubs.stop()
        history.ops.extend(stale.ops)
        bad = check(fleet, history, [store])
        if store in DEFAULT:
            bad = [b for b in bad if "not in the final" not in b]
        print(f"{store} broken={broken!r}: {len(bad)} violation(s); the stale client: "
              + ", ".join(f"{o.path} {'ok' if o.ok else 'refused'} {o.owner}/{o.epoch}"
                          for o in stale.ops))
        print("\n".join(bad[:5]))
        if broken:
            assert bad, "the checker passed a build that acknowledges past its lease"
        else:
            assert bad == [], "\n".join(bad[:20]) + fleet.logs()
    finally:
        fleet.close()
