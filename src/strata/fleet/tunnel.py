"""Tunnels: a client's connection carried through a member to a store's owner, unread.

A forward costs the member a whole HTTP request of its own: the request parsed,
routed and written again, and the answer read and written back (about 0.35 ms
of Python on this 2-core machine, beside 0.45 ms for the request itself). A
client that will send many requests for one store asks once instead:

    CONNECT store/<name> HTTP/1.1        (or volume/<name>, placed by the catalog)
    X-Strata-Fleet-Token: ...            (or Authorization: Bearer ..., store/ only)

and the member answers `200` and then either

- **carries** the connection: it opened its own connection to the owner
  member, said there who it is (`POST /fleet/v1/tunnel`, marked with the
  fleet's secret as a forward is), and from then on copies bytes both ways
  without reading them. The owner handles every request on that connection
  as a client's request that entered the fleet here (its traffic counts for
  this member, fleet/traffic.py), and checks each caller as it checks any
  client; or
- **keeps** it: the connection is handed to this member's own HTTP server,
  exactly as if the client had connected for plain requests. That is the
  answer when this member owns the store, when the store has no owner right
  now (each request then gets the usual 503), when the volume is not in the
  catalog yet (a create), when the owner member does not answer, and for a
  caller that may not ask (each request then gets the usual 403). The answer
  says which (`X-Strata-Tunnel: kept MEMBER`, or the owner's name). So a
  `CONNECT` never answers differently for a store or volume that exists and
  one that does not, to a caller without the fleet's secret.

Where the kernel allows it, the two sockets of a carried connection are
joined by a BPF sockmap (fleet/splice.py): the kernel moves the bytes and
the member is not woken per request; elsewhere the member copies them.

A carried connection is cut (both ends closed) when the member's view of the
store's lease stops naming the same owner serving it: checked after each
read of the leases (5 times a second), so a client waiting on an answer from
an owner that lost the store hears so then, and, when the member copies
the bytes itself, each time the client sends some. A request sent before
the cut reaches the old owner, which handles it as any request for a store
it does not own: forwarded to the owner it knows, or answered 503. A cut
request never got an answer; the client sends it again (a publish keeps its
txid), through the next member, which opens a new tunnel to the new owner.

Which bytes go where is all this module decides. It reads only the `CONNECT`
head and the owner's answer to its own `POST`; it never reads a client's
request, so it never holds more than the socket buffers of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

from strata.fleet.splice import Splice

log = logging.getLogger(__name__)

TUNNEL_PATH = "/fleet/v1/tunnel"
MAX_HEAD = 16 * 1024        # a CONNECT head (and the owner's answer to the opening POST)
DECIDE_WITHIN = 30.0        # a connection that has sent no whole first head by then is closed
PREFIX = b"CONNECT "
OK = b"HTTP/1.1 200 Connection established\r\n"
# A joined tunnel whose bytes wait in the member's kernel past this (an end not
# reading) is cut at the next sweep: the kernel queues them without a bound.
SPLICE_HOLD = 16 << 20

# Where a tunnel goes: (host, port, the owner's name, alive, whether the caller
# holds the fleet's secret and so may be carried by the kernel), or None (kept here).
Target = tuple[str, int, str, Callable[[], bool], bool] | None
Resolve = Callable[[bytes, dict[bytes, bytes]], Awaitable[Target]]


class Tunnels:
    """A member's tunnels: the protocol its TCP listener starts every connection with."""

    def __init__(self, name: str, http: Callable[[], asyncio.Protocol], resolve: Resolve,
                 mark: Callable[[], str], connect_timeout: float) -> None:
        self.name = name            # this member's
        self.http = http            # the member's own HTTP server protocol (aiohttp)
        self.resolve = resolve      # a CONNECT's target and head -> where it goes
        self.mark = mark            # the forwarding mark the owner checks
        self.connect_timeout = connect_timeout
        self.carried: set[_Pipe] = set()
        self.opened = 0             # tunnels carried since start (for status and tests)
        self.splice = Splice.create()  # None: the member copies carried bytes itself

    def protocol(self) -> asyncio.Protocol:
        return _Entry(self)

    def close(self) -> None:
        for pipe in list(self.carried):
            pipe.close()
        if self.splice is not None:
            self.splice.close()
            self.splice = None

    @property
    def spliced(self) -> int:
        """Tunnels the kernel carried since start."""
        return 0 if self.splice is None else self.splice.joined

    def sweep(self) -> None:
        """Cut every carried connection whose owner is no longer the owner.

        Called after each read of the leases: a client waiting on an answer
        from an owner that lost the store hears so now, not at its timeout.
        """
        for pipe in list(self.carried):
            if pipe.alive is not None and not pipe.alive():
                pipe.close()
            elif pipe.joint is not None and pipe.peer is not None and self.splice is not None \
                    and pipe.transport is not None and pipe.peer.transport is not None:
                held = self.splice.held(pipe.transport.get_extra_info("socket"),
                                        pipe.peer.transport.get_extra_info("socket"))
                if held > SPLICE_HOLD:
                    log.info("tunnel cut: the kernel held %d bytes for an end that "
                             "does not read", held)
                    pipe.close()

    async def carry(self, entry: _Entry, target: bytes, head: dict[bytes, bytes]) -> None:
        """Answer the CONNECT: carry the connection to the owner, or keep it here."""
        up: _Pipe | None = None
        where: Target = None
        try:
            where = await self.resolve(target, head)
            if where is not None:
                up = await self._open(where[0], where[1])
        except Exception as exc:  # noqa: BLE001 - any failure: the plain path answers
            log.debug("tunnel to %r kept here: %s", target, exc)
            up = None
        t = entry.transport
        if t is None or t.is_closing():
            if up is not None:
                up.close()
            return
        rest, entry.buf = bytes(entry.buf), bytearray()
        if up is None or where is None:
            t.write(OK + b"X-Strata-Tunnel: kept " + self.name.encode() + b"\r\n\r\n")
            entry.hand_over(rest)
            return
        down = _Pipe(self, alive=where[3])
        down.peer, up.peer = up, down
        t.set_protocol(down)
        down.connection_made(t)
        t.write(OK + b"X-Strata-Tunnel: " + where[2].encode() + b"\r\n\r\n")
        self.carried.update((down, up))
        self.opened += 1
        if rest:
            down.data_received(rest)
        elif self.splice is not None and where[4] and up.transport is not None:
            # Both ends idle: the client waits for its 200, the owner answered.
            joined = self.splice.join(t.get_extra_info("socket"),
                                      up.transport.get_extra_info("socket"))
            if joined is not None:
                down.joint = up.joint = [joined]
        t.resume_reading()

    async def _open(self, host: str, port: int) -> _Pipe:
        """A connection to the owner member that said who this is, ready to carry bytes."""
        loop = asyncio.get_running_loop()
        _t, up = await asyncio.wait_for(
            loop.create_connection(lambda: _Pipe(self, alive=None), host, port),
            self.connect_timeout)
        try:
            assert up.transport is not None
            up.transport.write(
                f"POST {TUNNEL_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"X-Strata-Forwarded: {self.mark()}\r\nContent-Length: 0\r\n\r\n".encode())
            assert up.hello is not None
            status, length = await asyncio.wait_for(up.hello, self.connect_timeout)
            if status != 200 or length != 0:
                raise ConnectionError(f"the owner answered {status} to the tunnel")
        except BaseException:
            up.close()
            raise
        return up


class _Entry(asyncio.Protocol):
    """A new connection's first bytes: a CONNECT head, or anything else (plain HTTP)."""

    def __init__(self, tunnels: Tunnels) -> None:
        self.tunnels = tunnels
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.deciding = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.timer = asyncio.get_running_loop().call_later(DECIDE_WITHIN, transport.close)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.deciding:
            return
        if not self.buf.startswith(PREFIX):
            if PREFIX.startswith(self.buf):
                return  # too short to tell yet
            self.hand_over(bytes(self.buf))
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEAD:
                self._refuse(b"431 Request Header Fields Too Large")
            return
        parsed = _parse(bytes(self.buf[:end]))
        if parsed is None:
            self._refuse(b"400 Bad Request")
            return
        del self.buf[:end + 4]
        self.deciding = True
        assert self.transport is not None
        self.transport.pause_reading()
        if self.timer is not None:
            self.timer.cancel()
        task = asyncio.ensure_future(self.tunnels.carry(self, *parsed))
        task.add_done_callback(_log_failure)

    def hand_over(self, first: bytes) -> None:
        """The connection is plain HTTP from here: the member's own server takes it."""
        if self.timer is not None:
            self.timer.cancel()
        t = self.transport
        assert t is not None
        http = self.tunnels.http()
        t.set_protocol(http)
        http.connection_made(t)
        if first:
            http.data_received(first)
        if self.deciding:
            t.resume_reading()

    def _refuse(self, status: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None


class _Pipe(asyncio.Protocol):
    """One end of a carried connection: what it reads is written to its peer's end.

    The owner's end first reads the answer to the opening POST (`hello`). The
    client's end asks `alive` before passing bytes on: False cuts both ends.
    """

    def __init__(self, tunnels: Tunnels, alive: Callable[[], bool] | None) -> None:
        self.tunnels = tunnels
        self.alive = alive
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        # The owner's end only: its answer to the opening POST (status, Content-Length).
        self.hello: asyncio.Future[tuple[int, int]] | None = \
            asyncio.get_running_loop().create_future() if alive is None else None
        self._head = bytearray()
        # Shared by both ends once the kernel carries their bytes: what to part.
        self.joint: list[Any] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None:  # the owner's answer to the opening POST
            if self.hello is not None:
                self._hello(data)
            return
        if self.alive is not None and not self.alive():
            self.close()  # the store moved or its owner went: the client asks again
            return
        if peer.transport is not None:
            peer.transport.write(data)

    def _hello(self, data: bytes) -> None:
        assert self.hello is not None
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD and not self.hello.done():
                self.hello.set_exception(ConnectionError("the owner's answer is too long"))
            return
        if self.hello.done() or end + 4 != len(self._head):
            if not self.hello.done():
                self.hello.set_exception(ConnectionError("the owner sent more than asked"))
            return
        lines = bytes(self._head[:end]).split(b"\r\n")
        parts = lines[0].split(None, 2)
        length = -1
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length" and value.strip().isdigit():
                length = int(value)
        status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0
        self.hello.set_result((status, length))

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()  # this end's buffer is full: stop the other

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # HTTP does not half-close: the end of either is the end of both

    def close(self) -> None:
        for end in (self, self.peer):
            if end is not None and end.transport is not None:
                end.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.hello is not None and not self.hello.done():
            self.hello.set_exception(ConnectionError("the owner closed the tunnel"))
        if self.joint is not None and self.joint[0] is not None:
            if self.tunnels.splice is not None:
                self.tunnels.splice.part(self.joint[0])
            self.joint[0] = None
        self.transport = None
        self.tunnels.carried.discard(self)
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


def _parse(head: bytes) -> tuple[bytes, dict[bytes, bytes]] | None:
    """A CONNECT head's target and headers (names lower-cased), or None if malformed."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"CONNECT" or not parts[2].startswith(b"HTTP/1."):
        return None
    headers: dict[bytes, bytes] = {}
    for line in lines[1:101]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            return None
        headers[name.lower()] = value.strip()
    if len(lines) > 101:
        return None
    return parts[1], headers


def _log_failure(task: asyncio.Future[None]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        exc = task.exception()
        if exc is not None:
            log.warning("tunnel: %s", exc)
