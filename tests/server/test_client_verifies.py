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
