"""What a new user hit on mounts (each failed before its fix)."""

from __future__ import annotations

import json

from mount_harness import MountEnv


def test_commit_json_reports_a_conflict_on_stdout(menv: MountEnv) -> None:
    menv.run("volume", "create", "v")
    menv.run("put", "v", "f", "-m", "base", input="base\n")
    m = menv.mount("v")
    (m / "f").write_text("mine\n")
    menv.run("put", "v", "f", "-m", "theirs", input="theirs\n")
    p = menv.run("commit", str(m), "--json", rc=3)
    out = json.loads(p.stdout)
    assert out["conflicts"] == ["f"] and out["published"] == {}
