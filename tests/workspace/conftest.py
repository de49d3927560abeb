"""Fixtures for workspace tests: a served store, and workspaces always detached."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ws_harness import WsEnv, cleanup

from serverutil import Server


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
