"""Steps as transactions: real `strata run` processes, real sandboxes, real kills.

Exit 0 publishes every changed read-write volume; any other end (a non-zero
exit, a signal, the timeout, the memory limit, the death of the runner)
publishes nothing and leaves nothing behind. Concurrent steps: disjoint
changes all land, same-file changes conflict (exit 3, path named, change set
kept on rejected/<run-id>), and no update is ever lost. Most steps run with
`--sandbox none` (the cheapest); a few run under bubblewrap and one under gVisor.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from run_harness import StepEnv, finish, pid_alive, wait_for

from strata.engine.tree import Trees
from strata.run.runner import LEASE_TTL

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")
needs_runsc = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc not installed")

# Inside every sandbox the volumes are at $STRATA_STORAGE/NAME.
VOL = '"$STRATA_STORAGE/v"'


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def test_exit_0_publishes(senv: StepEnv) -> None:
    before = senv.head("v")
    r = senv.step(["v"], sh(f"mkdir {VOL}/d && echo hello > {VOL}/d/f && echo out"))
    assert r.rc == 0, r
    assert r.stdout == "out\n"  # the command's own output passes through
    assert r.out["status"] == 0 and r.out["conflicts"] == []
    head = senv.head("v")
    assert head != before and r.out["published"] == {"v": head}
    assert senv.cat("v", "d/f") == "hello\n"
    assert r.out["run"] in senv.run("log", "v", "-n", "1").stdout
    senv.wait_clean()


@pytest.mark.parametrize(("case", "script", "extra", "status"), [
    pytest.param("exit-1", f"echo x > {VOL}/f; exit 1", (), 1, id="exit-1"),
    pytest.param("sigkill", f"echo x > {VOL}/f; kill -9 $$", (), 128 + 9, id="sigkill"),
    pytest.param("timeout", f"echo x > {VOL}/f; sleep 60", ("--timeout", "1"), 124,
                 id="timeout"),
    pytest.param("memory", f"echo x > {VOL}/f; python3 -c 'b = bytearray(400 << 20); "
                 "b[::4096] = b\"x\" * len(b[::4096])'", ("--memory", "64M"), 128 + 9,
                 id="memory"),
])
def test_failures_publish_nothing(senv: StepEnv, case: str, script: str,
                                  extra: tuple[str, ...], status: int) -> None:
    senv.run("put", "v", "keep", input="kept")
    before = senv.head("v")
    t0 = time.monotonic()
    r = senv.step(["v"], sh(script), "none", *extra)
    assert r.rc == status, r
    assert r.out["status"] == status and r.out["published"] == {}
    assert r.out["timed_out"] is (case == "timeout")
    assert r.out["oom"] is (case == "memory")
    if case == "timeout":
        assert time.monotonic() - t0 < 30  # killed at the deadline, not after `sleep 60`
    assert senv.head("v") == before
    assert senv.ls("v") == ["keep"]
    senv.wait_clean()


def test_what_the_command_leaves_running_is_killed(senv: StepEnv) -> None:
    """A background process cannot write to the volume after the step has ended."""
    r = senv.step(["v"], sh(f"sleep 60 >/dev/null 2>&1 & echo $! > {VOL}/bg; echo x > {VOL}/f"),
                  timeout=30)
    assert r.rc == 0, r
    pid = int(senv.cat("v", "bg"))
    assert wait_for(lambda: not pid_alive(pid), 5.0), "a background process outlived its step"
    senv.wait_clean()


@needs_bwrap
@pytest.mark.parametrize("case", ["exit-1", "memory"])
def test_failures_publish_nothing_under_bwrap(senv: StepEnv, case: str) -> None:
    before = senv.head("v")
    if case == "exit-1":
        r = senv.step(["v"], sh("echo x > /storage/v/f; exit 1"), "bwrap")
        assert r.rc == 1, r
    else:
        r = senv.step(["v"], ["python3", "-c", "open('/storage/v/f', 'w').write('x'); "
                              "b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096])"],
                      "bwrap", "--memory", "64M")
        assert r.rc == 137 and r.out["oom"], r
    assert r.out["published"] == {}
    assert senv.head("v") == before
    senv.wait_clean()


@pytest.mark.parametrize("sandbox", ["none", pytest.param("bwrap", marks=needs_bwrap)])
def test_sigkill_of_the_runner_publishes_nothing(senv: StepEnv, sandbox: str) -> None:
    """The runner dies mid-step: its mount process kills the command and discards all."""
    before = senv.head("v")
    # The command says it runs through a file in its volume (bwrap lets it write
    # nowhere else), seen on the host in the mount's upper directory.
    p = senv.start_step(["v"], sh(f"echo x > {VOL}/f; echo $$ > {VOL}/running; exec sleep 60"),
                        sandbox)
    assert wait_for(lambda: bool(senv.written("v", "running")), 20), (
        finish(p) if p.poll() is not None else "the command never ran")
    (running,) = senv.written("v", "running")
    pid = int(running.read_text()) if sandbox == "none" else None  # a pid in bwrap's namespace
    p.send_signal(signal.SIGKILL)
    p.wait()
    senv.wait_clean(5.0)
    if pid is not None:
        assert wait_for(lambda: not pid_alive(pid), 5.0), "the command outlived its runner"
    assert senv.head("v") == before and senv.ls("v") == []
    # The store is not wedged: the next step publishes.
    assert senv.step(["v"], sh(f"echo y > {VOL}/g")).rc == 0
    assert senv.ls("v") == ["g"]


@pytest.mark.parametrize("end", ["sigkill", "cancel"])
def test_a_mount_process_never_handed_a_step_exits(end: str) -> None:
    """A mount process forked for a step that never got its mount exits.

    The runner forks it first; dying (or giving up) before the mount exists
    must not leave that process waiting.
    """
    import sys
    code = ("import os, signal, sys\n"
            "from strata.mount.process import Prepared\n"
            "p = Prepared(watch_pid=os.getpid())\n"
            "print('forked', flush=True)\n"
            + ("os.kill(os.getpid(), signal.SIGKILL)\n" if end == "sigkill" else "p.cancel()\n"))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    # The mount process holds the runner's stdout until it exits (or hands it to its
    # log): the end of the pipe is the end of that process.
    out, err = p.communicate(timeout=60)
    assert out == b"forked\n", err
    assert p.returncode == (-signal.SIGKILL if end == "sigkill" else 0), err


@needs_bwrap
def test_read_only_volume_refuses_writes_and_rw_lands(senv: StepEnv) -> None:
    senv.run("volume", "create", "ref")
    senv.run("put", "ref", "data", input="reference")
    ref_head = senv.head("ref")
    script = (
        "import errno, os\n"
        "assert open('/storage/ref/data').read() == 'reference'\n"
        "try:\n"
        "    open('/storage/ref/new', 'w')\n"
        "    err = 'no error'\n"
        "except OSError as e:\n"
        "    err = errno.errorcode[e.errno]\n"
        "open('/storage/v/result', 'w').write(err)\n"
    )
    r = senv.step(["ref:ro", "v"], ["python3", "-c", script], "bwrap")
    assert r.rc == 0, r
    assert senv.cat("v", "result") == "EROFS"
    assert set(r.out["published"]) == {"v"}
    assert senv.head("ref") == ref_head and senv.ls("ref") == ["data"]
    senv.wait_clean()


def test_eight_concurrent_disjoint_steps_all_land(senv: StepEnv) -> None:
    procs = [senv.start_step(["v"], sh(f"echo {i} > {VOL}/f{i}")) for i in range(8)]
    results = [finish(p) for p in procs]
    assert [r.rc for r in results] == [0] * 8, [r.stderr for r in results if r.rc]
    assert sorted(senv.ls("v")) == [f"f{i}" for i in range(8)]
    for i in range(8):
        assert senv.cat("v", f"f{i}") == f"{i}\n"
    assert len(json.loads(senv.run("log", "v", "--json").stdout)) == 9  # 8 runs + the empty root
    senv.wait_clean()


# Reads the counter, waits (0.2 s, or until the wall-clock instant given as argv[1]),
# writes n + 1. With an instant shared by every step of a round, concurrent steps
# that read the same n write equal bytes in one kernel clock tick (equal mtimes): the
# case an "equal results do not conflict" rule loses.
COUNTER = (
    "import os, sys, time\n"
    "p = os.path.join(os.environ['STRATA_STORAGE'], 'v', 'counter')\n"
    "n = int(open(p).read())\n"
    "time.sleep(max(0.0, float(sys.argv[1]) - time.time()) if sys.argv[1:] else 0.2)\n"
    "open(p, 'w').write(str(n + 1))\n"
)


def test_concurrent_counter_never_loses_an_update(senv: StepEnv) -> None:
    """8 steps x 5 rounds increment one counter: every step lands or gets a conflict."""
    senv.run("put", "v", "counter", input="0")
    ok = 0
    rejected: list[dict[str, object]] = []
    for _round in range(5):
        procs = [senv.start_step(["v"], ["python3", "-c", COUNTER]) for _ in range(8)]
        for r in (finish(p) for p in procs):
            assert r.rc in (0, 3), r
            if r.rc == 0:
                ok += 1
            else:
                assert r.out["conflicts"] == ["counter"], r.out
                rejected.append(r.out)
        assert int(senv.cat("v", "counter")) == ok
    assert ok >= 5 and rejected, (ok, len(rejected))
    assert ok + len(rejected) == 40
    # Each refused change set is kept: rejected/<run> is its base plus the counter.
    branches = senv.branches("v")
    with senv.remote() as store:
        trees = Trees(store)
        for i, out in enumerate(rejected):
            branch = f"rejected/{out['run']}"
            assert branches.get(branch) == out["rejected"]["v"]
            base = store.snapshot(branches[branch]).parent
            assert base is not None
            seen = int(senv.cat(f"v#{base}", "counter")) if i < 2 else None
            if i < 2:  # through the CLI for a couple, in-process for all
                diff = json.loads(senv.run("diff", f"v#{base}", f"v@{branch}", "--json").stdout)
                assert diff == [{"path": "counter", "change": "modified"}]
                assert int(senv.cat(f"v@{branch}", "counter")) == seen + 1
            changed = [path for path, _old, _new in trees.diff(store.snapshot(base).root,
                                                               store.snapshot(branches[branch]).root)]
            assert changed == ["counter"], (branch, changed)
    senv.wait_clean()


def test_counter_race_with_equal_results_loses_no_update(senv: StepEnv) -> None:
    """Concurrent increments write equal bytes at one instant: counter == steps that exited 0."""
    senv.run("put", "v", "counter", input="0")
    ok = 0
    for _round in range(3):
        at = time.time() + 2.5  # after every step of the round has read the counter
        procs = [senv.start_step(["v"], ["python3", "-c", COUNTER, str(at)])
                 for _ in range(4)]
        results = [finish(p) for p in procs]
        assert all(r.rc in (0, 3) for r in results), results
        assert all(r.out["timings"]["began"] < at - 0.5 for r in results), "steps too slow"
        landed = sum(1 for r in results if r.rc == 0)
        assert landed == 1, [r.out for r in results]  # all read the same n: one may land
        ok += landed
        assert int(senv.cat("v", "counter")) == ok
        for r in results:
            if r.rc == 3:
                assert r.out["conflicts"] == ["counter"], r.out
    senv.wait_clean()


def test_merge_identical_accepts_equal_results_by_choice(senv: StepEnv) -> None:
    """Idempotent steps (same bytes, same mtime) both land with --merge-identical, not without."""
    job = sh(f"mkdir -p {VOL}/out && printf built > {VOL}/out/artifact && "
             f"touch -d @1700000000 {VOL}/out/artifact {VOL}/out && sleep 1")
    for extra, expect in (((), [0, 3]), (("--merge-identical",), [0, 0])):
        senv.run("rm", "-r", "v", "out", rc=None)
        procs = [senv.start_step(["v"], job, "none", *extra) for _ in range(2)]
        results = [finish(p) for p in procs]
        assert sorted(r.rc for r in results) == expect, (extra, results)
        assert senv.cat("v", "out/artifact") == "built"
    senv.wait_clean()


def test_exclusive_steps_take_turns(senv: StepEnv) -> None:
    """:exclusive steps on one branch never overlap, and none of them conflicts."""
    senv.run("put", "v", "counter", input="0")
    script = (
        "import os, sys, time\n"
        "d = os.path.join(os.environ['STRATA_STORAGE'], 'v')\n"
        "start = time.time()\n"
        "n = int(open(d + '/counter').read())\n"
        "time.sleep(0.3)\n"
        "open(d + '/counter', 'w').write(str(n + 1))\n"
        "open(d + '/t' + sys.argv[1], 'w').write(f'{start} {time.time()}')\n"
    )
    procs = [senv.start_step(["v:exclusive"], ["python3", "-c", script, str(i)])
             for i in range(5)]
    results = [finish(p) for p in procs]
    assert [r.rc for r in results] == [0] * 5, [r.stderr for r in results if r.rc]
    assert senv.cat("v", "counter") == "5"
    spans = sorted(tuple(map(float, senv.cat("v", f"t{i}").split())) for i in range(5))
    for (_s1, e1), (s2, _e2) in zip(spans, spans[1:], strict=False):
        assert e1 <= s2, f"exclusive steps overlapped: {spans}"
    senv.wait_clean()


def test_killed_lease_holder_blocks_no_longer_than_the_ttl(senv: StepEnv) -> None:
    p = senv.start_step(["v:exclusive"], sh(f"echo held > {VOL}/running; exec sleep 120"))
    assert wait_for(lambda: bool(senv.written("v", "running")), 20)
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed = time.monotonic()
    r = senv.step(["v:exclusive"], sh(f"echo next > {VOL}/next"))
    waited = time.monotonic() - killed
    assert r.rc == 0, r
    assert waited < LEASE_TTL + 5, f"the next exclusive step waited {waited:.1f}s"
    assert senv.ls("v") == ["next"]
    senv.wait_clean()


@needs_bwrap
def test_run_scoped_volume_leaves_the_branch_alone(senv: StepEnv) -> None:
    senv.run("put", "v", "f", input="original")
    live = senv.head("v")
    r = senv.step(["v:run"], sh("echo changed > /storage/v/f && echo new > /storage/v/g"),
                  "bwrap")
    assert r.rc == 0, r
    branch = f"run/{r.out['run']}"
    assert senv.branches("v")[branch] == r.out["published"]["v"]
    assert senv.cat(f"v@{branch}", "f") == "changed\n"
    assert senv.cat(f"v@{branch}", "g") == "new\n"
    assert senv.head("v") == live and senv.cat("v", "f") == "original"
    senv.wait_clean()


@needs_runsc
def test_git_commit_under_gvisor_is_published(senv: StepEnv, tmp_path: Path) -> None:
    senv.run("volume", "create", "repo")
    git = "git -c user.name=Step -c user.email=step@example.com"
    script = ("cd /storage/repo && git init -q && echo 'hello from gVisor' > README && "
              f"git add README && {git} commit -q -m 'first commit' && git rev-parse HEAD")
    r = senv.step(["repo"], sh(script), "gvisor", env={"HOME": "/tmp"})
    assert r.rc == 0, r
    commit_id = r.stdout.strip()
    assert len(commit_id) == 40
    log = json.loads(senv.run("log", "repo", "--json").stdout)
    assert log[0]["id"] == r.out["published"]["repo"] and r.out["run"] in log[0]["message"]
    assert {"HEAD", "objects", "refs"} <= set(senv.ls("repo", ".git"))
    # The published snapshot is a working repository: export it and ask git.
    out = tmp_path / "export"
    senv.run("export", "repo", str(out))
    p = subprocess.run(["git", "-C", str(out), "log", "--format=%H %s"], capture_output=True,
                       text=True, env={**os.environ, "HOME": str(tmp_path)})
    assert p.stdout.strip() == f"{commit_id} first commit", p
    senv.wait_clean()


def test_names_that_are_not_utf8_are_published_byte_exact(senv: StepEnv, tmp_path: Path) -> None:
    """Finding 7 of the hardening issue: a step (mount commit) with Latin-1 and raw-byte names."""
    script = (f"cd {VOL} && printf latin1 > \"$(printf 'caf\\351.txt')\" && "
              f"mkdir \"$(printf 'd\\377')\" && printf x > \"$(printf 'd\\377')/x\"")
    r = senv.step(["v"], sh(script))
    assert r.rc == 0, (r.rc, r.stderr)
    raw = subprocess.run([*senv.step_argv([], ["true"])[:3], "ls", "v"], env=senv.env,
                         capture_output=True, timeout=60)
    assert raw.returncode == 0 and raw.stdout.split(b"\n")[:2] == [b"caf\xe9.txt", b"d\xff"]
    assert senv.run("cat", "v", '"caf\\351.txt"').stdout == "latin1"  # as the CLI shows it
    out = tmp_path / "out"
    senv.run("export", "v", str(out))
    assert (out / os.fsdecode(b"caf\xe9.txt")).read_bytes() == b"latin1"
    assert (out / os.fsdecode(b"d\xff") / "x").read_bytes() == b"x"
    senv.wait_clean()
