"""The fleet page: what `strata fleet status` shows, in a browser, served by every member.

Routes on the member's port, beside the API it routes:

- `/fleet/ui/login?ticket=T` trades a view ticket for a cookie and sends the
  browser on to `/fleet/ui/` (the ticket leaves the URL at once);
- `/fleet/ui/` is a static shell whose script reads `/fleet/ui/api/status`
  every second and shows members with their heartbeats' ages, and stores
  with owner, state, epoch, lease age, sync mode, lag to the bucket and loss
  window, plus a list of the owner changes it saw;
- `/fleet/ui/static/...` serves the shell's script and the store web view's
  own stylesheet (server/ui_static/app.css), so both pages look alike.

Who may look. The member's port answers as every store's owner to the
fleet's secret, which must never sit in a browser. `strata fleet ui` makes
a **view ticket** instead: an expiry time and an HMAC of it under the
fleet's secret, so every member can check it and it grants nothing but this
page's data (no store's API, no member endpoint). The cookie holding it is
HttpOnly, SameSite=Strict, scoped to `/fleet/ui` and lives no longer than the
ticket. The data route also takes the secret itself, for scripts. Anything
else gets 403, saying only that a ticket is needed.

The page's Content-Security-Policy is the web view's: scripts, styles and
data only from this origin, and everything shown is set with textContent.
This module reads the bucket (through fleet/status.py); it changes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web

from strata.fleet.status import fleet_status

if TYPE_CHECKING:
    from strata.fleet.member import Member

COOKIE = "strata_fleet_ui"
TICKET_TTL = 3600.0     # seconds a ticket lasts unless asked otherwise
MAX_TICKET_TTL = 7 * 86400.0
FRESH = 0.5             # seconds one read of the bucket serves every page that asks
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
            "connect-src 'self'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")
STATIC = {"fleet.js": ("strata.fleet", "text/javascript"),
          "app.css": ("strata.server", "text/css")}
MEMBER_KEY: web.AppKey[Any] = web.AppKey("fleet_member", object)


def _headers() -> dict[str, str]:
    return {"Content-Security-Policy": PAGE_CSP, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
            "Cache-Control": "no-store"}


def _mac(secret: str, expires: int) -> str:
    return hmac.new(secret.encode(), f"strata fleet view until {expires}".encode(),
                    hashlib.sha256).hexdigest()


def make_ticket(secret: str, ttl: float = TICKET_TTL) -> str:
    """A view ticket valid for `ttl` seconds (by the wall clock of the member that checks)."""
    expires = int(time.time() + min(max(ttl, 1.0), MAX_TICKET_TTL))
    return f"{expires}.{_mac(secret, expires)}"


def ticket_expires(secret: str, ticket: str) -> int | None:
    """When a valid, unexpired ticket expires; None for anything else."""
    head, sep, mac = ticket.partition(".")
    if not sep or not head.isdigit() or len(head) > 12:
        return None
    expires = int(head)
    if not hmac.compare_digest(mac.encode(), _mac(secret, expires).encode()):
        return None
    return expires if expires > time.time() else None


class FleetPage:
    """The routes' shared state: the member, and the last read of the bucket."""

    def __init__(self, member: Member) -> None:
        self.member = member
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()

    def allowed(self, request: web.Request) -> bool:
        if self.member._authorized(request):
            return True
        return ticket_expires(self.member.token, request.cookies.get(COOKIE, "")) is not None

    async def status(self) -> dict[str, Any]:
        async with self._lock:  # one bucket read at a time, however many pages poll
            if self._cached is None or time.monotonic() - self._cached[0] > FRESH:
                loop = asyncio.get_running_loop()
                got = await loop.run_in_executor(self.member._pool, fleet_status,
                                                 self.member.url)
                self._cached = (time.monotonic(), got)
            return {**self._cached[1], "served_by": self.member.name}


def _page(request: web.Request) -> FleetPage:
    page: FleetPage = request.app[MEMBER_KEY]
    return page


async def _to_root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/fleet/ui/")


async def shell(request: web.Request) -> web.Response:
    return web.Response(body=resources.files("strata.fleet").joinpath(
        "ui_static/fleet.html").read_bytes(), content_type="text/html", headers=_headers())


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in STATIC:
        raise web.HTTPNotFound()
    package, ctype = STATIC[name]
    data = resources.files(package).joinpath(
        f"ui_static/{name}").read_bytes()
    return web.Response(body=data, content_type=ctype,
                        headers={**_headers(), "Cache-Control": "no-cache"})


async def login(request: web.Request) -> web.Response:
    """Trade the ticket in the URL for a cookie, then go to the page without it."""
    ticket = request.query.get("ticket", "")
    expires = ticket_expires(_page(request).member.token, ticket)
    if expires is None:
        return _refused()
    resp = web.HTTPSeeOther(location="/fleet/ui/", headers=_headers())
    resp.set_cookie(COOKIE, ticket, path="/fleet/ui", httponly=True, samesite="Strict",
                    max_age=max(int(expires - time.time()), 1))
    raise resp


async def api_status(request: web.Request) -> web.Response:
    page = _page(request)
    if not page.allowed(request):
        return _refused()
    return web.json_response(await page.status(), headers=_headers())


def _refused() -> web.Response:
    return web.json_response({"error": "Forbidden", "message": "a fleet view ticket is needed: "
                              "run strata fleet ui and open the URL it prints"},
                             status=403, headers=_headers())


def register(app: web.Application, member: Member) -> None:
    """Add the page's routes (before the member's catch-all route)."""
    app[MEMBER_KEY] = FleetPage(member)
    r = app.router
    r.add_get("/fleet/ui", _to_root)
    r.add_get("/fleet/ui/", shell)
    r.add_get("/fleet/ui/login", login)
    r.add_get("/fleet/ui/static/{name}", static)
    r.add_get("/fleet/ui/api/status", api_status)
