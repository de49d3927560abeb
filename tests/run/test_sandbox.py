"""The sandbox's own promises: an unprivileged id range, stored owners, an image root, limits.

The attack side (what a hostile step cannot reach) is tests/run/test_hostile.py;
these check that ordinary work still sees what it should, through real steps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from run_harness import StepEnv
from ws_harness import tiny_root

SANDBOXES = ["bwrap", pytest.param("gvisor", marks=pytest.mark.skipif(
    shutil.which("runsc") is None, reason="gVisor (runsc) is not installed"))]


def test_root_inside_a_bwrap_step_is_a_high_unprivileged_host_id(senv: StepEnv) -> None:
    r = senv.step(["v"], ["sh", "-c", "id -u; cat /proc/self/uid_map; "
                          "cat /proc/self/status | grep -E '^(NoNewPrivs|Seccomp):'"], "bwrap")
    assert r.rc == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == "0"
    inside, host, count = (int(x) for x in lines[1].split())
    assert (inside, count) == (0, 65536) and host >= 1 << 30
    assert "NoNewPrivs:\t1" in r.stdout and "Seccomp:\t2" in r.stdout


def test_two_concurrent_bwrap_steps_get_different_host_ids(senv: StepEnv) -> None:
    senv.run("volume", "create", "w")
    a = senv.start_step(["v"], ["sh", "-c", "cat /proc/self/uid_map; sleep 1"], "bwrap")
    b = senv.start_step(["w"], ["sh", "-c", "cat /proc/self/uid_map; sleep 1"], "bwrap")
    outs = [p.communicate(timeout=60)[0].split()[1] for p in (a, b)]
    assert outs[0] != outs[1]


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_stored_owners_show_inside_and_owners_set_inside_are_stored(senv: StepEnv,
                                                                  sandbox: str) -> None:
    src = senv.root / "src"
    src.mkdir()
    (src / "apt-owned").write_text("x\n")
    os.chown(src / "apt-owned", 42, 43)
    senv.run("import", "v", str(src), "-m", "owners")
    r = senv.step(["v"], ["sh", "-c", "cd /storage/v && stat -c %u:%g apt-owned 2>/dev/null "
                          "|| python3 -c \"import os; s = os.stat('apt-owned'); "
                          "print(f'{s.st_uid}:{s.st_gid}')\"; echo new > made && "
                          "chown 1000:1001 apt-owned"], sandbox)
    assert r.rc == 0, r.stderr
    assert r.stdout.split()[0] == "42:43"
    stat = dict(line.split(None, 1) for line in senv.run("stat", "v", "apt-owned").stdout
                .splitlines())
    assert (stat["uid"], stat["gid"]) == ("1000", "1001")
    stat = dict(line.split(None, 1) for line in senv.run("stat", "v", "made").stdout
                .splitlines())
    assert (stat["uid"], stat["gid"]) == ("0", "0")  # root inside is root as stored


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_the_default_root_holds_programs_and_nothing_of_the_host(senv: StepEnv,
                                                                sandbox: str) -> None:
    marker = Path("/var/tmp") / f"strata-host-marker-{os.getpid()}"
    marker.write_text("host\n")
    try:
        r = senv.step(["v"], ["python3", "-c", "import os, sys; "
                              "print(sorted(os.listdir('/'))); "
                              "print(os.path.exists(sys.argv[1])); "
                              "print(open('/etc/hostname').read().strip()); "
                              "print(os.path.exists(sys.argv[2]))",
                              str(marker), str(senv.store)], sandbox)
    finally:
        marker.unlink()
    assert r.rc == 0, r.stderr
    top, marker_seen, hostname, store_seen = r.stdout.splitlines()[:4]
    for absent in ("work", "mnt", "opt", "srv", "media"):
        assert f"'{absent}'" not in top
    assert (marker_seen, hostname, store_seen) == ("False", "strata-step", "False")


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_an_image_volume_is_the_root_and_its_changes_are_thrown_away(senv: StepEnv,
                                                                    sandbox: str) -> None:
    root = tiny_root(senv.root / "rootfs", ("sh", "cat", "mkdir", "echo"))
    (root / "etc" / "image-name").write_text("tiny\n")
    senv.run("volume", "create", "img")
    senv.run("import", "img", str(root), "-m", "a tiny root")
    before = senv.head("img")
    r = senv.step(["v"], ["/bin/sh", "-c", "cat /etc/image-name; echo junk > /etc/junk; "
                          "echo from-image > /storage/v/out"], sandbox, "--image", "img")
    assert r.rc == 0, r.stderr
    assert r.stdout.splitlines()[0] == "tiny"
    assert senv.cat("v", "out") == "from-image\n"
    assert senv.head("img") == before and "junk" not in senv.ls("img", "etc")


def test_a_step_that_outgrows_its_disk_gets_enospc_inside_and_publishes_nothing(
        senv: StepEnv) -> None:
    before = senv.head("v")
    r = senv.step(["v"], ["sh", "-c", "dd if=/dev/zero of=/storage/v/big bs=1M count=64 "
                          "2>&1; echo dd=$?"], "bwrap", "--disk", "16M")
    assert "No space left on device" in r.stdout and "dd=1" in r.stdout, r.stdout
    assert r.rc == 0  # the command went on after the error and exited 0: what fit lands
    assert int(senv.run("stat", "v", "big").stdout.split("size")[1].split()[0]) < 16 << 20
    r = senv.step(["v"], ["sh", "-c", "head -c 32M /dev/zero > /storage/v/big2"], "bwrap",
                  "--disk", "8M")
    assert r.rc != 0 and senv.head("v") != before and "big2" not in senv.ls("v")


def test_a_fork_bomb_hits_the_step_limit_and_the_host_goes_on(senv: StepEnv) -> None:
    r = senv.step(["v"], ["sh", "-c", "n=0; while [ $n -lt 400 ]; do sleep 3 & "
                          "n=$((n+1)); echo $n > /storage/v/n; done"],
                  "bwrap", "--pids", "64")
    assert r.rc != 0 and "Cannot fork" in r.stderr, r.stderr  # dash gives up: the step fails
    assert "n" not in senv.ls("v")  # and publishes nothing
    assert subprocess.run(["true"]).returncode == 0


@pytest.mark.parametrize("in_process", [False, True], ids=["service", "in-process"])
@pytest.mark.parametrize("sandbox", ["none", *SANDBOXES])
def test_a_step_writes_where_the_callers_files_stand(senv: StepEnv, sandbox: str,
                                                     in_process: bool) -> None:
    """A redirected stdout under gVisor was written from offset 0, over the caller's lines."""
    import shlex

    from strata_harness import STRATA
    run = shlex.join([*STRATA, "run", "-v", "v", "--sandbox", sandbox, "--",
                      "sh", "-c", "echo STEP-OUT; echo STEP-ERR >&2"])
    out, err = senv.root / "out", senv.root / "err"
    script = (f"{{ echo before-1; echo before-2; echo before-e >&2; {run}; echo after; "
              f"echo after-e >&2; }} > {shlex.quote(str(out))} 2> {shlex.quote(str(err))}")
    env = {**senv.env, **({"STRATA_RUN_IN_PROCESS": "1"} if in_process else {})}
    p = subprocess.run(["sh", "-c", script], env=env, timeout=120)
    assert p.returncode == 0
    assert out.read_text() == "before-1\nbefore-2\nSTEP-OUT\nafter\n"
    assert err.read_text() == "before-e\nSTEP-ERR\nafter-e\n"


@pytest.mark.parametrize("sandbox", ["none", *SANDBOXES])
def test_commands_that_cannot_run_exit_as_in_a_shell(senv: StepEnv, sandbox: str) -> None:
    senv.run("put", "v", "notexec", "-m", "a file without x", input="#!/bin/sh\necho no\n")
    before = senv.head("v")
    r = senv.step(["v"], ["no-such-command-here"], sandbox)
    assert r.rc == 127, r
    r = senv.step(["v"], ["v/notexec"], sandbox)
    assert r.rc == 126, r
    assert senv.head("v") == before


def test_a_step_strata_could_not_run_exits_125(senv: StepEnv) -> None:
    r = senv.step(["nosuchvolume"], ["true"], "bwrap")
    assert r.rc == 125 and "nosuchvolume" in r.stderr, r
