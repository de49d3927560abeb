"""Finding 7 of the hardening issue: the web view under the API's budgets.

One real `strata serve` over loopback TCP on a store of 16 MiB blocks;
readers hold read-only tokens of volume `a` or `b` as the browser does (the
`strata_ui` cookie). Volume `a` holds what a hostile writer could leave:

- `big.bin`, 128 MiB of eight random blocks;
- `zeros.bin`, 4 GiB of holes (a file node of 256 zero ids);
- `d/fake.db`, a SQLite header over a 256 MiB node whose entry claims 1,000
  bytes, written into the store in process, as a store from before publish
  refused such entries (tests/server/test_bad_requests.py) could hold it.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from serverutil import Server, cli, free_port, peak_rss, reset_peak
from strata.engine.interface import ChangeSet
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import (
    BLOCK,
    FILENODE,
    K_DIR,
    K_FILE,
    TREE,
    ZERO_ID,
    Entry,
    FileNode,
    TreeNode,
    object_id,
)
from strata.engine.txn import Transaction

MIB = 1024 * 1024
BLOCK_SIZE = 16 * MIB


def _publish_nodes(store: LocalStore, volume: str, path: str, entry: Entry,
                   objects: list[tuple[int, bytes]]) -> None:
    cs = ChangeSet(volume, "live", store.head(volume, "live"), {path: entry}, "hostile", {})
    store.publish([cs], objects)


class Env:
    def __init__(self, root: Path) -> None:
        self.store_dir = root / "store"
        init_store(str(self.store_dir), block_size=BLOCK_SIZE)
        store = LocalStore(str(self.store_dir))
        try:
            store.create_volume("a")
            store.create_volume("b")
            t = Transaction(store, "a")
            self.big = b"".join(os.urandom(BLOCK_SIZE) for _ in range(8))
            t.write("big.bin", self.big)
            t.commit("big")
            zeros = FileNode.v1(4 << 30, BLOCK_SIZE, (ZERO_ID,) * 256).encode()
            _publish_nodes(store, "a", "zeros.bin",
                           Entry(kind=K_FILE, size=4 << 30, ref=object_id(FILENODE, zeros)),
                           [(FILENODE, zeros)])
            head = b"SQLite format 3\x00" + os.urandom(4080)
            fake = FileNode.v1(256 * MIB, BLOCK_SIZE, (object_id(BLOCK, head),)
                            + (ZERO_ID,) * 15).encode()
            liar = Entry(kind=K_FILE, size=1000, ref=object_id(FILENODE, fake))
            tree = TreeNode(0, entries=((b"fake.db", liar),)).encode()
            _publish_nodes(store, "a", "d", Entry(kind=K_DIR, ref=object_id(TREE, tree)),
                           [(BLOCK, head), (FILENODE, fake), (TREE, tree)])
            self.head_a = store.head("a", "live")
            t = Transaction(store, "b")
            t.write("hello.txt", b"hello\n")
            self.head_b = t.commit("hello")
        finally:
            store.close()
        self.server = Server(self.store_dir, tcp_port=free_port()).start()
        assert self.server.proc is not None and self.server.tcp_port is not None
        self.pid, self.port = self.server.proc.pid, self.server.tcp_port
        self.cookie = {v: self._token(v) for v in ("a", "b")}

    def _token(self, volume: str) -> str:
        p = cli("token", "create", volume, "--ro", "--json", store=self.store_dir)
        assert p.returncode == 0, p.stderr
        return str(json.loads(p.stdout)["token"])

    def request_bytes(self, volume: str, path: str) -> bytes:
        return (f"GET {path} HTTP/1.1\r\nHost: x\r\n"
                f"Cookie: strata_ui={self.cookie[volume]}\r\n\r\n").encode()

    def get(self, volume: str, path: str, timeout: float = 60) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path, headers={"Cookie": f"strata_ui={self.cookie[volume]}"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        ctype = resp.getheader("Content-Type") or ""
        return resp.status, json.loads(data) if ctype.startswith("application/json") else data

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    e = Env(tmp_path_factory.mktemp("uibudget"))
    yield e
    e.close()
    log = e.server.log.read_text(errors="replace")
    assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]


def test_the_view_takes_a_files_size_from_its_node(env: Env) -> None:
    """An entry claiming 1,000 bytes over a 256 MiB node: the view sees 256 MiB."""
    status, body = env.get("a", f"/ui/api/file?v=a&s={env.head_a}&p=d/fake.db")
    assert status == 200, body
    assert body["view"] == "sqlite" and body["size"] == 256 * MIB, body
    assert "over 64 MiB" in body["tables"]["error"], body["tables"]
    conn = socket.create_connection(("127.0.0.1", env.port), timeout=30)
    try:
        conn.sendall(env.request_bytes("a", f"/ui/raw?v=a&s={env.head_a}&p=d/fake.db"))
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
    finally:
        conn.close()
    assert f"Content-Length: {256 * MIB}".encode() in head, head[:500]


def test_slow_raw_readers_stay_within_the_answer_budget(env: Env) -> None:
    """Six readers of a 128 MiB file that stop reading: the server holds a block each, at most."""
    time.sleep(0.5)
    reset_peak(env.pid)
    base = peak_rss(env.pid)
    readers = []
    for _ in range(6):
        s = socket.create_connection(("127.0.0.1", env.port), timeout=30)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.sendall(env.request_bytes("a", f"/ui/raw?v=a&s={env.head_a}&p=big.bin"))
        readers.append(s)
    for s in readers:
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    time.sleep(4)  # they read no more
    grown = peak_rss(env.pid) - base
    for s in readers:
        s.close()
    print(f"peak growth under six stalled /ui/raw readers: {grown // MIB} MiB")
    assert grown < 200 * MIB, f"server grew by {grown // MIB} MiB"
    # A reader that reads gets every byte.
    status, data = env.get("a", f"/ui/raw?v=a&s={env.head_a}&p=big.bin")
    assert status == 200 and blake3.blake3(data).digest() == blake3.blake3(env.big).digest()


def test_one_volume_cannot_take_the_executor_and_work_stops_with_its_clients(
        env: Env) -> None:
    """40 hashes of a 4 GiB file on `a`: `b` is answered at once, and the work ends with them."""
    hogs = []
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", env.port), timeout=30)
        s.sendall(env.request_bytes("a", f"/ui/api/file?v=a&s={env.head_a}&p=zeros.bin"))
        hogs.append(s)
    time.sleep(0.5)
    took: list[float] = []

    def other_volume() -> None:
        t0 = time.monotonic()
        status, body = env.get("b", f"/ui/api/tree?v=b&s={env.head_b}&p=", timeout=30)
        took.append(time.monotonic() - t0)
        assert status == 200 and body["count"] == 1, body

    t = threading.Thread(target=other_volume)
    t.start()
    t.join(timeout=40)
    for s in hogs:  # the clients leave
        s.close()
    time.sleep(2.0)
    cpu0 = env.cpu_seconds()
    time.sleep(2.0)
    busy = env.cpu_seconds() - cpu0
    print(f"another volume answered in {took[0] * 1000:.0f} ms; server CPU 2-4 s after "
          f"the clients left: {busy:.2f} s")
    assert took[0] < 1.0, took
    assert busy < 0.3, f"the server worked {busy:.2f} s of 2 after its clients left"
    # The hash is still right for a client that waits for it.
    status, body = env.get("a", f"/ui/api/file?v=a&s={env.head_a}&p=zeros.bin")
    assert status == 200 and body["view"] == "binary" and body["size"] == 4 << 30
    h = blake3.blake3()
    zero = bytes(BLOCK_SIZE)
    for _ in range(256):
        h.update(zero)
    assert body["blake3"] == h.hexdigest()
