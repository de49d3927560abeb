"""The forward's fast path: a small request to another member over kept-alive HTTP/1.1.

aiohttp's client spends about 0.15 ms of Python on each request (a URL
object, header maps, a request and an answer object, timers), which was half
of what a forward added to a small read. A forward needs much less: write
the head and a body already in hand, read a status line, headers and a body
of known length. That is all this speaks, over connections kept per member:

- only requests whose body is already read whole (or have none), and never
  event streams (forward.py's aiohttp path takes those, and streamed bodies);
- an answer with a length up to forward.SMALL is read whole; a longer one,
  or a chunked one, is passed on a buffer at a time, as forward.py does, and
  cut off (the connection closed) if it stops short;
- a kept connection that fails before a byte of the answer came is retried
  once on a new one (the other member closed it idle; a publish carries its
  txid, so a repeat is found, not made twice); anything else is
  `Unreachable` and the member answers 503.

It never reads a client's body and decides nothing about who may ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from aiohttp import web
from multidict import CIMultiDict

from strata.fleet.forward import HOP, PIECE, POLL, SMALL, WRITE_TIMEOUT, Unreachable

MAX_HEAD = 64 * 1024     # an answer's status line and headers, at most
MAX_HEADERS = 100
IDLE_FOR = 20.0          # a kept connection unused this long is closed (aiohttp keeps 75 s)
KEEP = 32                # idle connections kept per member


class BadAnswer(Exception):
    """Not HTTP/1.1 as this speaks it."""


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.used = time.monotonic()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class QuickHops:
    """Kept-alive connections to other members, and the small-request relay over them."""

    def __init__(self, connect_timeout: float, answer_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self.answer_timeout = answer_timeout
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def _get(self, where: tuple[str, int]) -> tuple[_Conn, bool]:
        idle = self._idle.get(where)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.used < IDLE_FOR and not conn.reader.at_eof() \
                    and not conn.writer.is_closing():
                return conn, True
            conn.close()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(*where, limit=MAX_HEAD), self.connect_timeout)
        return _Conn(reader, writer), False

    def _put(self, where: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(where, [])
        if len(idle) >= KEEP:
            conn.close()
            return
        conn.used = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    async def relay(self, request: web.Request, addr: str, headers: dict[str, str],
                    body: bytes | None, *, alive: Callable[[], bool]) -> web.StreamResponse:
        host, _, port = addr.removeprefix("http://").rpartition(":")
        where = (host.strip("[]"), int(port))
        lines = [f"{request.method} {request.path_qs} HTTP/1.1", f"Host: {host}:{port}"]
        lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() != "content-length"]
        if body is not None or request.method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        # Back to the bytes the client sent: aiohttp decodes heads as UTF-8, keeping any
        # other byte as a surrogate.
        message = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") \
            + (body or b"")
        for attempt in (0, 1):
            try:
                conn, reused = await self._get(where)
            except (OSError, TimeoutError) as exc:  # refused, unreachable, no answer
                raise Unreachable(str(exc) or type(exc).__name__) from exc
            try:
                conn.writer.write(message)
                status, answer = await asyncio.wait_for(_head(conn.reader), self.answer_timeout)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    BadAnswer, TimeoutError) as exc:
                conn.close()
                if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                    continue  # closed while idle: once more, on a new connection
                raise Unreachable(str(exc) or type(exc).__name__) from exc
            break
        try:
            return await self._answer(request, where, conn, status, answer, alive)
        except BaseException:
            conn.close()
            raise

    async def _answer(self, request: web.Request, where: tuple[str, int], conn: _Conn,
                      status: int, answer: CIMultiDict[str],
                      alive: Callable[[], bool]) -> web.StreamResponse:
        out: CIMultiDict[str] = CIMultiDict(
            (k, v) for k, v in answer.items()
            if k.lower() not in HOP and k.lower() not in ("date", "server"))
        keep = answer.get("Connection", "").lower() != "close"
        chunked = "chunked" in answer.get("Transfer-Encoding", "").lower()
        length: int | None = None
        if request.method == "HEAD" or status in (204, 304):
            length = 0
        elif not chunked and "Content-Length" in answer:
            if not answer["Content-Length"].isdigit():
                raise Unreachable("bad Content-Length")
            length = int(answer["Content-Length"])
        if length is not None and length <= SMALL:
            try:
                data = await asyncio.wait_for(conn.reader.readexactly(length),
                                              self.answer_timeout)
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                conn.close()
                raise Unreachable("the answer ended early") from exc
            if keep:
                self._put(where, conn)
            else:
                conn.close()
            return web.Response(status=status, body=data, headers=out)
        resp = web.StreamResponse(status=status, headers=out)
        if length is not None:
            resp.content_length = length
        await resp.prepare(request)
        whole = await _pump(conn.reader, resp, length, chunked, alive)
        if whole and length is not None or whole and chunked:
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
            if keep:
                self._put(where, conn)
            else:
                conn.close()
        else:
            conn.close()
            if whole:  # read to the end of the connection: that was its length
                with contextlib.suppress(ConnectionError):
                    await resp.write_eof()
            elif request.transport is not None:
                request.transport.close()  # cut short: the client must not take it as whole
        return resp


async def _head(reader: asyncio.StreamReader) -> tuple[int, CIMultiDict[str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw[:-4].decode("utf-8", "replace").split("\r\n")  # aiohttp writes UTF-8
    parts = lines[0].split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise BadAnswer(f"bad status line {lines[0][:80]!r}")
    if len(lines) > MAX_HEADERS + 1:
        raise BadAnswer("too many header lines")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadAnswer(f"bad header line {line[:80]!r}")
        headers.add(name, value.strip())
    return int(parts[1]), headers


async def _read(reader: asyncio.StreamReader, n: int, alive: Callable[[], bool]) -> bytes:
    """Up to `n` bytes (b"" at the end), asking `alive` whenever nothing comes for POLL."""
    while True:
        try:
            return await asyncio.wait_for(reader.read(n), POLL)
        except TimeoutError:
            if not alive():
                raise ConnectionError("the source no longer owns the store") from None


async def _pump(reader: asyncio.StreamReader, out: web.StreamResponse, length: int | None,
                chunked: bool, alive: Callable[[], bool]) -> bool:
    """Pass the answer's body on a buffer at a time; True if it all came."""
    try:
        if chunked:
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0].strip() or b"x", 16)
                if size == 0:
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":
                        pass  # trailers: not passed on
                    return True
                while size:
                    piece = await _read(reader, min(size, PIECE), alive)
                    if not piece:
                        return False
                    size -= len(piece)
                    await asyncio.wait_for(out.write(piece), WRITE_TIMEOUT)
                if await reader.readexactly(2) != b"\r\n":
                    return False
        left = length
        while left is None or left > 0:
            piece = await _read(reader, PIECE if left is None else min(left, PIECE), alive)
            if not piece:
                return left is None
            if left is not None:
                left -= len(piece)
            await asyncio.wait_for(out.write(piece), WRITE_TIMEOUT)
        return True
    except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError,
            asyncio.LimitOverrunError):
        return False
