"""Smoke test of the day benchmark (bench/day.py) on its two rungs that need no FUSE.

The harness runs as `make day` runs it, as a program, with tiny sizes: the
local disk and "upload at stop" (tar + zstd to a moto bucket on loopback).
The assertions are about the shape of the results and what each rung must
show, never about time: the local disk keeps every acknowledged byte (its
"host kill" resumes on the same disk), and upload at stop loses everything
acknowledged since the last stop, which the day never reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FSYNCS = 10


def test_day_smoke_local_and_upload_at_stop(tmp_path: Path) -> None:
    out = tmp_path / "day.json"
    env = {**os.environ, "DAY_RUNGS": "local,upload", "DAY_REPO_FILES": "40", "DAY_NPM": "0",
           "DAY_FSYNC_ITERS": str(FSYNCS), "DAY_STEP_TIMEOUT": "30"}
    p = subprocess.run([sys.executable, "-m", "bench.day", "--dir", str(tmp_path),
                        "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "local disk" in p.stdout and "upload at stop" in p.stdout  # the table printed
    rows = {r["rung"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"local", "upload"}
    assert not [d for d in tmp_path.iterdir() if d.name.startswith("strata-day-")], \
        "the harness left its work directory behind"

    local = rows["local"]
    assert local["errors"] == {}, local["errors"]
    f = local["figures"]
    for key in ("clone_s", "commit_s", "sync_s", "fsync_p50_ms", "fsync_p99_ms", "resume_s",
                "fork_s", "fork_cmd_s", "cold_attach_s"):
        assert f[key] >= 0, key
    assert f["fsync_p50_ms"] <= f["fsync_p99_ms"]
    assert f["acked_bytes"] > FSYNCS * 4096  # the fsync log and the synced workspace
    assert f["lost_bytes"] == 0 and f["commit_survived"] is True
    assert f["bucket_bytes"] is None and local["baseline"] is None

    up = rows["upload"]
    g = up["figures"]
    # The same day: the same files, give or take git's own (its objects hold timestamps).
    assert abs(g["acked_bytes"] - f["acked_bytes"]) < f["acked_bytes"] // 100
    assert g["lost_bytes"] == g["acked_bytes"] > 0  # nothing was uploaded before the kill
    assert g["commit_survived"] is False
    assert "resume_s" not in g and "gone" in up["errors"]["resume"]
    # The rest of the day ran on the redone morning: forks from the bucket, a cold attach.
    assert set(up["errors"]) == {"resume"}, up["errors"]
    assert g["fork_prep_s"] > 0 and g["fork_s"] > 0 and g["cold_attach_s"] > 0
    assert g["bucket_bytes"] > 0
    assert up["baseline"]["lost_bytes"] == 0  # the local disk's figures ride along
