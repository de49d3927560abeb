"""Who may hold a TCP connection: a cap per peer and one for all of TCP.

A half-open request costs the server a descriptor for as long as its client
keeps it open. Before these caps 3,000 connections that never finished their
headers were held for as long as their clients liked; with the descriptor
limit at 1,024, 1,100 of them left no descriptor for token holders, nor for
the owner's unix socket, where `strata ls` got no answer for 30 s.

So TCP is admitted here, at `connection_made`, before aiohttp sees a byte:

- one peer (an IPv4 address, or an IPv6 /64, which one host usually holds
  whole) holds at most MAX_PER_PEER connections;
- all of TCP holds at most `tcp_cap()`, half of what the descriptor limit
  leaves after FD_RESERVE, so the rest stays for the unix sockets (the
  owner's HTTP socket and the lean stream), the store's files and the
  threads' work.

A connection over either cap is closed at once (its client sees a reset and
may retry); nothing else about it is read. How long an admitted connection
may take to send its request is the runner's business (`serve.py`: the header
timeout) and the handlers' (`app.py`: the body timeout).

This module must never apply to the unix sockets: they are the owner's, and
the capacity left for them is the point.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import resource
import socket
from collections import Counter
from typing import Any, cast

from aiohttp import web

log = logging.getLogger(__name__)

MAX_PER_PEER = 64      # TCP connections one peer (IPv4 address, IPv6 /64) holds at once
MAX_TCP = 4096         # TCP connections at once, whatever the descriptor limit
FD_RESERVE = 512       # descriptors never counted towards TCP (lean threads, packs, unix)


def tcp_cap(soft_limit: int | None = None) -> int:
    """TCP connections held at once: half of what the descriptor limit leaves after the reserve."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        soft_limit = 1 << 20
    return max(16, min(MAX_TCP, (soft_limit - FD_RESERVE) // 2))


def peer_key(peername: Any) -> str:
    """The peer a connection is counted against: its IPv4 address, or its IPv6 /64."""
    host = peername[0] if isinstance(peername, tuple) and peername else str(peername)
    try:
        addr = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return str(host)
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{addr}/64", strict=False))
    return str(addr)


class Admission:
    """Counts of TCP connections held, in total and per peer (event loop only)."""

    def __init__(self, total: int | None = None, per_peer: int = MAX_PER_PEER) -> None:
        self.total = tcp_cap() if total is None else total
        self.per_peer = per_peer
        self.held = 0
        self.by_peer: Counter[str] = Counter()
        self.refused = 0

    def admit(self, key: str) -> bool:
        if self.held >= self.total or self.by_peer[key] >= self.per_peer:
            self.refused += 1
            return False
        self.held += 1
        self.by_peer[key] += 1
        return True

    def report(self) -> dict[str, int]:
        return {"held": self.held, "cap": self.total, "per_peer": self.per_peer,
                "peers": len(self.by_peer), "refused": self.refused}

    def release(self, key: str) -> None:
        self.held -= 1
        self.by_peer[key] -= 1
        if self.by_peer[key] <= 0:
            del self.by_peer[key]


class _Admitted(asyncio.Protocol):
    """aiohttp's protocol for one connection, reached only if the connection is admitted."""

    def __init__(self, inner: asyncio.Protocol, admission: Admission) -> None:
        self.inner = inner
        self.admission = admission
        self.key: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        key = peer_key(transport.get_extra_info("peername"))
        if not self.admission.admit(key):
            log.debug("TCP connection from %s refused: over a cap", key)  # `stats` counts them
            cast(asyncio.Transport, transport).abort()  # a reset now, not a descriptor held
            return
        self.key = key
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.key is None:
            return
        self.admission.release(self.key)
        self.key = None
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.key is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.key is not None else None

    def pause_writing(self) -> None:
        if self.key is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.key is not None:
            self.inner.resume_writing()


class AdmittedSite(web.SockSite):
    """A TCP listener whose connections pass `Admission` before aiohttp serves them."""

    __slots__ = ("_admission",)

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, admission: Admission,
                 *, backlog: int = 512) -> None:
        super().__init__(runner, sock, backlog=backlog)
        self._admission = admission

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; SockSite's own start is replaced
        server = self._runner.server
        assert server is not None
        admission = self._admission
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Admitted(server(), admission), sock=self._sock, backlog=self._backlog)
