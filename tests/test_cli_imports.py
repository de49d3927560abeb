"""The CLI's import budget: `strata ls` must not pull in the heavy half of strata.

`strata ls` first tries its fast path (cli/fastls.py: one request on the lean
stream, no argparse, no engine codecs); the ordinary path (argparse, the
remote store, the tree code) serves every other form and has a budget too.

Every `strata` command pays for what it imports before it does anything, and
agents call the CLI thousands of times a day. These tests run real processes
(`python -X importtime -m strata ...` against a real store and its server) and
fail when the import set of `strata ls` grows past the lists below. Nothing
here measures time: the budget is the set of modules, which does not vary
with load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from strata.cli import main as climain
from strata.cli import parser as cliparser

# Heavy or irrelevant to reading a snapshot: none may be imported by `strata ls`, nor by
# building the parser of all commands (`strata --help`).
FORBIDDEN = (
    "aiohttp", "pyfuse3", "trio", "rich", "lmdb", "obstore", "zstandard", "asyncio",
    "http.client", "email", "concurrent.futures", "subprocess", "uuid", "urllib.parse",
    "shutil", "multiprocessing", "ssl", "hashlib",
    "strata.engine.local", "strata.engine.txn", "strata.engine.journal", "strata.engine.pack",
    "strata.engine.bucket", "strata.engine.tier", "strata.fsio", "strata.mount",
    "strata.run", "strata.server.app", "strata.server.serve", "strata.server.events",
    "strata.server.ui",
)

# What the fast path must not import either: what it exists to avoid.
FAST_FORBIDDEN = FORBIDDEN + (
    "argparse", "socket", "selectors", "typing", "dataclasses", "json", "gettext",
    "strata.cli.common", "strata.cli.parser", "strata.engine.objects",
    "strata.engine.tree", "strata.server",
)

# Every strata module the fast `strata ls` may import, and no more.
LS_FAST_MODULES = {
    "strata", "strata.cli", "strata.cli.main", "strata.cli.fastls", "strata.cli.show",
    "strata.engine", "strata.engine.errors", "strata.engine.kinds",
}

# All modules of a fast `strata ls`, the interpreter's own start-up included (60
# under `python -m` when this was written; `python -c pass` imports 25); `--json`
# adds the json package and what it imports (13 more).
LS_FAST_BUDGET = 63
LS_FAST_JSON_EXTRA = 15

# Every strata module the ordinary `strata ls` may import, and no more.
LS_STRATA_MODULES = {
    "strata", "strata.cli", "strata.cli.common", "strata.cli.main", "strata.cli.read",
    "strata.cli.parser", "strata.cli.show", "strata.cli.fastls", "strata.engine.kinds",
    "strata.engine", "strata.engine.errors", "strata.engine.names", "strata.engine.objects",
    "strata.engine.tree", "strata.engine.interface", "strata.engine.storedir",
    "strata.server", "strata.server.wire", "strata.server.client",
    "strata.workspace",  # is the snapshot a workspace? (one constant, one lookup)
}

# All modules, the interpreter's own start-up included (120 when this was written).
LS_MODULE_BUDGET = 125


def _env(store: Path) -> dict[str, str]:
    return {**os.environ, "STRATA_STORE": str(store)}


def _imported(args: list[str], env: dict[str, str]) -> tuple[set[str], str]:
    """The modules a `python -m strata ARGS` process imported, and its stdout."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "strata", *args],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    mods = set()
    for line in p.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                mods.add(name)
    assert "strata.cli.main" in mods  # the parse found real lines
    return mods, p.stdout


def _forbidden(mods: set[str]) -> list[str]:
    return sorted(m for m in mods
                  if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "store"
    env = _env(path)
    strata = [sys.executable, "-m", "strata"]
    subprocess.run([*strata, "init"], env=env, check=True, capture_output=True)
    subprocess.run([*strata, "volume", "create", "v"], env=env, check=True,
                   capture_output=True)
    subprocess.run([*strata, "put", "v", "dir/a.txt"], input=b"hello\n", env=env, check=True,
                   capture_output=True)
    yield path
    subprocess.run([*strata, "serve", "--stop"], env=env, capture_output=True)


def _forbidden_fast(mods: set[str], allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(m for m in mods
                  if any(m == f or m.startswith(f + ".") for f in FAST_FORBIDDEN)
                  and m.split(".")[0] not in allowed)


def test_fast_ls_import_budget(store: Path) -> None:
    for args in (["ls", "v"], ["ls", "-l", "v", "dir"], ["ls", "v", "--json"]):
        mods, out = _imported(args, _env(store))
        assert out.strip(), args
        assert _forbidden_fast(mods, ("json",) if "--json" in args else ()) == [], args
        assert {m for m in mods if m.split(".")[0] == "strata"} <= LS_FAST_MODULES, sorted(
            {m for m in mods if m.startswith("strata")} - LS_FAST_MODULES)
        budget = LS_FAST_BUDGET + (LS_FAST_JSON_EXTRA if "--json" in args else 0)
        assert len(mods) <= budget, (args, sorted(mods))


def _ordinary(store: Path) -> list[str]:
    """Global options that send `ls` down the ordinary path, to the same server."""
    return ["--server", f"unix:{store / 'serve.sock'}"]


def test_ls_import_budget(store: Path) -> None:
    mods, out = _imported([*_ordinary(store), "ls", "v"], _env(store))
    assert out.split() == ["dir"]
    assert _forbidden(mods) == []
    assert {m for m in mods if m.split(".")[0] == "strata"} <= LS_STRATA_MODULES, sorted(
        {m for m in mods if m.startswith("strata")} - LS_STRATA_MODULES)
    assert len(mods) <= LS_MODULE_BUDGET, sorted(mods)


# `strata run` hands the step to the step service (run/service.py): the client imports
# only the thin side (run/client.py), none of the runner, the mount or the store client.
RUN_FORBIDDEN = tuple(f for f in FORBIDDEN if f != "strata.run") + (
    "strata.run.runner", "strata.run.service", "strata.run.sandbox", "strata.run.spec",
    "strata.server.client", "strata.server.wire", "strata.engine.objects",
    "strata.engine.tree", "msgpack", "blake3", "ctypes", "threading", "socket", "selectors")
RUN_STRATA_MODULES = {
    "strata", "strata.cli", "strata.cli.common", "strata.cli.main", "strata.cli.run",
    # The parser and display helpers `strata.cli.main` used to hold (split out so
    # that `strata ls` can skip them), and the entry kinds they name.
    "strata.cli.parser", "strata.cli.show", "strata.engine.kinds",
    "strata.engine", "strata.engine.errors", "strata.engine.names", "strata.run",
    "strata.run.client", "strata.run.protocol",
}


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="steps need root and /dev/fuse")
def test_run_import_budget(store: Path, tmp_path: Path) -> None:
    env = {**_env(store), "STRATA_SCRATCH": str(tmp_path / "scratch"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # Without a sandbox the command runs in the directory holding the volumes.
    argv = ["run", "--sandbox", "none", "-v", "v", "--", "cat", "v/dir/a.txt"]
    warm = subprocess.run([sys.executable, "-m", "strata", *argv], env=env,
                          capture_output=True, text=True, timeout=120)
    assert warm.returncode == 0, warm.stderr  # the service is running from here on
    mods, out = _imported(argv, env)
    assert out == "hello\n"
    assert _forbidden_in(mods, RUN_FORBIDDEN) == []
    assert {m for m in mods if m.split(".")[0] == "strata"} <= RUN_STRATA_MODULES, sorted(
        {m for m in mods if m.startswith("strata")} - RUN_STRATA_MODULES)
    assert len(mods) <= LS_MODULE_BUDGET, sorted(mods)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="mounts need root and /dev/fuse")
def test_background_mount_import_budget(store: Path, tmp_path: Path) -> None:
    """`strata mount --background` asks the step service too: the same thin client."""
    env = {**_env(store), "STRATA_SCRATCH": str(tmp_path / "scratch"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    first, second = tmp_path / "m1", tmp_path / "m2"
    first.mkdir()
    second.mkdir()
    strata = [sys.executable, "-m", "strata"]
    try:
        warm = subprocess.run([*strata, "mount", "v", str(first), "--background"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert warm.returncode == 0, warm.stderr
        mods, out = _imported(["mount", "v", str(second), "--background"], env)
        assert out == f"mounted {second}\n"
        assert os.listdir(second) == ["dir"]
    finally:
        for m in (first, second):
            subprocess.run([*strata, "unmount", str(m), "--discard"], env=env,
                           capture_output=True, timeout=120)
    assert _forbidden_in(mods, RUN_FORBIDDEN) == []
    allowed = RUN_STRATA_MODULES - {"strata.cli.run"} | {"strata.cli.mount"}
    assert {m for m in mods if m.split(".")[0] == "strata"} <= allowed, sorted(
        {m for m in mods if m.startswith("strata")} - allowed)


def _forbidden_in(mods: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in mods if any(m == f or m.startswith(f + ".") for f in forbidden))


def test_ls_long_and_subdir_stay_in_budget(store: Path) -> None:
    mods, out = _imported([*_ordinary(store), "ls", "-l", "v", "dir"], _env(store))
    assert out.rstrip().endswith(" a.txt")
    assert _forbidden(mods) == []


def test_help_builds_every_parser_without_heavy_imports(store: Path) -> None:
    mods, out = _imported(["--help"], _env(store))
    for command in cliparser.COMMANDS:
        assert f"    {command} " in out or f"    {command}\n" in out, command
    assert _forbidden(mods) == []
    assert "strata.engine.objects" not in mods  # parsing needs no object code


def test_command_table_matches_the_modules() -> None:
    # The lazy parser registers only the module COMMANDS names: the table must agree
    # with what the modules register, or a command would vanish from its own parse.
    full = climain.build_parser()
    sub = next(a for a in full._actions if a.dest == "command")
    assert set(sub.choices) == set(cliparser.COMMANDS)  # type: ignore[arg-type]
    for command, module in cliparser.COMMANDS.items():
        assert module in cliparser.MODULES
        lazy = climain.build_parser(command)
        lazy_sub = next(a for a in lazy._actions if a.dest == "command")
        assert command in lazy_sub.choices  # type: ignore[operator]


@pytest.mark.parametrize(("argv", "command"), [
    (["ls", "v"], "ls"),
    (["--debug", "ls", "v"], "ls"),
    (["--store", "/x", "cat", "v", "p"], "cat"),
    (["--store=/x", "--token", "t", "volume", "list"], "volume"),
    (["--help"], None),
    (["--version"], None),
    (["-x", "ls"], None),
    ([], None),
    (["nosuchcommand"], "nosuchcommand"),
])
def test_command_of(argv: list[str], command: str | None) -> None:
    assert climain._command_of(argv) == command


def test_unknown_command_still_lists_the_choices(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "strata", "nosuchcommand"], capture_output=True,
                       text=True, env=_env(tmp_path / "none"), timeout=60)
    assert p.returncode == 2
    assert "invalid choice" in p.stderr and "'ls'" in p.stderr
