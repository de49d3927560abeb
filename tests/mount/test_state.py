"""A mount's state.json: what older strata wrote still loads, what is written now round-trips.

Until its settings became fields, MountState kept them in one free "extra"
object; a mount made before that (still mounted across an upgrade) must still
be found, committed and torn down.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from strata.mount.session import SWEEP_AFTER, sweep_abandoned_steps
from strata.mount.state import SETTINGS, MountState, VolumeState, find_mount, new_state

PINNED = "0" * 64


def _new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MountState:
    monkeypatch.setenv("STRATA_SCRATCH", str(tmp_path / "scratch"))
    (tmp_path / "mnt").mkdir()
    return new_state(str(tmp_path / "mnt"), "unix:/nowhere", [
        VolumeState("", "v", "live", PINNED, PINNED, published={"a": "d1"})], single=True,
        save=False)


def test_settings_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = _new(tmp_path, monkeypatch)
    st.token, st.store, st.keepalive, st.privileged = "strata_t", "/store", 2.5, True
    st.run, st.runner, st.stage, st.id_shift = "abc", 1234, "/stage", 100000
    st.rw, st.pgid = "rw", 4321
    st.save()
    raw = json.loads((Path(st.scratch) / "state.json").read_text())
    assert "extra" not in raw and raw["token"] == "strata_t" and raw["pgid"] == 4321
    assert MountState.load(st.scratch) == st
    assert find_mount(st.mountpoint) == st


def test_state_json_with_extra_still_loads(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    st = _new(tmp_path, monkeypatch)
    st.save()
    raw = json.loads((Path(st.scratch) / "state.json").read_text())
    for key in SETTINGS:
        del raw[key]
    # As the last strata with a free "extra" object wrote it (a step's mount).
    raw["extra"] = {"token": "strata_t", "run": "abc", "runner": 1234, "stage": "/stage",
                    "id_shift": 100000, "rw": "rw", "pgid": 4321}
    (Path(st.scratch) / "state.json").write_text(json.dumps(raw))
    old = MountState.load(st.scratch)
    assert (old.token, old.run, old.runner, old.stage, old.id_shift, old.rw, old.pgid) == (
        "strata_t", "abc", 1234, "/stage", 100000, "rw", 4321)
    assert old.is_step and not old.privileged and old.store == "" and old.keepalive == 0.0
    assert old.upper(old.volumes[0]) == f"{st.scratch}/rw/upper/_"
    assert old.volumes[0].published == {"a": "d1"}
    # A plain `strata mount`: only how it reaches its store.
    raw["extra"] = {"token": None, "privileged": True, "store": "/store", "keepalive": 60.0}
    (Path(st.scratch) / "state.json").write_text(json.dumps(raw))
    old = MountState.load(st.scratch)
    assert not old.is_step and old.privileged and old.keepalive == 60.0
    assert old.store == "/store" and old.token is None
    assert find_mount(st.mountpoint).id == st.id


def test_sweep_takes_a_dead_steps_scratch_only(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    p = subprocess.Popen(["true"])  # the runner: a pid that is gone
    p.wait()
    plain = _new(tmp_path, monkeypatch)
    plain.pid = 0
    plain.save()
    step = new_state(str(tmp_path / "mnt"), "unix:/nowhere", [], single=False, save=False)
    step.pid, step.run, step.runner = 0, "abc", p.pid
    step.save()
    # Written before the settings were fields, and left by a runner that died too.
    old = new_state(str(tmp_path / "mnt"), "unix:/nowhere", [], single=False, save=False)
    old.pid = 0
    old.save()
    raw = json.loads((Path(old.scratch) / "state.json").read_text())
    for key in SETTINGS:
        del raw[key]
    raw["extra"] = {"run": "def", "runner": p.pid}
    (Path(old.scratch) / "state.json").write_text(json.dumps(raw))
    long_ago = os.stat(plain.scratch).st_mtime - SWEEP_AFTER - 60
    for st in (plain, step, old):
        os.utime(Path(st.scratch) / "state.json", (long_ago, long_ago))
    assert sorted(sweep_abandoned_steps()) == sorted([step.scratch, old.scratch])
    assert os.path.isdir(plain.scratch)
