"""`strata watch --json` against real steps publishing at once: every event once, in order."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

from run_harness import StepEnv, finish

from strata_harness import STRATA


def _reader(proc: subprocess.Popen[str], out: list[dict[str, Any]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(json.loads(line))


def _wait(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def _watching(env: dict[str, str]) -> tuple[subprocess.Popen[str], list[dict[str, Any]]]:
    """`strata watch v --json` running, its events gathered as they come, once it said hello."""
    watch = subprocess.Popen([*STRATA, "watch", "v", "--json"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events: list[dict[str, Any]] = []
    threading.Thread(target=_reader, args=(watch, events), daemon=True).start()
    try:
        assert _wait(lambda: any(e["type"] == "hello" for e in events), 20), events
    except BaseException:
        watch.kill()
        raise
    return watch, events


def test_watch_json_sees_every_publish_once_in_order(senv: StepEnv) -> None:
    watch, events = _watching(senv.env)
    try:
        start = events[0]["heads"]["v@live"]
        n = 8
        steps = [senv.start_step(["v"], ["sh", "-c", f'echo {i} > "$STRATA_STORAGE/v/f{i}"'])
                 for i in range(n)]
        results = [finish(p) for p in steps]
        assert [r.rc for r in results] == [0] * n, [r.stderr for r in results]
        # A change against an old base that touches a path moved since: a conflict.
        senv.run("put", "v", "f0", "--base", start, "-m", "late", input="late\n", rc=3)
        senv.run("fork", "v", "side")
        assert _wait(lambda: any(e["type"] == "fork" for e in events), 20), events
    finally:
        watch.terminate()
        watch.wait(10)
    pubs = [e for e in events if e["type"] == "publish"]
    log = json.loads(senv.run("log", "v", "--json").stdout)
    published = [s["id"] for s in reversed(log)][1:]  # oldest first, past the start
    assert [e["snapshot"] for e in pubs] == published  # each once, in publish order
    assert pubs[0]["parent"] == start
    for prev, cur in zip(pubs, pubs[1:], strict=False):
        assert cur["parent"] == prev["snapshot"]
    runs = {r.out["run"] for r in results}
    assert {e["run"] for e in pubs} == runs
    assert all((e["added"], e["deleted"], e["modified"], e["status"]) == (1, 0, 0, 0)
               for e in pubs)
    seqs = [e["seq"] for e in events if "seq" in e and e["type"] != "hello"]
    assert seqs == sorted(set(seqs))
    (conflict,) = [e for e in events if e["type"] == "conflict"]
    assert conflict["paths"] == ["f0"] and conflict["branch"] == "live"
    (fork,) = [e for e in events if e["type"] == "fork"]
    assert (fork["branch"], fork["snapshot"]) == ("side", published[-1])
    # The event order is the order things happened in: publishes, conflict, fork.
    kinds = [e["type"] for e in events if e["type"] != "hello"]
    assert kinds == ["publish"] * n + ["conflict", "fork"]


def test_failed_timed_out_and_oom_steps_appear_in_watch(senv: StepEnv) -> None:
    """They were missing from watch and the web view; CI dashboards show them."""
    watch, events = _watching(senv.env)
    try:
        failed = senv.step(["v"], ["sh", "-c", "echo x > $STRATA_STORAGE/v/f; exit 7"])
        slow = senv.step(["v"], ["sleep", "30"], "none", "--timeout", "0.5")
        assert (failed.rc, slow.rc) == (7, 124)
        assert _wait(lambda: len([e for e in events if e["type"] == "step"]) == 2, 20), events
    finally:
        watch.terminate()
        watch.wait(10)
    steps = [e for e in events if e["type"] == "step"]
    assert [(e["run"], e["status"], e["timed_out"]) for e in steps] == [
        (failed.out["run"], 7, False), (slow.out["run"], 124, True)]
    assert steps[0]["argv"][:2] == ["sh", "-c"] and steps[0]["branch"] == "live"


def test_a_watched_server_does_not_exit_when_idle(senv: StepEnv) -> None:
    """A watched server stays up past its idle limit.

    It exited 5 s after the last request (the tests' limit), and the watch then
    reconnected to a new server: a publish landing in that gap came late, or not at all.
    """
    env = {**senv.env, "STRATA_SERVER_IDLE_EXIT": "1"}
    senv.run("serve", "--stop")
    subprocess.run([*STRATA, "ls", "v"], env=env, check=True, capture_output=True)
    watch, events = _watching(env)
    try:
        epoch = events[0]["epoch"]
        time.sleep(4)  # four idle limits, and no request but the stream
        senv.run("put", "v", "late", input="x\n")
        assert _wait(lambda: any(e["type"] == "publish" for e in events), 20), events
    finally:
        watch.terminate()
        watch.wait(10)
    assert [e["type"] for e in events] == ["hello", "publish"], events
    assert events[1]["seq"] > 0 and events[0]["epoch"] == epoch
