"""A steady client for the handoff tests: publishes and reads until told to stop.

Run as a process (`python handoff_client.py --url unix:S/serve.sock --client 0
--stop FILE`). Each round publishes one new small file at its own path
(`c<client>-<n>`) through a `Transaction` on the remote store and reads back
an earlier file of its own. Every acknowledged publish is printed, flushed,
as `ACK <snapshot> <path> <sha256>`, so the test can check afterwards that
each one is in the store. A failed call prints `ERR <op> <error>` and is
counted; the last line is `DONE publishes=N reads=N errors=N max_wait_ms=N`
(the slowest call, i.e. the longest a handoff made this client wait). The
exit status is 0 only when no call failed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time

from strata.engine.errors import StrataError
from strata.engine.txn import Transaction
from strata.server.client import RemoteStore


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="unix:PATH or http://HOST:PORT")
    ap.add_argument("--token", default=None)
    ap.add_argument("--volume", default="v")
    ap.add_argument("--branch", default="live")
    ap.add_argument("--client", type=int, required=True)
    ap.add_argument("--stop", required=True, help="stop once this file exists")
    ap.add_argument("--pause", type=float, default=0.005, help="seconds between rounds")
    args = ap.parse_args()
    rng = random.Random(args.client)
    store = RemoteStore(args.url, args.token, retry_for=30.0, timeout=30.0)
    written: list[tuple[str, str]] = []
    publishes = reads = errors = 0
    max_wait = 0.0
    txn: Transaction | None = None
    n = 0
    while not os.path.exists(args.stop):
        # Publish: a new file (inline or one block) at a path of this client's own.
        path = f"c{args.client}-{n:05d}"
        data = rng.randbytes(rng.choice((100, 3000, 9000))) + path.encode()
        t0 = time.monotonic()
        try:
            if txn is None:
                txn = Transaction(store, args.volume, args.branch)
            txn.write(path, data)
            sid = txn.commit(f"client {args.client} round {n}")
        except (StrataError, OSError) as exc:
            errors += 1
            txn = None  # start again from the branch's head
            print(f"ERR publish {path} {type(exc).__name__}: {exc}", flush=True)
        else:
            publishes += 1
            written.append((path, hashlib.sha256(data).hexdigest()))
            print(f"ACK {sid} {path} {written[-1][1]}", flush=True)
        max_wait = max(max_wait, time.monotonic() - t0)
        n += 1
        # Read: an earlier file of ours, from the branch's current head.
        if written:
            rpath, digest = rng.choice(written)
            t0 = time.monotonic()
            try:
                got = Transaction(store, args.volume, args.branch).read(rpath)
            except (StrataError, OSError) as exc:
                errors += 1
                print(f"ERR read {rpath} {type(exc).__name__}: {exc}", flush=True)
            else:
                reads += 1
                if hashlib.sha256(got).hexdigest() != digest:
                    errors += 1
                    print(f"ERR read {rpath} content differs from what was published",
                          flush=True)
            max_wait = max(max_wait, time.monotonic() - t0)
        time.sleep(args.pause)
    store.close()
    print(f"DONE publishes={publishes} reads={reads} errors={errors} "
          f"max_wait_ms={max_wait * 1000:.0f}", flush=True)
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
