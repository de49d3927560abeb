"""Fixtures for step tests (the harness itself is in run_harness.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_harness import StepEnv, mounts_under, wait_for


@pytest.fixture
def senv(tmp_path: Path) -> Iterator[StepEnv]:
    """A fresh store with a volume `v`; on teardown, nothing may be left mounted."""
    env = StepEnv(tmp_path)
    env.run("init")
    env.run("volume", "create", "v")
    yield env
    # A runner tears its mount down before it exits; one that was killed leaves it
    # to the mount process, which notices within a fraction of a second.
    clean = wait_for(lambda: env.leftovers() == ([], []), 5.0)
    left = env.leftovers()
    for mp in sorted(mounts_under(str(tmp_path)), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    env.run("serve", "--stop", rc=None)
    assert clean, f"left behind: mounts {left[0]}, scratch {left[1]}"
