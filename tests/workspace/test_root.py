"""A workspace as a sandbox's whole root filesystem: `strata run --root ws:NAME`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from ws_harness import WsEnv, tiny_root

SANDBOXES = ["bwrap", pytest.param("gvisor", marks=pytest.mark.skipif(
    shutil.which("runsc") is None, reason="gVisor (runsc) is not installed"))]


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_seeded_workspace_is_the_root_and_keeps_what_runs_write(wsenv: WsEnv,
                                                                  sandbox: str) -> None:
    seed = tiny_root(wsenv.root / "seed")
    wsenv.run("workspace", "create", "box", "--size", "1G", "--seed", str(seed))
    p = wsenv.run("run", "--root", "ws:box", "--sandbox", sandbox, "--",
                  "/bin/sh", "-c", "cat /etc/hostname && mkdir -p /work && "
                  "echo made > /work/out && echo /*")
    assert p.stdout.splitlines()[0] == "seeded"
    assert "/work" in p.stdout.split()  # (not `ls`: this gVisor fails coreutils' statx)
    # Durable, not a transaction: a failing command's writes stay too.
    p = wsenv.run("run", "--root", "ws:box", "--sandbox", sandbox, "--",
                  "/bin/sh", "-c", "echo partial > /work/partial; exit 7", rc=7)
    d = wsenv.attach("box", "look")
    assert (d / "work" / "out").read_text() == "made\n"
    assert (d / "work" / "partial").read_text() == "partial\n"
    assert (d / "etc" / "hostname").read_text() == "seeded\n"
    assert Path(d / "bin" / "sh").resolve().is_file() or (d / "bin" / "sh").is_symlink()
    wsenv.detach(d)


def test_a_root_needs_a_sandbox(wsenv: WsEnv) -> None:
    wsenv.run("workspace", "create", "box", "--size", "1G")
    p = wsenv.run("run", "--root", "ws:box", "--sandbox", "none", "--", "true", rc=None)
    assert p.returncode != 0 and "sandbox" in p.stderr
    assert not subprocess.run(["findmnt", "-rn", "-S", "/dev/loop"], capture_output=True,
                              text=True).stdout.count(str(wsenv.root))


def test_root_in_a_bwrap_root_owns_every_file_but_cannot_mount(wsenv: WsEnv) -> None:
    """A system's files belong to many users (apt's `_apt`): root must reach them all."""
    seed = tiny_root(wsenv.root / "seed", ("sh", "cat", "mkdir", "mount", "chown"))
    private = seed / "var" / "lib" / "apt" / "partial"
    private.mkdir(parents=True)
    (private / "f").write_text("apt's\n")
    os.chown(private / "f", 42, 0)
    os.chown(private, 42, 0)
    private.chmod(0o700)
    wsenv.run("workspace", "create", "box", "--size", "1G", "--seed", str(seed))
    p = wsenv.run("run", "--root", "ws:box", "--sandbox", "bwrap", "--",
                  "/bin/sh", "-c", "cat /var/lib/apt/partial/f && "
                  "echo more >> /var/lib/apt/partial/f && chown 42 /var/lib/apt/partial/f && "
                  "mkdir /m && mount -t tmpfs x /m; echo mount=$?")
    lines = p.stdout.splitlines()
    assert lines[0] == "apt's"
    assert lines[-1].startswith("mount=") and lines[-1] != "mount=0"  # no CAP_SYS_ADMIN
    d = wsenv.attach("box", "look")
    assert (d / "var" / "lib" / "apt" / "partial" / "f").read_text() == "apt's\nmore\n"
    wsenv.detach(d)


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_volumes_beside_a_workspace_root_are_a_transaction_the_root_is_not(
        wsenv: WsEnv, sandbox: str) -> None:
    seed = tiny_root(wsenv.root / "seed")
    wsenv.run("workspace", "create", "box", "--size", "1G", "--seed", str(seed))
    wsenv.run("volume", "create", "data")
    p = wsenv.run("run", "--root", "ws:box", "-v", "data", "--sandbox", sandbox, "--",
                  "/bin/sh", "-c", "echo $STRATA_STORAGE && cat /etc/hostname > "
                  "/storage/data/from-root && echo kept > /in-root")
    assert p.stdout.splitlines()[0] == "/storage"
    assert wsenv.run("cat", "data", "from-root").stdout == "seeded\n"  # published
    # A failing command: the volume's change is dropped, the root's write stays.
    wsenv.run("run", "--root", "ws:box", "-v", "data", "--sandbox", sandbox, "--",
              "/bin/sh", "-c", "echo no > /storage/data/dropped && "
              "echo yes > /in-root-too; exit 5", rc=5)
    assert "dropped" not in wsenv.run("ls", "data").stdout
    d = wsenv.attach("box", "look")
    assert (d / "in-root").read_text() == "kept\n"
    assert (d / "in-root-too").read_text() == "yes\n"
    assert (d / "storage").is_dir() and not any((d / "storage").iterdir())  # a mount point
    wsenv.detach(d)
    p = wsenv.run("run", "--root", "ws:box", "-v", "box", "--sandbox", sandbox, "--", "true",
                  rc=None)
    assert p.returncode != 0 and "root workspace" in p.stderr


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_runner_that_dies_leaves_no_workspace_attached(wsenv: WsEnv, sandbox: str) -> None:
    import time

    from strata_harness import STRATA
    seed = tiny_root(wsenv.root / "seed", ("sh", "sleep"))
    wsenv.run("workspace", "create", "box", "--size", "1G", "--seed", str(seed))
    scratch = wsenv.root / "scratch"
    env = {**wsenv.env, "STRATA_SCRATCH": str(scratch)}
    runner = subprocess.Popen([*STRATA, "run", "--root", "ws:box", "--sandbox", sandbox, "--",
                               "/bin/sh", "-c", "echo unsynced > /written; echo ready; "
                               "exec sleep 600"], env=env, stdout=subprocess.PIPE)
    assert runner.stdout is not None
    assert runner.stdout.readline() == b"ready\n"
    runner.kill()
    runner.wait()

    def mounted() -> list[str]:
        with open("/proc/self/mountinfo") as f:
            return [ln.split()[4] for ln in f if ln.split()[4].startswith(str(scratch))]

    deadline = time.monotonic() + 30
    while (mounted() or os.listdir(wsenv.root / "state")) and time.monotonic() < deadline:
        time.sleep(0.1)
    # The attach daemon saw its owner go, unmounted (which flushed), released the
    # workspace and cleaned its state: the command's unsynced write is in.
    assert mounted() == [] and os.listdir(wsenv.root / "state") == []
    d = wsenv.attach("box", "look")
    assert (d / "written").read_text() == "unsynced\n"
    wsenv.detach(d)
    # The next step sweeps the dead runner's directory once it has been left alone.
    (left,) = os.listdir(scratch)
    os.utime(scratch / left, (time.time() - 60, time.time() - 60))
    subprocess.run([*STRATA, "run", "--root", "ws:box", "--sandbox", sandbox, "--", "/bin/sh",
                    "-c", "true"], env=env, check=True, capture_output=True, timeout=120)
    assert os.listdir(scratch) == []
