"""Mount, change, commit, remount elsewhere: the basic life of a writable mount."""

from __future__ import annotations

import os
from pathlib import Path

from mount_harness import MountEnv


def test_mount_commit_and_see_it_elsewhere(menv: MountEnv, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a").write_text("hello\n")
    (src / "big").write_bytes(os.urandom(300_000))
    menv.run("volume", "create", "v")
    menv.run("import", "v", str(src))
    m = menv.mount("v")
    assert (m / "d" / "a").read_text() == "hello\n"
    with open(m / "d" / "a", "a") as f:
        f.write("world\n")
    (m / "new").mkdir()
    (m / "new" / "f").write_text("x")
    (m / "big").unlink()
    os.rename(m / "d", m / "d2")
    status = menv.run("status", str(m)).stdout
    assert "d2/a" in status and "big" in status
    head = menv.run("commit", str(m), "-m", "change").stdout.strip()
    assert len(head) == 64
    assert menv.run("cat", "v", "d2/a").stdout == "hello\nworld\n"
    assert menv.run("cat", "v", "new/f").stdout == "x"
    assert menv.run("cat", "v", "big", rc=4).returncode == 4
    assert menv.run("cat", "v", "d/a", rc=4).returncode == 4
    # The mount keeps its view; a second mount of the new head sees the change.
    other = menv.mount("v", "m2")
    assert (other / "d2" / "a").read_text() == "hello\nworld\n"
    assert not (other / "big").exists()
    menv.unmount(other)
    # Unmount refuses to drop uncommitted changes.
    (m / "more").write_text("y")
    p = menv.unmount(m, rc=None)
    assert p.returncode != 0 and "uncommitted" in p.stderr
    menv.run("commit", str(m))
    menv.unmount(m)
    assert menv.run("cat", "v", "more").stdout == "y"


def test_readonly_mount_refuses_writes(menv: MountEnv) -> None:
    menv.run("volume", "create", "v")
    menv.run("put", "v", "f", input="data")
    m = menv.mount("v", "ro", "--ro")
    assert (m / "f").read_text() == "data"
    try:
        (m / "g").write_text("x")
        raise AssertionError("write to a read-only mount succeeded")
    except OSError as exc:
        assert exc.errno == 30  # EROFS
    menv.unmount(m)
