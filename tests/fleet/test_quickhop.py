"""The forward's fast path (fleet/quickhop.py) between two real aiohttp servers on loopback.

A front server passes every request to a back server through `QuickHops`,
as a member forwards to an owner; a real aiohttp client asks the front. The
answers cover what an owner sends: small, large with a length, chunked, cut
off half way, and a kept connection the back closed while it sat idle.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest
from aiohttp import web

from strata.fleet.forward import request_body, request_headers
from strata.fleet.quickhop import QuickHops

BIG = os.urandom(3 * 1024 * 1024 + 11)
PIECES = [os.urandom(100_000) for _ in range(5)]


async def back_small(request: web.Request) -> web.Response:
    return web.json_response({"got": (await request.read()).decode(),
                              "q": request.query.get("q"),
                              "agent": request.headers.get("User-Agent")},
                             headers={"X-Back": "1"})


async def back_big(request: web.Request) -> web.Response:
    return web.Response(body=BIG)


async def back_chunked(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for piece in PIECES:
        await resp.write(piece)
    await resp.write_eof()
    return resp


async def back_cut(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.content_length = len(BIG)
    await resp.prepare(request)
    await resp.write(BIG[:500_000])
    assert request.transport is not None
    request.transport.close()
    return resp


async def run() -> None:
    back = web.Application()
    back.router.add_post("/small", back_small)
    back.router.add_get("/big", back_big)
    back.router.add_get("/chunked", back_chunked)
    back.router.add_get("/cut", back_cut)
    # keepalive_timeout 0.3 s: the back closes kept connections while the front holds them.
    back_runner = web.AppRunner(back, keepalive_timeout=0.3)
    await back_runner.setup()
    back_site = web.TCPSite(back_runner, "127.0.0.1", 0)
    await back_site.start()
    port = back_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    hops = QuickHops(2.0, 2.0)

    async def front_handler(request: web.Request) -> web.StreamResponse:
        body = await request_body(request, whole=True)
        assert body is None or isinstance(body, bytes)
        return await hops.relay(request, f"http://127.0.0.1:{port}", request_headers(request),
                                body, alive=lambda: True)

    front = web.Application()
    front.router.add_route("*", "/{tail:.*}", front_handler)
    front_runner = web.AppRunner(front)
    await front_runner.setup()
    front_site = web.TCPSite(front_runner, "127.0.0.1", 0)
    await front_site.start()
    fport = front_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{fport}"
    try:
        async with aiohttp.ClientSession() as client:
            for i in range(3):
                async with client.post(base + "/small?q=x%20y", data=b"hello",
                                       headers={"User-Agent": "mine"}) as r:
                    assert r.status == 200 and r.headers["X-Back"] == "1"
                    assert await r.json() == {"got": "hello", "q": "x y", "agent": "mine"}
                if i == 1:
                    await asyncio.sleep(0.6)  # the back closed the kept connection by now
            async with client.get(base + "/big") as r:
                assert await r.read() == BIG
            async with client.get(base + "/chunked") as r:
                assert await r.read() == b"".join(PIECES)
            async with client.get(base + "/nothing-here") as r:
                assert r.status == 404
            async with client.get(base + "/cut") as r:
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()  # short, never taken as whole
    finally:
        hops.close()
        await front_runner.cleanup()
        await back_runner.cleanup()


def test_quick_hops_pass_answers_of_every_shape() -> None:
    asyncio.run(run())
