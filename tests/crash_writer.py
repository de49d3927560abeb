"""The writer process of tests/test_crash.py: publishes in a loop until killed.

Usage: python crash_writer.py STORE RUN THREADS

With STRATA_TEST_NO_FSYNC=1 in the environment, fsync and fdatasync do
nothing in this process: the power-cut test uses it to show that it catches
a store that acknowledges before its data is durable.

Each thread publishes one new file per commit to branch ``live`` of volume
``v`` (under ``t<thread>/r<run>/``; ``t<thread>`` is made by the test) and, once
`commit` has returned, prints ``ack <thread> <run> <n> <snapshot id>`` and
flushes, so every printed line is a publish the store acknowledged as
durable. Content is a pure function of the path, so the test can check
every file it finds, acknowledged or not.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import blake3

from strata.engine.local import LocalStore, StoreConfig
from strata.engine.txn import Transaction

# Mostly small files (inline, or one or two blocks), now and then one of several blocks.
SIZES = [1, 300, 700, 2000, 4096, 4097, 5000, 9000, 20_000, 70_000]


def path_of(thread: int, run: int, n: int) -> str:
    return f"t{thread}/r{run}/{n}"


BIG = 5_000_000  # over the 4 MiB a publish carries: uploaded ahead with put_objects


def content_of(path: str) -> bytes:
    n = BIG if path.endswith(".big") else (
        SIZES[blake3.blake3(path.encode()).digest()[0] % len(SIZES)])
    return blake3.blake3(path.encode()).digest(length=n)


def main() -> None:
    store_dir, run, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if os.environ.get("STRATA_TEST_NO_FSYNC") == "1":
        os.fsync = os.fdatasync = lambda fd: None
    # Every Nth file is 5 MB, so its blocks are uploaded ahead of the publish
    # (put_objects, not yet durable) and the publish that names them must make them so.
    big_every = int(os.environ.get("STRATA_TEST_BIG_EVERY", "0"))
    # Small packs and a short age limit: seals and new packs happen between kills.
    store = LocalStore(store_dir, StoreConfig(pack_size_limit=512 * 1024, pack_age_limit=0.2,
                                              lock_timeout=10))
    out = threading.Lock()

    def loop(thread: int) -> None:
        try:
            for n in range(1_000_000):
                path = path_of(thread, run, n)
                if big_every and n % big_every == big_every - 1:
                    path += ".big"
                t = Transaction(store, "v")
                if n == 0:
                    t.mkdir(path.rpartition("/")[0])
                t.write(path, content_of(path), mtime_ns=0)
                sid = t.commit(f"{path}")
                with out:
                    sys.stdout.write(f"ack {thread} {run} {n} {sid} {path}\n")
                    sys.stdout.flush()
                time.sleep(0.002)  # fewer, not slower, publishes: keeps the store small
        except BaseException as exc:  # noqa: BLE001 - any failure ends the process loudly
            sys.stderr.write(f"writer thread {thread} failed: {exc!r}\n")
            sys.stderr.flush()
            os._exit(3)

    workers = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


if __name__ == "__main__":
    main()
