"""A client process of tests/server/test_crash_server.py: publishes through a server until killed.

Usage: python crash_client.py URL CLIENT [BIG_EVERY]

Publishes one new file per commit to branch ``live`` of volume ``v`` (under
``c<CLIENT>/``) through the remote store at URL and, once `commit` has
returned, prints ``ack <client> <n> <snapshot id>`` and flushes: every
printed line is a publish the server acknowledged as durable. The server
may be SIGKILLed and restarted at any moment; the client's own retries
must carry it through. Every BIG_EVERY-th file (0: never) is larger than
what rides inside a publish request, so its objects are uploaded first.
Content is a pure function of the path (crash_writer.content_of).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import blake3

# Run as a script, this file gets only its own directory on sys.path, not pytest's
# `pythonpath`; crash_writer lives one directory up.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from crash_writer import content_of  # noqa: E402
from strata.engine.txn import INLINE_PUBLISH_BYTES, Transaction  # noqa: E402
from strata.server.client import RemoteStore  # noqa: E402


def big_content(path: str) -> bytes:
    """Over INLINE_PUBLISH_BYTES, so Transaction uploads it before publishing."""
    return blake3.blake3(path.encode()).digest(length=INLINE_PUBLISH_BYTES + 100_000)


def path_of(client: int, n: int) -> str:
    return f"c{client}/{n}"


def content(client: int, n: int, big_every: int) -> bytes:
    path = path_of(client, n)
    if big_every and n % big_every == big_every - 1:
        return big_content(path)
    return content_of(path)


def main() -> None:
    url, client = sys.argv[1], int(sys.argv[2])
    big_every = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    store = RemoteStore(url, retry_for=120.0)
    try:
        for n in range(1_000_000):
            t = Transaction(store, "v")
            if n == 0:
                t.mkdir(f"c{client}", exist_ok=True)
            t.write(path_of(client, n), content(client, n, big_every), mtime_ns=0)
            sid = t.commit(path_of(client, n))
            sys.stdout.write(f"ack {client} {n} {sid}\n")
            sys.stdout.flush()
            time.sleep(0.002)
    except BaseException as exc:  # noqa: BLE001 - any failure ends the process loudly
        sys.stderr.write(f"client {client} failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        sys.exit(3)


if __name__ == "__main__":
    main()
