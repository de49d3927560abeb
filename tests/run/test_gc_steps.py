"""Garbage collection in a loop while 8 steps at a time and 2 mounts use the same volume.

The volume keeps only its last snapshot, and `strata gc --min-age 0` runs
over and over, so every step's base is superseded and unkept within
moments. Steps pin their base through the server while they run: each one
reads files of its base (and a big one) byte for byte, writes its own file,
and publishes. Two read-only mounts of the first snapshot are read the whole
time. None may fail or see wrong bytes.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

from run_harness import StepEnv, finish


def test_steps_run_while_gc_collects_in_a_loop(senv: StepEnv) -> None:
    big = os.urandom(3_000_000)
    src = senv.root / "big.bin"
    src.write_bytes(big)
    senv.run("put", "v", "big.bin", "--from", str(src))
    senv.run("put", "v", "small", input="small\n")
    senv.run("policy", "set", "v", "--keep-last", "1")
    digest = hashlib.sha256(big).hexdigest()
    stop = threading.Event()
    passes: list[int] = []
    mounts = []
    for name in ("m1", "m2"):
        target = senv.root / name
        target.mkdir()
        senv.run("mount", "v", str(target), "--ro", "--background")
        deadline = time.monotonic() + 10
        while not os.path.ismount(target) and time.monotonic() < deadline:
            time.sleep(0.02)
        mounts.append(target)
    mount_errors: list[str] = []

    def read_mounts() -> None:
        while not stop.is_set():
            for target in mounts:
                fd = os.open(target / "big.bin", os.O_RDONLY)
                try:  # not from the page cache: through the mount each time
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                if (target / "big.bin").read_bytes() != big:
                    mount_errors.append(f"{target}: wrong bytes")
                if (target / "small").read_bytes() != b"small\n":
                    mount_errors.append(f"{target}: wrong small")
            time.sleep(0.1)

    reader = threading.Thread(target=read_mounts, daemon=True)
    reader.start()

    def collect() -> None:
        while not stop.is_set():
            senv.run("gc", "--min-age", "0", "--json")
            passes.append(1)

    gc = threading.Thread(target=collect, daemon=True)
    gc.start()
    try:
        results = []
        for wave in range(3):
            steps = [senv.start_step(["v"], ["sh", "-c",
                     'sleep 0.3; d="$STRATA_STORAGE/v"; '
                     f'[ "$(sha256sum < "$d/big.bin" | cut -c1-64)" = "{digest}" ] || exit 7; '
                     '[ "$(cat "$d/small")" = small ] || exit 8; '
                     f'echo {wave}-$$ > "$d/w{wave}-$$"'])
                     for _ in range(8)]
            results += [finish(p) for p in steps]
    finally:
        stop.set()
        gc.join(60)
        reader.join(60)
        for target in mounts:
            senv.run("unmount", str(target))
    assert [r.rc for r in results] == [0] * len(results), [
        (r.rc, r.stderr[-500:]) for r in results if r.rc]
    assert len(passes) >= 3
    assert not mount_errors, mount_errors[:3]
    names = senv.run("ls", "v").stdout.split()
    assert len([n for n in names if n.startswith("w")]) == len(results)
    senv.run("fsck")  # exit 0: clean
