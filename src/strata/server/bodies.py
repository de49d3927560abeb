"""Request bodies and the byte budgets: how much a client may send, and hold, at once.

Every body the HTTP API reads comes through `read_body`: within MAX_BODY
bytes, each read within BODY_TIMEOUT, refused if it carries a
Content-Encoding (`UnsupportedEncoding`). Large bodies and large answers are
held in server-wide budgets while they are in memory: `ByteBudget` on the
event loop (the HTTP handlers), `BlockingBudget` in threads (the lean
stream, server/lean.py), with the same limits.

This module reads bodies and counts bytes; it never touches the store and
never decides who may do what (server/auth.py does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiohttp import web

from strata.engine.errors import InvalidInput
from strata.server import wire

MAX_BODY = wire.MAX_BODY
MAX_BATCH_GET = 1024  # ids per batch read
MAX_BATCH_ANSWER = 32 * 1024 * 1024  # bytes of objects in one batch answer (or its first one)
# Bytes of large request bodies held at once, server-wide: a request whose body
# would pass it waits (small requests, under LARGE_BODY, never do).
BODY_BUDGET = 256 * 1024 * 1024
LARGE_BODY = 1024 * 1024
# Bytes of objects being answered at once, server-wide (counted from their
# raw sizes before they are read): an answer that would pass it waits. An
# answer is held about three times while it is built and sent, so reads hold
# at most about 200 MiB, beside the bodies' budget.
ANSWER_BUDGET = 64 * 1024 * 1024
# Seconds a body read may wait for its next bytes (the head has serve.HEADER_TIMEOUT).
BODY_TIMEOUT = 10.0


class ByteBudget:
    """Bytes of large bodies or answers in memory at once, server-wide (event loop only)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        if n < LARGE_BODY:
            yield
            return
        n = min(n, self.limit)
        if self._cond is None:
            self._cond = asyncio.Condition()
        cond = self._cond
        async with cond:
            await cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        try:
            yield
        finally:
            async with cond:
                self.used -= n
                cond.notify_all()


class BlockingBudget:
    """As `ByteBudget`, for threads: the lean stream's requests or answers wait for room."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        if n < LARGE_BODY:
            yield
            return
        n = min(n, self.limit)
        with self._cond:
            self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        try:
            yield
        finally:
            with self._cond:
                self.used -= n
                self._cond.notify_all()


def body_size(request: web.Request) -> int:
    """What a request's body may hold in memory: its length, or the most a chunked one may."""
    if request.content_length is not None:
        return request.content_length
    return MAX_BODY if request.body_exists else 0


class UnsupportedEncoding(InvalidInput):
    """A request body with a Content-Encoding: 415, refused before a byte of it is read.

    aiohttp would inflate a gzip body before any check of ours (126 KiB of
    gzip made 128 MiB, and eight such requests 1.3 GiB), so the server takes
    bodies only as they travel: the runner is made with auto_decompress off,
    and this refusal says so. No strata client compresses a request.
    """

    http_status = 415


def check_encoding(request: web.Request) -> None:
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedEncoding(
            f"request bodies are taken without Content-Encoding, not {encoding[:40]!r}")


class TooLarge(InvalidInput):
    """A request body over MAX_BODY: 413, with the same JSON error as any other refusal."""

    http_status = 413


class TooSlow(InvalidInput):
    """A request body that stopped arriving: 408, and the connection is closed."""

    http_status = 408


async def read_body(request: web.Request, limit: int = MAX_BODY) -> bytes:
    """The whole body, within `limit` bytes, each read within BODY_TIMEOUT.

    The timeout is per read, as nginx's client_body_timeout: a large body on a
    slow link may take long, but one that stops arriving is cut off, and its
    connection with it, instead of holding a connection (and a share of the
    body budget) for as long as its client likes.
    """
    if request.content_length is not None and request.content_length > limit:
        raise TooLarge(f"request body over {limit} bytes")
    data = bytearray()
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(BODY_TIMEOUT) as deadline:
            while True:
                chunk = await request.content.readany()
                if not chunk:
                    break
                deadline.reschedule(loop.time() + BODY_TIMEOUT)
                data += chunk
                if len(data) > limit:  # a chunked body only says its size as it arrives
                    raise TooLarge(f"request body over {limit} bytes")
    except TimeoutError:
        raise TooSlow(f"request body stalled: nothing arrived for {BODY_TIMEOUT:g} s") from None
    except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
        raise InvalidInput("request body truncated") from exc
    if request.content_length is not None and len(data) != request.content_length:
        raise InvalidInput("request body truncated")
    return bytes(data)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (read by `read_body`, with its limits)."""
    try:
        body = json.loads(await read_body(request))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"request body is not JSON: {exc}") from exc
    except RecursionError:
        raise InvalidInput("request body is not JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidInput("request body must be a JSON object")
    return body


def body_field(body: dict[str, Any], name: str, kind: type | tuple[type, ...],
               *, optional: bool = False) -> Any:
    """One field of a JSON body, of type `kind` (a bool is never taken for a number)."""
    v = body.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise InvalidInput(f"field {name!r} is missing or has the wrong type")
    return v
