"""Workspaces on real FUSE, loop devices and ext4: attach, fsync, host loss, fencing, forks."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest
from ws_harness import WsEnv

WRITER = str(Path(__file__).with_name("ws_writer.py"))


def _state(env: WsEnv, d: Path) -> dict[str, object]:
    from strata.workspace.state import state_dir_for
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
    (e / "hello").write_bytes(b"changed\n")
    subprocess.run(["sync", "-f", str(e)], check=True)
    # The named snapshot, attached read-only beside the live workspace.
    ro = wsenv.attach(f"dev#{snap[:12]}", "ro")
    assert (ro / "hello").read_bytes() == b"hello\n"
    with pytest.raises(OSError):
        (ro / "new").write_bytes(b"x")
    wsenv.detach(ro)
    wsenv.detach(e)
    f = wsenv.attach("dev", "third")
    assert (f / "hello").read_bytes() == b"changed\n"
    assert not (f / "new").exists()
    wsenv.detach(f)


def test_attaching_what_is_not_a_workspace_is_refused(wsenv: WsEnv) -> None:
    p = wsenv.run("workspace", "attach", "nope", str(wsenv.root), rc=None)
    assert p.returncode != 0 and "nope" in p.stderr
    wsenv.run("volume", "create", "plain")
    (wsenv.root / "d").mkdir()
    p = wsenv.run("workspace", "attach", "plain", str(wsenv.root / "d"), rc=None)
    assert p.returncode != 0 and "not a workspace" in p.stderr
    assert not os.path.ismount(wsenv.root / "d")


def _extents(wsenv: WsEnv, name: str) -> int:
    from strata.engine.tree import Trees
    from strata.server.client import RemoteStore, default_socket
    from strata.workspace.device import written_extents
    store = RemoteStore("unix:" + default_socket(str(wsenv.store)))
    try:
        root = store.snapshot(store.head(name, "live")).root
        return len(list(written_extents(Trees(store), root)))
    finally:
        store.close()


def test_detach_gives_back_what_the_filesystem_freed(wsenv: WsEnv) -> None:
    wsenv.run("workspace", "create", "dev", "--size", "2G")
    d = wsenv.attach("dev", "w")
    (d / "big").write_bytes(os.urandom(32 << 20))
    subprocess.run(["sync", "-f", str(d)], check=True)
    full = _extents(wsenv, "dev")
    assert full >= 32
    (d / "big").unlink()
    (d / "small").write_bytes(b"kept\n")
    wsenv.detach(d)
    assert _extents(wsenv, "dev") <= full - 30  # the file's extents are holes again
    e = wsenv.attach("dev", "again")
    assert (e / "small").read_bytes() == b"kept\n"
    assert not (e / "big").exists()
    wsenv.detach(e)


def test_free_ranges_read_from_dumpe2fs() -> None:
    from strata.workspace.ext4 import free_ranges
    out = ("Free blocks:              1000\nBlock size:               4096\n"
           "Group 0: (Blocks 0-32767)\n  Free blocks: 10-19, 30\n  Free inodes: 12-100\n"
           "Group 1: (Blocks 32768-65535)\n  Free blocks: \n")
    assert free_ranges(out) == [(10 * 4096, 10 * 4096), (30 * 4096, 4096)]


def test_snapshots_are_browsable_file_by_file(wsenv: WsEnv) -> None:
    wsenv.run("workspace", "create", "dev", "--size", "2G")
    d = wsenv.attach("dev", "w")
    (d / "src").mkdir()
    (d / "src" / "a.txt").write_text("one\n")
    (d / "src" / "gone.txt").write_text("bye\n")
    odd = os.fsdecode(b"caf\xc3\xa9 \xff.txt")
    (d / odd).write_bytes(b"odd\n")
    a = wsenv.run("workspace", "snapshot", "dev", "-m", "a").stdout.strip()
    (d / "src" / "a.txt").write_text("two\n")
    (d / "src" / "gone.txt").unlink()
    (d / "src" / "new.txt").write_text("new\n")
    b = wsenv.run("workspace", "snapshot", "dev", "-m", "b").stdout.strip()
    # While the workspace stays attached and changes on.
    (d / "src" / "a.txt").write_text("three\n")
    assert wsenv.run("ls", f"dev#{a[:12]}", "src").stdout.split() == ["a.txt", "gone.txt"]
    assert wsenv.run("cat", f"dev#{a[:12]}", "src/a.txt").stdout == "one\n"
    assert wsenv.run("cat", f"dev#{b[:12]}", "src/a.txt").stdout == "two\n"
    listing = json.loads(wsenv.run("ls", f"dev#{b[:12]}", "--json").stdout)
    assert {e["name"] for e in listing} >= {"src", "lost+found"}
    stat = json.loads(wsenv.run("stat", f"dev#{b[:12]}", "src/new.txt", "--json").stdout)
    assert stat["size"] == 4 and stat["type"] == "file"
    diff = json.loads(wsenv.run("diff", f"dev#{a[:12]}", f"dev#{b[:12]}", "--json").stdout)
    assert sorted((r["path"], r["change"]) for r in diff) == [
        ("src/a.txt", "modified"), ("src/gone.txt", "deleted"), ("src/new.txt", "added")]
    out = wsenv.root / "out"
    wsenv.run("export", f"dev#{a[:12]}", str(out))
    assert (out / "src" / "a.txt").read_text() == "one\n"
    assert (out / odd).read_bytes() == b"odd\n"
    p = wsenv.run("cat", f"dev#{a[:12]}", "../../etc/passwd", rc=None)
    assert p.returncode != 0 and "leaves the workspace" in p.stderr
    assert [m for m in open("/proc/self/mountinfo").read().splitlines()
            if "strata-ws-view" in m] == []  # every view was detached


def test_detach_after_the_daemon_died_clears_what_it_left(wsenv: WsEnv) -> None:
    wsenv.run("workspace", "create", "dev", "--size", "2G")
    d = wsenv.attach("dev", "w")
    (d / "kept").write_text("synced\n")
    subprocess.run(["sync", "-f", str(d)], check=True)
    writer = subprocess.Popen(["sh", "-c", f"while :; do date >> {d}/log; done"])
    os.kill(int(_state(wsenv, d)["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    writer.kill()
    writer.wait()
    wsenv.detach(d)  # the daemon is gone: its mounts and FUSE connection are cleared
    assert not os.path.ismount(d)
    assert [ln for ln in open("/proc/self/mountinfo") if str(wsenv.root) in ln] == []
    e = wsenv.attach("dev", "again")
    assert (e / "kept").read_text() == "synced\n"


def test_an_attach_publishes_once_what_its_mount_wrote(wsenv: WsEnv) -> None:
    # The mount's own flushes (a journal replay, the superblock's mount count) are
    # answered without a publish; the attach publishes it all once mount returns.
    wsenv.run("workspace", "create", "dev", "--size", "2G")
    d = wsenv.attach("dev", "w")
    for i in range(50):
        with open(d / f"f{i}", "w") as f:
            f.write(f"record {i}\n")
            f.flush()
            os.fsync(f.fileno())
    os.kill(int(_state(wsenv, d)["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    wsenv.detach(d)  # the journal still holds those commits: the next mount replays them
    before = json.loads(wsenv.run("workspace", "log", "dev", "--all", "--json").stdout)
    e = wsenv.attach("dev", "again")
    after = json.loads(wsenv.run("workspace", "log", "dev", "--all", "--json").stdout)
    assert after[0]["parent"] == before[0]["id"]  # one flush on top of the head it found
    assert [(e / f"f{i}").read_text() for i in range(50)] == [f"record {i}\n"
                                                             for i in range(50)]


HOLDER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
end, i = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    os.write(fd, b"%08d" % i * 512)
    os.fsync(fd)
    print(i, flush=True)
    i += 1
"""


def test_detach_while_another_mount_namespace_holds_it_loses_nothing(wsenv: WsEnv) -> None:
    # A sandbox started while attached keeps the filesystem alive in its own mount
    # namespace after the unmount here. Detach must not trim (punch what the
    # bitmaps call free) until it is gone everywhere: blocks allocated meanwhile
    # would be punched after their last write.
    import sys
    wsenv.run("workspace", "create", "dev", "--size", "2G")
    d = wsenv.attach("dev", "w")
    holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", sys.executable,
                               "-c", HOLDER, str(d / "log"), "3"], stdout=subprocess.PIPE)
    assert holder.stdout is not None
    assert holder.stdout.readline() == b"0\n"
    wsenv.detach(d)  # unmounted here at once; the device stays in use until the holder ends
    out, _ = holder.communicate(timeout=60)
    acked = int(out.split()[-1]) + 1 if out.split() else 1
    assert holder.returncode == 0
    e = wsenv.attach("dev", "again")
    data = (e / "log").read_bytes()
    assert len(data) >= acked * 4096
    bad = [i for i in range(acked) if data[i * 4096:(i + 1) * 4096] != b"%08d" % i * 512]
    assert bad == []


def test_an_fsync_whose_flush_is_refused_fails(wsenv: WsEnv) -> None:
    # A host fenced by another attach: its next flush is refused, and the fsync
    # that asked for it must fail, not report durable what never reached the
    # store. (Async journal commits ignore the flush's result and returned 0.)
    wsenv.run("workspace", "create", "dev", "--size", "2G")
    d = wsenv.attach("dev", "one")
    fd = os.open(d / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b"acknowledged\n")
        os.fsync(fd)
        e = wsenv.attach("dev", "two")  # takes the lease: "one" is fenced
        os.write(fd, b"refused\n")
        with pytest.raises(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
    assert (e / "log").read_bytes() == b"acknowledged\n"
