"""`strata gc` shows its progress on a terminal, and nothing when stderr is not one.

Through the server (the default) the pass runs there and says nothing until it
ends: the bar shows that it goes on and for how long. In process
(STRATA_IN_PROCESS=1) the engine reports each phase as it starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ttyutil import drawn_on_a_terminal

STRATA = [sys.executable, "-m", "strata"]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "store"
    subprocess.run([*STRATA, "--store", str(path), "init"], check=True, capture_output=True)
    subprocess.run([*STRATA, "--store", str(path), "volume", "create", "v"], check=True,
                   capture_output=True)
    for _ in range(3):  # garbage: each put replaces the file
        subprocess.run([*STRATA, "--store", str(path), "put", "v", "f"], check=True,
                       input=os.urandom(100_000), capture_output=True)
    yield path
    subprocess.run([*STRATA, "--store", str(path), "serve", "--stop"], capture_output=True)


def test_gc_through_the_server_draws_on_a_terminal_only(store: Path) -> None:
    gc = [*STRATA, "--store", str(store), "gc", "--min-age", "0"]
    piped = subprocess.run(gc, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert piped.stdout.startswith("gc: ")
    rc, drawn = drawn_on_a_terminal(gc)
    assert rc == 0
    assert b"garbage collection (in the server)" in drawn, drawn[-500:]


def test_gc_in_process_draws_its_phases(store: Path) -> None:
    subprocess.run([*STRATA, "--store", str(store), "serve", "--stop"], check=True,
                   capture_output=True)
    env = {**os.environ, "STRATA_IN_PROCESS": "1"}
    gc = [*STRATA, "--store", str(store), "gc", "--min-age", "0"]
    piped = subprocess.run(gc, capture_output=True, text=True, timeout=120, env=env)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    rc, drawn = drawn_on_a_terminal(gc, env)
    assert rc == 0
    assert b"4/4" in drawn, drawn[-500:]  # every phase of the pass, counted


def test_serve_stop_draws_on_a_terminal_only(store: Path) -> None:
    stop = [*STRATA, "--store", str(store), "serve", "--stop"]
    subprocess.run([*STRATA, "--store", str(store), "ls", "v"], check=True,
                   capture_output=True)  # a server to stop
    rc, drawn = drawn_on_a_terminal(stop)
    assert rc == 0 and b"stopping" in drawn and b"stopped" in drawn, drawn[-500:]
    subprocess.run([*STRATA, "--store", str(store), "ls", "v"], check=True,
                   capture_output=True)
    piped = subprocess.run(stop, capture_output=True, text=True, timeout=60)
    assert (piped.returncode, piped.stderr) == (0, "stopped\n")
