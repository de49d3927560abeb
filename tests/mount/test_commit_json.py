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


def test_status_after_a_commit_lists_only_what_is_uncommitted(menv: MountEnv) -> None:
    """It printed '0 uncommitted path(s)', then every path ever written as 'changed'."""
    menv.run("volume", "create", "v")
    m = menv.mount("v")
    for i in range(3):
        (m / f"f{i}").write_text(f"{i}\n")
    menv.run("commit", str(m), "-m", "three")
    out = menv.run("status", str(m)).stdout.splitlines()
    assert out[0].endswith("0 uncommitted path(s)") and len(out) == 2, out
    # The three files, and the root directory whose mtime they changed.
    assert out[1] == "(4 other path(s) written since the mount are committed)"
    (m / "new").write_text("x\n")
    out = menv.run("status", str(m)).stdout.splitlines()
    assert ["changed", "new"] in [ln.split() for ln in out], out
    assert not any(ln.split()[-1:] == ["f0"] for ln in out), out  # committed: not listed
