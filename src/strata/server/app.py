"""The HTTP API over one open store (aiohttp): its routes, its middleware, its shared state.

The middleware asks `auth.py` who is asking, holds large bodies in the body
budget (`bodies.py`), counts requests in flight for a handoff to drain, and
turns the engine's errors into answers (a request answered 500 is logged
with its traceback). The handlers check what the scope allows, then call
the engine. `publish_now` is the publish both this API and the lean stream
(`lean.py`) run.

Requests run the engine's blocking calls in a thread pool, so concurrent
publishes from many clients meet in the engine's group commit exactly as
in-process threads do. While the server is starting or handing the store to
a new owner, every store request is answered 503 with Retry-After and the
client retries by itself. The API is described in `openapi.py` and served at
`/openapi.json`.

Nothing here reads a tree or a body's bytes by hand: trees are the engine's,
bodies `bodies.py`'s.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, TypeVar

from aiohttp import web

from strata.engine.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    StrataError,
    Unavailable,
    no_object,
)
from strata.engine.local import LocalStore
from strata.engine.names import check_branch, check_hex_id, check_volume
from strata.server import events as events_mod
from strata.server import ui, wire
from strata.server.admission import Admission
from strata.server.auth import request_scope, require_owner, scope_of
from strata.server.bodies import (
    ANSWER_BUDGET,
    BODY_BUDGET,
    LARGE_BODY,
    MAX_BATCH_ANSWER,
    MAX_BATCH_GET,
    MAX_BODY,
    ByteBudget,
    TooSlow,
    body_field,
    body_size,
    check_encoding,
    read_body,
    read_json,
)
from strata.server.openapi import OPENAPI
from strata.server.tokens import Scope, TokenStore
from strata.server.visibility import Visibility

log = logging.getLogger(__name__)
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PREFETCH_MAX = 256 * 1024  # bytes of new tree nodes sent back with a publish
MAX_HEADS = 256  # branches one POST /v1/heads reads


class ServerState:
    """What the handlers share: the store (None until open), tokens, the mode."""

    def __init__(self, store_dir: str) -> None:
        self.store_dir = store_dir
        self.store: LocalStore | None = None
        self.tokens = TokenStore(store_dir)
        self.visibility = Visibility()
        self.events = events_mod.EventFeed(lambda: self.store)
        self.listens: list[str] = []  # the addresses served (`strata ui` finds TCP here)
        self.budget = ByteBudget(BODY_BUDGET)
        self.answers = ByteBudget(ANSWER_BUDGET)
        self.mode = "starting"      # starting -> serving -> draining -> stopped
        self.inflight = 0
        self.watchers = 0  # open event streams (server/events.py): they keep it from idling
        self.last_request = time.monotonic()
        self.idle = asyncio.Event()
        self.idle.set()
        self.executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="strata-api")
        self.on_handoff: Callable[[], Awaitable[None]] | None = None
        self.on_stop: Callable[[], Awaitable[None]] | None = None
        # Objects served by GET /v1/objects (what mounts and remote readers fetched).
        self.served = {"objects_served": 0, "bytes_served": 0}
        self.admission: Admission | None = None  # TCP's connection caps (serve.py sets it)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def need_store(self) -> LocalStore:
        if self.store is None or self.mode != "serving":
            raise ChangingOwner("store is changing owner; retry", retry_after=0.1)
        return self.store


class ChangingOwner(Unavailable):
    """No store is open here for a moment (starting, handing off): the client retries.

    Only this 503 carries Retry-After. The engine's own Unavailable (a branch
    leased by another, a full disk) goes back to the caller at once: the
    Store contract lets the caller decide, and retrying a held lease for
    half a minute would only hide it.
    """


STATE = web.AppKey("state", ServerState)


def _error_response(exc: StrataError) -> web.Response:
    status = exc.http_status
    headers = {}
    if isinstance(exc, ChangingOwner):
        headers["Retry-After"] = f"{max(exc.retry_after, 0.05):.2f}"
    return web.json_response(wire.error_body(exc), status=status, headers=headers)


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    state.last_request = time.monotonic()
    try:
        check_encoding(request)  # before anything reads the body, whoever sends it
        request["scope"] = request_scope(request, state)
        # Requests that use the store are drained before a handoff or stop closes it;
        # fsck too (it reads every pack). Handoff and stop themselves must not count.
        if request.path.startswith("/v1/") and (not request.path.startswith("/v1/admin/")
                                                or request.path == "/v1/admin/fsck"):
            state.need_store()
            state.inflight += 1
            state.idle.clear()
            try:
                async with state.budget.hold(body_size(request)):
                    return await handler(request)
            finally:
                state.inflight -= 1
                if state.inflight == 0:
                    state.idle.set()
        return await handler(request)
    except StrataError as exc:
        if exc.http_status == 500:  # the store's fault, not the client's (Corrupt, ...)
            log.error("%s %s answered 500: %s", request.method, request.path, exc,
                      exc_info=exc)
        resp = _error_response(exc)
        if isinstance(exc, TooSlow):
            # Answer, then hang up at once: aiohttp would otherwise linger up to 10 s
            # more reading the rest of a body that has stopped arriving.
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            request.protocol.force_close()  # the transport flushes the answer, then closes
        if isinstance(exc, Unavailable) and state.mode == "draining":
            # The store has a new owner (or none): a kept-alive connection would only
            # get 503 until we exit, so make the client reconnect, to the successor.
            resp.force_close()
        return resp
    except web.HTTPException:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as exc:
        # OverflowError: float() of a JSON integer of hundreds of digits (a ttl).
        return _error_response(InvalidInput(f"malformed request: {exc}"))
    except TimeoutError:
        raise  # aiohttp answers 504
    except Exception as exc:
        # aiohttp answers 500; logged here with the request named, and serve.py keeps
        # aiohttp's own record of the same exception out of the log.
        log.exception("%s %s answered 500", request.method, request.path)
        setattr(exc, LOGGED, True)  # noqa: B010 - an attribute no exception class declares
        raise


LOGGED = "_strata_logged"  # set on an exception the middleware has logged


# -- handlers ---------------------------------------------------------------------------

async def openapi(request: web.Request) -> web.Response:
    return web.json_response(OPENAPI)


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    store = state.need_store()
    return web.json_response({"store_id": store.store_id.hex(), "block_size": store.block_size,
                              "version": 1})


async def whoami(request: web.Request) -> web.Response:
    """What the caller's credentials allow (the mount turns read-only tokens into ro mounts)."""
    scope = scope_of(request)
    return web.json_response({"owner": scope.is_owner, "volume": scope.volume,
                              "branch": scope.branch, "writable": scope.writable})


def _out_of_reach(scope: Scope, store: LocalStore, ids: list[bytes]) -> bytes | None:
    """For a scoped token, the first id its volume cannot reach (None: all reachable).

    Objects that do not exist are never reachable, so an out-of-scope object
    and a missing one get the same answer (engine/reach.py).
    """
    if scope.volume is None or not ids:
        return None
    for oid, ok in zip(ids, store.reachable(scope.volume, ids), strict=True):
        if not ok:
            return oid
    return None


async def missing(request: web.Request) -> web.Response:
    """The ids the store lacks; for a scoped token, also those its volume cannot reach.

    Such a client then uploads them, which proves it holds their bytes.
    """
    state = request.app[STATE]
    scope = scope_of(request)
    ids = wire.decode_ids(await read_body(request))
    store = state.need_store()

    def missing_or_unreachable() -> list[bytes]:
        out = store.missing(ids)  # checks the ids
        if scope.volume is None or not ids:
            return out
        return [oid for oid, ok in zip(ids, store.reachable(scope.volume, ids), strict=True)
                if not ok]

    out = await state.run(missing_or_unreachable)
    return web.Response(body=wire.encode_ids(out), content_type="application/octet-stream")


async def put_objects(request: web.Request) -> web.Response:
    state = request.app[STATE]
    scope = scope_of(request)
    scope.check_write()
    objs = wire.decode_objects(await read_body(request))
    store = state.need_store()

    def put() -> list[bytes]:
        volume = scope.volume
        if volume is not None:
            store.check_refs_reachable(volume, (), objs, upload=True)
        store.check_tree_refs(objs)
        ids = store.put_objects(objs)
        if volume is not None:
            store.grant_reach(volume, ids)  # the uploader holds these bytes
        return ids

    ids = await state.run(put)
    return web.json_response({"stored": len(ids)})


async def _send(request: web.Request, resp: web.Response) -> web.Response:
    """Write an answer now, so that budget held around this call covers its bytes."""
    await resp.prepare(request)
    await resp.write_eof()
    return resp


async def get_object(request: web.Request) -> web.Response:
    state = request.app[STATE]
    oid = _oid(request.match_info["oid"])
    scope = scope_of(request)
    store = state.need_store()

    def small_or_size() -> bytes | int:
        """The object if it is small (one trip to the executor), else its size."""
        if _out_of_reach(scope, store, [oid]) is not None:
            raise no_object(oid)
        n = store.object_size(oid)
        return store.get_object(oid) if n < LARGE_BODY else n

    got = await state.run(small_or_size)
    if not isinstance(got, int):  # small answers never wait, as small bodies never do
        return await _answer_object(request, got)
    async with state.answers.hold(got):
        return await _answer_object(request, await state.run(store.get_object, oid))


async def _answer_object(request: web.Request, raw: bytes) -> web.Response:
    state = request.app[STATE]
    rng = request.http_range
    state.served["objects_served"] += 1
    if rng.start is not None or rng.stop is not None:
        start, stop, _step = rng.indices(len(raw))
        state.served["bytes_served"] += max(stop - start, 0)
        if start >= len(raw) and len(raw) > 0:
            return web.json_response({"error": "InvalidInput",
                                      "message": "range not satisfiable"}, status=416)
        return await _send(request, web.Response(
            body=raw[start:stop], status=206, content_type="application/octet-stream",
            headers={"Content-Range": f"bytes {start}-{max(stop - 1, start)}/{len(raw)}"}))
    state.served["bytes_served"] += len(raw)
    return await _send(request, web.Response(body=raw, content_type="application/octet-stream"))


async def get_objects(request: web.Request) -> web.Response:
    """Several objects in one answer: for each id, a u32 length and the raw bytes.

    An answer holds at most MAX_BATCH_ANSWER bytes (and always the first
    object): the ids it covers are in `X-Strata-Count`, and the client asks
    again for the rest. Without the cap, 1024 copies of one large id would
    make one request hold 1024 times that object. The sizes are read from
    the frame headers first, and the answer holds its bytes in the server's
    answer budget until it is sent.
    """
    state = request.app[STATE]
    ids = wire.decode_ids(await read_body(request, limit=MAX_BATCH_GET * 32))
    if len(ids) > MAX_BATCH_GET:
        raise InvalidInput(f"at most {MAX_BATCH_GET} ids per batch read")
    store = state.need_store()
    scope = scope_of(request)

    def plan() -> tuple[list[int], list[bytes] | None]:
        """Sizes of the ids this answer covers; the objects too if they are small."""
        outside = _out_of_reach(scope, store, ids)
        if outside is not None:  # the answer for the first id the store lacks
            raise no_object(outside)
        sizes: list[int] = []
        total = 0
        for oid in ids:
            n = store.object_size(oid)
            if sizes and total + n > MAX_BATCH_ANSWER:
                break
            sizes.append(n)
            total += n
        if total < LARGE_BODY:  # one trip to the executor, and no wait on the budget
            return sizes, [store.get_object(oid) for oid in ids[:len(sizes)]]
        return sizes, None

    sizes, raws = await state.run(plan)
    todo = ids[:len(sizes)]
    async with state.answers.hold(sum(sizes)):
        if raws is None:
            raws = await state.run(lambda: [store.get_object(oid) for oid in todo])
        state.served["objects_served"] += len(raws)
        state.served["bytes_served"] += sum(len(r) for r in raws)
        body = wire.encode_blobs(raws)
        del raws
        return await _send(request, web.Response(
            body=body, content_type="application/octet-stream",
            headers={"X-Strata-Count": str(len(todo))}))


def _oid(text: str) -> bytes:
    check_hex_id(text)
    return bytes.fromhex(text)


async def list_volumes(request: web.Request) -> web.Response:
    store = request.app[STATE].need_store()
    scope = scope_of(request)
    vols = store.list_volumes()
    if not scope.is_owner:
        vols = [v for v in vols if v == scope.volume]
    return web.json_response({"volumes": vols})


async def create_volume(request: web.Request) -> web.Response:
    state = request.app[STATE]
    scope = scope_of(request)
    if not scope.is_owner:
        raise Forbidden("only the store owner creates volumes")
    name = body_field(await read_json(request), "name", str)

    def create_and_announce() -> str:
        head = state.need_store().create_volume(name)
        state.events.note_volume(name, True, head)
        return head

    head = await state.run(create_and_announce)
    return web.json_response({"name": name, "head": head}, status=201)


async def delete_volume(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not scope_of(request).is_owner:
        raise Forbidden("only the store owner deletes volumes")

    def delete_and_announce() -> None:
        state.need_store().delete_volume(request.match_info["volume"])
        state.events.note_volume(request.match_info["volume"], False)

    await state.run(delete_and_announce)
    return web.json_response({"deleted": request.match_info["volume"]})


async def list_branches(request: web.Request) -> web.Response:
    store = request.app[STATE].need_store()
    volume = check_volume(request.match_info["volume"])
    scope = scope_of(request)
    scope.check_volume(volume)
    heads = store.list_branches(volume)
    if scope.branch is not None:
        heads = {b: h for b, h in heads.items() if b == scope.branch}
    return web.json_response({"branches": heads})



async def heads(request: web.Request) -> web.Response:
    """Several branches' heads read at one instant (a run's consistent view)."""
    store = request.app[STATE].need_store()
    refs = body_field(await read_json(request), "refs", list)
    if not 0 < len(refs) <= MAX_HEADS:
        raise InvalidInput(f"'refs' must list 1 to {MAX_HEADS} [volume, branch] pairs")
    pairs = []
    scope = scope_of(request)
    for item in refs:
        if not (isinstance(item, list) and len(item) == 2
                and all(isinstance(x, str) for x in item)):
            raise InvalidInput("each of 'refs' must be a [volume, branch] pair of strings")
        volume, branch = check_volume(item[0]), check_branch(item[1])
        scope.check_branch(volume, branch, write=False)
        pairs.append((volume, branch))
    return web.json_response({"heads": store.heads(pairs)})


async def fork(request: web.Request) -> web.Response:
    state = request.app[STATE]
    volume = check_volume(request.match_info["volume"])
    body = await read_json(request)
    name = check_branch(body_field(body, "name", str))
    at = body_field(body, "at", str, optional=True)
    scope_of(request).check_branch(volume, name, write=True)
    if at is not None:
        await _check_visible(request, volume, at)

    def fork_and_announce() -> str:
        head = state.need_store().fork(volume, name, at=at)
        state.events.note_fork(volume, name, head)
        return head

    head = await state.run(fork_and_announce)
    return web.json_response({"name": name, "head": head}, status=201)


async def delete_branch(request: web.Request) -> web.Response:
    state = request.app[STATE]
    volume = check_volume(request.match_info["volume"])
    branch = check_branch(request.match_info["branch"])
    scope_of(request).check_branch(volume, branch, write=True)

    def delete_and_announce() -> None:
        state.need_store().delete_branch(volume, branch)
        state.events.note_branch_deleted(volume, branch)

    await state.run(delete_and_announce)
    return web.json_response({"deleted": branch})


async def find_snapshot(request: web.Request) -> web.Response:
    state = request.app[STATE]
    prefix = check_hex_id(request.match_info["prefix"], min_len=8)
    scope = scope_of(request)
    if scope.is_owner:
        sid = await state.run(state.need_store().find_snapshot, prefix)
        return web.json_response({"id": sid})
    # The Store interface names no volume here: a token's own volume is the default.
    volume = request.query.get("volume") or str(scope.volume)
    scope.check_volume(volume)
    store = state.need_store()

    def resolve() -> list[str]:
        # Only matches in the volume's history count, so another volume's snapshot
        # neither resolves nor makes a prefix ambiguous: the answers are the same
        # as if it did not exist.
        vid = store.volume_id(volume)
        return [m for m in store.snapshots_with_prefix(prefix)
                if state.visibility.contains(store, vid, volume, m)]

    matches = await state.run(resolve)
    if not matches:
        raise NotFound(f"no snapshot matches {prefix} in volume {volume!r}")
    if len(matches) > 1:
        raise InvalidInput(f"snapshot prefix {prefix} is ambiguous")
    return web.json_response({"id": matches[0]})


async def _check_visible(request: web.Request, volume: str, sid: str) -> None:
    """A scoped token may only name snapshots in its own volume's history.

    A snapshot that does not exist and one of another volume get the same
    answer, word for word.
    """
    scope = scope_of(request)
    if scope.is_owner:
        return
    state = request.app[STATE]
    store = state.need_store()

    def visible() -> bool:
        return state.visibility.contains(store, store.volume_id(volume), volume, sid)

    if not await state.run(visible):
        raise NotFound(f"no snapshot {sid} in volume {volume!r}")


async def publish(request: web.Request) -> web.Response:
    state = request.app[STATE]
    scope = scope_of(request)
    scope.check_write()  # a read-only token is refused before a byte of its body is read
    req = wire.decode_publish(await read_body(request))
    for cs in req.changesets:
        scope.check_branch(cs.volume, cs.branch, write=True)
        if not scope.is_owner:
            await _check_visible(request, cs.volume, cs.base)
    heads, prefetch = await state.run(publish_now, state, scope, req)
    return web.json_response({"heads": heads, "prefetch": [
        [oid, base64.b64encode(raw).decode()] for oid, raw in prefetch]})


def publish_now(state: ServerState, scope: Scope, req: wire.Publish
                ) -> tuple[list[str], list[tuple[str, bytes]]]:
    """Publish (blocks: the group commit's fdatasync); the heads and what to prefetch.

    Shared by the HTTP handler and the unix socket's lean stream (server/lean.py).
    """
    store = state.need_store()
    changesets, objects, txid = req.changesets, req.objects, req.txid
    if scope.volume is not None:
        store.check_refs_reachable(scope.volume, changesets, objects)
    store.check_tree_refs(objects)
    try:
        heads, nodes = store.publish_detailed(changesets, objects, txid=txid)
    except Conflict as exc:
        state.events.note_conflict(changesets, exc.paths)
        raise
    # Noted here, in the thread that published: a client that hangs up now
    # cancels the handler, not this.
    state.events.note_publish(changesets, heads, txid)
    return heads, _prefetch(store, heads, nodes) if req.prefetch else []


def _prefetch(store: LocalStore, heads: list[str], nodes: dict[bytes, bytes]
              ) -> list[tuple[str, bytes]]:
    """The new snapshots and tree nodes (up to a budget): what the client reads next."""
    out = []
    for head in heads:
        out.append((head, store.get_object(bytes.fromhex(head))))
    budget = PREFETCH_MAX
    for oid, node in nodes.items():
        budget -= len(node)
        if budget < 0:
            break
        out.append((oid.hex(), node))
    return out


async def lease(request: web.Request) -> web.Response:
    state = request.app[STATE]
    volume = check_volume(request.match_info["volume"])
    action = request.match_info["action"]
    body = await read_json(request)
    branch = check_branch(body_field(body, "branch", str))
    scope_of(request).check_branch(volume, branch, write=True)
    store = state.need_store()
    if action == "acquire":
        ttl = float(body_field(body, "ttl", (int, float)))
        holder = body_field(body, "holder", str, optional=True) or ""
        steal = bool(body_field(body, "steal", bool, optional=True))
        got = await state.run(functools.partial(store.acquire_lease, steal=steal),
                              volume, branch, ttl, holder)
    elif action == "renew":
        got = await state.run(store.renew_lease, volume, branch,
                              body_field(body, "lease", str),
                              float(body_field(body, "ttl", (int, float))))
    elif action == "release":
        await state.run(store.release_lease, volume, branch, body_field(body, "lease", str))
        return web.json_response({"released": True})
    else:
        raise NotFound(f"no lease action {action!r}")
    # The id (the holder's secret) goes back only to whoever acquired or renewed with it.
    return web.json_response({"fencing": got.fencing, "expires_ns": got.expires_ns,
                              "holder": got.holder, "lease": got.id})


async def steps(request: web.Request) -> web.Response:
    """A runner says a step on a branch ended without publishing (watch and the view show it).

    It changes nothing in the store: an event for those following the branch.
    """
    state = request.app[STATE]
    volume = check_volume(request.match_info["volume"])
    scope = scope_of(request)
    scope.check_volume(volume)  # permission before the body is read
    scope.check_write()
    body = await read_json(request)
    branch = check_branch(body_field(body, "branch", str))
    scope.check_branch(volume, branch, write=True)
    run = body_field(body, "run", str)
    if not 0 < len(run) <= 64 or not run.isalnum():
        raise InvalidInput("'run' must be 1 to 64 letters and digits")
    status = body_field(body, "status", int)
    if not 0 <= status <= 255:
        raise InvalidInput("'status' must be an exit status, 0 to 255")
    flags = [body_field(body, name, bool, optional=True) for name in ("timed_out", "oom")]
    argv = body_field(body, "argv", list, optional=True) or []
    if len(argv) > 64 or not all(isinstance(a, str) and len(a) <= 1024 for a in argv):
        raise InvalidInput("'argv' must list at most 64 strings of at most 1 KiB")
    state.events.note_step(volume, branch, run, status, timed_out=bool(flags[0]),
                           oom=bool(flags[1]), argv=argv)
    return web.json_response({"ok": True})


async def pins(request: web.Request) -> web.Response:
    """Pins on snapshots (garbage collection keeps them): pin, renew, release."""
    state = request.app[STATE]
    volume = check_volume(request.match_info["volume"])
    action = request.match_info["action"]
    scope = scope_of(request)
    scope.check_volume(volume)  # permission before the body is read
    body = await read_json(request)
    store = state.need_store()
    ttl = body_field(body, "ttl", (int, float), optional=True)
    if action == "pin":
        sids = body_field(body, "snapshots", list)
        if not 0 < len(sids) <= 64 or not all(isinstance(x, str) for x in sids):
            raise InvalidInput("'snapshots' must list 1 to 64 snapshot ids")
        if not scope.is_owner:  # a scoped token pins only what its volume reaches
            oids = [bytes.fromhex(check_hex_id(x)) for x in sids]
            ok = await state.run(store.reachable, volume, oids)
            if not all(ok):
                raise NotFound("no such snapshot")
        got = await state.run(store.pin, volume, sids, float(ttl or 60.0),
                              "" if scope.is_owner else f"token:{scope.token_id}")
        return web.json_response({"pins": got})
    ids = body_field(body, "pins", list)
    if not 0 < len(ids) <= 64 or not all(isinstance(x, str) for x in ids):
        raise InvalidInput("'pins' must list 1 to 64 pin ids")
    if action == "renew":
        await state.run(store.renew_pins, volume, ids, float(ttl or 60.0))
    elif action == "release":
        await state.run(store.release_pins, volume, ids)
    else:
        raise NotFound(f"no pin action {action!r}")
    return web.json_response({"ok": True})


# -- owner-only administration ------------------------------------------------------------

async def token_create(request: web.Request) -> web.Response:
    require_owner(request)
    body = await read_json(request)
    ttl = body_field(body, "ttl", (int, float), optional=True)
    volume = check_volume(body_field(body, "volume", str))
    state = request.app[STATE]
    vid = await state.run(state.need_store().volume_id, volume)  # NotFound: no such volume
    token, tinfo = state.tokens.create(
        volume, body_field(body, "branch", str, optional=True),
        bool(body_field(body, "writable", bool)), float(ttl) if ttl is not None else None, vid)
    return web.json_response({"token": token, "id": tinfo.id, "volume": tinfo.volume,
                              "branch": tinfo.branch, "writable": tinfo.writable,
                              "expires": tinfo.expires}, status=201)


async def token_list(request: web.Request) -> web.Response:
    require_owner(request)
    return web.json_response({"tokens": [
        {"id": t.id, "volume": t.volume, "branch": t.branch, "writable": t.writable,
         "expires": t.expires} for t in request.app[STATE].tokens.list()]})


async def token_revoke(request: web.Request) -> web.Response:
    require_owner(request)
    request.app[STATE].tokens.revoke(request.match_info["tid"])
    return web.json_response({"revoked": request.match_info["tid"]})


async def stats(request: web.Request) -> web.Response:
    require_owner(request)
    state = request.app[STATE]
    store = state.need_store()
    tier = await state.run(store.tier_report)
    tcp = state.admission.report() if state.admission is not None else None
    return web.json_response({**store.stats, **state.served, "bucket": tier,
                              "gc": store.gc_report(), "listen": state.listens, "tcp": tcp})


async def fsck(request: web.Request) -> web.Response:
    require_owner(request)
    state = request.app[STATE]
    store = state.need_store()
    body = await read_json(request) if request.can_read_body else {}
    progress = _fsck_progress()
    if body.get("rebuild_index"):
        rebuilt = await state.run(store.rebuild_index)
        report = await state.run(store.fsck, progress)
        report["rebuilt"] = rebuilt
    else:
        report = await state.run(store.fsck, progress)
    return web.json_response(report)


def _fsck_progress() -> Callable[[int, int, str], None]:
    """Report how far fsck got in the server's log: each phase as it starts, then every 30 s."""
    last: list[tuple[str, float]] = [("", 0.0)]

    def say(done: int, total: int, phase: str) -> None:
        now = time.monotonic()
        if phase != last[0][0] or now - last[0][1] >= 30:
            log.info("fsck: %s%s", phase, f" ({done}/{total})" if total else "")
            last[0] = (phase, now)
    return say


async def gc(request: web.Request) -> web.Response:
    """One garbage collection pass (engine/gc.py), owner only."""
    require_owner(request)
    state = request.app[STATE]
    store = state.need_store()
    body = await read_json(request) if request.can_read_body else {}
    min_age = body_field(body, "min_age", (int, float), optional=True)
    dry = body_field(body, "dry_run", bool, optional=True)
    full = body_field(body, "full", bool, optional=True)
    kw: dict[str, Any] = {"dry_run": bool(dry), "full": bool(full)}
    if min_age is not None:
        kw["min_age"] = float(min_age)
    report = await state.run(lambda: store.gc(**kw))
    return web.json_response(report)


async def policy(request: web.Request) -> web.Response:
    """A volume's retention policy: GET ?volume=V[&branch=B]; POST sets fields (owner only)."""
    require_owner(request)
    store = request.app[STATE].need_store()
    if request.method == "GET":
        volume, branch = request.query.get("volume", ""), request.query.get("branch", "")
    else:
        body = await read_json(request)
        volume = body_field(body, "volume", str)
        branch = body_field(body, "branch", str, optional=True) or ""
    check_volume(volume)
    if branch:
        check_branch(branch)
    store.list_branches(volume)  # the volume must exist
    if request.method == "POST":
        fields = {k: body_field(body, k, (int, float), optional=True)
                  for k in ("keep_last", "keep_newer", "expire_runs") if k in body}
        store.policies.set(volume, branch or None, **fields)
    return web.json_response(asdict(store.policies.get(volume, branch)))


async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events (docs/api.md, "Events"); outside /v1: never drained on handoff."""
    state = request.app[STATE]
    return await events_mod.answer(request, state, scope_of(request))


async def handoff(request: web.Request) -> web.Response:
    require_owner(request)
    state = request.app[STATE]
    if state.on_handoff is None:
        raise Unavailable("this server cannot hand off")
    await state.on_handoff()
    return web.json_response({"released": True})


async def stop(request: web.Request) -> web.Response:
    require_owner(request)
    state = request.app[STATE]
    if state.on_stop is not None:
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(
            state.on_stop() if state.on_stop else asyncio.sleep(0)))
    return web.json_response({"stopping": True})


def make_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[middleware], client_max_size=MAX_BODY)
    app[STATE] = state
    r = app.router
    r.add_get("/openapi.json", openapi)
    r.add_get("/v1/info", info)
    r.add_get("/v1/whoami", whoami)
    r.add_post("/v1/objects/missing", missing)
    r.add_post("/v1/objects", put_objects)
    r.add_get("/v1/objects/{oid}", get_object)
    r.add_post("/v1/objects/get", get_objects)
    r.add_get("/v1/volumes", list_volumes)
    r.add_post("/v1/volumes", create_volume)
    r.add_delete("/v1/volumes/{volume}", delete_volume)
    r.add_post("/v1/heads", heads)
    r.add_get("/v1/volumes/{volume}/branches", list_branches)
    r.add_post("/v1/volumes/{volume}/branches", fork)
    r.add_delete("/v1/volumes/{volume}/branches/{branch:.+}", delete_branch)
    r.add_post("/v1/volumes/{volume}/lease/{action}", lease)
    r.add_post("/v1/volumes/{volume}/pins/{action}", pins)
    r.add_post("/v1/volumes/{volume}/steps", steps)
    r.add_get("/v1/snapshots/{prefix}", find_snapshot)
    r.add_post("/v1/publish", publish)
    r.add_post("/v1/admin/tokens", token_create)
    r.add_get("/v1/admin/tokens", token_list)
    r.add_delete("/v1/admin/tokens/{tid}", token_revoke)
    r.add_get("/v1/admin/stats", stats)
    r.add_post("/v1/admin/fsck", fsck)
    r.add_post("/v1/admin/gc", gc)
    r.add_get("/v1/admin/policy", policy)
    r.add_post("/v1/admin/policy", policy)
    r.add_post("/v1/admin/handoff", handoff)
    r.add_post("/v1/admin/stop", stop)
    r.add_get("/events", events)
    ui.register(app, state)
    return app
