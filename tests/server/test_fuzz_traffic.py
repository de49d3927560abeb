"""Hostile traffic beside legitimate clients, for as long as STRATA_FUZZ_TRAFFIC says (seconds).

`make fuzz` runs it for 60 s; `make test` skips it. One real `strata serve`
over loopback TCP and its unix socket. Attackers, each in a loop of its own,
from loopback addresses of their own (127.0.0.2 and up):

- gzip bodies that inflate to 63 MiB (read-only token);
- heads trickled a byte at a time, and bodies that claim 100 MiB and trickle;
- oversized bodies: a Content-Length over the limit, and a chunked body
  that runs past it;
- 100 MiB uploads (read-write token), two at a time;
- idle connections by the hundred;
- web view readers that stop reading a 64 MiB file, and hashes of a 1 GiB
  file whose clients leave after a second.

Meanwhile three token holders (their own volume, over TCP from 127.0.0.1)
publish, read and list, and the owner lists over the unix socket. The run
fails if any of their calls takes more than 1 s, or if the server's peak
resident set grows more than 512 MiB over its idle one.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from serverutil import Server, cli, free_port, peak_rss, reset_peak
from strata.engine.interface import ChangeSet
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import FILENODE, K_FILE, ZERO_ID, Entry, FileNode, object_id
from strata.engine.txn import Transaction
from strata.server.client import RemoteStore

SECONDS = float(os.environ.get("STRATA_FUZZ_TRAFFIC", "0"))
MIB = 1024 * 1024
LEGIT_LIMIT = 1.0
GROWTH_LIMIT = 512 * MIB

pytestmark = pytest.mark.skipif(not SECONDS, reason="set STRATA_FUZZ_TRAFFIC=SECONDS (make fuzz)")


def _from(source: str, port: int, timeout: float = 10) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


class Traffic:
    def __init__(self, root: Path) -> None:
        self.store_dir = root / "store"
        init_store(str(self.store_dir))
        store = LocalStore(str(self.store_dir))
        try:
            store.create_volume("a")
            store.create_volume("b")
            t = Transaction(store, "a")
            t.write("big.bin", os.urandom(64 * MIB))
            t.commit("big")
            bs = store.block_size
            node = FileNode.v1(1 << 30, bs, (ZERO_ID,) * ((1 << 30) // bs))
            raw = node.encode()
            cs = ChangeSet("a", "live", store.head("a", "live"), {"zeros.bin": Entry(
                kind=K_FILE, size=1 << 30, ref=object_id(FILENODE, raw))}, "zeros", {})
            self.head_a = store.publish([cs], [(FILENODE, raw)])[0]
        finally:
            store.close()
        self.port = free_port()
        self.server = Server(self.store_dir, tcp_port=self.port).start()
        assert self.server.proc is not None
        self.pid = self.server.proc.pid
        self.ro_a, self.rw_a, self.rw_b = (self._token(v, f) for v, f in
                                           (("a", "--ro"), ("a", "--rw"), ("b", "--rw")))
        self.stop = threading.Event()
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.waits: list[tuple[float, str]] = []

    def _token(self, volume: str, flag: str) -> str:
        p = cli("token", "create", volume, flag, "--json", store=self.store_dir)
        assert p.returncode == 0, p.stderr
        return str(json.loads(p.stdout)["token"])

    def note(self, what: str) -> None:
        with self.lock:
            self.seen[what] += 1

    def loop(self, name: str, fn: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            while not self.stop.is_set():
                try:
                    fn()
                except Exception as exc:  # an attack refused, or a legitimate call failed
                    self.note(f"{name}: {type(exc).__name__}: {str(exc)[:100]}")
        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    # -- attackers ---------------------------------------------------------------------------

    def post(self, source: str, token: str, path: str, body: bytes, headers: dict[str, str]
             ) -> int:
        s = _from(source, self.port, timeout=60)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.sock = s
        try:
            conn.request("POST", path, body=body, headers={
                "Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream",
                **headers})
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def gzip_bombs(self) -> Callable[[], None]:
        z = zlib.compressobj(9, zlib.DEFLATED, 31)
        bomb = b"".join([z.compress(bytes(MIB)) for _ in range(63)] + [z.flush()])
        return lambda: self.note(f"gzip {self.post('127.0.0.2', self.ro_a, '/v1/objects/missing', bomb, {'Content-Encoding': 'gzip'})}")  # noqa: E501

    def trickled_heads(self) -> None:
        conns = []
        for _ in range(100):
            s = _from("127.0.0.3", self.port)
            s.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            conns.append(s)
        for _ in range(30):
            if self.stop.wait(0.5):
                break
            for s in conns:
                with contextlib.suppress(OSError):
                    s.send(b"a")
        for s in conns:
            s.close()
        self.note("trickled heads")

    def trickled_bodies(self) -> None:
        conns = []
        for _ in range(10):
            s = _from("127.0.0.4", self.port)
            s.sendall(b"POST /v1/objects HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      + self.rw_a.encode() + b"\r\nContent-Type: application/octet-stream\r\n"
                      b"Content-Length: " + str(100 * MIB).encode() + b"\r\n\r\n")
            conns.append(s)
        for _ in range(6):
            if self.stop.wait(2):
                break
            for s in conns:
                with contextlib.suppress(OSError):
                    s.send(b"\0" * 1024)
        for s in conns:
            s.close()
        self.note("trickled bodies")

    def oversized(self) -> None:
        s = _from("127.0.0.5", self.port, timeout=60)
        try:
            s.sendall(b"POST /v1/objects HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      + self.rw_a.encode() + b"\r\nContent-Length: " + str(200 * MIB).encode()
                      + b"\r\n\r\n")
            s.recv(4096)
        finally:
            s.close()
        s = _from("127.0.0.5", self.port, timeout=60)
        chunk = b"%x\r\n" % MIB + bytes(MIB) + b"\r\n"
        try:
            s.sendall(b"POST /v1/objects HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      + self.rw_a.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(140):
                if self.stop.is_set():
                    break
                s.sendall(chunk)
        finally:
            s.close()
        self.note("oversized")
        self.stop.wait(2)

    def uploads(self) -> None:
        self.note(f"upload {self.post('127.0.0.6', self.rw_a, '/v1/objects', bytes(100 * MIB), {})}")  # noqa: E501
        self.stop.wait(1)

    def idle_flood(self) -> None:
        conns = [_from(f"127.0.0.{7 + i % 4}", self.port) for i in range(240)]
        self.stop.wait(5)
        for s in conns:
            s.close()
        self.note("idle flood")

    def ui_request(self, source: str, path: str) -> socket.socket:
        s = _from(source, self.port)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.sendall((f"GET {path} HTTP/1.1\r\nHost: x\r\n"
                   f"Cookie: strata_ui={self.ro_a}\r\n\r\n").encode())
        return s

    def stalled_raw(self) -> None:
        conns = [self.ui_request("127.0.0.11", f"/ui/raw?v=a&s={self.head_a}&p=big.bin")
                 for _ in range(6)]
        self.stop.wait(5)
        for s in conns:
            s.close()
        self.note("stalled raw")

    def hash_hogs(self) -> None:
        conns = [self.ui_request("127.0.0.12", f"/ui/api/file?v=a&s={self.head_a}&p=zeros.bin")
                 for _ in range(20)]
        self.stop.wait(1)
        for s in conns:
            s.close()
        self.note("hash hogs")

    # -- the legitimate --------------------------------------------------------------------

    def timed(self, what: str, fn: Callable[[], object]) -> None:
        t0 = time.monotonic()
        fn()
        with self.lock:
            self.waits.append((time.monotonic() - t0, what))

    def token_holder(self, n: int) -> Callable[[], None]:
        client = RemoteStore(f"http://127.0.0.1:{self.port}", self.rw_b, retry_for=5)
        i = [0]

        def work() -> None:
            i[0] += 1
            path = f"w{n}-f{i[0] % 50}"
            t = Transaction(client, "b")
            t.write(path, os.urandom(4096 + i[0] % 8192))
            self.timed("publish", lambda: t.commit(f"holder {n}"))
            self.timed("list", lambda: client.list_branches("b"))
            self.timed("read", lambda: Transaction(client, "b").read(path))
            self.stop.wait(0.05)
        return work

    def owner(self) -> Callable[[], None]:
        client = self.server.remote(retry_for=5)

        def work() -> None:
            self.timed("owner list", client.list_volumes)
            self.timed("owner head", lambda: client.head("b", "live"))
            self.stop.wait(0.1)
        return work


def test_hostile_traffic_beside_legitimate_clients(tmp_path: Path) -> None:
    tr = Traffic(tmp_path)
    try:
        time.sleep(1.0)
        reset_peak(tr.pid)
        idle = peak_rss(tr.pid)
        threads = [tr.loop("gzip", tr.gzip_bombs()), tr.loop("heads", tr.trickled_heads),
                   tr.loop("bodies", tr.trickled_bodies), tr.loop("oversized", tr.oversized),
                   tr.loop("uploads", tr.uploads), tr.loop("uploads", tr.uploads),
                   tr.loop("idle", tr.idle_flood), tr.loop("raw", tr.stalled_raw),
                   tr.loop("hash", tr.hash_hogs)]
        threads += [tr.loop(f"holder {n}", tr.token_holder(n)) for n in range(3)]
        threads.append(tr.loop("owner", tr.owner()))
        time.sleep(SECONDS)
        tr.stop.set()
        for t in threads:
            t.join(timeout=70)
        grown = peak_rss(tr.pid) - idle
        waits = sorted(tr.waits, reverse=True)
        print(f"\n{len(waits)} legitimate calls; slowest {waits[:5]}; server grew "
              f"{grown // MIB} MiB over idle; attacks: {dict(tr.seen)}")
        publishes = sum(1 for _w, what in waits if what == "publish")
        assert publishes > SECONDS, publishes  # the token holders did work
        assert waits[0][0] <= LEGIT_LIMIT, waits[:10]
        assert grown <= GROWTH_LIMIT, f"server grew {grown // MIB} MiB"
        assert not [k for k in tr.seen if k.startswith(("holder", "owner"))], tr.seen
        assert tr.seen["gzip 415"] > 0 and not [k for k in tr.seen if k.startswith("gzip 4")
                                                  and k != "gzip 415"]
        log = tr.server.log.read_text(errors="replace")
        assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]
    finally:
        tr.stop.set()
        tr.server.stop()
