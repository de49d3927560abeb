"""Passing one API request on, as it came, and its answer back: a member's two hops.

A member passes a request either to a store it owns (the store's own server,
in the same process) or to the member that owns it. Either way this module
does the passing:

- a body up to `SMALL` bytes, from a caller that holds the fleet's secret,
  is read whole and sent in one write; any other body (a large one, or one
  from a caller with only a scoped token) is streamed through as the owner
  reads it, so a member never holds more than a buffer of it and the owner's
  server checks the caller before it reads a byte;
- an answer up to `SMALL` bytes is read whole; a larger one, one without a
  length, and every event stream are streamed back a buffer at a time (the
  owner is not read faster than the client reads);
- a streamed answer whose source stops being the owner (`alive()` turns
  false: the store moved, its owner died or lost its lease) ends at once. An
  event stream ends cleanly, so the client reconnects with its last event id
  (through any member, to the new owner); any other answer is cut off, so
  the client sees it short and asks again.

A forward to another member whose body is in hand, and that is not an event
stream, takes the fast path of fleet/quickhop.py instead (same rules, fewer
layers). Headers a member uses itself (the fleet secret, the forwarding mark) are
never passed on from a client. This module decides nothing about who may
ask (member.py) or who owns what; it never reads the bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

SMALL = 256 * 1024      # bodies and answers up to this are read whole
PIECE = 64 * 1024       # a streamed body is passed on this much at a time
POLL = 0.2              # seconds between asking whether a stream's source still owns it
WRITE_TIMEOUT = 30.0    # a client that reads nothing of a streamed answer for this long is cut
HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                 "content-encoding", "te", "trailer", "upgrade", "proxy-authorization",
                 "proxy-connection", "expect"})
INTERNAL = frozenset({"x-strata-fleet-token", "x-strata-forwarded"})
EVENT_PATHS = frozenset({"/events", "/ui/events"})


def proxy_session(connector: aiohttp.BaseConnector) -> aiohttp.ClientSession:
    """A client session that passes requests on as they came.

    No cookie jar: one session carries every client's requests, so a cookie one
    owner answer set must never ride along on another client's request. No
    headers of its own (User-Agent, Accept, Accept-Encoding), and bodies are
    passed on as they are, never inflated.
    """
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                 auto_decompress=False,
                                 skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))


class Unreachable(Exception):
    """The owner did not answer (refused, reset, timed out) before any byte went back."""


def is_stream(request: web.Request) -> bool:
    """Whether the answer will be an event stream (no read timeout: it idles by design)."""
    return request.path in EVENT_PATHS \
        or "text/event-stream" in request.headers.get("Accept", "")


def request_headers(request: web.Request, drop: frozenset[str] = INTERNAL) -> dict[str, str]:
    """The client's headers to pass on: not hop-by-hop ones, not the member's own."""
    out = {k: v for k, v in request.headers.items()
           if k.lower() not in HOP and k.lower() not in drop}
    if request.content_length is not None:
        out["Content-Length"] = str(request.content_length)  # the owner refuses by length
    return out


async def request_body(request: web.Request, *, whole: bool) -> bytes | AsyncIterator[bytes] | None:
    """What to send on: the bytes (small, `whole`), a stream of them, or nothing."""
    if not request.body_exists:
        return None
    if whole and request.content_length is not None and request.content_length <= SMALL:
        return await request.read()

    async def pieces() -> AsyncIterator[bytes]:
        async for piece in request.content.iter_chunked(PIECE):
            yield piece
    return pieces()


def _answer_headers(resp: aiohttp.ClientResponse, extra: dict[str, str]) -> dict[str, str]:
    out = {k: v for k, v in resp.headers.items()
           if k.lower() not in HOP and k.lower() not in ("date", "server")}
    out.update(extra)
    return out


async def relay(request: web.Request, session: aiohttp.ClientSession, url: str,
                headers: dict[str, str], body: bytes | AsyncIterator[bytes] | None, *,
                timeout: aiohttp.ClientTimeout, alive: Callable[[], bool],
                extra: dict[str, str]) -> web.StreamResponse:
    """Send the request to `url` and answer the client with what comes back (module docstring).

    `Unreachable` if nothing came back; once the answer's head is sent, a
    failure ends or cuts the answer instead.
    """
    try:
        # A streamed body waits for the owner's "100 Continue": the request's head
        # goes at once, and the owner may refuse it before a byte of the body is read
        # (without this, the head waited for the body's first piece).
        async with session.request(request.method, url, data=body, headers=headers,
                                   timeout=timeout,
                                   expect100=body is not None and not isinstance(body, bytes),
                                   ) as resp:
            out_headers = _answer_headers(resp, extra)
            events = resp.headers.get("Content-Type", "").startswith("text/event-stream")
            length = resp.content_length
            if not events and length is not None and length <= SMALL:
                return web.Response(status=resp.status, body=await resp.read(),
                                    headers=out_headers)
            out = web.StreamResponse(status=resp.status, headers=out_headers)
            if length is not None and not events:
                out.content_length = length
            await out.prepare(request)
            whole = await _pump(resp, out, alive)
            if whole or events:
                # An event stream ends cleanly whatever ended it: its reader reconnects
                # with the last event id it had, and the new owner catches it up.
                with contextlib.suppress(ConnectionError):
                    await out.write_eof()
            elif request.transport is not None:
                request.transport.close()  # cut short: the client must not take it as whole
            return out
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
        raise Unreachable(str(exc) or type(exc).__name__) from exc


async def _pump(resp: aiohttp.ClientResponse, out: web.StreamResponse,
                alive: Callable[[], bool]) -> bool:
    """Copy the answer's body a buffer at a time; True if it all came."""
    while True:
        try:
            # Cancelling a pending readany loses nothing: the bytes stay buffered.
            piece = await asyncio.wait_for(resp.content.readany(), POLL)
        except TimeoutError:
            if not alive():
                return False
            continue
        except (aiohttp.ClientError, ConnectionError):
            return False
        if not piece:
            return resp.content.is_eof() and resp.content.exception() is None
        try:
            await asyncio.wait_for(out.write(piece), WRITE_TIMEOUT)
        except (TimeoutError, ConnectionError):
            return False
