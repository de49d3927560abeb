"""A workspace attached through a fleet member: its store moves to that member.

(Short module and test names: a member's store socket lives under pytest's
directory for the test, and AF_UNIX paths are short.)
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fleetutil import Fleet

from bucketutil import Moto
from strata_harness import STRATA

sys_path = Path(__file__).resolve().parents[1] / "workspace"
MOVE_ENV = {"STRATA_FLEET_MOVE_WINDOW": "2", "STRATA_FLEET_MOVE_MIN": "20",
            "STRATA_FLEET_MOVE_COOLDOWN": "15"}


@pytest.fixture
def fleet(moto: Moto, fleet_url: str, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(fleet_url, tmp_path, {**moto.env(), **MOVE_ENV})
    try:
        yield f
    finally:
        f.close()


def _strata(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([*STRATA, *args], capture_output=True, text=True, timeout=180,
                       env={**os.environ, **env})
    assert p.returncode == 0, p.stderr
    return p


def _cleanup(root: Path) -> None:
    import sys
    sys.path.insert(0, str(sys_path))
    from ws_harness import cleanup
    cleanup(root)


def test_ws_moves(fleet: Fleet, tmp_path: Path) -> None:
    fleet.records.add_store("s", "bucket")
    for name in ("a", "b"):
        fleet.add(name)
    owner = fleet.owner("s", 60)
    here = next(n for n in fleet.members if n != owner)
    env = {"STRATA_FLEET": f"{fleet.members[here].addr},{fleet.members[owner].addr}",
           "STRATA_FLEET_STORE": "s", "STRATA_WORKSPACE_STATE": str(tmp_path / "state")}
    _strata(env, "workspace", "create", "ws", "--size", "1G")
    d = tmp_path / "w"
    d.mkdir()
    attached = False
    try:
        _strata(env, "workspace", "attach", "ws", str(d))
        attached = True
        listed = json.loads(_strata(env, "workspace", "list", "--json").stdout)
        assert any(w.get("attached") for w in listed), listed
        # Each write + fsync publishes through `here`, which forwards to the owner until
        # the store follows the work to it.
        i, deadline = 0, time.monotonic() + 90
        while fleet.records.lease("s").holder != here:  # type: ignore[union-attr]
            with open(d / f"f{i % 20}", "wb") as f:
                f.write(os.urandom(4096))
                f.flush()
                os.fsync(f.fileno())
            i += 1
            assert time.monotonic() < deadline, "the store did not move to the work" \
                + fleet.logs()
        fleet.owner("s", 60)
        # fsync goes on through the move and after it, with nothing lost.
        for j in range(20):
            with open(d / f"after{j}", "wb") as f:
                f.write(b"after %d\n" % j)
                f.flush()
                os.fsync(f.fileno())
        _strata(env, "workspace", "detach", str(d))
        attached = False
        e = tmp_path / "again"
        e.mkdir()
        _strata(env, "workspace", "attach", "ws", str(e))
        attached = True
        d = e
        assert [(e / f"after{j}").read_bytes() for j in range(20)] == \
            [b"after %d\n" % j for j in range(20)]
        assert len(list(e.glob("f*"))) == min(i, 20)
        print(f"moved to {here} after {i} fsyncs")
    finally:
        if attached:
            subprocess.run([*STRATA, "workspace", "detach", str(d)], capture_output=True,
                           env={**os.environ, **env}, timeout=120)
        _cleanup(tmp_path)
