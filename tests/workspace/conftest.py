"""Fixtures for workspace tests: a served store, and workspaces always detached."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ws_harness import WsEnv, cleanup

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serverutil import Server  # noqa: E402


@pytest.fixture
def wsenv(tmp_path: Path) -> Iterator[WsEnv]:
    env = WsEnv(tmp_path)
    env.run("init")
    server = Server(env.store).start()
    try:
        yield env
        for d in list(env.attached):
            env.run("workspace", "detach", str(d), rc=None)
    finally:
        cleanup(tmp_path)
        server.stop()
