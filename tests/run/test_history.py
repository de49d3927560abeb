"""Isolation, proved by a history checker over real concurrent steps.

Many `strata run` steps, over two volumes and forks of them, read list keys,
append unique elements, and increment counters (writes synchronised to one
instant, so equal results are common). Some steps fail on purpose after
writing, some runners are SIGKILLed mid-step, and the server is SIGKILLed
while steps run. The final state and every recorded read then go through
`history.check` (see its docstring for what it verifies). The first tests
show that the checker itself catches each anomaly it claims to.

`STRATA_HISTORY_STEPS` sets the number of steps (default sized for
`make test`; `make fuzz` runs a longer history).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from history import CONFLICT, FAIL, INFO, OK, Final, Op, Txn, check
from run_harness import StepEnv, finish, wait_for

from strata.engine.errors import NotFound
from strata.engine.txn import Transaction
from strata.mount.session import SWEEP_AFTER

# -- the checker catches what it claims to ------------------------------------------


def _inc(tid: str, key: str, seen: int, status: str = OK) -> Txn:
    branch = key.rpartition(":")[0]
    return Txn(tid, status, [Op("i", key, seen)], [branch])


def _final(lists: dict[str, list[str]] | None = None, counters: dict[str, int] | None = None,
           markers: dict[str, set[str]] | None = None) -> Final:
    return Final(lists or {}, counters or {}, markers or {})


def test_checker_accepts_a_valid_history() -> None:
    t1 = Txn("t1", OK, [Op("r", "a@live:l", []), Op("a", "a@live:l", "x")], ["a@live"])
    t2 = Txn("t2", OK, [Op("r", "a@live:l", ["x"]), Op("a", "a@live:l", "y"),
                        Op("i", "a@live:c", 0)], ["a@live"])
    t3 = Txn("t3", CONFLICT, [Op("r", "a@live:l", ["x"]), Op("a", "a@live:l", "z")],
             ["a@live"])
    t4 = Txn("t4", OK, [Op("r", "a@live:l", ["x", "y"])])  # read-only
    final = _final({"a@live:l": ["x", "y"]}, {"a@live:c": 1}, {"a@live": {"t1", "t2"}})
    assert check([t1, t2, t3, t4], final) == []


def test_checker_catches_a_lost_increment() -> None:
    """Two committed steps read 5 and wrote 6: the old equal-bytes rule's silent loss."""
    txns = [_inc("t1", "a@live:c", 0), _inc("t2", "a@live:c", 0)]
    problems = check(txns, _final(counters={"a@live:c": 1},
                                  markers={"a@live": {"t1", "t2"}}))
    assert any("lost update" in p for p in problems), problems
    assert any("moved by 1" in p for p in problems), problems


def test_checker_catches_missing_and_aborted_writes() -> None:
    ok = Txn("ok", OK, [Op("a", "a@live:l", "x")], ["a@live"])
    refused = Txn("refused", CONFLICT, [Op("a", "a@live:l", "y")], ["a@live"])
    failed = Txn("failed", FAIL, [Op("a", "a@live:l", "z")], ["a@live"])
    problems = check([ok, refused, failed],
                     _final({"a@live:l": ["y"]}, markers={"a@live": {"refused"}}))
    assert any("ok exited 0 but nothing" in p for p in problems), problems
    assert any("refused ended conflict but its writes are visible" in p for p in problems)
    lost = check([ok], _final({"a@live:l": []}, markers={"a@live": {"ok"}}))
    assert any("append 'x'" in p and "missing" in p for p in lost), lost
    ghost = check([failed], _final({"a@live:l": ["z"]}))
    assert any("'z'" in p and "not committed" in p for p in ghost), ghost


def test_checker_catches_a_partial_multi_volume_publish() -> None:
    t = Txn("t", INFO, [Op("a", "a@live:l", "x"), Op("a", "b@live:l", "y")],
            ["a@live", "b@live"])
    problems = check([t], _final({"a@live:l": ["x"], "b@live:l": []},
                                 markers={"a@live": {"t"}}))
    assert any("landed in part" in p for p in problems), problems


def test_checker_catches_reads_of_states_that_never_existed() -> None:
    w = Txn("w", OK, [Op("a", "a@live:l", "x"), Op("a", "a@live:m", "y")], ["a@live"])
    w2 = Txn("w2", OK, [Op("a", "a@live:l", "x2")], ["a@live"])
    bogus = Txn("r1", OK, [Op("r", "a@live:l", ["x2"])])
    final = _final({"a@live:l": ["x", "x2"], "a@live:m": ["y"]},
                   markers={"a@live": {"w", "w2"}})
    problems = check([w, w2, bogus], final)
    assert any("never existed" in p for p in problems), problems
    # A fractured read: saw w on l but not on m (w wrote both in one publish).
    fractured = Txn("r2", OK, [Op("r", "a@live:l", ["x"]), Op("r", "a@live:m", [])])
    problems = check([w, w2, fractured], final)
    assert any("G-single" in p and "r2" in p for p in problems), problems


def test_checker_allows_write_skew_but_not_a_dependency_cycle() -> None:
    # Write skew: each read the other's key before the other wrote it. Allowed under SI.
    a = Txn("a", OK, [Op("r", "v@live:x", []), Op("a", "v@live:y", "a1")], ["v@live"])
    b = Txn("b", OK, [Op("r", "v@live:y", []), Op("a", "v@live:x", "b1")], ["v@live"])
    final = _final({"v@live:x": ["b1"], "v@live:y": ["a1"]}, markers={"v@live": {"a", "b"}})
    assert check([a, b], final) == []
    # Each saw the other's write: impossible in any order.
    a2 = Txn("a", OK, [Op("r", "v@live:x", ["b1"]), Op("a", "v@live:y", "a1")], ["v@live"])
    b2 = Txn("b", OK, [Op("r", "v@live:y", ["a1"]), Op("a", "v@live:x", "b1")], ["v@live"])
    problems = check([a2, b2], final)
    assert any("G1c" in p for p in problems), problems


# -- the workload ---------------------------------------------------------------------

LISTS = ("l0", "l1", "l2")
COUNTER = "c0"
FAIL_EXIT = 7

# The step itself: run inside `strata run --sandbox none`. It reads its plan, does the
# reads, waits for the plan's instant (the next whole second after it was launched, so
# the steps launched within one second write in one kernel clock tick and equal
# results carry equal mtimes), does the writes, writes a marker into every branch it
# wrote, records what it saw, and exits.
STEP = r"""
import json, os, sys, time
plan = json.load(open(sys.argv[1]))
root = os.environ["STRATA_STORAGE"]
seen = []
def path(vol, name):
    return os.path.join(root, vol, name)
for op in plan["ops"]:
    if op["f"] == "r":
        with open(path(op["vol"], op["name"])) as f:
            seen.append(f.read().split())
time.sleep(max(0.0, plan["at"] - time.time()))
out = []
for op in plan["ops"]:
    p = path(op["vol"], op["name"])
    if op["f"] == "a":
        with open(p, "a") as f:
            f.write(op["elem"] + "\n")
    elif op["f"] == "i":
        with open(p) as f:
            n = int(f.read() or 0)
        out.append(n)
        with open(p, "w") as f:
            f.write(str(n + 1))
        if op["reproducible"]:  # as SOURCE_DATE_EPOCH tools do: mtime follows content
            t = (1_700_000_000 + n + 1) * 10**9
            os.utime(p, ns=(t, t))
for vol in plan["writes"]:
    open(os.path.join(root, vol, "m", plan["id"]), "w").close()
with open(sys.argv[2], "w") as f:
    json.dump({"reads": seen, "incs": out}, f)
sys.exit(plan["exit"])
"""


@dataclass
class Running:
    txn: Txn
    plan: dict[str, object]
    proc: subprocess.Popen[str]
    result: Path
    kill_at: float | None


def _plan(rng: random.Random, n: int, branches: list[str]) -> dict[str, object]:
    """One step's random plan over one or two branches of different volumes."""
    by_volume: dict[str, list[str]] = {}
    for b in branches:
        by_volume.setdefault(b.split("@")[0], []).append(b)
    vols = rng.sample(sorted(by_volume), k=rng.choice([1, 1, 2]) if len(by_volume) > 1 else 1)
    chosen = [rng.choice(by_volume[v]) for v in vols]
    ops: list[dict[str, object]] = []
    writes = []
    read_only = rng.random() < 0.1
    for b in chosen:
        vol = b.split("@")[0]
        for name in rng.sample(LISTS, rng.randint(1, 2)):
            ops.append({"f": "r", "vol": vol, "name": name, "branch": b})
        if read_only:
            continue
        wrote = False
        if rng.random() < 0.5:
            ops.append({"f": "a", "vol": vol, "name": rng.choice(LISTS), "branch": b,
                        "elem": f"s{n}{vol}"})
            wrote = True
        if rng.random() < 0.4 or not wrote:
            ops.append({"f": "i", "vol": vol, "name": COUNTER, "branch": b,
                        "reproducible": rng.random() < 0.5})
        writes.append(b)
    return {"id": f"s{n}", "branches": chosen, "ops": ops, "exit": (
        FAIL_EXIT if writes and rng.random() < 0.1 else 0),
        "writes": [b.split("@")[0] for b in writes], "write_branches": writes}


def _spec(branch: str) -> str:
    vol, _, br = branch.partition("@")
    return vol if br == "live" else f"{vol}@{br}"


def _txn(plan: dict[str, object], status: str, result: dict[str, object] | None) -> Txn:
    reads = iter(result["reads"]) if result else iter(())  # type: ignore[call-overload]
    incs = iter(result["incs"]) if result else iter(())  # type: ignore[call-overload]
    ops = []
    for op in plan["ops"]:  # type: ignore[attr-defined]
        key = f"{op['branch']}:{op['name']}"
        if op["f"] == "r":
            ops.append(Op("r", key, next(reads, None)))
        elif op["f"] == "a":
            ops.append(Op("a", key, op["elem"]))
        else:
            ops.append(Op("i", key, next(incs, None)))
    return Txn(str(plan["id"]), status, ops, list(plan["write_branches"]))  # type: ignore


def _server_pid(senv: StepEnv) -> int | None:
    try:
        return int((senv.store / "lock").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _final_state(senv: StepEnv, branches: list[str]) -> Final:
    lists: dict[str, list[str]] = {}
    counters: dict[str, int] = {}
    markers: dict[str, set[str]] = {}
    with senv.remote() as store:
        for b in branches:
            vol, _, br = b.partition("@")
            t = Transaction(store, vol, br)
            for name in LISTS:
                lists[f"{b}:{name}"] = t.read(name).decode().split()
            counters[f"{b}:{COUNTER}"] = int(t.read(COUNTER) or b"0")
            try:
                markers[b] = {name for name, _e in t.listdir("m")}
            except NotFound:
                markers[b] = set()
    return Final(lists, counters, markers)


def run_history(senv: StepEnv, tmp: Path, steps: int, seed: int, *, workers: int = 6,
                kill_steps: float = 0.08, server_kills: int = 2) -> tuple[list[Txn], Final]:
    rng = random.Random(seed)
    for vol in ("a", "b"):
        senv.run("volume", "create", vol)
        with senv.remote() as store:
            t = Transaction(store, vol)
            for name in LISTS:
                t.write(name, b"")
            t.write(COUNTER, b"0")
            t.mkdir("m")
            t.commit("history: empty keys")
    branches = ["a@live", "b@live"]
    forks = {steps // 3: ("a@live", "a@f1"), (2 * steps) // 3: ("b@live", "b@f2")}
    kills = sorted(rng.sample(range(steps // 5, steps), server_kills))
    txns: list[Txn] = []
    counter_start: dict[str, tuple[str | None, int]] = {}
    running: list[Running] = []
    server_kills_done: list[int] = []
    plans = tmp / "plans"
    plans.mkdir()
    n = 0

    def reap() -> None:
        now = time.monotonic()
        for r in list(running):
            if r.kill_at is not None and now >= r.kill_at and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGKILL)
            if r.proc.poll() is None:
                continue
            res = finish(r.proc, timeout=180)
            running.remove(r)
            if res.rc == 0:
                status = OK
            elif res.rc == 3:
                status = CONFLICT
            elif res.rc == FAIL_EXIT and res.out.get("status") == FAIL_EXIT:
                status = FAIL
            else:  # killed, or the runner gave up: the publish may or may not have landed
                assert res.rc < 0 or r.kill_at is not None or "Unavailable" in res.stderr \
                    or "cannot reach" in res.stderr, (res.rc, res.stderr[-2000:])
                status = INFO
            result = json.loads(r.result.read_text()) if r.result.exists() else None
            txns.append(_txn(r.plan, status, result))

    while n < steps or running:
        if n in forks and not running:
            parent, child = forks.pop(n)
            pvol, _, pbr = parent.partition("@")
            cvol, _, cbr = child.partition("@")
            senv.run("fork", f"{pvol}@{pbr}", cbr)
            # The fork is a read of the parent at one snapshot: record what it holds.
            with senv.remote() as store:
                t = Transaction(store, cvol, cbr)
                ops = [Op("r", f"{parent}:{name}", t.read(name).decode().split())
                       for name in LISTS]
                start = int(t.read(COUNTER) or b"0")
                ops.append(Op("rc", f"{parent}:{COUNTER}", start))
            txns.append(Txn(f"fork:{child}", OK, ops))
            counter_start[f"{child}:{COUNTER}"] = (f"{parent}:{COUNTER}", start)
            branches.append(child)
        if n < steps and len(running) < workers and n not in forks:
            if kills and n >= kills[0]:
                kills.pop(0)
                pid = _server_pid(senv)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    server_kills_done.append(pid)
            plan = _plan(rng, n, branches)
            plan["at"] = float(int(time.time() + 0.8) + 1)
            plan_file = plans / f"s{n}.json"
            plan_file.write_text(json.dumps(plan))
            result = plans / f"s{n}.out"
            specs = [_spec(b) for b in plan["branches"]]  # type: ignore[attr-defined]
            proc = senv.start_step(specs, [sys.executable, "-c", STEP, str(plan_file),
                                           str(result)])
            kill_at = (time.monotonic() + rng.uniform(0.1, 0.9)
                       if rng.random() < kill_steps else None)
            running.append(Running(Txn(str(plan["id"]), INFO), plan, proc, result, kill_at))
            n += 1
            continue
        reap()
        time.sleep(0.02)
    # A runner killed between its mount's teardown and removing its scratch leaves that
    # to the next step on the machine, once it has lain untouched for a few seconds:
    # run one then, and nothing may be left.
    time.sleep(SWEEP_AFTER + 0.5)
    assert senv.step(["a"], ["true"]).rc == 0
    final = _final_state(senv, branches)
    final.counter_start = counter_start
    assert len(server_kills_done) == server_kills, server_kills_done
    return txns, final


def test_history_of_concurrent_steps_is_snapshot_isolated(senv: StepEnv,
                                                           tmp_path: Path) -> None:
    steps = int(os.environ.get("STRATA_HISTORY_STEPS", "80"))
    seed = int(os.environ.get("STRATA_HISTORY_SEED", str(int(time.time()))))
    txns, final = run_history(senv, tmp_path, steps, seed)
    problems = check(txns, final)
    counts = {s: sum(1 for t in txns if t.status == s) for s in (OK, CONFLICT, FAIL, INFO)}
    summary = f"seed {seed}: {counts}; final {final.counters}"
    print(summary)
    assert not problems, summary + "\n" + "\n".join(problems[:40])
    # The run must have exercised what it claims: races lost and won, failures, kills.
    assert counts[OK] >= steps // 4 and counts[CONFLICT] >= 1, summary
    assert sum(final.counters.values()) > 0, summary
    # A runner killed while its mount came up once left that mount behind (about
    # one run in five): the mount process died writing "ok" to the gone runner,
    # before it began watching it. Nothing may be left now.
    assert wait_for(lambda: senv.leftovers() == ([], []), 10), senv.leftovers()
