"""A mount moves onto new snapshots: after a commit (onto what it published) and on reload.

After a commit the mount stayed on its old snapshot, so its upper directory
kept everything ever written, and `status` and `commit` looked at all of it.
"""

from __future__ import annotations

import json
import os
import subprocess

from mount_harness import MountEnv, strata_mounts

MANY = 600  # above mount/move.py's MOVE_AFTER


def _upper_files(menv: MountEnv) -> int:
    scratch = menv.root / "scratch"
    return sum(len(files) for d in scratch.iterdir() if (d / "upper").is_dir()
               for _p, _d, files in os.walk(d / "upper"))


def test_a_commit_moves_the_mount_onto_what_it_published(menv: MountEnv) -> None:
    menv.run("volume", "create", "v")
    m = menv.mount("v")
    for i in range(MANY):
        (m / f"f{i}").write_text(f"{i}\n")
    out = json.loads(menv.run("commit", str(m), "--json").stdout)
    assert out["moved"] is True and out["changed"] == MANY + 1
    assert _upper_files(menv) == 0  # the published files left the upper directory
    assert (m / "f7").read_text() == "7\n" and len(os.listdir(m)) == MANY
    assert len([p for p in strata_mounts(str(menv.root)) if "lower" in p]) == 1
    (m / "f7").write_text("seven\n")
    st = json.loads(menv.run("status", str(m), "--json").stdout)
    assert st["uncommitted"] == ["", "f7"] or st["uncommitted"] == ["f7"], st
    assert len(st["changes"]) <= 2 and st["pinned"] == out["published"]["v"]
    out2 = json.loads(menv.run("commit", str(m), "--json").stdout)
    assert out2["read"]["files"] == 1 and out2["moved"] is False  # a small commit stays
    assert menv.run("cat", "v", "f7").stdout == "seven\n"
    menv.unmount(m)  # nothing uncommitted: the moved mount unmounts cleanly
    assert strata_mounts(str(menv.root)) == []


def test_a_mount_in_use_stays_and_says_why(menv: MountEnv) -> None:
    menv.run("volume", "create", "v")
    m = menv.mount("v")
    for i in range(MANY):
        (m / f"f{i}").write_text(f"{i}\n")
    holder = subprocess.Popen(["sleep", "60"], cwd=m)
    try:
        out = json.loads(menv.run("commit", str(m), "--json").stdout)
        assert out["moved"] is False and f"{holder.pid} (sleep)" in out["stayed"]
        (m / "after").write_text("still writable\n")  # the refused move left it read-write
    finally:
        holder.kill()
        holder.wait()
    menv.run("reload", str(m))
    assert (m / "after").read_text() == "still writable\n"
    assert _upper_files(menv) == 1  # only the uncommitted file moved along


def test_reload_keeps_uncommitted_changes_and_shows_the_head(menv: MountEnv) -> None:
    menv.run("volume", "create", "v")
    for name in ("a", "b", "c"):
        menv.run("put", "v", name, input=f"{name}\n")
    m = menv.mount("v")
    (m / "a").write_text("mine\n")
    (m / "b").unlink()
    (m / "d" / "e").mkdir(parents=True)
    (m / "d" / "e" / "f").write_text("new\n")
    os.chmod(m / "d", 0o700)
    menv.run("put", "v", "theirs", input="theirs\n")  # someone else published meanwhile
    head = menv.run("log", "v", "-n", "1", "--json").stdout
    menv.run("reload", str(m))
    assert (m / "theirs").read_text() == "theirs\n"  # the head's change shows
    assert (m / "a").read_text() == "mine\n" and not (m / "b").exists()
    assert (m / "d" / "e" / "f").read_text() == "new\n"
    assert os.stat(m / "d").st_mode & 0o777 == 0o700
    st = json.loads(menv.run("status", str(m), "--json").stdout)
    assert json.loads(head)[0]["id"] == st["pinned"]
    assert {"a", "b", "d", "d/e", "d/e/f"} <= set(st["uncommitted"])
    assert "theirs" not in st["uncommitted"]
    menv.run("commit", str(m), "-m", "mine")
    assert menv.run("cat", "v", "theirs").stdout == "theirs\n"
    assert menv.run("cat", "v", "a").stdout == "mine\n"


def test_reload_refuses_paths_changed_on_both_sides_and_changes_nothing(menv: MountEnv) -> None:
    menv.run("volume", "create", "v")
    menv.run("put", "v", "f", input="base\n")
    m = menv.mount("v")
    (m / "f").write_text("mine\n")
    menv.run("put", "v", "f", input="theirs\n")
    p = menv.run("reload", str(m), rc=3)
    assert "f" in p.stderr.splitlines()
    assert (m / "f").read_text() == "mine\n"
    (m / "g").write_text("writable still\n")
