"""Who is asking: each request's scope, from its socket, its bearer token or its cookie.

- A connection on the unix socket is the store's owner (the socket is 0600
  in a 0700 directory).
- `/openapi.json` is public: its scope is None.
- The web view (`/ui`) carries a read-only token in a cookie
  (`session_scope`); a missing or bad one leaves the scope None, and the
  page says so.
- Everything else carries `Authorization: Bearer TOKEN`.

A token is checked in one place, `token_scope`: it must verify, and it
works only for the volume it was made for, not a later volume of that
name. What a scope may then do is `Scope`'s business (server/tokens.py).

This module decides identities only; it never reads a body or serves a route.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from aiohttp import web

from strata.engine.errors import Forbidden, NotFound, Unauthenticated
from strata.server.tokens import OWNER, Scope

if TYPE_CHECKING:
    from strata.server.app import ServerState

COOKIE = "strata_ui"  # the web view's session: a read-only token, HttpOnly, SameSite=Strict


def is_unix(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family == socket.AF_UNIX


def token_scope(state: ServerState, token: str) -> Scope:
    """The scope of a token, or Unauthenticated.

    A token works only for the volume it was made for, not a later one of that name.
    """
    scope = state.tokens.verify(token)
    if scope.volume is not None:
        try:
            current = state.need_store().volume_id(scope.volume)
        except NotFound:
            current = None
        if current != scope.volume_id:
            raise Unauthenticated("token's volume no longer exists (deleted or made anew)")
    return scope


def session_scope(request: web.Request, state: ServerState) -> Scope | None:
    """The scope of the browser's cookie; None without a valid one (the page says so)."""
    token = request.cookies.get(COOKIE)
    if not token:
        return None
    try:
        return token_scope(state, token)
    except Unauthenticated:
        return None


def request_scope(request: web.Request, state: ServerState) -> Scope | None:
    """What this request may do (module docstring); Unauthenticated for a bad bearer token."""
    if is_unix(request):
        return OWNER
    if request.path == "/openapi.json":
        return None
    if request.path.startswith("/ui"):  # the web view: a cookie, not a header
        return session_scope(request, state)
    auth = request.headers.get("Authorization", "")
    if not auth.startswith("Bearer "):
        raise Unauthenticated("missing bearer token")
    return token_scope(state, auth[7:].strip())


def scope_of(request: web.Request) -> Scope:
    """The scope the middleware gave this request."""
    return request["scope"]  # type: ignore[no-any-return]


def require_owner(request: web.Request) -> None:
    if not scope_of(request).is_owner:
        raise Forbidden("administration is only allowed over the owner's unix socket")
