"""A loopback HTTP proxy that adds a fixed delay to every request: a bucket with a real latency.

moto on loopback answers in about a millisecond; S3 Express answers in 5-10
ms and S3 Standard in 50-100 ms. This kernel has no netem, so the delay is
added here: each request waits `delay` seconds, then is forwarded to the
upstream server over a kept-alive connection of its own thread, and the
answer is sent back whole. Headers pass unchanged (the Host header the
client signed included), so conditional writes and ranged reads behave as
against the server itself.
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
       "upgrade"}


class SlowProxy:
    def __init__(self, upstream_host: str, upstream_port: int, delay: float) -> None:
        self.delay = delay
        local = threading.local()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                body = self._body()
                time.sleep(proxy.delay)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                for attempt in (0, 1):
                    conn = getattr(local, "conn", None)
                    if conn is None:
                        conn = local.conn = http.client.HTTPConnection(upstream_host,
                                                                       upstream_port,
                                                                       timeout=60)
                    try:
                        conn.request(self.command, self.path, body or None, headers)
                        resp = conn.getresponse()
                        data = resp.read()
                        break
                    except (OSError, http.client.HTTPException):
                        conn.close()
                        local.conn = None
                        if attempt:
                            raise
                self.send_response_only(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                length = resp.getheader("Content-Length")
                if self.command == "HEAD":
                    self.send_header("Content-Length", length or "0")
                    self.end_headers()
                    return
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SlowProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
