"""Workspaces on real FUSE, loop devices and ext4: attach, fsync, host loss, fencing, forks."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from conftest import WsEnv

WRITER = str(Path(__file__).with_name("ws_writer.py"))


def _state(env: WsEnv, d: Path) -> dict[str, object]:
    from strata.workspace.attach import state_dir_for
    os.environ["STRATA_WORKSPACE_STATE"] = env.env["STRATA_WORKSPACE_STATE"]
    with open(os.path.join(env.root / "state", os.path.basename(state_dir_for(str(d))),
                           "state.json")) as f:
        return dict(json.load(f))


def _lose_host(env: WsEnv, d: Path, *procs: subprocess.Popen[bytes]) -> None:
    """SIGKILL the daemon and its users, as when the host dies, and clear its mounts."""
    pid = int(_state(env, d)["pid"])  # type: ignore[call-overload]
    for p in procs:
        p.kill()
    os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait()
    subprocess.run(["umount", "-l", str(d)], capture_output=True)
    env.attached.remove(d)


def _syncfs(d: Path) -> None:
    subprocess.run(["sync", "-f", str(d)], check=True, timeout=60)


def _acked(out: bytes) -> int:
    lines = out.decode().split("\n")[:-1]  # a last line without its newline was not acked
    return int(lines[-1]) if lines else 0


def test_attach_write_detach_attach_again(wsenv: WsEnv) -> None:
    wsenv.run("workspace", "create", "dev", "--size", "4G")
    d = wsenv.attach("dev", "w")
    (d / "hello").write_bytes(b"hello\n")
    name = bytes(range(1, 256)).replace(b"/", b"")[:200]
    (d / os.fsdecode(name)).write_bytes(b"odd name")
    subprocess.run(["git", "init", "-q", str(d / "repo")], check=True)
    (d / "repo" / "f").write_text("x\n")
    subprocess.run(["git", "-C", str(d / "repo"), "add", "f"], check=True)
    subprocess.run(["git", "-C", str(d / "repo"), "-c", "user.email=a@b", "-c", "user.name=a",
                    "commit", "-qm", "one"], check=True)
    db = sqlite3.connect(d / "db.sqlite")
    db.execute("create table t (x)")
    db.execute("insert into t values (42)")
    db.commit()
    db.close()
    snap = wsenv.run("workspace", "snapshot", "dev", "-m", "first point").stdout.strip()
    wsenv.detach(d)
    assert not os.path.ismount(d)
    e = wsenv.attach("dev", "again")
    assert (e / "hello").read_bytes() == b"hello\n"
    assert (e / os.fsdecode(name)).read_bytes() == b"odd name"
    assert subprocess.run(["git", "-C", str(e / "repo"), "fsck"], capture_output=True
                          ).returncode == 0
    db = sqlite3.connect(e / "db.sqlite")
    assert db.execute("select x from t").fetchall() == [(42,)]
    assert db.execute("pragma integrity_check").fetchall() == [("ok",)]
    db.close()
    log = json.loads(wsenv.run("workspace", "log", "dev", "--json").stdout)
    assert [s["message"] for s in log] == ["first point", "create workspace"]
    assert log[0]["id"] == snap
    listing = json.loads(wsenv.run("workspace", "list", "--json").stdout)
    assert [(r["workspace"], r["attached"]) for r in listing] == [("dev@live", str(e))]
    wsenv.detach(e)


def test_every_fsynced_record_survives_host_loss(wsenv: WsEnv) -> None:
    wsenv.run("workspace", "create", "dev", "--size", "2G")
    rng = random.Random(7)
    acked = 0
    for round_ in range(6):
        d = wsenv.attach("dev", f"h{round_}")
        log = d / "log"
        if acked:
            records = log.read_bytes().split(b"\n")
            have = [int(r[:8]) for r in records if r]
            assert have[:acked] == list(range(1, acked + 1)), f"round {round_}: lost records"
            log.unlink()  # start over: each round checks its own records
            _syncfs(d)
        writer = subprocess.Popen([sys.executable, WRITER, str(log)], stdout=subprocess.PIPE)
        time.sleep(rng.uniform(0.2, 1.0))
        os.kill(writer.pid, signal.SIGSTOP)  # freeze the report pipe at this instant
        _lose_host(wsenv, d, writer)
        assert writer.stdout is not None
        acked = _acked(writer.stdout.read())
        assert acked > 0
    d = wsenv.attach("dev", "last")
    records = (d / "log").read_bytes().split(b"\n")
    assert [int(r[:8]) for r in records if r][:acked] == list(range(1, acked + 1))


def test_a_frozen_host_is_fenced_when_another_attaches(wsenv: WsEnv) -> None:
    wsenv.run("workspace", "create", "dev", "--size", "2G")
    a = wsenv.attach("dev", "a")
    (a / "f").write_bytes(b"from a\n")
    _syncfs(a)
    pid_a = int(_state(wsenv, a)["pid"])  # type: ignore[call-overload]
    os.kill(pid_a, signal.SIGSTOP)
    try:
        b = wsenv.attach("dev", "b")
        assert (b / "f").read_bytes() == b"from a\n"
        (b / "g").write_bytes(b"from b\n")
        _syncfs(b)  # not sync(2): that would wait for the frozen host's filesystem
    finally:
        os.kill(pid_a, signal.SIGCONT)
    # Host a thaws and keeps writing: its flushes are refused, so nothing reaches the
    # workspace (its filesystem sees I/O errors).
    writer = subprocess.run([sys.executable, "-c",
                             "import os,sys; fd=os.open(sys.argv[1], os.O_WRONLY|os.O_CREAT);"
                             "os.write(fd, b'late a'); os.fsync(fd)", str(a / "late")],
                            capture_output=True, timeout=60)
    assert writer.returncode != 0
    _lose_host(wsenv, a)
    wsenv.detach(b)
    c = wsenv.attach("dev", "c")
    assert sorted(os.listdir(c)) == ["f", "g", "lost+found"]
    assert (c / "g").read_bytes() == b"from b\n"


def test_three_forks_attached_at_once_see_only_their_own_changes(wsenv: WsEnv) -> None:
    wsenv.run("workspace", "create", "dev", "--size", "2G")
    base = wsenv.attach("dev", "base")
    (base / "shared").write_text("base\n")
    wsenv.detach(base)
    dirs = {}
    for n in ("one", "two", "three"):
        wsenv.run("workspace", "fork", "dev", n)
        dirs[n] = wsenv.attach(f"dev@{n}", n)
    for n, d in dirs.items():
        (d / "shared").write_text(f"{n}\n")
        (d / n).write_text(n)
    for d in dirs.values():
        wsenv.detach(d)
    for n in ("one", "two", "three"):
        d = wsenv.attach(f"dev@{n}", f"{n}-again")
        assert (d / "shared").read_text() == f"{n}\n"
        assert sorted(os.listdir(d)) == sorted(["lost+found", "shared", n])
        wsenv.detach(d)
    d = wsenv.attach("dev", "base-again")
    assert (d / "shared").read_text() == "base\n"


def test_attaching_what_is_not_a_workspace_is_refused(wsenv: WsEnv) -> None:
    p = wsenv.run("workspace", "attach", "nope", str(wsenv.root), rc=None)
    assert p.returncode != 0 and "nope" in p.stderr
    wsenv.run("volume", "create", "plain")
    (wsenv.root / "d").mkdir()
    p = wsenv.run("workspace", "attach", "plain", str(wsenv.root / "d"), rc=None)
    assert p.returncode != 0 and "not a workspace" in p.stderr
    assert not os.path.ismount(wsenv.root / "d")
