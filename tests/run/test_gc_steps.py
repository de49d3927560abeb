"""Garbage collection in a loop while steps read and write the same volume.

The volume keeps only its last snapshot, and `strata gc --min-age 0` runs
over and over, so every step's base is superseded and unkept within
moments. Steps pin their base through the server while they run: each one
reads files of its base (and a big one) byte for byte, writes its own file,
and publishes. None may fail or see wrong bytes.
"""

from __future__ import annotations

import hashlib
import os
import threading

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
                     for _ in range(4)]
            results += [finish(p) for p in steps]
    finally:
        stop.set()
        gc.join(60)
    assert [r.rc for r in results] == [0] * len(results), [
        (r.rc, r.stderr[-500:]) for r in results if r.rc]
    assert len(passes) >= 3
    names = senv.run("ls", "v").stdout.split()
    assert len([n for n in names if n.startswith("w")]) == len(results)
    senv.run("fsck")  # exit 0: clean
