"""Real tools on a writable mount: git, a virtualenv with pip, npm, SQLite, tar, rsync.

Each tool does its usual work on the mount, the mount commits, and the
result is checked again in a fresh mount of the new head (a new mount
process that reads everything back from the store). One store and one
writable mount are shared by the module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fsutil import SharedMount, varied_tree


@pytest.fixture(scope="module")
def sm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedMount]:
    s = SharedMount(tmp_path_factory.mktemp("tools"))
    try:
        yield s
    finally:
        s.close()


def run(*cmd: str | os.PathLike[str], cwd: Path | None = None, env: dict[str, str] | None = None,
        input: str | None = None) -> str:
    p = subprocess.run([os.fspath(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                       text=True, input=input, timeout=180)
    assert p.returncode == 0, (cmd, p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p.stdout


# -- git ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def git_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("git_home")
    return {**os.environ, "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": "Strata Test", "GIT_AUTHOR_EMAIL": "test@strata.invalid",
            "GIT_COMMITTER_NAME": "Strata Test", "GIT_COMMITTER_EMAIL": "test@strata.invalid",
            "GIT_AUTHOR_DATE": "2024-01-02T03:04:05Z", "GIT_COMMITTER_DATE": "2024-01-02T03:04:05Z"}


def _generate_repo(root: Path, files: int = 200) -> None:
    for i in range(files):
        d = root / "src" / f"pkg{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_text(f"# module {i}\n" + f"VALUE_{i} = {i}\n" * (i % 40 + 1))
    (root / "data.bin").write_bytes(os.urandom(300_000))
    (root / "README").write_text("generated\n")
    os.chmod(root / "README", 0o755)  # git tracks the executable bit
    os.symlink("README", root / "README.link")


def test_git(sm: SharedMount, git_env: dict[str, str], tmp_path: Path) -> None:
    def git(*args: str, cwd: Path) -> str:
        return run("git", *args, cwd=cwd, env=git_env)

    repo = sm.m / "repo"
    repo.mkdir()
    git("init", "-q", "-b", "main", cwd=repo)
    _generate_repo(repo)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "initial", cwd=repo)
    assert git("status", "--porcelain", cwd=repo) == ""
    for i in range(0, 200, 7):
        path = repo / "src" / f"pkg{i % 10}" / f"mod{i}.py"
        path.write_text(path.read_text() + "CHANGED = True\n")
    (repo / "src" / "pkg3" / "mod3.py").unlink()
    assert len(git("status", "--porcelain", cwd=repo).splitlines()) == 30
    git("commit", "-q", "-a", "-m", "second", cwd=repo)
    git("mv", "src/pkg1", "lib_pkg1", cwd=repo)  # a directory renamed in history
    git("commit", "-q", "-m", "move pkg1", cwd=repo)
    assert git("status", "--porcelain", cwd=repo) == ""
    loose_before = _count_objects(git("count-objects", "-v", cwd=repo))
    assert loose_before["count"] > 200
    git("gc", "-q", cwd=repo)
    after = _count_objects(git("count-objects", "-v", cwd=repo))
    assert after["count"] == 0 and after["packs"] == 1, after
    git("fsck", "--full", "--strict", cwd=repo)
    log = git("log", "--format=%H %s", cwd=repo)
    # A local clone on the same filesystem hard-links the pack; a clone of a bare
    # repository from the local disk copies it.
    git("clone", "-q", str(repo), str(sm.m / "repo_linked"), cwd=sm.m)
    pack = next((repo / ".git" / "objects" / "pack").glob("*.pack"))
    linked = sm.m / "repo_linked" / ".git" / "objects" / "pack" / pack.name
    assert os.stat(linked).st_ino == os.stat(pack).st_ino and os.stat(pack).st_nlink == 2
    bare = tmp_path / "bare.git"
    git("clone", "-q", "--bare", str(repo), str(bare), cwd=tmp_path)
    git("clone", "-q", str(bare), str(sm.m / "cloned"), cwd=sm.m)
    assert git("log", "--format=%H %s", cwd=sm.m / "cloned") == log
    with sm.fresh() as f:
        for name in ("repo", "repo_linked", "cloned"):
            git("fsck", "--full", "--strict", cwd=f / name)
            assert git("log", "--format=%H %s", cwd=f / name) == log
            assert git("status", "--porcelain", cwd=f / name) == "", name
        assert [line.split(" ", 1)[1] for line in log.splitlines()] == [
            "move pkg1", "second", "initial"]
        renames = git("log", "-1", "-M", "--name-status", "--format=", cwd=f / "repo")
        assert sum(line.startswith("R100\tsrc/pkg1/") for line in renames.splitlines()) == 20
        assert (f / "repo" / "lib_pkg1" / "mod1.py").read_text().startswith("# module 1\n")
        assert not (f / "repo" / "src" / "pkg1").exists()
        assert os.access(f / "repo" / "README", os.X_OK)
        assert os.readlink(f / "repo" / "README.link") == "README"
        fp = f / "repo" / ".git" / "objects" / "pack" / pack.name
        fl = f / "repo_linked" / ".git" / "objects" / "pack" / pack.name
        assert os.stat(fp).st_ino == os.stat(fl).st_ino and os.stat(fl).st_nlink == 2
        # And git keeps working there: a new commit and a gc in the fresh mount.
        (f / "repo" / "new_file").write_text("after remount\n")
        git("add", "new_file", cwd=f / "repo")
        git("commit", "-q", "-m", "after remount", cwd=f / "repo")
        git("gc", "-q", cwd=f / "repo")
        git("fsck", "--full", cwd=f / "repo")


def _count_objects(out: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split(": ") for line in out.splitlines())
            if v.strip().isdigit()}


# -- a virtualenv and pip ----------------------------------------------------------------------


BACKEND = r'''
"""A build backend with no dependencies: pip can build this package offline."""
import base64, hashlib, os, zipfile

NAME, VERSION = "strata_probe", "1.0"
DIST = f"{NAME}-{VERSION}.dist-info"


def _files():
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, NAME, "__init__.py"), "rb") as f:
        init = f.read()
    return {
        f"{NAME}/__init__.py": init,
        f"{DIST}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n".encode(),
        f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nGenerator: probe\nRoot-Is-Purelib: true\n"
                         b"Tag: py3-none-any\n",
        f"{DIST}/entry_points.txt": f"[console_scripts]\nstrata-probe = {NAME}:main\n".encode(),
    }


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    files = _files()
    record = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{path},sha256={digest.decode()},{len(data)}")
        record.append(f"{DIST}/RECORD,,")
        z.writestr(f"{DIST}/RECORD", "\n".join(record) + "\n")
    return name
'''

PYPROJECT = """
[build-system]
requires = []
build-backend = "backend"
backend-path = ["."]

[project]
name = "strata_probe"
version = "1.0"
"""

PROBE = '''
def hello():
    return "hello from the mount"


def main():
    print(hello())
'''


def test_virtualenv_and_pip(sm: SharedMount, tmp_path: Path) -> None:
    src = tmp_path / "probe"
    (src / "strata_probe").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "backend.py").write_text(BACKEND)
    (src / "strata_probe" / "__init__.py").write_text(PROBE)
    venv = sm.m / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    run(sys.executable, "-m", "venv", venv, env=env)
    py = venv / "bin" / "python"
    run(py, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", src, env=env)
    assert run(py, "-c", "import strata_probe; print(strata_probe.hello())",
               env=env) == "hello from the mount\n"
    assert run(venv / "bin" / "strata-probe", env=env) == "hello from the mount\n"
    assert "strata_probe" in run(py, "-m", "pip", "list", "--format=freeze", env=env).replace(
        "-", "_")
    with sm.fresh() as f:
        fpy = f / "venv" / "bin" / "python"
        assert run(fpy, "-c", "import strata_probe, sys; print(strata_probe.__file__)",
                   env=env).startswith(str(f / "venv"))
        assert run(fpy, "-m", "pip", "show", "strata_probe", env=env).splitlines()[1] == (
            "Version: 1.0")
        # Uninstalling from the fresh mount removes the files the first one wrote.
        run(fpy, "-m", "pip", "uninstall", "-q", "-y", "strata_probe", env=env)
        p = subprocess.run([fpy, "-c", "import strata_probe"], capture_output=True, env=env)
        assert p.returncode != 0


# -- npm ---------------------------------------------------------------------------------------


def npm_packages(where: Path) -> dict[str, str]:
    """Two local npm packages packed as tarballs, and npm's environment (no registry).

    `strata-app-tool` depends on `strata-app-dep` and installs a bin.
    """
    env = {**os.environ, "npm_config_cache": str(where / "npm-cache"),
           "npm_config_update_notifier": "false", "npm_config_fund": "false",
           "npm_config_audit": "false"}
    for name, deps, files in (
            ("strata-app-dep", {}, {"index.js": "module.exports = () => 'dep ok';\n"}),
            ("strata-app-tool", {"strata-app-dep": f"file:{where}/strata-app-dep-1.0.0.tgz"},
             {"index.js": "module.exports = require('strata-app-dep');\n",
              "cli.js": "#!/usr/bin/env node\nconsole.log('tool says ' + "
                        "require('strata-app-dep')());\n"})):
        src = where / name
        src.mkdir(parents=True)
        pkg: dict[str, Any] = {"name": name, "version": "1.0.0", "main": "index.js",
                               "dependencies": deps}
        if "cli.js" in files:
            pkg["bin"] = {"strata-tool": "cli.js"}
        (src / "package.json").write_text(json.dumps(pkg))
        for fname, text in files.items():
            (src / fname).write_text(text)
        run("npm", "pack", "--silent", "--pack-destination", where, cwd=src, env=env)
    return env


def npm_install(app: Path, where: Path, env: dict[str, str]) -> None:
    """`npm install` of the tool into `app`, then `npm ci` from its lockfile, offline."""
    app.mkdir()
    run("npm", "init", "-y", cwd=app, env=env)
    run("npm", "install", "--offline", f"{where}/strata-app-tool-1.0.0.tgz", cwd=app, env=env)
    shutil.rmtree(app / "node_modules")
    run("npm", "ci", "--offline", cwd=app, env=env)  # the lockfile, into a fresh tree


def npm_check(app: Path, env: dict[str, str]) -> None:
    assert run(app / "node_modules" / ".bin" / "strata-tool", env=env) == "tool says dep ok\n"
    assert run("node", "-e", "console.log(require('strata-app-tool')())", cwd=app,
               env=env) == "dep ok\n"
    run("npm", "ls", "--offline", "--all", cwd=app, env=env)  # the tree matches the lock


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
def test_npm_install_and_ci_offline(sm: SharedMount, tmp_path: Path) -> None:
    env = npm_packages(tmp_path)
    npm_install(sm.m / "app", tmp_path, env)
    npm_check(sm.m / "app", env)
    with sm.fresh() as f:
        npm_check(f / "app", env)


# -- SQLite ------------------------------------------------------------------------------------


WRITER = r"""
import os, sqlite3, sys
path, wid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
con = sqlite3.connect(path, timeout=60, isolation_level=None)
con.execute("PRAGMA busy_timeout = 60000")
if len(sys.argv) > 4:
    con.execute("PRAGMA wal_autocheckpoint = 0")  # let the WAL grow: commit it as it is
for i in range(n):
    con.execute("BEGIN IMMEDIATE")
    con.execute("INSERT INTO t (w, i, payload) VALUES (?, ?, ?)", (wid, i, os.urandom(1500)))
    con.execute("UPDATE counters SET n = n + 1 WHERE w = ?", (wid,))
    con.execute("COMMIT")
con.close()
"""
WRITERS = 4
ROWS = 150


def _create_db(path: Path, mode: str) -> None:
    import sqlite3

    con = sqlite3.connect(path, isolation_level=None)
    assert con.execute(f"PRAGMA journal_mode = {mode}").fetchone()[0] == mode.lower()
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, w INT, i INT, payload BLOB)")
    con.execute("CREATE INDEX t_w ON t (w, i)")
    con.execute("CREATE TABLE counters (w INT PRIMARY KEY, n INT)")
    con.executemany("INSERT INTO counters VALUES (?, 0)", [(w,) for w in range(WRITERS)])
    con.close()


def _write_concurrently(path: Path, *extra: str) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w), str(ROWS),
                               *extra], stderr=subprocess.PIPE, text=True)
             for w in range(WRITERS)]
    errors = [(p.wait(timeout=180), p.stderr.read() if p.stderr else "") for p in procs]
    assert all(rc == 0 for rc, _ in errors), errors


def _check_db(path: Path, rounds: int) -> None:
    """integrity_check through the sqlite3 tool, and every writer's rows are there."""
    assert run("sqlite3", path, "PRAGMA integrity_check;") == "ok\n"
    out = run("sqlite3", path, "SELECT w, count(*), count(DISTINCT i) FROM t GROUP BY w;"
                               "SELECT w, n FROM counters ORDER BY w;")
    per_writer = ROWS * rounds
    assert out.split() == [f"{w}|{per_writer}|{ROWS}" for w in range(WRITERS)] + [
        f"{w}|{per_writer}" for w in range(WRITERS)], out


def test_sqlite_wal_concurrent_writers(sm: SharedMount) -> None:
    import sqlite3

    db = sm.m / "sqlite" / "wal.db"
    db.parent.mkdir()
    _create_db(db, "WAL")
    # A connection held open across the commit: the WAL and its shared-memory
    # index are published as they are, unmerged, and SQLite recovers from them.
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("PRAGMA wal_autocheckpoint = 0")
        assert holder.execute("SELECT count(*) FROM t").fetchone()[0] == 0
        _write_concurrently(db, "no-checkpoint")
        assert os.path.getsize(f"{db}-wal") > ROWS * WRITERS * 1500
        _check_db(db, 1)
        with sm.fresh() as f:
            assert (f / "sqlite" / "wal.db-wal").exists()
            _check_db(f / "sqlite" / "wal.db", 1)
    finally:
        holder.close()


def test_sqlite_rollback_journal_concurrent_writers(sm: SharedMount) -> None:
    db = sm.m / "sqlite" / "journal.db"
    db.parent.mkdir(exist_ok=True)
    _create_db(db, "DELETE")
    _write_concurrently(db)
    _check_db(db, 1)
    assert not Path(f"{db}-journal").exists()
    with sm.fresh() as f:
        _check_db(f / "sqlite" / "journal.db", 1)
        # Four writers again, now on a database of the snapshot: the first one to
        # open it for writing copies it up while the others wait.
        _write_concurrently(f / "sqlite" / "journal.db")
        _check_db(f / "sqlite" / "journal.db", 2)
        sm.env.run("commit", str(f))
        with sm.fresh(commit=False) as g:
            _check_db(g / "sqlite" / "journal.db", 2)


# -- tar ---------------------------------------------------------------------------------------


TAR_CREATE = ["tar", "--format=posix", "--xattrs", "--xattrs-include=*", "--sort=name",
              "--numeric-owner", "--pax-option=delete=atime,delete=ctime"]


def _members(path: Path) -> list[dict[str, Any]]:
    """Every member of a tar file with its header fields, pax records and content."""
    out = []
    with tarfile.open(path) as t:
        for m in t.getmembers():
            f = t.extractfile(m) if m.isfile() else None
            out.append({"name": m.name, "type": m.type, "mode": oct(m.mode), "uid": m.uid,
                        "gid": m.gid, "size": m.size, "linkname": m.linkname,
                        "pax": dict(sorted(m.pax_headers.items())),
                        "data": f.read() if f is not None else None})
    return out


def test_tar_round_trip(sm: SharedMount, tmp_path: Path) -> None:
    src = tmp_path / "tree"
    varied_tree(src, sparse=False)
    orig = tmp_path / "orig.tar"
    run(*TAR_CREATE, "-cf", orig, "-C", src, ".")
    dest = sm.m / "untarred"
    dest.mkdir()
    run("tar", "--xattrs", "--xattrs-include=*", "-xpf", orig, "-C", dest)
    again = tmp_path / "again.tar"
    run(*TAR_CREATE, "-cf", again, "-C", dest, ".")
    expected = _members(orig)
    assert len(expected) > 20
    assert any(m["type"] == tarfile.LNKTYPE for m in expected)
    assert any(any(k.startswith("SCHILY.xattr.user.") for k in m["pax"]) for m in expected)
    assert _members(again) == expected
    with sm.fresh() as f:
        back = tmp_path / "back.tar"
        run(*TAR_CREATE, "-cf", back, "-C", f / "untarred", ".")
        got = _members(back)
        for a, b in zip(expected, got, strict=False):
            assert a == b, (a["name"], {k: (a[k], b[k]) for k in a if a[k] != b[k]})
        assert len(got) == len(expected)


# -- rsync -------------------------------------------------------------------------------------


def _diff(a: Path, b: Path) -> list[str]:
    p = subprocess.run(["diff", "-r", "--no-dereference", str(a), str(b)], capture_output=True,
                       text=True)
    lines = [line for line in p.stdout.splitlines()
             if not (" is a fifo while file " in line and line.endswith(" is a fifo"))]
    assert p.returncode in (0, 1) and not p.stderr, p.stderr
    return lines


def _itemize(src: Path, dest: Path) -> list[str]:
    """What `rsync -aHX` would still change (nothing, when dest is an exact copy)."""
    out = run("rsync", "-aHXn", "--itemize-changes", f"{src}/", f"{dest}/")
    return [line for line in out.splitlines() if line.strip()]


def test_rsync(sm: SharedMount, tmp_path: Path) -> None:
    assert shutil.which("rsync"), "rsync is installed by the Makefile (make deps)"
    src = tmp_path / "tree"
    varied_tree(src)
    dest = sm.m / "rsynced"
    run("rsync", "-aHX", f"{src}/", f"{dest}/")
    assert _diff(src, dest) == []
    assert _itemize(src, dest) == []
    # A second sync after changes moves only what changed.
    (src / "dir" / "text").write_text("changed\n")
    (src / "multi_block").unlink()
    (src / "added").write_bytes(os.urandom(70_000))
    out = run("rsync", "-aHX", "--delete", "--itemize-changes", f"{src}/", f"{dest}/")
    changed = sorted(line[12:] for line in out.splitlines() if line.strip())
    assert changed == ["./", "added", "dir/text", "multi_block"], out
    assert _diff(src, dest) == [] and _itemize(src, dest) == []
    with sm.fresh() as f:
        assert _diff(src, f / "rsynced") == []
        assert _itemize(src, f / "rsynced") == []


# -- make and a C compiler -------------------------------------------------------------------


MAKEFILE = """\
OBJS := $(patsubst %.c,%.o,$(sort $(wildcard src/*.c)))
prog: $(OBJS)
\t$(CC) -o $@ $^
src/%.o: src/%.c src/common.h
\t$(CC) -O0 -c -o $@ $<
"""


@pytest.mark.skipif(not (shutil.which("make") and shutil.which("cc")), reason="no make or cc")
def test_make_and_cc(sm: SharedMount) -> None:
    """A build, an incremental rebuild, and make's view after a commit and remount.

    make decides what is up to date from nanosecond mtimes.
    """
    proj = sm.m / "cproj"
    (proj / "src").mkdir(parents=True)
    (proj / "Makefile").write_text(MAKEFILE)
    (proj / "src" / "common.h").write_text("int f(int);\n")
    calls = " + ".join(f"f{i}(1)" for i in range(20))
    for i in range(20):
        (proj / "src" / f"f{i}.c").write_text(f'#include "common.h"\nint f{i}(int x) '
                                              f"{{ return x + {i}; }}\n")
    decls = "".join(f"int f{i}(int);\n" for i in range(20))
    (proj / "src" / "main.c").write_text(f'#include <stdio.h>\n#include "common.h"\n{decls}'
                                         f'int f(int x) {{ return x; }}\nint main(void) '
                                         f'{{ printf("%d\\n", {calls}); return 0; }}\n')
    run("make", "-j4", "-s", cwd=proj)
    assert run(proj / "prog") == f"{sum(1 + i for i in range(20))}\n"
    run("make", "-q", cwd=proj)  # exit 0: up to date
    (proj / "src" / "f3.c").write_text('#include "common.h"\nint f3(int x) { return x + 103; }\n')
    compiled = [line for line in run("make", cwd=proj).splitlines() if " -c " in line]
    assert compiled == ["cc -O0 -c -o src/f3.o src/f3.c"]  # only what changed
    with sm.fresh() as f:
        fproj = f / "cproj"
        run("make", "-q", cwd=fproj)  # exit 0: everything up to date
        assert run(fproj / "prog") == f"{sum(1 + i for i in range(20)) + 100}\n"
        (fproj / "src" / "common.h").write_text("int f(int);\n/* touched */\n")
        assert len([line for line in run("make", cwd=fproj).splitlines()
                    if " -c " in line]) == 21
