"""The `strata` command line, driven as a real process against a temporary store.

Covers every command, the JSON shapes, the exit codes (2 usage, 3 conflict,
4 not found), replayed and conflicting stale-base puts, and import/export
round trips compared with the original directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from strata.engine.objects import EMPTY_SNAPSHOT_ID
from strata_harness import STRATA


class Cli:
    def __init__(self, store: Path) -> None:
        self.store = store

    def run(self, *args: str, input: bytes | None = None, rc: int | None = 0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [*STRATA, "--store", str(self.store), *args] if env is None else [*STRATA, *args]
        p = subprocess.run(cmd, input=input.decode() if input is not None else None,
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, **(env or {})})
        if rc is not None:
            assert p.returncode == rc, (args, p.returncode, p.stdout, p.stderr)
        return p

    def out(self, *args: str, input: bytes | None = None) -> str:
        return self.run(*args, input=input).stdout.strip()

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "--json").stdout)

    def head(self, ref: str) -> str:
        return str(self.json("log", ref, "-n", "1")[0]["id"])


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    c = Cli(tmp_path / "store")
    c.run("init")
    yield c
    c.run("serve", "--stop", rc=None)  # the server the CLI started for this store


def _one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("strata: error: ")
    assert "Traceback" not in p.stderr
    return lines[0]


# -- volumes, branches, forks --------------------------------------------------------


def test_volume_and_branch_lifecycle(cli: Cli) -> None:
    cli.run("volume", "create", "proj")
    cli.run("volume", "create", "other")
    assert cli.json("volume", "list") == [{"name": "other", "branches": 1},
                                          {"name": "proj", "branches": 1}]
    assert cli.out("volume", "list").splitlines() == ["other", "proj"]
    _one_line_error(cli.run("volume", "create", "proj", rc=1))
    assert cli.json("branch", "list", "proj") == [{"name": "live", "head": EMPTY_SNAPSHOT_ID}]

    head = cli.out("put", "proj", "f.txt", input=b"data")
    assert cli.out("fork", "proj", "exp") == head
    assert cli.out("fork", "proj@exp", "exp2") == head
    assert cli.out("fork", f"proj#{head[:8]}", "at-snap") == head
    assert cli.out("fork", "proj", "blank", "--empty") == EMPTY_SNAPSHOT_ID
    assert cli.json("branch", "list", "proj") == [
        {"name": "at-snap", "head": head}, {"name": "blank", "head": EMPTY_SNAPSHOT_ID},
        {"name": "exp", "head": head}, {"name": "exp2", "head": head},
        {"name": "live", "head": head}]
    assert cli.out("branch", "list", "proj").splitlines()[0] == f"at-snap\t{head}"
    _one_line_error(cli.run("fork", "proj", "exp", rc=1))  # already exists

    cli.run("branch", "delete", "proj@exp2")
    cli.run("branch", "delete", "proj@exp2", rc=4)
    cli.run("branch", "delete", "proj", rc=2)  # must name the branch
    assert [b["name"] for b in cli.json("branch", "list", "proj")] == [
        "at-snap", "blank", "exp", "live"]

    cli.run("volume", "delete", "other")
    cli.run("volume", "delete", "other", rc=4)
    assert cli.json("volume", "list") == [{"name": "proj", "branches": 4}]


# -- reading and writing one path ------------------------------------------------------


def test_put_cat_ls_stat_log(cli: Cli, tmp_path: Path) -> None:
    cli.run("volume", "create", "v")
    s1 = cli.out("put", "v", "a/b/c.txt", "-m", "first", input=b"hello\n")
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(200_000))
    s2 = cli.out("put", "v", "big.bin", "--from", str(src))
    assert len(s1) == len(s2) == 64

    assert cli.run("cat", "v", "a/b/c.txt").stdout == "hello\n"
    big = subprocess.run([*STRATA, "--store", str(cli.store), "cat", "v", "big.bin"],
                         capture_output=True, check=True).stdout
    assert big == src.read_bytes()
    assert cli.run("cat", f"v#{s1[:10]}", "a/b/c.txt").stdout == "hello\n"
    cli.run("cat", f"v#{s1[:10]}", "big.bin", rc=4)  # not there yet in s1
    cli.run("cat", "v", "a", rc=2)  # a directory

    assert cli.out("ls", "v").splitlines() == ["a", "big.bin"]
    assert cli.out("ls", "v", "a/b").splitlines() == ["c.txt"]
    long = cli.out("ls", "v", "-l").splitlines()
    assert long[0].startswith("drwxr-xr-x") and long[0].endswith(" a/")
    assert long[1].startswith("-rw-r--r--") and " 200000 " in long[1]
    rows = cli.json("ls", "v", "a/b")
    assert [(r["name"], r["path"], r["type"], r["size"], r["mode"]) for r in rows] == [
        ("c.txt", "a/b/c.txt", "file", 6, "0644")]

    st = cli.json("stat", "v", "a/b/c.txt")
    assert {k: st[k] for k in ("path", "type", "size", "mode", "nlink")} == {
        "path": "a/b/c.txt", "type": "file", "size": 6, "mode": "0644", "nlink": 1}
    assert isinstance(st["mtime_ns"], int)
    assert "size" in cli.out("stat", "v", "a/b/c.txt")
    cli.run("stat", "v", "nope", rc=4)

    log = cli.json("log", "v")
    assert [e["id"] for e in log] == [s2, s1, EMPTY_SNAPSHOT_ID]
    assert set(log[0]) == {"id", "parent", "time", "message"}
    assert log[0]["parent"] == s1 and log[1]["parent"] == EMPTY_SNAPSHOT_ID
    assert log[1]["message"] == "first" and log[0]["message"] == "put big.bin"
    assert isinstance(log[0]["time"], float) and log[0]["time"] >= log[1]["time"]
    assert len(cli.json("log", "v", "-n", "1")) == 1
    assert cli.out("log", "v", "-n", "2").splitlines()[1].startswith(s1[:12])


def test_rm(cli: Cli) -> None:
    cli.run("volume", "create", "v")
    cli.out("put", "v", "d/x", input=b"1")
    cli.out("put", "v", "d/e/y", input=b"2")
    cli.out("put", "v", "top", input=b"3")
    sid = cli.out("rm", "v", "top")
    assert cli.head("v") == sid
    cli.run("rm", "v", "top", rc=4)
    cli.run("rm", "v", "d", rc=2)  # not empty without -r
    cli.out("rm", "v", "d", "-r", "-m", "drop d")
    assert cli.out("ls", "v") == ""
    assert cli.json("log", "v", "-n", "1")[0]["message"] == "drop d"


def test_diff(cli: Cli) -> None:
    cli.run("volume", "create", "v")
    cli.out("put", "v", "keep", input=b"k")
    cli.out("put", "v", "change", input=b"1")
    cli.out("put", "v", "gone/x", input=b"x")
    cli.out("fork", "v", "b")
    cli.out("put", "v@b", "change", input=b"2")
    cli.out("put", "v@b", "new", input=b"n")
    cli.out("rm", "v@b", "gone", "-r")
    assert cli.json("diff", "v", "v@b") == [
        {"path": "change", "change": "modified"}, {"path": "gone/x", "change": "deleted"},
        {"path": "gone", "change": "deleted"}, {"path": "new", "change": "added"}]
    assert cli.json("diff", "v", "v") == []
    assert cli.out("diff", "v", "v@b").splitlines()[0] == "M  change"


# -- exit codes and errors ---------------------------------------------------------------


def test_exit_codes_and_one_line_errors(cli: Cli) -> None:
    cli.run("volume", "create", "v")
    head = cli.out("put", "v", "f", input=b"x")
    for hostile in ("../x", "/etc/passwd", "a//b", "a/./b", "x/..", "n" * 256):
        line = _one_line_error(cli.run("put", "v", hostile, input=b"evil", rc=2))
        assert "path" in line or "name" in line
        cli.run("ls", "v", hostile, rc=2)
    assert cli.head("v") == head  # nothing changed

    _one_line_error(cli.run("ls", "missing", rc=4))
    _one_line_error(cli.run("ls", "v@nobranch", rc=4))
    _one_line_error(cli.run("cat", "v", "nofile", rc=4))
    _one_line_error(cli.run("log", "v#00000000", rc=4))
    _one_line_error(cli.run("log", "v#xyz", rc=2))
    _one_line_error(cli.run("ls", "bad name", rc=2))
    _one_line_error(cli.run("put", f"v#{head[:8]}", "g", input=b"", rc=2))
    _one_line_error(cli.run("--store", str(cli.store) + "-none", "ls", "v", rc=4))
    cli.run("no-such-command", rc=2)
    cli.run("ls", rc=2)
    assert "no volume given" in _one_line_error(cli.run("run", "--", "true", rc=125))
    p = cli.run("--debug", "cat", "v", "nofile", rc=4)
    assert "Traceback" in p.stderr and "strata: error: " in p.stderr


def test_store_from_env_and_options_after_the_command(cli: Cli, tmp_path: Path) -> None:
    cli.run("volume", "create", "v", env={"STRATA_STORE": str(cli.store)})
    assert cli.run("volume", "list", "--store", str(cli.store), env={}).stdout == "v\n"
    other = tmp_path / "other"
    cli.run("init", env={"STRATA_STORE": str(other)})
    assert cli.run("volume", "list", env={"STRATA_STORE": str(other)}).stdout == ""
    assert cli.run("--version").stdout.startswith("strata ")


# -- stale bases: replay and conflict ------------------------------------------------------


def test_stale_base_puts_replay_and_conflicts_are_named(cli: Cli) -> None:
    cli.run("volume", "create", "v")
    cli.out("put", "v", "victim.txt", input=b"doomed")
    base = cli.out("put", "v", "shared.txt", input=b"v1")
    one = cli.out("put", "v", "one.txt", "--base", base, input=b"1")
    two = cli.out("put", "v", "two.txt", "--base", base[:8], input=b"2")
    assert one != two
    assert cli.out("ls", "v").splitlines() == ["one.txt", "shared.txt", "two.txt", "victim.txt"]
    assert cli.json("log", "v")[0]["parent"] == one  # replayed onto the moved head

    cli.out("put", "v", "shared.txt", input=b"ours")
    head = cli.head("v")
    p = cli.run("put", "v", "shared.txt", "--base", base, input=b"theirs", rc=3)
    lines = p.stderr.strip().splitlines()
    assert lines[0].startswith("strata: error: conflict") and lines[1:] == ["shared.txt"]
    p = cli.run("rm", "v", "shared.txt", "--base", base, rc=3)
    assert p.stderr.strip().splitlines()[1:] == ["shared.txt"]
    assert cli.head("v") == head  # nothing published
    assert cli.run("cat", "v", "shared.txt").stdout == "ours"
    cli.out("rm", "v", "victim.txt", "--base", base)  # a stale rm replays too
    assert cli.out("ls", "v").splitlines() == ["one.txt", "shared.txt", "two.txt"]


def test_both_sides_deleting_a_path_conflicts_unless_merge_identical(cli: Cli) -> None:
    """Two consumers removing one job file: the second learns it lost the race."""
    cli.run("volume", "create", "v")
    cli.out("put", "v", "job-1", input=b"work")
    base = cli.out("put", "v", "job-2", input=b"work")
    cli.out("rm", "v", "job-1")
    head = cli.head("v")
    p = cli.run("rm", "v", "job-1", "--base", base, rc=3)
    assert p.stderr.strip().splitlines()[1:] == ["job-1"]
    assert cli.head("v") == head
    cli.out("rm", "v", "job-1", "--base", base, "--merge-identical")
    assert cli.out("ls", "v").splitlines() == ["job-2"]


def test_fsck(cli: Cli) -> None:
    cli.run("volume", "create", "v")
    cli.out("put", "v", "f", input=b"x" * 100_000)
    report = cli.json("fsck")
    assert report["ok"] is True and report["damaged"] == [] and report["objects"] > 0
    assert cli.out("fsck").splitlines()[-1].startswith("ok: ")
    rebuilt = cli.json("fsck", "--rebuild-index")
    assert rebuilt["ok"] is True and rebuilt["rebuilt"]["volumes"] == 1
    assert cli.run("cat", "v", "f").stdout == "x" * 100_000


# -- import and export -----------------------------------------------------------------------


T0 = 1_600_000_000_123_456_789


def _make_tree(root: Path) -> None:
    """A directory with every kind of entry and metadata import must keep."""
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "ro").mkdir()
    (root / "src" / "main.py").write_text("print('hi')\n")
    (root / "src" / "pkg" / "__init__.py").write_bytes(b"")
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)
    (root / "secret").write_bytes(b"s")
    (root / "secret").chmod(0o600)
    big = os.urandom(70_000) + bytes(140_000) + os.urandom(5_000)  # spans a zero block
    (root / "big.bin").write_bytes(big)
    (root / "ro" / "inside").write_text("read-only dir\n")
    os.symlink("src/main.py", root / "link-to-main")
    os.symlink("../nowhere", root / "src" / "dangling")
    (root / "hard-a").write_text("linked\n")
    os.link(root / "hard-a", root / "src" / "hard-b")
    os.link(root / "hard-a", root / "src" / "pkg" / "hard-c")
    os.mkfifo(root / "fifo")
    os.setxattr(root / "src" / "main.py", "user.origin", b"test-suite")
    os.setxattr(root / "src", "user.kind", b"dir")
    for i, (dirpath, dirnames, filenames) in enumerate(sorted(os.walk(root), reverse=True)):
        for j, name in enumerate(sorted(filenames + dirnames)):
            os.utime(os.path.join(dirpath, name), ns=(T0 + i, T0 + 1000 * i + j + 7),
                     follow_symlinks=False)
        os.utime(dirpath, ns=(T0, T0 + 999_999 * i + 3))
    (root / "ro").chmod(0o555)


def _snapshot_of(root: Path) -> dict[str, tuple[Any, ...]]:
    """Everything import/export keeps, per relative path (hard links as link groups)."""
    out: dict[str, tuple[Any, ...]] = {}
    inodes: dict[int, list[str]] = {}
    paths = [str(root)]
    for dirpath, dirnames, filenames in os.walk(root):
        paths += [os.path.join(dirpath, n) for n in dirnames + filenames]
    for p in paths:
        rel = os.path.relpath(p, root)
        s = os.lstat(p)
        content: Any = None
        if stat.S_ISREG(s.st_mode):
            content = hashlib.sha256(Path(p).read_bytes()).hexdigest()
        elif stat.S_ISLNK(s.st_mode):
            content = os.readlink(p)
        xattrs = tuple(sorted((n, os.getxattr(p, n, follow_symlinks=False))
                              for n in os.listxattr(p, follow_symlinks=False)))
        linked = stat.S_ISREG(s.st_mode) and s.st_nlink > 1
        if linked:
            inodes.setdefault(s.st_ino, []).append(rel)
        out[rel] = (stat.S_IFMT(s.st_mode), stat.S_IMODE(s.st_mode), s.st_uid, s.st_gid,
                    s.st_mtime_ns, None if stat.S_ISDIR(s.st_mode) else s.st_size,
                    content, xattrs, s.st_nlink if linked else 1, s.st_ino if linked else 0)
    for members in inodes.values():  # an inode number becomes its sorted link group
        for rel in members:
            out[rel] = out[rel][:-1] + (tuple(sorted(members)),)
    return out


def test_import_export_round_trip(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _make_tree(src)
    cli.run("volume", "create", "v")
    sid = cli.out("import", "v", str(src), "-m", "initial")
    assert cli.head("v") == sid
    assert cli.json("log", "v", "-n", "1")[0]["message"] == "initial"
    st = cli.json("stat", "v", "src/hard-b")
    assert st["nlink"] == 3 and st["ino"]
    assert cli.json("stat", "v", "link-to-main")["target"] == "src/main.py"
    assert cli.json("stat", "v", "src/main.py")["xattrs"] == {"user.origin": "test-suite"}
    assert cli.json("stat", "v", "fifo")["type"] == "fifo"

    dst = tmp_path / "out"
    cli.run("export", "v", str(dst))
    want, got = _snapshot_of(src), _snapshot_of(dst)
    assert sorted(got) == sorted(want)
    for path in want:
        assert got[path] == want[path], path
    ino = {os.stat(dst / p).st_ino for p in ("hard-a", "src/hard-b", "src/pkg/hard-c")}
    assert len(ino) == 1 and os.stat(dst / "hard-a").st_nlink == 3
    assert os.stat(dst / "big.bin").st_blocks * 512 < 215_000  # the zero block is a hole

    # A non-empty target is refused; a snapshot ref exports too.
    _one_line_error(cli.run("export", "v", str(dst), rc=2))
    cli.run("export", f"v#{sid[:8]}", str(tmp_path / "again"))
    assert _snapshot_of(tmp_path / "again") == want
    (src / "ro").chmod(0o755)  # let pytest clean up
    (dst / "ro").chmod(0o755)
    (tmp_path / "again" / "ro").chmod(0o755)


def test_import_of_a_changed_directory_publishes_only_the_changes(cli: Cli,
                                                                   tmp_path: Path) -> None:
    src = tmp_path / "src"
    for d in ("a", "b", "c/deep"):
        (src / d).mkdir(parents=True)
    for i in range(5):
        for d in ("a", "b", "c/deep"):
            (src / d / f"f{i}").write_text(f"{d} {i}\n")
    cli.run("volume", "create", "v")
    first = cli.out("import", "v", str(src))
    assert cli.out("import", "v", str(src)) == first  # unchanged: no new snapshot
    assert len(cli.json("log", "v")) == 2

    dir_times = {d: os.stat(src / d).st_mtime_ns for d in ("a", "b", "c", "c/deep")}
    (src / "a" / "f1").write_text("a 1 changed, longer\n")
    (src / "a" / "f2").chmod(0o600)
    (src / "b" / "new").write_text("new\n")
    (src / "b" / "f3").unlink()
    for f in (src / "c" / "deep").iterdir():
        f.unlink()
    (src / "c" / "deep").rmdir()
    for d, t in dir_times.items():  # so that only the files' own changes remain
        if (src / d).exists():
            os.utime(src / d, ns=(t, t))
    second = cli.out("import", "v", str(src), "-m", "round two")
    assert cli.json("log", "v", "-n", "1")[0]["parent"] == first
    changes = cli.json("diff", f"v#{first[:8]}", "v")
    assert sorted((c["path"], c["change"]) for c in changes) == sorted(
        [("a/f1", "modified"), ("a/f2", "modified"), ("b/new", "added"),
         ("b/f3", "deleted"), ("c/deep", "deleted")]
        + [(f"c/deep/f{i}", "deleted") for i in range(5)])
    assert cli.json("stat", "v", "a/f2")["mode"] == "0600"
    assert cli.run("cat", "v", "a/f1").stdout == "a 1 changed, longer\n"

    # A stale-base import replays onto a head that moved elsewhere ...
    cli.out("put", "v", "elsewhere", input=b"e")
    (src / "a" / "f0").write_text("a 0 again, changed\n")
    cli.out("import", "v", str(src), "--base", second)
    assert cli.out("ls", "v").splitlines() == ["a", "b", "c", "elsewhere"]
    # ... and conflicts when the head changed the same path.
    cli.out("put", "v", "a/f4", input=b"theirs")
    (src / "a" / "f4").write_text("ours, and longer\n")
    p = cli.run("import", "v", str(src), "--base", second, rc=3)
    assert "a/f4" in p.stderr.splitlines()[1:]
    cli.run("import", "v", str(tmp_path / "no-such-dir"), rc=4)


# -- lifecycle: policies, tags, garbage collection -----------------------------------


def test_policy_tag_and_gc(cli: Cli, tmp_path: Path) -> None:
    cli.run("volume", "create", "v")
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(3_000_000))
    first = cli.out("put", "v", "big.bin", "--from", str(src))
    assert cli.out("tag", f"v#{first[:12]}", "first") == first
    src.write_bytes(os.urandom(3_000_000))
    middle = cli.out("put", "v", "big.bin", "--from", str(src))
    src.write_bytes(os.urandom(3_000_000))
    cli.out("put", "v", "big.bin", "--from", str(src))
    assert "all history" in cli.out("policy", "show", "v")
    assert cli.json("policy", "set", "v", "--keep-last", "1")["keep_last"] == 1
    assert "the last 1 snapshot(s)" in cli.out("policy", "show", "v")
    dry = cli.json("gc", "--dry-run", "--min-age", "0")
    assert dry["dry_run"] and dry["bytes_freed"] >= 3_000_000
    cli.json("gc", "--min-age", "0")
    second = cli.json("gc", "--min-age", "0")  # empty packs go one pass later
    assert second["dry_run"] is False
    p = cli.run("cat", f"v#{middle[:12]}", "big.bin", rc=4)
    assert "expired" in p.stderr
    kept = subprocess.run([*STRATA, "--store", str(cli.store), "cat", "v@tags/first",
                           "big.bin"], capture_output=True, check=True).stdout
    assert len(kept) == 3_000_000  # the tag kept it
    p = cli.run("put", "v@tags/first", "x", input=b"no", rc=2)
    assert "tag" in p.stderr
    stats = cli.json("stats")
    assert stats["gc"]["snapshots_expired"] == 0  # the last pass found nothing more
    assert cli.json("fsck")["ok"]


def test_the_default_branch_is_deleted_only_with_force(cli: Cli) -> None:
    """A new user deleted proj@live (exit 0, no output); then `strata ls proj` failed."""
    cli.run("volume", "create", "proj")
    p = cli.run("branch", "delete", "proj@live", rc=2)
    assert "--force" in p.stderr
    assert cli.run("ls", "proj").returncode == 0
    cli.run("branch", "delete", "proj@live", "--force")
    cli.run("ls", "proj", rc=4)


def test_volume_delete_asks_on_a_terminal(cli: Cli) -> None:
    cli.run("volume", "create", "keep")
    cli.run("volume", "create", "gone")

    def on_a_terminal(*args: str, answer: bytes) -> int:
        leader, follower = os.openpty()
        try:
            p = subprocess.Popen([*STRATA, "--store", str(cli.store), *args], stdin=follower,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            os.write(leader, answer)
            p.communicate(timeout=60)
            return p.returncode
        finally:
            os.close(leader)
            os.close(follower)

    assert on_a_terminal("volume", "delete", "keep", answer=b"n\n") == 1
    assert on_a_terminal("volume", "delete", "gone", answer=b"y\n") == 0
    assert cli.out("volume", "list").split() == ["keep"]
    cli.run("volume", "delete", "keep", "--yes")  # and no terminal: no question


def test_gc_says_what_it_gave_back_and_what_the_next_pass_will(cli: Cli) -> None:
    """One pass printed 'bytes_freed' while the store grew; the space came back a pass later."""
    import re

    def disk() -> int:
        return sum(p.stat().st_size for p in (cli.store / "packs").glob("*.pack"))

    cli.run("volume", "create", "g")
    for i in range(6):
        data = os.urandom(1 << 20).hex().encode()  # 2 MiB of text (the helper sends text)
        cli.run("put", "g", "big", "-m", f"v{i}", input=data)
    cli.run("policy", "set", "g", "--keep-last", "1")
    first = cli.run("gc", "--min-age", "0").stdout
    pending = re.search(r"gc: ([\d.]+) MiB in (\d+) pack\(s\) is given back by the next pass",
                        first)
    assert pending and float(pending[1]) > 0, first
    before = disk()
    second = cli.run("gc", "--min-age", "0").stdout
    given = re.search(r"gave back ([\d.]+) MiB of disk now", second)
    assert given and abs(float(given[1]) - float(pending[1])) < 0.2, (first, second)
    assert before - disk() >= float(given[1]) * 2**20 * 0.9


def test_tags_are_listed_and_a_duplicate_says_tag(cli: Cli) -> None:
    cli.run("volume", "create", "t")
    sid = cli.run("put", "t", "f", "-m", "one", input=b"1").stdout.strip()
    cli.run("tag", "t", "release-1")
    p = cli.run("tag", "t", "release-1", rc=1)
    assert "tag 'release-1' exists" in p.stderr and "branch" not in p.stderr
    assert cli.json("tag", "list", "t") == [{"name": "release-1", "snapshot": sid}]
    assert cli.out("tag", "list", "t").split() == ["release-1", sid]


def test_human_output_has_no_epochs_seconds_or_reprs(cli: Cli) -> None:
    cli.run("volume", "create", "h")
    cli.run("policy", "set", "h", "--keep-newer", "1d")
    assert "newer than 1d" in cli.out("policy", "show", "h")
    assert cli.out("log", "h").endswith("(empty volume)")
    stats = cli.out("stats")
    assert "['" not in stats and "None" not in stats, stats


def test_long_work_draws_progress_on_a_terminal_only(cli: Cli, tmp_path: Path) -> None:
    """Import and export draw a bar on a terminal (rich); piped, they print nothing more."""
    src = tmp_path / "tree"
    for i in range(3000):
        d = src / f"d{i % 30}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_text(str(i))
    cli.run("volume", "create", "big")
    cli.run("import", "big", str(src), "-m", "many")
    piped = cli.run("export", "big", str(tmp_path / "piped"))
    assert piped.stderr == ""
    leader, follower = os.openpty()
    try:
        p = subprocess.Popen([*STRATA, "--store", str(cli.store), "export", "big",
                              str(tmp_path / "tty")], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=follower,
                             env={**os.environ, "COLUMNS": "100"})
        os.close(follower)
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            drawn += chunk
        assert p.wait(60) == 0
    finally:
        os.close(leader)
    assert b"exporting" in drawn, drawn[-500:]
    assert len(list((tmp_path / "tty").rglob("f*"))) == 3000
