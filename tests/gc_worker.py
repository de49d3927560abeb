"""A process that publishes and collects garbage in a loop, to be SIGKILLed (test_gc_kill.py).

Each publish rewrites a few files with versioned contents and a manifest
naming each file's version; a GC pass (min age 0, keep the last 2
snapshots) runs after every few publishes. It prints "ack N" after each
acknowledged publish.
"""

from __future__ import annotations

import random
import sys

from strata.engine.local import LocalStore
from strata.engine.txn import Transaction

PATHS = [f"f{i}" for i in range(6)]


def content(path: str, version: int) -> bytes:
    size = (3_000, 70_000, 300_000)[version % 3]
    return random.Random(f"{path}:{version}").randbytes(size)


def main() -> None:
    store_dir, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    with LocalStore(store_dir) as s:
        if "v" not in s.list_volumes():
            s.create_volume("v")
            s.policies.set("v", None, keep_last=2)
        n = 0
        while True:
            t = Transaction(s, "v")
            try:
                manifest = dict(line.split("=") for line in t.read("manifest").decode().split())
            except Exception:  # noqa: BLE001 - the first publish
                manifest = {}
            for path in rng.sample(PATHS, 2):
                v = rng.randrange(6)  # versions repeat: publishes dedup against garbage
                t.write(path, content(path, v))
                manifest[path] = str(v)
            t.write("manifest", " ".join(f"{k}={v}" for k, v in sorted(manifest.items())).encode())
            t.commit()
            n += 1
            print(f"ack {n}", flush=True)
            if n % 3 == 0:
                s.gc(min_age=0)


if __name__ == "__main__":
    main()
