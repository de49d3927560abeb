"""The step service (run/service.py): `strata run` as a thin client of a resident process.

Real processes throughout: the `strata run` client, the service it starts,
the service's workers and their mount processes, killed with SIGKILL at the
worst moment. Whoever dies, the step publishes nothing and leaves nothing
behind, and the next `strata run` works (with a fresh service if the old one
died). Requests on the service's socket are untrusted: malformed ones are
refused one by one, and the service keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
from pathlib import Path

from run_harness import StepEnv, finish, pid_alive, wait_for

from strata.run import protocol

VOL = '"$STRATA_STORAGE/v"'


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def service_pids(senv: StepEnv) -> list[int]:
    """The step service of this test's store, if one runs (its pid is in its lock file)."""
    try:
        pid = int((senv.store / protocol.LOCK_NAME).read_text())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [os.fsdecode(a) for a in f.read().split(b"\0") if a]
    except (OSError, ValueError):
        return []
    return [pid] if args[-3:] == ["-m", "strata.run.service", str(senv.store)] and pid_alive(
        pid) else []


def the_service(senv: StepEnv) -> int:
    assert wait_for(lambda: len(service_pids(senv)) == 1, 10), service_pids(senv)
    (pid,) = service_pids(senv)
    return pid


def test_the_command_gets_the_callers_stdio_and_publishes(senv: StepEnv) -> None:
    p = subprocess.run([*senv.step_argv(["v"], sh(f"cat; echo err >&2; echo x > {VOL}/f"))],
                       env=senv.env, input="from stdin\n", capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("from stdin\n")
    assert json.loads(p.stdout[len("from stdin\n"):])["published"]["v"] == senv.head("v")
    assert p.stderr == "err\n"
    assert senv.cat("v", "f") == "x\n"
    mode = os.stat(protocol.socket_path(str(senv.store))).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    # A second step is served by the same service.
    first = the_service(senv)
    assert senv.step(["v"], sh(f"echo y > {VOL}/g")).rc == 0
    assert service_pids(senv) == [first]
    senv.wait_clean()


def _start_and_wait_running(senv: StepEnv) -> tuple[subprocess.Popen[str], int]:
    p = senv.start_step(["v"], sh(f"echo x > {VOL}/f; echo $$ > {VOL}/running; exec sleep 60"))
    assert wait_for(lambda: bool(senv.written("v", "running")), 20), (
        finish(p) if p.poll() is not None else "the command never ran")
    (running,) = senv.written("v", "running")
    assert wait_for(lambda: running.read_text().strip().isdigit(), 5)
    return p, int(running.read_text())


def test_sigkill_of_the_client_publishes_nothing_and_the_service_stays(senv: StepEnv) -> None:
    before = senv.head("v")
    p, pid = _start_and_wait_running(senv)
    service = the_service(senv)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert wait_for(lambda: not pid_alive(pid), 5.0), "the command outlived its client"
    senv.wait_clean(5.0)
    assert senv.head("v") == before and senv.ls("v") == []
    assert senv.step(["v"], sh(f"echo y > {VOL}/g")).rc == 0
    assert senv.ls("v") == ["g"]
    assert service_pids(senv) == [service]


def test_sigkill_of_the_service_fails_the_step_and_the_next_starts_a_fresh_one(
        senv: StepEnv) -> None:
    before = senv.head("v")
    p, pid = _start_and_wait_running(senv)
    service = the_service(senv)
    os.kill(service, signal.SIGKILL)
    r = finish(p, 30)
    assert r.rc == 125, r  # strata's own failure, not the command's
    assert "step service died before the step finished; nothing was published" in r.stderr
    assert wait_for(lambda: not pid_alive(pid), 5.0), "the command outlived the service"
    senv.wait_clean(5.0)
    assert senv.head("v") == before and senv.ls("v") == []
    assert senv.step(["v"], sh(f"echo y > {VOL}/g")).rc == 0
    assert senv.ls("v") == ["g"]
    fresh = the_service(senv)
    assert fresh != service


def _raw(senv: StepEnv, data: bytes, fds: int = 3) -> dict[str, object] | None:
    """Send `data` (with `fds` descriptors of /dev/null) as a client would; the answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        sock.settimeout(30)
        sock.connect(protocol.socket_path(str(senv.store)))
        with contextlib.suppress(BrokenPipeError):  # refused before it was all sent
            sent = socket.send_fds(sock, [data], [null] * fds) if fds else 0
            if sent < len(data):
                sock.sendall(data[sent:])
            sock.shutdown(socket.SHUT_WR)
        return protocol.read_frame(sock, protocol.MAX_ANSWER)
    finally:
        sock.close()
        os.close(null)


def test_malformed_requests_are_refused_and_the_service_keeps_serving(senv: StepEnv) -> None:
    assert senv.step(["v"], sh("true")).rc == 0  # the service is up
    service = the_service(senv)
    good = {"v": protocol.PROTOCOL, "argv": ["sh", "-c", f"echo x > {VOL}/bad"], "specs": ["v"],
            "sandbox": "none", "timeout": None, "memory": None, "network": False,
            "message": None, "identical": False, "env": {"PATH": os.environ["PATH"]},
            "cwd": "/", "umask": 0o22}
    bad_fields: list[dict[str, object]] = [
        {"v": 99}, {"argv": "sh"}, {"argv": []}, {"argv": ["a\0b"]}, {"specs": ["v", "v"]},
        {"specs": ["../x"]}, {"sandbox": "docker"}, {"timeout": -1}, {"timeout": True},
        {"memory": "1G"}, {"network": 1}, {"env": {"A=B": "c"}}, {"env": {"A": "b\0"}},
        {"cwd": "relative"}, {"umask": 0o1777}, {"surprise": 1},
    ]
    for change in bad_fields:
        answer = _raw(senv, protocol.frame({**good, **change}))
        assert answer is not None and answer["event"] == "error", (change, answer)
    for data, fds in [
        (protocol.frame(good), 0),                          # no descriptors
        (protocol.frame(good), 2),                          # too few
        ((protocol.MAX_REQUEST + 1).to_bytes(4, "big"), 3),  # a body over the limit
        (b"\x00\x00\x00\x10{not json", 3),                # cut short
        (b"\x00\x00\x00\x02[]", 3),                       # not an object
    ]:
        answer = _raw(senv, data, fds)
        assert answer is not None and answer["event"] == "error", (data, fds, answer)
        assert answer["code"] == 2
    target = senv.root / "mnt"
    target.mkdir()
    mount = {"v": protocol.PROTOCOL, "op": "mount", "refs": [["", "v", "live", None, False]],
             "target": str(target), "ro": False, "single": True,
             "env": {"PATH": os.environ["PATH"]}, "cwd": "/", "umask": 0o22}
    ref = ["", "v", "live", None, False]
    for change in [
        {"op": "dance"}, {"refs": []}, {"refs": [["", "v", None, None, False]]},
        {"refs": [["", "v", "live", "deadbeef", False]]}, {"refs": [["../x", *ref[1:]]]},
        {"refs": [["", "v", "live", None, "no"]]}, {"refs": [ref, ref]}, {"refs": "v"},
        {"refs": [["", "v", "live", "zz", False]]}, {"target": "relative"},
        {"target": str(senv.root / "missing")}, {"single": "yes"}, {"argv": ["true"]},
    ]:
        answer = _raw(senv, protocol.frame({**mount, **change}))
        assert answer is not None and answer["event"] == "error", (change, answer)
    assert not os.path.ismount(target)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # connects, says nothing
    sock.connect(protocol.socket_path(str(senv.store)))
    sock.close()
    assert service_pids(senv) == [service]
    assert senv.step(["v"], sh(f"echo y > {VOL}/g")).rc == 0
    assert senv.ls("v") == ["g"]
    senv.wait_clean()


def test_the_in_process_runner_still_works(senv: StepEnv) -> None:
    """STRATA_RUN_IN_PROCESS=1 (and --server) run the step in the CLI's own process."""
    r = senv.step(["v"], sh(f"echo x > {VOL}/f"), env={"STRATA_RUN_IN_PROCESS": "1"})
    assert r.rc == 0, r
    assert senv.ls("v") == ["f"]
    assert service_pids(senv) == []
    senv.wait_clean()


def test_the_service_leaves_with_the_server(senv: StepEnv, tmp_path: Path) -> None:
    assert senv.step(["v"], sh("true")).rc == 0
    service = the_service(senv)
    senv.run("serve", "--stop")
    assert wait_for(lambda: not pid_alive(service), 10), "the service outlived the server"
    assert not os.path.exists(protocol.socket_path(str(senv.store)))
    # The next step starts both again.
    assert senv.step(["v"], sh(f"echo x > {VOL}/f")).rc == 0
    assert senv.ls("v") == ["f"]


def test_a_command_that_cannot_run_is_an_error_and_publishes_nothing(senv: StepEnv) -> None:
    before = senv.head("v")
    r = senv.step(["v"], ["no-such-command-here"])
    assert r.rc == 127 and "command not found" in r.stderr, r  # as a shell says
    assert senv.head("v") == before
    senv.wait_clean()


def test_ctrl_c_of_the_client_publishes_nothing(senv: StepEnv) -> None:
    """SIGINT reaches only `strata run` (the command is in the service's session)."""
    before = senv.head("v")
    p, pid = _start_and_wait_running(senv)
    p.send_signal(signal.SIGINT)
    r = finish(p, 30)
    assert r.rc == 130 and "interrupted" in r.stderr, r
    assert wait_for(lambda: not pid_alive(pid), 5.0), "the command outlived its client"
    senv.wait_clean(5.0)
    assert senv.head("v") == before and senv.ls("v") == []
