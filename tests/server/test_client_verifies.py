"""Finding 9 of the hardening issue: the client checks every object a server sends.

A server is not trusted either: `RemoteStore` hashes what it receives and
refuses bytes that do not match the id it asked for, for single reads, batch
reads and ranges. The server here is a real HTTP server on loopback that
answers with the wrong bytes (a tampering proxy or a broken cache in front of
strata would look like this to the client).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from strata.engine.errors import Corrupt
from strata.engine.objects import BLOCK, object_id
from strata.server import wire
from strata.server.client import RemoteStore

GOOD = b"the real block"
GOOD_ID = object_id(BLOCK, GOOD)


class Tampering(BaseHTTPRequestHandler):
    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._send(b"not the real block")

    def do_POST(self) -> None:  # noqa: N802
        n = int(self.headers.get("Content-Length", 0))
        count = len(self.rfile.read(n)) // 32
        self._send(wire.encode_blobs([b"tampered"] * count))

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def tampering() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Tampering)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_objects_that_do_not_match_their_id_are_refused(tampering: str) -> None:
    store = RemoteStore(tampering, "strata_x_y", retry_for=1.0)
    with pytest.raises(Corrupt, match="do not match"):
        store.get_object(GOOD_ID)
    with pytest.raises(Corrupt, match="do not match"):
        store.get_objects([GOOD_ID, GOOD_ID])
    with pytest.raises(Corrupt, match="do not match"):
        store.get_range(GOOD_ID, 2, 4)


class _TamperingLean:
    """A lean stream (frames of msgpack) that answers every get_file with `answer`."""

    def __init__(self, path: str, answer: list[object]) -> None:
        import socket
        self.answer = answer
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(4)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import msgpack
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                f = conn.makefile("rb")
                while True:
                    head = f.read(4)
                    if len(head) < 4:
                        break
                    f.read(int.from_bytes(head, "big"))
                    body = msgpack.packb([0, self.answer], use_bin_type=True)
                    conn.sendall(len(body).to_bytes(4, "big") + body)

    def close(self) -> None:
        self.sock.close()


def test_a_file_read_in_one_round_trip_is_verified(tmp_path: object) -> None:
    from pathlib import Path

    from strata.engine.errors import InvalidInput
    from strata.engine.objects import FILENODE, FileNode
    other = b"the other block"
    node = FileNode.v1(2 * 64 * 1024, 64 * 1024, (GOOD_ID, object_id(BLOCK, other)))
    raw = node.encode()
    ref = object_id(FILENODE, raw)
    sock = str(Path(str(tmp_path)) / "serve.sock")
    cases: list[tuple[list[object], type[Exception]]] = [
        ([b"not the node", []], Corrupt),              # other bytes for the node
        ([raw, [GOOD, b"tampered"]], Corrupt),          # a block that is not its id
        ([raw, [GOOD, other, GOOD]], InvalidInput),     # more blocks than the range has
        ([raw, "not a list"], InvalidInput),
    ]
    for answer, error in cases:
        fake = _TamperingLean(wire.lean_path(sock), answer)
        try:
            store = RemoteStore(f"unix:{sock}", retry_for=1.0)
            with pytest.raises(error):
                store.get_file(ref, 0, node.size)
            store.close()
        finally:
            fake.close()
            Path(wire.lean_path(sock)).unlink()
    fake = _TamperingLean(wire.lean_path(sock), [raw, [GOOD]])  # a prefix: the rest is ours
    try:
        store = RemoteStore(f"unix:{sock}", retry_for=1.0)
        got_node, blocks = store.get_file(ref, 0, node.size)
        assert got_node == node and blocks == {GOOD_ID: GOOD}
        store.close()
    finally:
        fake.close()
