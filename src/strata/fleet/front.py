"""The member's front for volumes: which store a client's request is for.

A client's request (not one forwarded by another member) names its store in
`X-Strata-Store` (an override), or a volume: in its path
(`/v1/volumes/<volume>/...`) or, for requests whose path names none
(objects, publish, heads), in `X-Strata-Volume`. The volume catalog
(fleet/placement.py) says which store holds the volume; a record's store
never changes once written, so a record read once is cached for good.

Three requests are answered here rather than by one store:

- `POST /v1/volumes` creates a volume: the catalog record first
  (create-only, `creating`), then the volume in its store, then the record
  made `ready` (If-Match). A creator that dies between the two writes leaves
  a `creating` record; the next create of that name (by anyone) sends the
  create to the record's store again, so the name is completed, not blocked.
  Two creators at once: one writes the record, both send the create to the
  same store, and the store's own create lets one win; the other gets
  `AlreadyExists`. A create that names its store (`X-Strata-Store`) for a
  name the catalog places elsewhere is made in that store, outside the
  catalog: a store's names are its own, and it is reached by naming it.
- `GET /v1/volumes` lists the catalog: `ready` records, and `creating` or
  `deleting` ones whose store says the volume exists.
- `DELETE /v1/volumes/<volume>`: the record made `deleting`, the volume
  deleted in its store, the record made `deleted` (kept: names are never
  reused for another object; a later create goes back to the same store).

This module never owns a store; it asks `Member.forward` to reach one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from strata.engine.errors import (
    AlreadyExists,
    InvalidInput,
    NotFound,
    StrataError,
)
from strata.engine.names import check_volume
from strata.fleet.forward import HOP
from strata.fleet.placement import Placement, VolumeCatalog, place
from strata.server import wire

if TYPE_CHECKING:
    from strata.fleet.member import Member

log = logging.getLogger(__name__)

MAX_CREATE_BODY = 4096      # a create names one volume: {"name": ...}
ANY_STORE = ("/v1/info", "/v1/whoami", "/openapi.json")  # the same answer from any store


def error(exc: StrataError) -> web.Response:
    return web.json_response(wire.error_body(exc), status=exc.http_status)


class VolumeFront:
    def __init__(self, member: Member) -> None:
        self.member = member
        self.catalog = VolumeCatalog(member.records)
        self.cache: dict[str, Placement] = {}

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.member._pool, fn, *args)

    async def lookup(self, volume: str) -> Placement | None:
        """The volume's record: cached (its store never changes), else read."""
        p = self.cache.get(volume)
        if p is None:
            p = await self._run(self.catalog.get, volume)
            if p is not None:
                self.cache[volume] = p
        return p

    async def route(self, request: web.Request,
                    store: str | None) -> str | None | web.StreamResponse:
        """The store a client's request goes to, or the whole answer (create, list, delete).

        Only for callers with the fleet's secret: the catalog names every volume.
        """
        try:
            return await self._route(request, store)
        except StrataError as exc:
            return error(exc)

    async def _route(self, request: web.Request,
                     store: str | None) -> str | None | web.StreamResponse:
        parts = request.path.split("/")  # "", "v1", "volumes", VOLUME, ...
        names_volumes = len(parts) >= 3 and parts[1] == "v1" and parts[2] == "volumes"
        if names_volumes and len(parts) == 3:
            if request.method == "POST":
                return await self.create(request, await self._body(request), store)
            if request.method == "GET" and store is None:
                return await self.list()
            return store
        volume: str | None = None
        if names_volumes:
            volume = check_volume(parts[3])
            if request.method == "DELETE" and len(parts) == 4:
                return await self.delete(request, await self._body(request), volume, store)
        if store is not None:
            return store
        if volume is None:
            volume = request.headers.get("X-Strata-Volume")
            if volume is None:
                if request.path in ANY_STORE:
                    return self.any_store()
                return None
            volume = check_volume(volume)
        p = await self.lookup(volume)
        if p is None:
            raise NotFound(f"no volume {volume} in the fleet's catalog")
        return p.store

    def any_store(self) -> str | None:
        for s in sorted(self.member.catalog):
            lease = self.member.route(s)
            if lease is not None and lease.state == "serving":
                return s
        return None

    @staticmethod
    async def _body(request: web.Request) -> bytes:
        """A create's or delete's body: small, so read whole (a larger one is refused)."""
        if (request.content_length or 0) > MAX_CREATE_BODY:
            raise InvalidInput(f"a create body is at most {MAX_CREATE_BODY} bytes")
        return await request.read()

    def _headers(self, request: web.Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in HOP}

    async def create(self, request: web.Request, body: bytes,
                     store: str | None) -> web.StreamResponse:
        if len(body) > MAX_CREATE_BODY:
            raise InvalidInput(f"a create body is at most {MAX_CREATE_BODY} bytes")
        try:
            doc = json.loads(body)
        except ValueError:
            raise InvalidInput("the request body is not JSON") from None
        name = doc.get("name") if isinstance(doc, dict) else None
        if not isinstance(name, str):
            raise InvalidInput("name the volume: {\"name\": ...}")
        name = check_volume(name)
        stores = sorted(self.member.catalog)
        if not stores:  # a member just started, before its first scan
            stores = sorted(await self._run(self.member.records.stores))
        if store is not None and store not in stores:
            raise NotFound(f"no store {store} in the fleet")
        p, _mine = await self._run(self.catalog.create, name, store or place(name, stores))
        if store is not None and p.store != store:
            # A store named outright holds its own names: the catalog keeps naming
            # the first, and this one is reached with the store named.
            out = await self.member.forward(store, "POST", request.path_qs,
                                            self._headers(request), body)
            out.headers["X-Strata-Store"] = store
            return out
        self.cache[name] = p
        out = await self.member.forward(p.store, "POST", request.path_qs,
                                        self._headers(request), body)
        if out.status < 300 or out.status == 409:  # the volume exists in its store now
            await self._settle(p, "ready")
        out.headers["X-Strata-Store"] = p.store
        return out

    async def _settle(self, p: Placement, state: str) -> None:
        if p.state == state:
            return
        try:
            self.cache[p.volume] = await self._run(self.catalog.set_state, p, state)
        except AlreadyExists:
            # Someone else changed it meanwhile (completed the same create, or a
            # delete): theirs stands; the next reader sees it.
            self.cache.pop(p.volume, None)

    async def list(self) -> web.StreamResponse:
        names = await self._run(self.catalog.names)
        got = await asyncio.gather(*[self._run(self.catalog.get, n) for n in names],
                                   return_exceptions=True)
        out = []
        for n, p in zip(names, got, strict=True):
            if isinstance(p, BaseException):
                if not isinstance(p, StrataError):
                    raise p
                log.warning("volume catalog: %s skipped: %s", n, p)
                continue
            if p is None or p.state == "deleted":
                continue
            self.cache[p.volume] = p
            if p.state == "ready" or await self._exists(p):
                out.append(p.volume)
        return web.json_response({"volumes": out})

    async def _exists(self, p: Placement) -> bool:
        """A record left half way (a crashed create or delete): ask its store, and settle it."""
        headers = {"X-Strata-Fleet-Token": self.member.token}
        got = await self.member.forward(p.store, "GET", f"/v1/volumes/{p.volume}/branches",
                                        headers, b"")
        if got.status == 200:
            if p.state == "creating":
                await self._settle(p, "ready")
            return True
        if got.status == 404:
            if p.state == "deleting":
                await self._settle(p, "deleted")
            return False
        return p.state == "deleting"  # its store cannot say now: it was there

    async def delete(self, request: web.Request, body: bytes, volume: str,
                     store: str | None) -> web.StreamResponse:
        p = await self._run(self.catalog.get, volume)
        target = store or (p.store if p is not None else None)
        if target is None:
            raise NotFound(f"no volume {volume} in the fleet's catalog")
        tracked = p is not None and p.store == target
        if tracked and p is not None and p.state != "deleting":
            self.cache[volume] = p = await self._run(self.catalog.set_state, p, "deleting")
        out = await self.member.forward(target, "DELETE", request.path_qs,
                                        self._headers(request), body)
        if tracked and p is not None and out.status in (200, 404):
            await self._settle(p, "deleted")
        out.headers["X-Strata-Store"] = target
        return out

    async def where(self, request: web.Request) -> web.Response:
        """`GET /fleet/v1/volumes/<volume>`: the volume's record (for clients)."""
        if not self.member._authorized(request):
            return web.json_response({"error": "Forbidden", "message": "fleet token needed"},
                                     status=403)
        try:
            volume = check_volume(request.match_info["volume"])
            p = await self.lookup(volume)
            if p is None:
                raise NotFound(f"no volume {volume} in the fleet's catalog")
        except StrataError as exc:
            return error(exc)
        return web.json_response({"volume": p.volume, "store": p.store, "state": p.state})
