"""Finding 1 of the hardening issue: bytes a client uploads never become records.

A client with a token uploads, over TCP, a block whose bytes hold
well-formed commit frames (the old "SR" frame magic, and guessed markers)
that would create a volume. Disk damage before that block, recovery after a
SIGKILL, and `fsck --rebuild-index` while the server holds the store must
all leave it a block. A rebuild that meets a torn-looking tail in the active
pack reports it and never cuts the pack under its writer.
"""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path

from serverutil import Server, cli, free_port, served_volume
from strata.engine import pack as packfmt
from strata.engine.local import MAX_OBJECT, init_store
from strata.engine.objects import BLOCK, object_id, packb
from strata.server.wire import OBJ_HEAD


def forged_commit(marker: bytes) -> bytes:
    return marker + packfmt.encode_frame(packfmt.R_COMMIT, packb(
        {"t": 1, "ops": [["vol+", "pwned"]]}))


def hostile_block() -> bytes:
    forged = b"".join(forged_commit(m) for m in (b"SR", bytes(16), b"\xff" * 16))
    return os.urandom(64) + forged + os.urandom(64)


def raw_upload(port: int, token: str, objects: list[tuple[int, bytes]]) -> int:
    """POST /v1/objects with a batch built here, not by the client library."""
    body = b"".join(OBJ_HEAD.pack(k, object_id(k, raw), len(raw)) + raw for k, raw in objects)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/objects", body=body, headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def records(store: Path) -> list[tuple[Path, packfmt.Record]]:
    out = []
    for p in sorted((store / "packs").glob("*.pack")):
        out += [(p, r) for r in packfmt.scan(str(p)).records]
    return out


def flip(path: Path, offset: int) -> None:
    mode = path.stat().st_mode
    path.chmod(0o600)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x40]))
    path.chmod(mode & 0o777)


def test_uploaded_bytes_never_become_records(tmp_path: Path) -> None:
    store = tmp_path / "s"
    with served_volume(store) as (server, tok):
        port = server.tcp_port
        assert port is not None
        block = hostile_block()
        assert raw_upload(port, tok, [(BLOCK, block)]) == 200
        # An object over the payload limit is refused when written, not found on a scan.
        assert raw_upload(port, tok, [(BLOCK, bytes(MAX_OBJECT + 1))]) in (400, 413)
        p = cli("put", "v", "f", server=server.tcp_url, token=tok, input=b"after")
        assert p.returncode == 0, p.stderr
        # Damage the hostile record itself, in the random bytes before the forged
        # frames: a scan resynchronises from there, and must not land inside it.
        (pack, hostile), = [(p_, r) for p_, r in records(store)
                            if r.rtype == packfmt.R_OBJECT and r.payload[1:33] == object_id(
                                BLOCK, block)]
        size_before = pack.stat().st_size
        flip(pack, hostile.offset + hostile.length - len(block) + 10)
        p = cli("fsck", "--rebuild-index", "--json", store=store)
        report = json.loads(p.stdout)
        assert any(d["offset"] == hostile.offset for d in report["damaged"]), report
        assert pack.stat().st_size == size_before  # the active pack is never cut
        assert "pwned" not in cli("volume", "list", store=store).stdout.decode()
        server.kill()  # a crash: recovery scans the damaged pack again on open
    server = Server(store, tcp_port=free_port()).start()
    try:
        assert cli("volume", "list", store=store).stdout.decode().split() == ["v"]
        assert cli("cat", "v", "f", store=store).stdout == b"after"
        assert all(r.rtype != packfmt.R_COMMIT or b"pwned" not in r.payload
                   for _p, r in records(store))
    finally:
        server.stop()


def test_a_rebuild_under_a_running_server_never_cuts_the_active_pack(tmp_path: Path) -> None:
    store = tmp_path / "s"
    init_store(str(store))
    server = Server(store).start()
    try:
        assert cli("volume", "create", "v", store=store).returncode == 0
        for i in range(3):
            assert cli("put", "v", f"f{i}", store=store, input=b"x" * 3000).returncode == 0
        pack, last = records(store)[-1]
        assert last.rtype == packfmt.R_COMMIT
        size = pack.stat().st_size
        flip(pack, last.offset + packfmt.FRAME_SIZE + 2)  # looks like a torn tail now
        report = json.loads(cli("fsck", "--rebuild-index", "--json", store=store).stdout)
        assert pack.stat().st_size == size, "the rebuild cut the pack under its writer"
        assert not report["ok"]
        # The writer goes on appending after the untouched bytes.
        assert cli("put", "v", "g", store=store, input=b"later").returncode == 0
        assert pack.stat().st_size > size
    finally:
        server.stop()
