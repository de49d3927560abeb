"""`strata ls` on its fast path (cli/fastls.py) prints exactly what the ordinary path prints.

Real processes against a real store and its server: every listing is made
twice, once as typed (the fast path: one `list` on the lean stream) and once
with `--server` naming the same server's socket, which the fast path leaves
to argparse and the tree code (the ordinary path). The two must agree byte
for byte, errors and exit codes included.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from strata import workspace
from strata.cli import fastls
from strata.server import wire
from strata.server.client import SOCKET_NAME
from strata_harness import STRATA

ODD = "caf\udce9 \"q\"\t.txt"  # a byte that is not UTF-8, a quote, a tab


def _env(store: Path) -> dict[str, str]:
    env = {**os.environ, "STRATA_STORE": str(store)}
    for name in ("STRATA_SERVER", "STRATA_TOKEN", "STRATA_IN_PROCESS"):
        env.pop(name, None)
    return env


def _run(store: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*STRATA, *args], env=_env(store), capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One store for the module (read only, but for a volume of the last test's own)."""
    tmp_path = tmp_path_factory.mktemp("fastls")
    path = tmp_path / "store"
    src = tmp_path / "src"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "sub" / "a.txt").write_bytes(b"a" * 10)
    (src / "big").write_bytes(os.urandom(200_000))
    (src / "small").write_bytes(b"hello\n")
    os.link(src / "small", src / "hardlink")
    os.symlink("sub/a.txt", src / "link")
    os.mkfifo(src / "fifo")
    os.chmod(src / "big", 0o4751)
    os.setxattr(src / "small", "user.note", b"caf\xe9")
    (src / os.fsencode(ODD).decode("utf-8", "surrogateescape")).write_bytes(b"odd")
    assert _run(path, "init").returncode == 0
    assert _run(path, "volume", "create", "v").returncode == 0
    assert _run(path, "import", "v", str(src), "-m", "tree").returncode == 0
    yield path
    _run(path, "serve", "--stop")


def _both(store: Path, *args: str) -> tuple[subprocess.CompletedProcess[bytes],
                                             subprocess.CompletedProcess[bytes]]:
    fast = _run(store, *args)
    ordinary = _run(store, "--server", f"unix:{store / SOCKET_NAME}", *args)
    return fast, ordinary


@pytest.mark.parametrize("args", [
    ["ls", "v"],
    ["ls", "-l", "v"],
    ["ls", "v", "--json"],
    ["ls", "v", "sub"],
    ["ls", "-l", "v", "sub/a.txt"],
    ["ls", "v", "link", "--json"],
    ["ls", "--json", "v", "small"],
    ["ls", "v", "empty"],
    ["ls", "v@live", "-l"],
    ["--debug", "ls", "v", "sub/deeper"],
    ["ls", "v", '"caf\\351 \\"q\\"\\t.txt"'],  # the quoted form the CLI shows
    ["ls", "v", "nosuch"],           # not found: exit 4
    ["ls", "nosuchvolume"],
    ["ls", "v@nosuchbranch"],
    ["ls", "v#0000000000"],           # no such snapshot
    ["ls", "v#xyz"],                  # not a snapshot prefix: exit 2
    ["ls", "bad/name"],
    ["ls", "v", "../x"],
])
def test_fast_and_ordinary_ls_agree(store: Path, args: list[str]) -> None:
    fast, ordinary = _both(store, *args)
    assert (fast.returncode, fast.stdout, fast.stderr) == (
        ordinary.returncode, ordinary.stdout, ordinary.stderr)
    if args[-1] in ("v", "-l") and "v@live" not in args:
        assert fast.returncode == 0 and fast.stdout


def test_snapshot_refs_and_the_store_option(store: Path) -> None:
    head = _run(store, "log", "v", "--json").stdout
    sid = head.split(b'"id": "')[1][:12].decode()
    fast, ordinary = _both(store, "ls", "-l", f"v#{sid}")
    assert fast.returncode == 0 and fast.stdout == ordinary.stdout
    env = _env(store)
    del env["STRATA_STORE"]
    p = subprocess.run([*STRATA, "--store", str(store), "ls", "v", "sub"], env=env,
                       capture_output=True, timeout=60)
    assert p.returncode == 0 and p.stdout == b"a.txt\ndeeper\n"
    p = subprocess.run([*STRATA, "ls", f"--store={store}", "v", "sub"], env=env,
                       capture_output=True, timeout=60)
    assert p.returncode == 0 and p.stdout == b"a.txt\ndeeper\n"


def test_fast_path_declines_what_it_does_not_do(store: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_STORE", str(store))
    for name in ("STRATA_SERVER", "STRATA_TOKEN", "STRATA_IN_PROCESS"):
        monkeypatch.delenv(name, raising=False)
    assert fastls.run(["ls", "v", "sub"]) == 0  # it is taken when it can be
    assert fastls.run(["ls", "v", "nosuch"]) is None  # errors: the ordinary path says them
    assert fastls.run(["ls", "-a", "v"]) is None  # an option it does not know
    assert fastls.run(["ls", "v", "sub", "more"]) is None
    assert fastls.run(["ls"]) is None
    assert fastls.run(["ls", "--server", "unix:/nowhere", "v"]) is None
    monkeypatch.setenv("STRATA_TOKEN", "strata_x_y")
    assert fastls.run(["ls", "v"]) is None
    monkeypatch.delenv("STRATA_TOKEN")
    # A workspace volume lists the files inside its device: the ordinary path's job.
    assert _run(store, "volume", "create", "w").returncode == 0
    assert fastls.run(["ls", "w"]) == 0
    put = subprocess.run([*STRATA, "put", "w", workspace.LAYOUT_PATH], input=b"{}",
                         env=_env(store), capture_output=True, timeout=60)
    assert put.returncode == 0
    assert fastls.run(["ls", "w"]) is None
    # No server answering: the ordinary path starts one.
    monkeypatch.setenv("STRATA_STORE", str(store.parent / "elsewhere"))
    assert fastls.run(["ls", "v"]) is None


def test_constants_match_the_server() -> None:
    assert fastls.SOCKET == SOCKET_NAME + wire.LEAN_SUFFIX
    assert fastls.WORKSPACE_LAYOUT == workspace.LAYOUT_PATH
    assert fastls.MAX_ANSWER == wire.MAX_BODY
