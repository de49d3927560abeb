"""A faulty bucket for the fault rounds: an HTTP proxy in front of moto, as its own process.

Run in the bucket's network namespace (`python bucketproxy.py LISTEN_HOST
LISTEN_PORT UPSTREAM_HOST UPSTREAM_PORT`), so a host cut from the bucket is
cut from it too. Every member reaches the bucket through it. The test sets
its fault with `POST /__fault__` and a JSON body (no S3 bucket can be named
`__fault__`); each field stays until set again:

- `fail_status`, `fail_every`: answer `fail_status` (500) to every
  `fail_every`-th request instead of forwarding it;
- `delay`: seconds to wait before forwarding each request (a slow bucket);
- `lose_answers`: forward this many conditional PUTs (If-None-Match or
  If-Match), then drop the connection instead of answering: the write
  happened, its writer does not know.

`GET /__fault__` answers the counts of what was done, for the test's log.
"""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import sys
import threading
import time
from typing import Any


class Faults:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fail_status: int | None = None
        self.fail_every = 1
        self.delay = 0.0
        self.lose_answers = 0
        self.count = 0
        self.done = {"failed": 0, "delayed": 0, "answers_lost": 0, "forwarded": 0}


def serve(host: str, port: int, upstream: tuple[str, int]) -> None:
    faults = Faults()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, data: bytes = b"") -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _control(self, body: bytes | None) -> None:
            with faults.lock:
                if self.command == "POST":
                    for k, v in json.loads(body or b"{}").items():
                        setattr(faults, k, v)
                data = json.dumps(faults.done).encode()
            self._reply(200, data)

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if self.path.startswith("/__fault__"):
                self._control(body)
                return
            conditional = self.command == "PUT" and (
                "If-None-Match" in self.headers or "If-Match" in self.headers)
            with faults.lock:
                faults.count += 1
                fail = faults.fail_status is not None and faults.count % faults.fail_every == 0
                status, delay = faults.fail_status, faults.delay
                lose = conditional and not fail and faults.lose_answers > 0
                if lose:
                    faults.lose_answers -= 1
                faults.done["failed" if fail else "forwarded"] += 1
                faults.done["delayed"] += delay > 0
                faults.done["answers_lost"] += lose
            if delay > 0:
                time.sleep(delay)
            if fail and status is not None:
                self._reply(status)
                return
            conn = http.client.HTTPConnection(*upstream, timeout=30)
            try:
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                resp = conn.getresponse()
                data = resp.read()
            finally:
                conn.close()
            if lose:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.send_response(resp.status)
            head = self.command == "HEAD"  # its Content-Length is the object's: keep it
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection") \
                        and (head or k.lower() != "content-length"):
                    self.send_header(k, v)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), (sys.argv[3], int(sys.argv[4])))
