"""The remote `Store` through a fleet: one store, any live member of a list.

`FleetStore` is `RemoteStore` with two differences: every request names the
store (`X-Strata-Store`), and a member that does not answer, or answers 503
(no owner right now, a takeover under way, a lease that ran out), is left
for the next one in the list. A publish keeps its txid across every
attempt and every member, so a publish that landed before its answer was
lost is found, not made twice (docs/design.md, "Publish algorithm").
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from strata.engine.errors import InvalidInput, Unavailable
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


class FleetStore(RemoteStore):
    """A store of the fleet, reached through any of `members` (http://HOST:PORT each)."""

    def __init__(self, members: Sequence[str], store: str, *, token: str | None = None,
                 bearer: str | None = None, retry_for: float = 60.0,
                 timeout: float = 10.0) -> None:
        if not members:
            raise InvalidInput("a fleet client needs at least one member address")
        self.members = [m.rstrip("/") for m in members]
        for m in self.members:
            if parse_server(m)[0] != "tcp":
                raise InvalidInput(f"a fleet member is http://HOST:PORT, not {m!r}")
        super().__init__(self.members[0], bearer, retry_for=retry_for, timeout=timeout,
                         prefetch=True)
        self.store = store
        # With a bearer token (scoped to a volume of this store) and no fleet secret, the
        # members pass requests to the store's server, which checks the token as on TCP.
        self.fleet_token = token or (None if bearer else os.environ.get("STRATA_FLEET_TOKEN")) \
            or None
        self._which = 0
        self._which_lock = threading.Lock()
        self.last = threading.local()  # the last answer's owner and epoch (for checkers)

    def _conn(self) -> _Conn:
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is None:
            with self._which_lock:
                url = self.members[self._which % len(self.members)]
            kind, where, port = parse_server(url)
            conn = _Conn(kind, where, port, self.timeout)
            self._local.conn = conn
        return conn

    def _next_member(self) -> None:
        self._drop_conn()
        with self._which_lock:
            self._which += 1

    def request(self, method: str, path: str, body: bytes | None = None,
                ctype: str = "application/json", headers: dict[str, str] | None = None,
                ) -> tuple[int, dict[str, str], bytes]:
        hdrs = {"Content-Type": ctype, "X-Strata-Store": self.store, **(headers or {})}
        if self.fleet_token:
            hdrs["X-Strata-Fleet-Token"] = self.fleet_token
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"
        deadline = time.monotonic() + self.retry_for
        delay = 0.02
        last = ""
        while True:
            try:
                status, rheaders, data = self._conn().request(method, path, body, hdrs)
                if rheaders.get("connection", "").lower() == "close":
                    self._drop_conn()
            except (OSError, BadResponse) as exc:  # refused, reset, timed out: next member
                last = str(exc) or type(exc).__name__
                self._next_member()
                if time.monotonic() >= deadline:
                    raise Unavailable(f"no fleet member answered for store {self.store}: "
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
            epoch = rheaders.get("x-strata-epoch")
            self.last.epoch = int(epoch) if epoch and epoch.isdigit() else None
            if status >= 400:
                raise_http_error(status, data)
            return status, rheaders, data

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
        hdrs = {"Accept": "text/event-stream", "X-Strata-Store": self.store}
        if self.fleet_token:
            hdrs["X-Strata-Fleet-Token"] = self.fleet_token
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"
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
                    raise Unavailable(f"no fleet member streamed events of store "
                                      f"{self.store}: {failed}")
                self._next_member()
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
            finally:
                conn.close()
