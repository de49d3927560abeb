"""Finding 4 of the hardening issue: no token can push the server's memory without bound.

Measured on a real server process over TCP: its peak resident set (VmHWM)
before and after each attack.

- A read-only token's 100 MiB publish body is refused before it is read.
- A batch read of 1024 copies of one 16 MiB block answers at most 32 MiB
  (or its first object) and says how many ids it covered; the client asks again.
- Six concurrent 100 MiB uploads hold at most the server's body budget in
  memory at once, and a small request meanwhile is answered within a second.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path

from serverutil import Server, cli, free_port, peak_rss, reset_peak
from strata.engine.local import init_store
from strata.engine.objects import BLOCK, object_id
from strata.server.client import RemoteStore

MIB = 1024 * 1024


def send(port: int, token: str, method: str, path: str, body: bytes,
         ctype: str = "application/octet-stream") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=body, headers={
            "Authorization": f"Bearer {token}", "Content-Type": ctype})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    except (BrokenPipeError, ConnectionResetError):
        return 0, {}, b""  # the server answered and closed before taking the whole body
    finally:
        conn.close()


def test_memory_stays_bounded_under_large_requests(tmp_path: Path) -> None:
    store = tmp_path / "s"
    init_store(str(store), block_size=16 * MIB)
    port = free_port()
    server = Server(store, tcp_port=port).start()
    assert server.proc is not None
    pid = server.proc.pid
    try:
        assert cli("volume", "create", "v", store=store).returncode == 0
        ro = json.loads(cli("token", "create", "v", "--ro", "--json", store=store).stdout)
        rw = json.loads(cli("token", "create", "v", "--rw", "--json", store=store).stdout)
        big = os.urandom(16 * MIB)
        oid = object_id(BLOCK, big)
        with RemoteStore(server.tcp_url, rw["token"]) as writer:  # in the volume's reach
            writer.put_objects([(BLOCK, big)])
        time.sleep(0.2)

        # A read-only token's huge publish: refused before its body is read.
        reset_peak(pid)
        base = peak_rss(pid)
        status, _h, body = send(port, ro["token"], "POST", "/v1/publish", bytes(100 * MIB),
                                "application/msgpack")
        assert status in (0, 403), (status, body[:200])
        grown_publish = peak_rss(pid) - base
        assert grown_publish < 32 * MIB

        # 1024 copies of one 16 MiB id in one batch read.
        reset_peak(pid)
        base = peak_rss(pid)
        status, headers, body = send(port, ro["token"], "POST", "/v1/objects/get", oid * 1024)
        assert status == 200
        count = int(headers["x-strata-count"])
        assert 1 <= count <= 3 and len(body) <= 48 * MIB
        grown_batch = peak_rss(pid) - base
        assert grown_batch < 256 * MIB
        with RemoteStore(server.tcp_url, ro["token"]) as reader:
            assert reader.get_objects([oid] * 9) == [big] * 9  # asks again for the rest

        # Six 100 MiB uploads at once, and a small request in the middle of them.
        reset_peak(pid)
        base = peak_rss(pid)
        junk = bytes(100 * MIB)
        threads = [threading.Thread(target=send, args=(port, rw["token"], "POST",
                                                       "/v1/objects", junk))
                   for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        status, _h, _b = send(port, rw["token"], "GET", "/v1/whoami", b"")
        small = time.monotonic() - t0
        for t in threads:
            t.join()
        assert status == 200 and small < 1.0, small
        grown = peak_rss(pid) - base
        print(f"peak growth: read-only publish {grown_publish // MIB} MiB, batch read "
              f"{grown_batch // MIB} MiB, six uploads {grown // MIB} MiB; small request "
              f"{small * 1000:.0f} ms")
        assert grown < 640 * MIB, f"server grew by {grown // MIB} MiB"
    finally:
        server.stop()


def test_concurrent_large_reads_stay_within_the_answer_budget(tmp_path: Path) -> None:
    """Many read-only clients reading big objects at once: the server's answer budget holds.

    One object is 60 MiB of zeros, which its pack frame stores in a few KiB:
    the budget counts raw sizes (from the frame header), not stored ones.
    """
    store = tmp_path / "s"
    init_store(str(store), block_size=16 * MIB)
    port = free_port()
    server = Server(store, tcp_port=port).start()
    assert server.proc is not None
    pid = server.proc.pid
    try:
        assert cli("volume", "create", "v", store=store).returncode == 0
        ro = json.loads(cli("token", "create", "v", "--ro", "--json", store=store).stdout)
        rw = json.loads(cli("token", "create", "v", "--rw", "--json", store=store).stdout)
        zeros = bytes(60 * MIB)
        blocks = [os.urandom(16 * MIB) for _ in range(2)]
        with RemoteStore(server.tcp_url, rw["token"]) as writer:
            writer.put_objects([(BLOCK, zeros)])
            writer.put_objects([(BLOCK, b) for b in blocks])
        zid = object_id(BLOCK, zeros).hex()
        batch = b"".join(object_id(BLOCK, b) for b in blocks) * 512
        time.sleep(0.2)
        reset_peak(pid)
        base = peak_rss(pid)
        answers: list[tuple[int, int]] = []

        def read(path: str, method: str, body: bytes) -> None:
            status, _h, got = send(port, ro["token"], method, path, body)
            answers.append((status, len(got)))

        threads = [threading.Thread(target=read, args=(f"/v1/objects/{zid}", "GET", b""))
                   for _ in range(12)]
        threads += [threading.Thread(target=read, args=("/v1/objects/get", "POST", batch))
                    for _ in range(12)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        status, _h, _b = send(port, ro["token"], "GET", "/v1/whoami", b"")
        small = time.monotonic() - t0
        for t in threads:
            t.join()
        grown = peak_rss(pid) - base
        print(f"peak growth under 24 concurrent large reads: {grown // MIB} MiB; small "
              f"request {small * 1000:.0f} ms")
        assert status == 200 and small < 1.0, small
        assert sorted(answers) == sorted([(200, 60 * MIB)] * 12
                                         + [(200, 2 * (16 * MIB + 4))] * 12)
        assert grown < 512 * MIB, f"server grew by {grown // MIB} MiB"
    finally:
        server.stop()
