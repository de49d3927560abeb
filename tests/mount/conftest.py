"""Fixtures for mount tests (the harness itself is in mount_harness.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from mount_harness import MountEnv, strata_mounts


@pytest.fixture
def menv(tmp_path: Path) -> Iterator[MountEnv]:
    env = MountEnv(tmp_path)
    env.run("init")
    yield env
    for target in list(env.mounts):
        env.run("unmount", str(target), "--discard", rc=None)
    for mp in sorted(strata_mounts(str(tmp_path)), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    env.run("serve", "--stop", rc=None)
    left = strata_mounts(str(tmp_path))
    assert not left, f"mounts left behind: {left}"
