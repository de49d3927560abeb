"""A server SIGKILLed under load and restarted: every publish a client saw acknowledged is there.

Four client processes (tests/server/crash_client.py) publish through the
server's unix socket as fast as they can, each printing a line for every
publish the server acknowledged. The server is SIGKILLed several times
mid-load, at random moments, and started again; the clients ride through
on their own retries and must never fail. Afterwards every acknowledged
snapshot is in the branch's history and holds the client's file with the
right bytes, the head holds every acknowledged file, and fsck is clean.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

from crash_client import content

from serverutil import Server
from strata.engine.local import init_store
from strata.engine.objects import K_FILE
from strata.engine.txn import Transaction
from strata.server.client import RemoteStore

HERE = Path(__file__).resolve().parent

CLIENTS = 4
KILLS = 6
BIG_EVERY = 15


class Client:
    def __init__(self, url: str, i: int, big_every: int) -> None:
        self.i = i
        self.acks: list[tuple[int, str]] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "crash_client.py"), url, str(i), str(big_every)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            tag, i, n, sid = line.split()
            assert tag == "ack" and int(i) == self.i
            self.acks.append((int(n), sid))

    def stop(self) -> str:
        """Kill the client (mid-publish, maybe) and return what it said on stderr."""
        self.proc.kill()
        self.proc.wait()
        self.reader.join(10)
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def wait_for_acks(clients: list[Client], more: int, timeout: float = 60.0) -> None:
    """Until every client has `more` acknowledgements beyond what it has now."""
    want = [len(c.acks) + more for c in clients]
    deadline = time.monotonic() + timeout
    while any(len(c.acks) < w for c, w in zip(clients, want, strict=True)):
        dead = [c for c in clients if c.proc.poll() is not None]
        assert not dead, [c.stop() for c in dead]
        assert time.monotonic() < deadline, [len(c.acks) for c in clients]
        time.sleep(0.01)


def test_acknowledged_publishes_survive_server_sigkill(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    init_store(str(store_dir))
    server = Server(store_dir).start()
    with server.remote() as owner:
        owner.create_volume("v")
    rng = random.Random(os.urandom(8))
    # Client 0 now and then publishes a file too big to ride in the publish request:
    # its objects are uploaded first, and a kill may fall between upload and publish.
    big_every = {0: BIG_EVERY}
    clients = [Client(server.unix_url, i, big_every.get(i, 0)) for i in range(CLIENTS)]
    try:
        wait_for_acks(clients, 3)
        for _ in range(KILLS):
            # Kill at a random moment while all four are publishing.
            time.sleep(rng.uniform(0.05, 0.4))
            server.kill()
            time.sleep(rng.uniform(0.0, 0.3))
            server.start()
            wait_for_acks(clients, 2)  # all four made it through the restart
    finally:
        errors = {c.i: c.stop() for c in clients}
    assert all(not e for e in errors.values()), errors

    # The last publishes may still be in flight: restart once more from cold to be sure
    # that what we check is what survives a crash, not what a live server remembers.
    server.kill()
    server.start()
    try:
        with RemoteStore(server.unix_url, retry_for=10.0) as store:
            head = store.head("v", "live")
            history = {info.id for info in store.log(head)}
            files = {p: e for p, e in Transaction(store, "v", base=head).walk()
                     if e.kind == K_FILE}
            for c in clients:
                assert [n for n, _sid in c.acks] == list(range(len(c.acks)))
                for n, sid in c.acks:
                    path = f"c{c.i}/{n}"
                    assert sid in history, (path, sid)
                    want = content(c.i, n, big_every.get(c.i, 0))
                    assert Transaction(store, "v", base=sid).read(path) == want, path
                    assert path in files, path
            # Unacknowledged publishes may have landed too, but only with the right bytes.
            head_t = Transaction(store, "v", base=head)
            for path in files:
                c_i, n = path[1:].split("/")
                want = content(int(c_i), int(n), big_every.get(int(c_i), 0))
                assert head_t.read(path) == want, path
            report = store.admin("POST", "fsck", {})
            assert report["ok"], report
            total = sum(len(c.acks) for c in clients)
            assert total >= CLIENTS * (3 + 2 * KILLS)
    finally:
        server.stop()
