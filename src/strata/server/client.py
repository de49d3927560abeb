"""The remote `Store`: the same interface as `LocalStore`, over the HTTP API.

Connections are kept alive, one per thread. A 503 (the store is changing
owner) or a refused connection is retried with backoff until `retry_for`
seconds have passed, so a handoff is invisible to callers. Retrying a publish
is safe: every publish carries a random publish id, and a retry of one that
already landed gets the snapshots it made (instead of a conflict with itself)
and publishes nothing new.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from strata.engine.errors import Corrupt, InvalidInput, Unavailable
from strata.engine.interface import ChangeSet, Lease, SnapshotInfo, Store
from strata.engine.names import check_branch, check_volume
from strata.engine.objects import FILENODE, FileNode, object_id
from strata.engine.tree import NodeCache
from strata.server import wire

if TYPE_CHECKING:
    import http.client

MAX_HEADER_LINE = 65536
MAX_HEADERS = 100
# Prefetched tree nodes kept raw until read, oldest dropped first past either bound.
PREFETCH_KEEP = 1024
PREFETCH_KEEP_BYTES = 8 << 20


LONG_ADMIN = frozenset({"fsck", "gc"})  # admin calls that may take minutes on a large store


class BadResponse(Exception):
    """The server's answer was not HTTP/1.1 as this client speaks it (or it hung up)."""


def _connect(kind: str, where: str, port: int, timeout: float | None) -> socket.socket:
    if kind != "unix":
        s = socket.create_connection((where, port), timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(where)
    except OSError:
        s.close()
        raise
    return s


class _Conn:
    """One kept-alive HTTP/1.1 connection: just the protocol the API needs.

    The CLI's start-up cost is mostly imports, and `http.client` pulls in the
    email package; this is the few lines of HTTP/1.1 a request/answer needs
    (Content-Length or chunked answers, keep-alive). Server-sent events still
    use `http.client` (imported only there).
    """

    def __init__(self, kind: str, where: str, port: int, timeout: float | None) -> None:
        self.sock = _connect(kind, where, port, timeout)
        self.rfile = self.sock.makefile("rb")
        self.host = "localhost" if kind == "unix" else f"{where}:{port}"

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]
                ) -> tuple[int, dict[str, str], bytes]:
        if any(c in path for c in " \r\n\0") or not path.isascii():
            raise InvalidInput(f"not a request path: {path!r}")
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}",
                 f"Content-Length: {len(body or b'')}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if body and len(body) <= 256 * 1024:
            self.sock.sendall(head + body)  # one write: one wake-up of the server
        else:
            self.sock.sendall(head)
            if body:
                self.sock.sendall(body)
        status, rheaders = self._head()
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            data = b""
        elif rheaders.get("transfer-encoding", "").lower() == "chunked":
            data = self._chunked()
        elif "content-length" in rheaders:
            try:
                length = int(rheaders["content-length"])
            except ValueError as exc:
                raise BadResponse("bad Content-Length") from exc
            data = self._exactly(length)
        else:
            data = self.rfile.read()
            rheaders["connection"] = "close"
        return status, rheaders, data

    def _head(self) -> tuple[int, dict[str, str]]:
        """An answer's status and headers (names lower-cased)."""
        status_line = self._line()
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise BadResponse(f"bad status line {status_line[:80]!r}")
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS):
            line = self._line()
            if not line.strip():
                return int(parts[1]), headers
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise BadResponse(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        raise BadResponse("too many header lines")

    def _line(self) -> bytes:
        line = self.rfile.readline(MAX_HEADER_LINE + 1)
        if not line:
            raise BadResponse("the server closed the connection")
        if len(line) > MAX_HEADER_LINE:
            raise BadResponse("header line too long")
        return line

    def _exactly(self, n: int) -> bytes:
        if n < 0:
            raise BadResponse("bad Content-Length")
        data = self.rfile.read(n)
        if len(data) != n:
            raise BadResponse("the answer ended early")
        return data

    def _chunked(self) -> bytes:
        out = bytearray()
        while True:
            size_text = self._line().split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError as exc:
                raise BadResponse("bad chunk size") from exc
            if size == 0:
                while self._line().strip():  # trailers
                    pass
                return bytes(out)
            out += self._exactly(size)
            self._exactly(2)  # CRLF


class _LeanConn:
    """One connection of the lean stream (server/lean.py): [op, args] in, [status, result] out."""

    FRAME = struct.Struct(">I")

    def __init__(self, path: str, timeout: float) -> None:
        self.sock = _connect("unix", path, 0, timeout)
        self.rfile = self.sock.makefile("rb")

    def call(self, request: list[Any]) -> tuple[int, Any]:
        data = msgpack.packb(request, use_bin_type=True)
        if len(data) <= 256 * 1024:
            self.sock.sendall(self.FRAME.pack(len(data)) + data)  # one write, one wake-up
        else:
            self.sock.sendall(self.FRAME.pack(len(data)))
            self.sock.sendall(data)
        head = self.rfile.read(self.FRAME.size)
        if len(head) != self.FRAME.size:
            raise BadResponse("the lean stream closed")
        (length,) = self.FRAME.unpack(head)
        if length > wire.MAX_BODY:
            raise BadResponse(f"lean answer of {length} bytes")
        body = self.rfile.read(length)
        if len(body) != length:
            raise BadResponse("the lean answer ended early")
        try:
            answer = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise BadResponse(f"lean answer is not msgpack: {exc}") from None
        if not (isinstance(answer, list) and len(answer) == 2 and isinstance(answer[0], int)):
            raise BadResponse("lean answer is not [status, result]")
        return answer[0], answer[1]

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


_MISS = object()  # the lean stream could not answer: use HTTP


def http_connection(kind: str, where: str, port: int, timeout: float
                    ) -> http.client.HTTPConnection:
    """A `http.client` connection (unix or TCP), for streaming and for tests.

    `http.client` is imported here, not at the top: the CLI's common path never needs it.
    """
    import http.client

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = _connect("unix", where, 0, timeout)

    if kind == "unix":
        return UnixConnection("localhost", timeout=timeout)
    return http.client.HTTPConnection(where, port, timeout=timeout)


SOCKET_NAME = "serve.sock"


_KINDS_BY_LIKELIHOOD = (1, 3, 2, 4)  # block, tree node, file node, snapshot


def raise_http_error(status: int, data: bytes) -> None:
    """Raise the error an HTTP answer of `status` (400 or over) with body `data` carries."""
    try:
        err = json.loads(data)
    except ValueError:
        err = {"message": data[:200].decode(errors="replace")}
    wire.raise_error(status, err if isinstance(err, dict) else {})


def _verified(oid: bytes, raw: bytes) -> bytes:
    """`raw` if it is the object `oid` names (of any kind); a server is not trusted."""
    from strata.engine.objects import object_id
    for kind in _KINDS_BY_LIKELIHOOD:
        if object_id(kind, raw) == oid:
            return raw
    raise Corrupt("server", 0, f"the bytes sent for object {oid.hex()} do not match its id")


def default_socket(store_dir: str) -> str:
    """Where a store's server listens unless told otherwise."""
    return os.path.join(store_dir, SOCKET_NAME)


def is_serving(socket_path: str) -> bool:
    """True if a server accepts connections on `socket_path`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(socket_path)
    except OSError:
        return False
    finally:
        s.close()
    return True


def parse_server(url: str) -> tuple[str, str, int]:
    """`unix:PATH` or `http://HOST:PORT` -> (kind, host-or-path, port)."""
    if url.startswith("unix:"):
        return "unix", url[5:], 0
    import urllib.parse
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise InvalidInput(f"server must be unix:PATH or http://HOST:PORT, not {url!r}")
    return "tcp", parsed.hostname, parsed.port or 80


class RemoteStore(Store):
    """A `Store` served by `strata serve` (see the module docstring)."""

    # Every object get_object and get_objects return was checked against its id here
    # (the server is not trusted): a caller need not hash it again.
    verifies_reads = True

    def __init__(self, url: str, token: str | None = None, *, retry_for: float = 30.0,
                 timeout: float = 120.0, prefetch: bool = True) -> None:
        self.url = url
        # False: a publish answers with the heads alone (the caller keeps its own map).
        self.prefetch = prefetch
        self.kind, self.where, self.port = parse_server(url)
        self.token = token
        self.retry_for = retry_for
        self.timeout = timeout
        self._local = threading.local()
        self.node_cache = NodeCache()
        self._snap_cache: dict[str, SnapshotInfo] = {}
        self._prefetch_raw: dict[bytes, bytes] = {}  # tree nodes a publish sent back
        self._prefetch_bytes = 0  # their total length
        self._prefetch_lock = threading.Lock()
        self._block_size: int | None = None
        # Object reads and publishes take the lean stream when the server offers one.
        self._lean = wire.lean_path(self.where) if self.kind == "unix" else None
        self._lean_after = 0.0  # after a refused connect, HTTP only until then

    # -- transport -------------------------------------------------------------------

    def _conn(self) -> _Conn:
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = _Conn(self.kind, self.where, self.port, self.timeout)
            self._local.conn = conn
        return conn

    def _lean_call(self, *request: Any) -> Any:
        """The lean stream's result, or _MISS (no stream, a restart, changing owner)."""
        if self._lean is None or time.monotonic() < self._lean_after:
            return _MISS
        conn: _LeanConn | None = getattr(self._local, "lean", None)
        fresh = conn is None
        try:
            if conn is None:
                conn = self._local.lean = _LeanConn(self._lean, self.timeout)
            status, result = conn.call(list(request))
        except (OSError, BadResponse):
            self._drop_lean()
            if fresh:  # no stream, or it is full (it hangs up at once): HTTP for a second
                self._lean_after = time.monotonic() + 1.0
            return _MISS  # HTTP retries (a publish carries its id: a retry is safe)
        if status == 0:
            return result
        if status == 503:
            self._drop_lean()
            return _MISS  # changing owner: HTTP's retry loop waits for the successor
        wire.raise_error(status, result if isinstance(result, dict) else {})
        return _MISS  # not reached: raise_error raises

    def _drop_lean(self) -> None:
        conn = getattr(self._local, "lean", None)
        if conn is not None:
            conn.close()
            self._local.lean = None

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def request(self, method: str, path: str, body: bytes | None = None,
                ctype: str = "application/json", headers: dict[str, str] | None = None,
                ) -> tuple[int, dict[str, str], bytes]:
        """One API call with retries on 503 and on a missing or restarting server."""
        hdrs = {"Content-Type": ctype, **(headers or {})}
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"
        deadline = time.monotonic() + self.retry_for
        delay = 0.02
        while True:
            try:
                status, rheaders, data = self._conn().request(method, path, body, hdrs)
                if rheaders.get("connection", "").lower() == "close":
                    self._drop_conn()
            except (OSError, BadResponse) as exc:  # refused, reset, timeout
                self._drop_conn()
                if time.monotonic() >= deadline:
                    raise Unavailable(f"cannot reach strata server at {self.url}: {exc}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            # Only a 503 with Retry-After means "no owner for a moment"; any other 503
            # (a leased branch, a full disk) is the store's answer.
            if status == 503 and "retry-after" in rheaders and time.monotonic() < deadline:
                try:
                    wait = float(rheaders.get("retry-after", delay))
                except ValueError:
                    wait = delay
                time.sleep(min(max(wait, 0.01), 1.0, max(deadline - time.monotonic(), 0)))
                continue
            if status >= 400:
                raise_http_error(status, data)
            return status, rheaders, data

    def _json(self, method: str, path: str, payload: Any = None) -> Any:
        body = None if payload is None else json.dumps(payload).encode()
        _s, _h, data = self.request(method, path, body)
        return json.loads(data) if data else None

    # -- Store -------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        if self._block_size is None:
            self._block_size = int(self._json("GET", "/v1/info")["block_size"])
        return self._block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        self._block_size = value

    def missing(self, ids: Sequence[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for start in range(0, len(ids), 100_000):
            _s, _h, data = self.request("POST", "/v1/objects/missing",
                                        wire.encode_ids(ids[start:start + 100_000]),
                                        "application/octet-stream")
            out += wire.decode_ids(data)
        return out

    def put_objects(self, objects: Sequence[tuple[int, bytes]]) -> list[bytes]:
        from strata.engine.objects import object_id
        batch: list[tuple[int, bytes]] = []
        size = 0
        for kind, raw in objects:
            batch.append((kind, raw))
            size += len(raw)
            if size >= 32 * 1024 * 1024:
                self._put(batch)
                batch, size = [], 0
        if batch:
            self._put(batch)
        return [object_id(k, r) for k, r in objects]

    def _put(self, batch: list[tuple[int, bytes]]) -> None:
        self.request("POST", "/v1/objects", wire.encode_objects(batch),
                     "application/octet-stream")

    def get_object(self, oid: bytes) -> bytes:
        with self._prefetch_lock:
            raw = self._prefetch_raw.pop(oid, None)
            if raw is not None:
                self._prefetch_bytes -= len(raw)
        if raw is not None:
            return raw  # verified when it arrived
        got = self._lean_call("get", oid)
        if isinstance(got, bytes):
            return _verified(oid, got)
        if got is not _MISS:
            raise InvalidInput("the server answered an object read with no bytes")
        _s, _h, data = self.request("GET", f"/v1/objects/{oid.hex()}")
        return _verified(oid, data)

    def prefetch_path(self, tree: bytes, names: Sequence[bytes]) -> None:
        """The nodes a lookup of `names` below `tree` reads, in one lean round trip.

        They wait, verified, with the nodes a publish sent back; without
        the lean stream nothing is fetched here and each is read when needed.
        """
        with self._prefetch_lock:
            if tree in self._prefetch_raw:  # at hand; a node below that is not asks again
                return
        got = self._lean_call("get_path", tree, list(names))
        if got is _MISS:
            return
        if not isinstance(got, list) or not all(
                isinstance(x, list) and len(x) == 2 and isinstance(x[0], bytes)
                and len(x[0]) == 32 and isinstance(x[1], bytes) for x in got):
            raise InvalidInput("the server's path read answer is malformed")
        for oid, raw in got:
            self._prefetched(oid.hex(), raw)

    def get_file(self, ref: bytes, offset: int, end: int
                 ) -> tuple[FileNode, dict[bytes, bytes]]:
        """The root file node, and the nodes and chunks of [offset, end) that fit one answer.

        Every object is verified against its id; what the answer left out is
        the caller's to read. Without the lean stream: a request a level.
        """
        got = self._lean_call("get_file", ref, offset, end)
        if got is _MISS:
            return super().get_file(ref, offset, end)
        if not (isinstance(got, list) and len(got) == 2 and isinstance(got[0], bytes)
                and isinstance(got[1], list) and all(isinstance(b, bytes) for b in got[1])):
            raise InvalidInput("the server's file read answer is malformed")
        raw, objs = got
        if object_id(FILENODE, raw) != ref:
            raise Corrupt("server", 0,
                          f"the bytes sent for file node {ref.hex()} do not match its id")
        node = FileNode.decode(raw)
        # Walk the range as the server did: each object sent is the next id of the walk.
        sent = iter(objs)
        out: dict[bytes, bytes] = {}
        for _kind, oid in node.range_ids(offset, end, out.__getitem__):
            data = next(sent, None)
            if data is None:
                break
            out[oid] = _verified(oid, data)
        if next(sent, None) is not None:
            raise InvalidInput("the server's file read answer has blocks it was not asked for")
        return node, out

    def get_objects(self, ids: Sequence[bytes]) -> list[bytes]:
        out: list[bytes] = []
        start = 0
        while start < len(ids):
            chunk = ids[start:start + 1024]
            got = self._lean_call("get_many", list(chunk))
            if got is not _MISS:
                if not isinstance(got, list) or not 1 <= len(got) <= len(chunk) or not all(
                        isinstance(r, bytes) for r in got):
                    raise InvalidInput("the server's batch read answer is malformed")
                out += [_verified(oid, raw) for oid, raw in zip(chunk, got, strict=False)]
                start += len(got)
                continue
            _s, headers, data = self.request("POST", "/v1/objects/get", wire.encode_ids(chunk),
                                             "application/octet-stream")
            # The server may answer only the first ids (its answers are size-capped).
            count = int(headers.get("x-strata-count", len(chunk)))
            if not 1 <= count <= len(chunk):
                raise InvalidInput(f"server answered {count} of {len(chunk)} objects")
            out += [_verified(oid, raw) for oid, raw in zip(
                chunk[:count], wire.decode_blobs(data, count), strict=True)]
            start += count
        return out

    def get_range(self, oid: bytes, offset: int, length: int) -> bytes:
        # A range cannot be checked against the id: fetch the object whole and verify it.
        if length <= 0:
            return b""
        return self.get_object(oid)[offset:offset + length]

    def create_volume(self, name: str) -> str:
        return str(self._json("POST", "/v1/volumes", {"name": check_volume(name)})["head"])

    def delete_volume(self, name: str) -> None:
        self._json("DELETE", f"/v1/volumes/{check_volume(name)}")

    def list_volumes(self) -> list[str]:
        return list(self._json("GET", "/v1/volumes")["volumes"])

    def list_branches(self, volume: str) -> dict[str, str]:
        return dict(self._json("GET", f"/v1/volumes/{check_volume(volume)}/branches")[
            "branches"])

    def heads(self, refs: Sequence[tuple[str, str]]) -> list[str]:
        pairs = [[check_volume(v), check_branch(b)] for v, b in refs]
        return [str(h) for h in self._json("POST", "/v1/heads", {"refs": pairs})["heads"]]

    def fork(self, volume: str, new_branch: str, *, at: str | None) -> str:
        check_volume(volume)
        check_branch(new_branch)
        return str(self._json("POST", f"/v1/volumes/{volume}/branches",
                              {"name": new_branch, "at": at})["head"])

    def delete_branch(self, volume: str, branch: str) -> None:
        self._json("DELETE", f"/v1/volumes/{check_volume(volume)}/branches/"
                             f"{check_branch(branch)}")

    def find_snapshot(self, prefix: str) -> str:
        from urllib.parse import quote
        return str(self._json("GET", f"/v1/snapshots/{quote(prefix)}")["id"])

    def acquire_lease(self, volume: str, branch: str, ttl: float, holder: str = "", *,
                      steal: bool = False) -> Lease:
        body: dict[str, Any] = {"branch": branch, "ttl": ttl, "holder": holder}
        if steal:
            body["steal"] = True
        r = self._json("POST", f"/v1/volumes/{check_volume(volume)}/lease/acquire", body)
        return Lease(int(r["fencing"]), int(r["expires_ns"]), str(r.get("holder", "")),
                     id=str(r["lease"]))

    def renew_lease(self, volume: str, branch: str, lease: str, ttl: float) -> Lease:
        r = self._json("POST", f"/v1/volumes/{check_volume(volume)}/lease/renew",
                       {"branch": branch, "lease": lease, "ttl": ttl})
        return Lease(int(r["fencing"]), int(r["expires_ns"]), str(r.get("holder", "")),
                     id=str(r["lease"]))

    def release_lease(self, volume: str, branch: str, lease: str) -> None:
        self._json("POST", f"/v1/volumes/{check_volume(volume)}/lease/release",
                   {"branch": branch, "lease": lease})

    def pin(self, volume: str, sids: Sequence[str], ttl: float) -> list[str]:
        r = self._json("POST", f"/v1/volumes/{check_volume(volume)}/pins/pin",
                       {"snapshots": list(sids), "ttl": ttl})
        return [str(p) for p in r["pins"]]

    def renew_pins(self, volume: str, pins: Sequence[str], ttl: float) -> None:
        self._json("POST", f"/v1/volumes/{check_volume(volume)}/pins/renew",
                   {"pins": list(pins), "ttl": ttl})

    def release_pins(self, volume: str, pins: Sequence[str]) -> None:
        self._json("POST", f"/v1/volumes/{check_volume(volume)}/pins/release",
                   {"pins": list(pins)})

    def publish(self, changesets: Sequence[ChangeSet],
                objects: Sequence[tuple[int, bytes]] = (), *,
                txid: bytes | None = None) -> list[str]:
        if not changesets:
            raise InvalidInput("nothing to publish")
        # One id for every attempt of this publish: `request` may send it again
        # after a lost answer, and the store recognises its own work.
        body = wire.encode_publish(changesets, objects, txid=txid or os.urandom(16),
                                   prefetch=self.prefetch)
        got = self._lean_call("publish", body)
        if got is not _MISS:
            if not isinstance(got, dict) or not isinstance(got.get("heads"), list):
                raise InvalidInput("the server's publish answer is malformed")
            for item in got.get("prefetch") or ():
                if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) \
                        and isinstance(item[1], bytes) and len(item[0]) == 64:
                    self._prefetched(item[0], item[1])
            return [str(h) for h in got["heads"]]
        _s, _h, data = self.request("POST", "/v1/publish", body, "application/msgpack")
        reply = json.loads(data)
        for oid, raw64 in reply.get("prefetch") or ():
            self._prefetched(oid, base64.b64decode(raw64))
        return [str(h) for h in reply["heads"]]

    def _prefetched(self, oid_hex: str, raw: bytes) -> None:
        # Verified like any object: the cache must never hold bytes under a wrong id.
        # A tree node is kept raw and decoded only if it is read (most never are).
        from strata.engine.objects import SNAPSHOT, TREE, Snapshot, object_id
        oid = bytes.fromhex(oid_hex)
        if object_id(SNAPSHOT, raw) == oid:
            self.snapshot_cache_put(SnapshotInfo.of(oid_hex, Snapshot.decode(raw)))
        elif object_id(TREE, raw) == oid:
            with self._prefetch_lock:
                old = self._prefetch_raw.pop(oid, None)
                self._prefetch_bytes += len(raw) - (len(old) if old is not None else 0)
                self._prefetch_raw[oid] = raw
                while len(self._prefetch_raw) > PREFETCH_KEEP \
                        or self._prefetch_bytes > PREFETCH_KEEP_BYTES:
                    self._prefetch_bytes -= len(self._prefetch_raw.pop(
                        next(iter(self._prefetch_raw))))

    def whoami(self) -> dict[str, Any]:
        """The caller's scope: owner, volume, branch, writable."""
        return dict(self._json("GET", "/v1/whoami"))

    def note_step(self, volume: str, branch: str, run: str, status: int, *,
                  timed_out: bool = False, oom: bool = False,
                  argv: Sequence[str] = ()) -> None:
        """Tell those following the branch that a step on it ended without publishing."""
        self._json("POST", f"/v1/volumes/{volume}/steps", {
            "branch": branch, "run": run, "status": status, "timed_out": timed_out,
            "oom": oom, "argv": [a[:1024] for a in list(argv)[:64]]})

    # -- owner administration (unix socket) ---------------------------------------------

    def events(self, refs: Sequence[str], since: str | None = None,
               heads: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
        """Follow `GET /events` (server-sent events) until the stream ends.

        Each event carries `_id` (its SSE id, for `since` on a reconnect) when it
        has one. `heads` ("VOLUME@BRANCH" -> snapshot) is what the caller already
        reported, so a server that cannot replay from its ring catches up from
        history instead. The stream's own connection, never the kept-alive one.
        """
        path = events_path(refs, since, heads)
        hdrs = {"Accept": "text/event-stream"}
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"
        conn = http_connection(self.kind, self.where, self.port, self.timeout)
        try:
            conn.request("GET", path, headers=hdrs)
            resp = conn.getresponse()
            if resp.status >= 400:
                raise_http_error(resp.status, resp.read())
            yield from read_events(resp)
        finally:
            conn.close()

    def admin(self, method: str, path: str, payload: Any = None) -> Any:
        if path not in LONG_ADMIN:
            return self._json(method, f"/v1/admin/{path}", payload)
        # A pass over a large store answers after minutes (fsck of 10M objects ran
        # past this client's 120 s and failed): a connection of its own, no timeout.
        saved = getattr(self._local, "conn", None)
        self._local.conn = _Conn(self.kind, self.where, self.port, None)
        try:
            return self._json(method, f"/v1/admin/{path}", payload)
        finally:
            conn = getattr(self._local, "conn", None)
            if conn is not None:
                conn.close()
            self._local.conn = saved

    def close(self) -> None:
        self._drop_conn()
        self._drop_lean()


def events_path(refs: Sequence[str], since: str | None,
                heads: dict[str, str] | None) -> str:
    """`GET /events`'s path and query for what a reader follows and last had."""
    from urllib.parse import urlencode
    query = [("ref", r) for r in refs]
    if since:
        query.append(("since", since))
    query += [("head", f"{ref}={sid}") for ref, sid in (heads or {}).items()]
    return "/events" + ("?" + urlencode(query) if query else "")


def read_events(resp: Any) -> Iterator[dict[str, Any]]:
    """The events of a server-sent event answer, until it ends (each with `_id` if it has one)."""
    sid: str | None = None
    data_lines: list[str] = []
    while True:
        raw = resp.readline()
        if not raw:
            return
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line == "":
            if data_lines:
                event = json.loads("\n".join(data_lines))
                if sid is not None:
                    event["_id"] = sid
                yield event
            sid, data_lines = None, []
        elif line.startswith("id:"):
            sid = line[3:].strip()
        elif line.startswith("data:"):
            data_lines.append(line[5:].lstrip())
