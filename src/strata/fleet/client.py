"""The remote `Store` through a fleet: one store, any live member of a list.

`FleetStore` is `RemoteStore` with two differences: every request names its
store, and a member that does not answer, or answers 503
(no owner right now, a takeover under way, a lease that ran out), is left
for the next one in the list. A publish keeps its txid across every
attempt and every member, so a publish that landed before its answer was
lost is found, not made twice (docs/design.md, "Publish algorithm").

A request names its store in `X-Strata-Store` when the client was given
one (an override); otherwise it names a volume, and the member finds the
volume's store in the fleet's catalog (fleet/front.py): in the path for
requests about one volume, or in `X-Strata-Volume` for those whose path
names none (objects, publish, heads), which go to the store of the volume
this client used last. One publish changes volumes of one store only.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from strata.engine.errors import InvalidInput, Unavailable
from strata.engine.interface import ChangeSet
from strata.engine.names import check_volume
from strata.server.client import (
    BadResponse,
    RemoteStore,
    _Conn,
    events_path,
    http_connection,
    parse_server,
    raise_http_error,
    read_events,
)

CONNECT_TIMEOUT = 5.0  # a stopped member is left after this (a SIGSTOPped host accepts)
EVENTS_IDLE = 45.0     # an event stream silent this long (3 missed pings) is given up


class _Tunnel(_Conn):
    """A connection to a member, carried to the owner of `target`'s store if it can be.

    `target` is `store/NAME` or `volume/NAME` (fleet/tunnel.py); None: a plain
    connection to the member. Either way, requests on it are ordinary requests:
    the member keeps a connection it cannot carry and answers them itself.
    """

    def __init__(self, kind: str, where: str, port: int, timeout: float | None,
                 target: str | None, headers: dict[str, str]) -> None:
        super().__init__(kind, where, port, timeout)
        self.target = target
        self.carried_to: str | None = None  # the owner member, if carried
        self.kept_by: str | None = None     # the member, if it kept the connection
        if target is not None:
            try:
                self._open(target, headers)
            except BaseException:
                self.close()
                raise

    def _open(self, target: str, headers: dict[str, str]) -> None:
        lines = [f"CONNECT {target} HTTP/1.1", f"Host: {self.host}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        status, headers_back = self._head()
        if status != 200:
            raise BadResponse(f"the member refused a tunnel ({status})")
        how, _, member = headers_back.get("x-strata-tunnel", "").partition(" ")
        if how == "kept":
            self.kept_by = member
        elif how:
            self.carried_to = how


class FleetStore(RemoteStore):
    """The fleet's volumes, reached through any of `members` (http://HOST:PORT each).

    `store` pins every request to one store; None lets the catalog place each.
    """

    def __init__(self, members: Sequence[str], store: str | None = None, *,
                 token: str | None = None, bearer: str | None = None,
                 retry_for: float = 60.0, timeout: float = 10.0,
                 prefetch: bool = True, tunnel: bool = True) -> None:
        if not members:
            raise InvalidInput("a fleet client needs at least one member address")
        self.members = [m.rstrip("/") for m in members]
        for m in self.members:
            if parse_server(m)[0] != "tcp":
                raise InvalidInput(f"a fleet member is http://HOST:PORT, not {m!r}")
        super().__init__(self.members[0], bearer, retry_for=retry_for, timeout=timeout,
                         prefetch=prefetch)
        self.store = store
        self.volume: str | None = None  # the volume requests without one in the path go to
        # With a bearer token (scoped to a volume of a store) and no fleet secret, the
        # members pass requests to the store's server, which checks the token as on TCP.
        self.fleet_token = token or (None if bearer else os.environ.get("STRATA_FLEET_TOKEN")) \
            or None
        if bearer and not self.fleet_token and store is None:
            # Tokens are a store's; the catalog is for those with the fleet's secret.
            raise InvalidInput("a token reaches the store it was made in: name it "
                               "(--fleet-store STORE or $STRATA_FLEET_STORE)")
        # Ask each member to carry the connection to the store's owner (fleet/tunnel.py):
        # a request then costs the member a copy of bytes, not a forward of its own.
        self.tunnel = tunnel
        self._which = 0
        self._which_lock = threading.Lock()
        self.last = threading.local()  # the last answer's owner and epoch (for checkers)

    def _conn(self, target: str | None = None) -> _Conn:
        """This thread's connection; a new one if `target` (a tunnel's) is not its own."""
        conn: _Tunnel | None = getattr(self._local, "conn", None)
        if conn is not None and target is not None and conn.target != target:
            self._drop_conn()
            conn = None
        if conn is None:
            with self._which_lock:
                url = self.members[self._which % len(self.members)]
            kind, where, port = parse_server(url)
            conn = _Tunnel(kind, where, port, self.timeout, target,
                           self._headers({}, None) if target is not None else {})
            self._local.conn = conn
        return conn

    def _target(self, volume: str | None) -> str | None:
        """The tunnel a request takes: its store's, else its volume's (None: any)."""
        if not self.tunnel:
            return None
        if self.store is not None:
            try:
                return f"store/{check_volume(self.store)}"  # a store's name: a volume's rules
            except InvalidInput:
                return None
        volume = volume or self.volume
        if volume is None or not self.fleet_token:
            return None  # a token holder names its store (the catalog is not its to ask)
        try:
            return f"volume/{check_volume(volume)}"
        except InvalidInput:
            return None  # the request itself will be refused

    def _next_member(self) -> None:
        self._drop_conn()
        with self._which_lock:
            self._which += 1

    def request(self, method: str, path: str, body: bytes | None = None,
                ctype: str = "application/json", headers: dict[str, str] | None = None,
                ) -> tuple[int, dict[str, str], bytes]:
        volume = None
        if self.store is None:
            parts = path.split("?", 1)[0].split("/")
            if len(parts) >= 4 and parts[1] == "v1" and parts[2] == "volumes":
                self.volume = parts[3]  # named in the path: the member places it
            else:
                volume = self.volume
        target = self._target(volume)
        hdrs = self._headers({"Content-Type": ctype, **(headers or {})}, volume)
        deadline = time.monotonic() + self.retry_for
        delay = 0.02
        last = ""
        while True:
            try:
                status, rheaders, data = self._conn(target).request(method, path, body, hdrs)
                if rheaders.get("connection", "").lower() == "close":
                    self._drop_conn()
            except (OSError, BadResponse) as exc:  # refused, reset, timed out: next member
                last = str(exc) or type(exc).__name__
                self._next_member()
                if time.monotonic() >= deadline:
                    raise Unavailable(f"no fleet member answered for {self._what()}: "
                                      f"{last}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
                continue
            if status == 503 and time.monotonic() < deadline:
                try:
                    wait = float(rheaders.get("retry-after", delay))
                except ValueError:
                    wait = delay
                self._next_member()
                time.sleep(min(max(wait, 0.01), 1.0, max(deadline - time.monotonic(), 0)))
                continue
            self.last.owner = rheaders.get("x-strata-owner")
            conn = getattr(self._local, "conn", None)
            if conn is not None and conn.kept_by and self.last.owner \
                    and self.last.owner != conn.kept_by:
                # Kept by a member that forwards it now (the store had no owner when the
                # connection opened): the next request opens a tunnel to the owner.
                self._drop_conn()
            epoch = rheaders.get("x-strata-epoch")
            self.last.epoch = int(epoch) if epoch and epoch.isdigit() else None
            if status >= 400:
                raise_http_error(status, data)
            return status, rheaders, data

    def _headers(self, hdrs: dict[str, str], volume: str | None) -> dict[str, str]:
        """`hdrs` plus where the request goes and the caller's credentials.

        Where: the pinned store, else `volume` for the catalog to place.
        """
        if self.store is not None:
            hdrs["X-Strata-Store"] = self.store
        elif volume is not None:
            hdrs["X-Strata-Volume"] = volume
        if self.fleet_token:
            hdrs["X-Strata-Fleet-Token"] = self.fleet_token
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"
        return hdrs

    def _what(self) -> str:
        if self.store is not None:
            return f"store {self.store}"
        return f"volume {self.volume}" if self.volume else "the fleet"

    def use_volume(self, volume: str) -> None:
        """Send requests that name no volume to `volume`'s store from now on."""
        if self.store is None:
            self.volume = check_volume(volume)

    def placed_in(self, volume: str) -> str:
        """The store the fleet's catalog places `volume` in."""
        _s, _h, data = self.request("GET", f"/fleet/v1/volumes/{check_volume(volume)}")
        return str(json.loads(data)["store"])

    def create_volume(self, name: str) -> str:
        self.use_volume(name)
        return super().create_volume(name)

    def heads(self, refs: Sequence[tuple[str, str]]) -> list[str]:
        if refs:
            self.use_volume(refs[0][0])
        return super().heads(refs)

    def publish(self, changesets: Sequence[ChangeSet],
                objects: Sequence[tuple[int, bytes]] = (), *,
                txid: bytes | None = None) -> list[str]:
        volumes = sorted({c.volume for c in changesets})
        if self.store is None and volumes:
            if len(volumes) > 1:
                stores = {v: self.placed_in(v) for v in volumes}
                if len(set(stores.values())) > 1:
                    raise InvalidInput("one publish changes the volumes of one store; these "
                                       "are in different stores: " + ", ".join(
                                           f"{v} ({s})" for v, s in stores.items()))
            self.use_volume(changesets[0].volume)
        return super().publish(changesets, objects, txid=txid)

    def events(self, refs: Sequence[str], since: str | None = None,
               heads: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
        """Follow the store's events through any member, until the stream ends.

        A member that does not answer, or answers 503, is left for the next, as
        for any request. The stream ends when the store moves or its owner dies
        (the members end it); the caller follows again with the last `_id` and
        the heads it had (as `strata watch` does), and the next member in the
        list takes it from there.
        """
        path = events_path(refs, since, heads)
        volume = check_volume(refs[0].partition("@")[0]) if refs else self.volume
        hdrs = self._headers({"Accept": "text/event-stream"}, volume)
        deadline = time.monotonic() + self.retry_for
        delay = 0.02
        while True:
            with self._which_lock:
                url = self.members[self._which % len(self.members)]
            kind, where, port = parse_server(url)
            conn = http_connection(kind, where, port, EVENTS_IDLE)
            try:
                try:
                    conn.request("GET", path, headers=hdrs)
                    resp = conn.getresponse()
                except OSError as exc:
                    failed = str(exc) or type(exc).__name__
                else:
                    if resp.status != 503:
                        if resp.status >= 400:
                            raise_http_error(resp.status, resp.read())
                        try:
                            yield from read_events(resp)
                        except OSError:
                            pass  # silent too long, or reset: the same as an end
                        self._next_member()  # whoever answers next reaches the new owner
                        return
                    failed = "503"
                if time.monotonic() >= deadline:
                    raise Unavailable(f"no fleet member streamed events of "
                                      f"{self._what()}: {failed}")
                self._next_member()
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
            finally:
                conn.close()
