"""POSIX and real tools inside an attached workspace, checked again after a reattach.

The filesystem is ext4, so POSIX is ext4's; what strata must keep is every
byte and every attribute across detach and attach on another directory (as
another host would): a varied tree with owners, modes, nanosecond times,
hard links, symlinks, sparse files, fifos and xattrs; a git repository; a
virtualenv with a package pip built offline; SQLite; make with its mtimes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fsutil import diff_states, tree_state, varied_tree
from test_tools import (
    BACKEND,
    MAKEFILE,
    PROBE,
    PYPROJECT,
    npm_check,
    npm_install,
    npm_packages,
)
from ws_harness import WsEnv


def run(*cmd: object, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, (cmd, p.stdout, p.stderr)
    return p.stdout


def test_a_varied_tree_survives_detach_and_attach(wsenv: WsEnv) -> None:
    wsenv.run("workspace", "create", "dev", "--size", "2G")
    d = wsenv.attach("dev", "w")
    varied_tree(d / "t")
    os.chown(d / "t" / "dir" / "text", 1234, 5678)
    os.chmod(d / "t" / "setuid", 0o4755)
    os.utime(d / "t" / "inline", ns=(1_000_000_001, 1_234_567_891_234_567_891))
    name = os.fsdecode(bytes(range(1, 256)).replace(b"/", b"")[:250])
    (d / "t" / name).write_bytes(b"every byte but / and NUL")
    before = tree_state(d / "t")
    wsenv.detach(d)
    e = wsenv.attach("dev", "elsewhere")
    assert diff_states(before, tree_state(e / "t")) == []
    assert os.stat(e / "t" / "holey").st_blocks * 512 < 1 << 20  # still sparse
    wsenv.detach(e)


def test_git_pip_npm_sqlite_make_in_a_workspace(wsenv: WsEnv, tmp_path: Path) -> None:
    wsenv.run("workspace", "create", "dev", "--size", "4G")
    d = wsenv.attach("dev", "w")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    origin = tmp_path / "origin"
    run("git", "init", "-q", "--bare", origin)
    seed = tmp_path / "seed"
    run("git", "clone", "-q", origin, seed)
    for i in range(200):
        (seed / f"f{i}.txt").write_text(f"file {i}\n" * (i + 1))
    run(*git, "-C", seed, "add", "-A")
    run(*git, "-C", seed, "commit", "-qm", "seed")
    run("git", "-C", seed, "push", "-q", "origin", "HEAD")
    run("git", "clone", "-q", origin, d / "repo")
    (d / "repo" / "new.txt").write_text("new\n")
    run(*git, "-C", d / "repo", "add", "-A")
    run(*git, "-C", d / "repo", "commit", "-qm", "in the workspace")
    head = run("git", "-C", d / "repo", "rev-parse", "HEAD").strip()
    # A virtualenv and a package pip builds offline.
    src = tmp_path / "probe"
    (src / "strata_probe").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "backend.py").write_text(BACKEND)
    (src / "strata_probe" / "__init__.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    run(sys.executable, "-m", "venv", d / "venv", env=env)
    run(d / "venv" / "bin" / "python", "-m", "pip", "install", "-q", "--no-index",
        "--no-build-isolation", src, env=env)
    # npm: a package with a bin and a dependency, installed and `npm ci`ed offline.
    npm_env = npm_packages(tmp_path / "npm")
    npm_install(d / "app", tmp_path / "npm", npm_env)
    # SQLite through its own command-line tool.
    run("sqlite3", d / "db", "pragma journal_mode=wal; create table t (x);"
        "insert into t values (1), (2), (3);")
    has_make = bool(shutil.which("make") and shutil.which("cc"))
    if has_make:
        proj = d / "cproj"
        (proj / "src").mkdir(parents=True)
        (proj / "Makefile").write_text(MAKEFILE)
        (proj / "src" / "common.h").write_text("int f(int);\n")
        (proj / "src" / "main.c").write_text('#include <stdio.h>\n#include "common.h"\n'
                                             "int f(int x) { return x; }\n"
                                             'int main(void) { printf("%d\\n", f(7)); }\n')
        run("make", "-s", cwd=proj)
    wsenv.detach(d)
    e = wsenv.attach("dev", "w")  # the same path, as a host that picks up the work would
    run("git", "-C", e / "repo", "fsck", "--strict")
    assert run("git", "-C", e / "repo", "rev-parse", "HEAD").strip() == head
    assert run("git", "-C", e / "repo", "status", "--porcelain") == ""
    assert run(e / "venv" / "bin" / "strata-probe", env=env) == "hello from the mount\n"
    npm_check(e / "app", npm_env)
    assert run("sqlite3", e / "db", "select sum(x) from t; pragma integrity_check;"
               ).split() == ["6", "ok"]
    if has_make:
        run("make", "-q", cwd=e / "cproj")  # exit 0: up to date, by nanosecond mtimes
        assert run(e / "cproj" / "prog") == "7\n"
    wsenv.detach(e)
    if not has_make:
        pytest.skip("make and cc are not installed: the rest passed")
