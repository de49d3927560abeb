"""A mount pins the snapshot its lower view shows: garbage collection leaves it alone.

The volume keeps only its last snapshot and moves on twice; `gc --min-age 0`
runs twice (empty packs go one pass later). The read-only mount of the old
snapshot still reads every byte, since cold (nothing cached before the
passes). After the unmount the pin is released and the snapshot goes.
"""

from __future__ import annotations

import os
from pathlib import Path

from mount_harness import MountEnv


def test_a_mounted_snapshot_survives_garbage_collection(menv: MountEnv, tmp_path: Path) -> None:
    menv.run("volume", "create", "v")
    big = os.urandom(2_000_000)
    src = tmp_path / "big.bin"
    src.write_bytes(big)
    old = menv.run("put", "v", "big.bin", "--from", str(src)).stdout.strip()
    target = menv.mount(f"v#{old}", "m", "--ro")
    menv.run("policy", "set", "v", "--keep-last", "1")
    for _ in range(2):
        src.write_bytes(os.urandom(2_000_000))
        menv.run("put", "v", "big.bin", "--from", str(src))
    for _ in range(2):
        menv.run("gc", "--min-age", "0")
    assert (target / "big.bin").read_bytes() == big
    menv.unmount(target)
    for _ in range(2):
        menv.run("gc", "--min-age", "0")
    p = menv.run("cat", f"v#{old}", "big.bin", rc=4)
    assert "expired" in p.stderr
