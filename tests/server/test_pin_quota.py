"""Hardening II, finding 8: pins are bounded per token, and the owner's are out of reach.

A read-only token placed ~100,000 pins in under three seconds; after that the
owner's own `strata run -v victim` failed with "100000 pins are held". Now a
token holds at most TOKEN_PINS, all tokens together ALL_TOKEN_PINS, and the
owner's pins are counted apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serverutil import Server, cli, free_port
from strata.engine.errors import Unavailable
from strata.engine.gc import TOKEN_PINS
from strata.engine.local import init_store
from strata.server.client import RemoteStore


def test_a_token_cannot_exhaust_the_owners_pins(tmp_path: Path) -> None:
    store = tmp_path / "s"
    init_store(str(store))
    server = Server(store, tcp_port=free_port()).start()
    try:
        assert cli("volume", "create", "victim", store=store).returncode == 0
        assert cli("put", "victim", "f", "-m", "x", store=store, input=b"x").returncode == 0

        def token() -> str:
            p = cli("token", "create", "victim", "--ro", "--json", store=store)
            return str(json.loads(p.stdout)["token"])

        greedy = RemoteStore(server.tcp_url, token())
        head = greedy.head("victim", "live")
        held = 0
        with pytest.raises(Unavailable, match="this token holds"):
            for _ in range(TOKEN_PINS // 64 + 2):
                held += len(greedy.pin("victim", [head] * 64, 120))
        assert held == TOKEN_PINS
        # Another token has a quota of its own, and the owner pins as before.
        other = RemoteStore(server.tcp_url, token())
        assert len(other.pin("victim", [head], 120)) == 1
        owner = RemoteStore(server.unix_url)
        assert len(owner.pin("victim", [head] * 64, 120)) == 64
        for c in (greedy, other, owner):
            c.close()
    finally:
        server.stop()
