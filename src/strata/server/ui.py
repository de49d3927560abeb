"""The web view at /ui: its routes and each request's context (`UiRequest`).

It shows volumes, branches, history, diffs and files, live as runs publish.
What a file holds and how it is shown (text, SQLite, a unified diff) is read
by `previews.py`; what a snapshot changed and what a rejected run met, by
`history.py`.

Everything here reads; no route changes a volume, a branch or a token. The
browser holds a read-only token in an HttpOnly, SameSite=Strict cookie set by
`/ui/login` (the URL `strata ui` prints carries the token once, then the
browser is sent to a clean URL). Each request's scope is the token's, checked
with the API's own rules: a token sees one volume, snapshots only from that
volume's history, and a name outside its scope gets the same answer whether
it exists or not.

Pages are one static shell (`ui_static/`), whose script reads the JSON routes
under `/ui/api/`. The shell's Content-Security-Policy allows only scripts,
styles and images served from here, so nothing from a volume runs in this
origin: file contents come as JSON text (the script shows them with
`textContent`), and `/ui/raw` sends bytes only as a download, or as a raster
image, each with `sandbox` and `nosniff`.

Budgets, as the API's. A file's size is its file node's (an entry's own size
is a claim: one claiming 1,000 bytes over a 256 MiB node once reached the
SQLite view's temporary file whole). Bytes being answered are held in the
server's answer budget until written (`/ui/raw` a block at a time; the text,
SQLite and diff views for their answer's size), and a write that makes no
progress for WRITE_TIMEOUT ends the answer. Work goes to the executor in
steps (a file is hashed HASH_STEP bytes a trip), each taking one of its
volume's VOLUME_SHARE seats, so one volume's readers cannot take every
thread; before each step the client must still be there, so a request whose
client left stops (40 hashes of a 4 GiB file used to run on after their
clients had gone, and another volume waited 20 s for a thread).

Names are bytes. A path travels in a URL as its bytes percent-encoded (a name
that is not UTF-8 keeps its raw bytes), and the server sends each entry's
encoded form (`q`) beside a printable one (`name`), so the script never has
to decode a path.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import json
import logging
import os
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from importlib import resources
from typing import Any, TypeVar

import blake3
from aiohttp import web

from strata.engine.errors import Expired, InvalidInput, NotFound, Unauthenticated
from strata.engine.interface import Store
from strata.engine.local import LocalStore
from strata.engine.names import check_branch, check_hex_id, check_volume, split_path
from strata.engine.objects import ENTRY_KIND_NAMES, K_DIR, K_FILE, K_SYMLINK, Entry, FileNode
from strata.engine.tree import Trees, change_kind, decode_name, encode_name
from strata.server import events as events_mod
from strata.server.auth import COOKIE
from strata.server.history import describe_publish, rejection
from strata.server.previews import (
    DIFF_FILE_LIMIT,
    SQLITE_ANSWER,
    SQLITE_LIMIT,
    TEXT_LIMIT,
    file_diff,
    file_node,
    file_size,
    read_file,
    sniff_file,
    sqlite_tables,
    text_lines,
)
from strata.server.tokens import Scope

log = logging.getLogger(__name__)

PAGE = 200            # entries in one page of a listing or of history
MAX_PAGE = 1000
DIFF_LIMIT = 10_000   # paths in one diff answer; the rest is counted, not sent
VOLUME_SHARE = 4      # executor threads one volume's view requests hold at once (of 32)
HASH_STEP = 16 * 1024 * 1024  # bytes hashed per trip to the executor
RAW_STEP = 512 * 1024  # bytes of /ui/raw read per trip (or one block, if larger)
WRITE_TIMEOUT = 30.0  # seconds a write of an answer may wait for the client to read
TEXT_ANSWER = 6       # a text answer's bytes per byte of the file, at most (JSON escapes)
T = TypeVar("T")

PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
            "connect-src 'self'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")
RAW_CSP = "default-src 'none'; sandbox"
STATIC = {"app.js": "text/javascript", "app.css": "text/css"}


def _headers(csp: str = PAGE_CSP) -> dict[str, str]:
    return {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
            "Cache-Control": "no-store"}


# -- request parsing --------------------------------------------------------------------

def _query(request: web.Request) -> dict[str, str]:
    """The query, decoded so that bytes that are not UTF-8 survive (surrogateescape)."""
    raw = request.raw_path.partition("?")[2]
    out: dict[str, str] = {}
    for part in raw.split("&"):
        if not part:
            continue
        k, _, v = part.partition("=")
        out.setdefault(urllib.parse.unquote_plus(k),
                       urllib.parse.unquote_plus(v, errors="surrogateescape"))
    return out


def quote(path: str) -> str:
    """A path as it travels in a URL: its bytes percent-encoded ('/' kept)."""
    return urllib.parse.quote(path, safe="/", errors="surrogateescape")


def printable(path: str) -> str:
    r"""A path to show: UTF-8 as is, other bytes as \xNN."""
    return encode_name(path).decode("utf-8", "backslashreplace")


class UiRequest:
    """One request's scope and store, with the API's checks."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.state = request.app[STATE_KEY]
        scope = request.get("scope")
        if not isinstance(scope, Scope):
            raise Unauthenticated("no session: open the URL `strata ui` prints")
        self.scope: Scope = scope
        self.store: LocalStore = self.state.need_store()
        self.q = _query(request)
        self.shares: Shares = request.app[SHARES_KEY]
        self.share = scope.volume or ""  # whose seats run() takes; volume() narrows it

    def arg(self, name: str, default: str | None = None) -> str:
        v = self.q.get(name, default)
        if v is None:
            raise InvalidInput(f"missing query parameter {name!r}")
        return v

    def volume(self) -> str:
        v = check_volume(self.arg("v"))
        self.scope.check_volume(v)  # the same refusal for a volume that does not exist
        self.share = v
        return v

    def branch(self, volume: str) -> str:
        b = check_branch(self.arg("b", "live"))
        self.scope.check_branch(volume, b, write=False)
        return b

    def snapshot(self, volume: str, name: str = "s") -> str:
        """A snapshot id from the query, if the token may see it (blocking)."""
        sid = check_hex_id(self.arg(name))
        if not self.scope.is_owner:
            vid = self.store.volume_id(volume)
            if not self.state.visibility.contains(self.store, vid, volume, sid):
                raise NotFound(f"no snapshot {sid} in volume {volume!r}")
        self.store.snapshot(sid)  # NotFound if it is none
        return sid

    def path(self) -> str:
        p = self.q.get("p", "").strip("/")
        split_path(p)
        return p

    def heads(self, volume: str) -> dict[str, str]:
        heads = self.store.list_branches(volume)
        if self.scope.branch is not None:
            heads = {b: h for b, h in heads.items() if b == self.scope.branch}
        return heads

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn` in the executor, in one of this volume's seats, if the client is still there."""
        async with self.shares.seat(self.share):
            if gone(self.request):
                log.debug("%s: the client left; its work stops", self.request.path)
                raise ClientGone()
            result: T = await self.state.run(fn, *args)
            return result

    def answers(self, n: int) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold `n` bytes of the server's answer budget (the API's) until the block ends."""
        hold: contextlib.AbstractAsyncContextManager[None] = self.state.answers.hold(n)
        return hold


class ClientGone(web.HTTPClientError):
    """The client hung up: the work for it stops, and nobody reads this answer."""

    status_code = 499


def gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class Shares:
    """Seats in the executor, VOLUME_SHARE per volume (event loop only).

    A volume's view requests wait here, not in the executor's queue, so
    another volume's request finds a thread free.
    """

    def __init__(self, per_volume: int = VOLUME_SHARE) -> None:
        self.per_volume = per_volume
        self._seats: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def seat(self, volume: str) -> AsyncIterator[None]:
        sem, users = self._seats.setdefault(volume, (asyncio.Semaphore(self.per_volume), [0]))
        users[0] += 1
        try:
            async with sem:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._seats[volume]


async def _sent(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """Write an answer now, so that budget held around this call covers its bytes."""
    await resp.prepare(request)
    await resp.write_eof()
    return resp


async def _write(request: web.Request, resp: web.StreamResponse, data: bytes | memoryview
                 ) -> None:
    """Write, or end the connection if the client takes nothing for WRITE_TIMEOUT."""
    try:
        async with asyncio.timeout(WRITE_TIMEOUT):
            await resp.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ClientGone() from None
    except ConnectionError:  # the client left mid-answer (reset, or lost while draining)
        raise ClientGone() from None


STATE_KEY: web.AppKey[Any] = web.AppKey("ui_state")
SHARES_KEY = web.AppKey("ui_shares", Shares)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(value, separators=(",", ":")), status=status,
                        content_type="application/json", headers=_headers())


# -- pages ------------------------------------------------------------------------------

def _static(name: str) -> bytes:
    return resources.files("strata.server").joinpath("ui_static", name).read_bytes()


async def page(request: web.Request) -> web.Response:
    """The shell every view shares; its script reads the view from the URL."""
    if not isinstance(request.get("scope"), Scope):
        return web.Response(text=_NO_SESSION, status=401, content_type="text/html",
                            headers=_headers())
    return web.Response(body=_static("index.html"), content_type="text/html",
                        headers=_headers())


_NO_SESSION = """<!doctype html><meta charset="utf-8"><title>strata</title>
<link rel="stylesheet" href="/ui/static/app.css">
<main><h1>strata</h1><p>No session. Run <code>strata ui VOLUME</code> and open the URL
it prints.</p></main>"""


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in STATIC:
        raise web.HTTPNotFound()
    headers = {**_headers(), "Cache-Control": "no-cache"}
    return web.Response(body=_static(name), content_type=STATIC[name], headers=headers)


async def login(request: web.Request) -> web.Response:
    """Trade the token in the URL for a cookie, then go to a URL without it.

    Setting a cookie changes nothing on the server. The token must be valid
    now; the cookie lives no longer than the token does.
    """
    state = request.app[STATE_KEY]
    q = _query(request)
    token = q.get("token", "")
    scope = state.tokens.verify(token)  # Unauthenticated: 401
    if scope.is_owner or scope.writable:
        # The browser gets read-only sessions only: nothing in it may write.
        raise InvalidInput("the web view takes read-only tokens (strata ui makes one)")
    nxt = q.get("next", "/ui/")
    if not nxt.startswith("/ui/") or "//" in nxt or "\\" in nxt or any(
            ord(c) < 0x20 for c in nxt):
        nxt = "/ui/"
    tid = token.split("_")[1]
    info = next((t for t in state.tokens.list() if t.id == tid), None)
    max_age = None if info is None or info.expires is None else max(
        int(info.expires - time.time()), 1)
    resp = web.HTTPSeeOther(location=nxt, headers=_headers())
    resp.set_cookie(COOKIE, token, path="/ui", httponly=True, samesite="Strict",
                    max_age=max_age)
    return resp


# -- volumes, branches, history ------------------------------------------------------------

async def api_volumes(request: web.Request) -> web.Response:
    view = UiRequest(request)

    def list_volumes() -> dict[str, Any]:
        store = view.store
        names = store.list_volumes()
        if not view.scope.is_owner:
            names = [n for n in names if n == view.scope.volume]
        out = []
        now = time.time()
        for name in names:
            branches = []
            image: dict[str, str] | None = None
            for b, h in sorted(view.heads(name).items()):
                info = store.snapshot(h)
                branches.append({"name": b, "head": h, "time": info.time_ns / 1e9,
                                 "age": max(now - info.time_ns / 1e9, 0),
                                 "message": info.message,
                                 "rejected": b.startswith("rejected/")})
                meta = info.meta.get("image")  # an imported image: its branches are tags
                if isinstance(meta, dict) and image is None:
                    image = {"ref": str(meta.get("ref") or ""),
                             "source": str(meta.get("source") or "")}
            out.append({"name": name, "branches": branches, "image": image})
        return {"volumes": out, "owner": view.scope.is_owner}

    return _json(await view.run(list_volumes))


def _limit(view: UiRequest) -> int:
    try:
        n = int(view.arg("limit", str(PAGE)))
    except ValueError as exc:
        raise InvalidInput("limit must be a number") from exc
    return min(max(n, 1), MAX_PAGE)


async def api_log(request: web.Request) -> web.Response:
    """One page of a branch's history, newest first; `next` continues it."""
    view = UiRequest(request)
    volume = view.volume()
    branch = view.branch(volume)
    limit = _limit(view)

    def history_page() -> dict[str, Any]:
        heads = view.heads(volume)
        if branch not in heads:
            raise NotFound(f"no branch {branch!r} in volume {volume!r}")
        cur: str | None = view.snapshot(volume, "after") if "after" in view.q else heads[branch]
        if "after" in view.q and cur is not None:
            cur = view.store.snapshot(cur).parent
        entries: list[dict[str, Any]] = []
        expired = False  # history ends where a retention policy let it go
        while cur is not None and len(entries) < limit:
            try:
                ev = describe_publish(view.store, cur, count_limit=10_000)
            except Expired:
                expired, cur = True, None
                break
            entries.append({"id": cur, "parent": ev["parent"], "time": ev["snapshot_time"],
                            "message": ev["message"], "run": ev["run"],
                            "added": ev["added"], "deleted": ev["deleted"],
                            "modified": ev["modified"], "truncated": ev.get("truncated", False)})
            cur = ev["parent"]
            if ev.get("parent_expired"):
                expired, cur = True, None
        return {"volume": volume, "branch": branch, "head": heads[branch],
                "entries": entries, "next": entries[-1]["id"] if cur is not None else None,
                "older_expired": expired}

    return _json(await view.run(history_page))


# -- directories and files --------------------------------------------------------------

def _iter_from(trees: Trees, oid: bytes, after: bytes | None) -> Iterator[tuple[bytes, Entry]]:
    """A directory's entries after the name `after`, reaching it in O(depth)."""
    node = trees.node(oid)
    if node.level == 0:
        names = [n for n, _ in node.entries]
        start = 0 if after is None else bisect.bisect_right(names, after)
        yield from node.entries[start:]
        return
    firsts = [c[0] for c in node.children]
    start = 0 if after is None else max(bisect.bisect_right(firsts, after) - 1, 0)
    for i, (_f, child, _c) in enumerate(node.children[start:]):
        yield from _iter_from(trees, child, after if i == 0 else None)


def _entry_json(path: str, e: Entry) -> dict[str, Any]:
    return {"name": printable(path.rpartition("/")[2]), "path": printable(path),
            "q": quote(path), "type": ENTRY_KIND_NAMES[e.kind], "size": e.size,
            "mtime": e.mtime_ns / 1e9, "mode": f"{e.mode:04o}"}


def _resolve(store: Store, sid: str, path: str) -> Entry:
    e = Trees(store, store.node_cache).resolve(store.snapshot(sid).root, split_path(path))
    if e is None:
        raise NotFound(f"no such file or directory: {printable(path)!r}")
    return e


async def api_tree(request: web.Request) -> web.Response:
    """One page of a directory (names in byte order); `next` is the last name's q."""
    view = UiRequest(request)
    volume = view.volume()
    limit = _limit(view)

    def directory_page() -> dict[str, Any]:
        sid = view.snapshot(volume)
        path = view.path()
        store = view.store
        e = _resolve(store, sid, path)
        if e.kind != K_DIR:
            return {"path": printable(path), "q": quote(path), "dir": False,
                    "entry": _entry_json(path, e)}
        trees = Trees(store, store.node_cache)
        after = encode_name(view.q["after"]) if view.q.get("after") else None
        items: list[dict[str, Any]] = []
        count = 0
        more = False
        if e.ref is not None:
            count = trees.count(e.ref)
            for name, child in itertools.islice(_iter_from(trees, e.ref, after), limit + 1):
                if len(items) == limit:
                    more = True
                    break
                full = f"{path}/{decode_name(name)}" if path else decode_name(name)
                items.append({**_entry_json(full, child), "raw": decode_name(name)})
        last = quote(items[-1]["raw"]) if more else None
        for item in items:
            del item["raw"]
        return {"path": printable(path), "q": quote(path), "dir": True, "count": count,
                "entries": items, "next": last}

    return _json(await view.run(directory_page))


async def api_file(request: web.Request) -> web.StreamResponse:
    view = UiRequest(request)
    volume = view.volume()

    def describe_entry() -> tuple[dict[str, Any], Entry, FileNode | None, str]:
        sid = view.snapshot(volume)
        path = view.path()
        store = view.store
        e = _resolve(store, sid, path)
        out: dict[str, Any] = {**_entry_json(path, e), "snapshot": sid}
        if e.kind == K_SYMLINK:
            out["view"] = "symlink"
            out["target"] = printable(os.fsdecode(e.data or b""))
        elif e.kind == K_DIR:
            out["view"] = "dir"
        elif e.kind != K_FILE:
            out["view"] = "special"
        if "view" in out:
            return out, e, None, ""
        node = file_node(store, e)
        out["size"] = file_size(e, node)
        return out, e, node, sniff_file(store, e, node)

    out, e, node, kind = await view.run(describe_entry)
    if not kind:
        return _json(out)
    out["blake3"] = await _hash(view, e, node)
    size: int = out["size"]
    if kind.startswith("image/"):
        out["view"] = "image"
        out["ctype"] = kind
    elif kind == "sqlite":
        out["view"] = "sqlite"
        if size > SQLITE_LIMIT:
            out["tables"] = {"error": f"database over {SQLITE_LIMIT >> 20} MiB: not opened"}
        else:
            async with view.answers(SQLITE_ANSWER):
                out["tables"] = await view.run(sqlite_tables, view.store, e, node)
                return await _sent(request, _json(out))
    elif kind == "text":
        async with view.answers(min(size, TEXT_LIMIT) * TEXT_ANSWER):
            out["view"] = "text"
            out["lines"], out["truncated"] = await view.run(text_lines, view.store, e, node)
            return await _sent(request, _json(out))
    else:
        out["view"] = "binary"
    return _json(out)


async def _hash(view: UiRequest, e: Entry, node: FileNode | None) -> str:
    """A file's BLAKE3, HASH_STEP bytes per trip to the executor (so it stops with its client)."""
    h = blake3.blake3()
    pieces = read_file(view.store, e, node=node)

    def step() -> bool:
        n = 0
        for piece in pieces:
            h.update(piece)
            n += len(piece)
            if n >= HASH_STEP:
                return False
        return True

    while not await view.run(step):
        pass
    return str(h.hexdigest())


async def raw(request: web.Request) -> web.StreamResponse:
    """A file's bytes: a raster image inline, anything else only as a download."""
    view = UiRequest(request)
    volume = view.volume()

    def open_file() -> tuple[Entry, FileNode | None, str, str]:
        sid = view.snapshot(volume)
        path = view.path()
        e = _resolve(view.store, sid, path)
        if e.kind != K_FILE:
            raise InvalidInput(f"{printable(path)!r} is not a regular file")
        node = file_node(view.store, e)
        return e, node, sniff_file(view.store, e, node), path

    e, node, kind, path = await view.run(open_file)
    headers = {**_headers(RAW_CSP), "Cache-Control": "private, max-age=3600",
               "Cross-Origin-Resource-Policy": "same-origin"}
    if kind.startswith("image/"):
        ctype = kind
    else:
        ctype = "application/octet-stream"
        name = encode_name(path.rpartition("/")[2])
        ascii_name = "".join(c if 32 < ord(c) < 127 and c not in '"\\;' else "_"
                             for c in name.decode("ascii", "replace")) or "file"
        headers["Content-Disposition"] = (f"attachment; filename=\"{ascii_name}\"; "
                                          f"filename*=UTF-8''{urllib.parse.quote(name)}")
    resp = web.StreamResponse(headers={**headers, "Content-Type": ctype})
    resp.content_length = file_size(e, node)
    await resp.prepare(request)
    pieces = read_file(view.store, e, node=node)
    # A trip reads RAW_STEP bytes, or one block where blocks are larger: those are held
    # in the answer budget until written (16 pieces a trip held 256 MiB of 16 MiB blocks).
    step = max(node.block_size if node is not None else 0, RAW_STEP)

    def batch() -> list[bytes | memoryview]:
        out: list[bytes | memoryview] = []
        n = 0
        for piece in pieces:
            out.append(piece)
            n += len(piece)
            if n >= RAW_STEP:
                break
        return out

    while True:
        async with view.answers(step):
            got = await view.run(batch)
            if not got:
                break
            for piece in got:
                await _write(request, resp, piece)
            del got
    await resp.write_eof()
    return resp


# -- diffs --------------------------------------------------------------------------------

async def api_diff(request: web.Request) -> web.StreamResponse:
    """The paths that differ between snapshots a and b, streamed one JSON line each.

    Lines come as the trees are walked, so a large diff starts showing at
    once; after DIFF_LIMIT paths the rest is only counted. The last line is
    `{"end": true, "total": N, "truncated": bool}`.
    """
    view = UiRequest(request)
    volume = view.volume()

    def start_diff() -> Iterator[tuple[str, Entry | None, Entry | None]]:
        a = view.snapshot(volume, "a")
        b = view.snapshot(volume, "b")
        store = view.store
        trees = Trees(store, store.node_cache)
        return trees.diff(store.snapshot(a).root, store.snapshot(b).root)

    lines = await view.run(start_diff)
    resp = web.StreamResponse(headers={**_headers(), "Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    total = 0
    while True:
        batch = await view.run(lambda: list(itertools.islice(lines, 500)))
        if not batch:
            break
        out = []
        for path, old, new in batch:
            total += 1
            if total > DIFF_LIMIT:
                continue
            change = change_kind(old, new)
            e = new if new is not None else old
            assert e is not None
            out.append(json.dumps({"path": printable(path), "q": quote(path), "change": change,
                                   "type": ENTRY_KIND_NAMES[e.kind],
                                   "old_size": old.size if old else None,
                                   "new_size": new.size if new else None}) + "\n")
        if out:
            await resp.write("".join(out).encode())
    await resp.write((json.dumps({"end": True, "total": total,
                                  "truncated": total > DIFF_LIMIT}) + "\n").encode())
    await resp.write_eof()
    return resp


async def api_filediff(request: web.Request) -> web.StreamResponse:
    """One path's change between snapshots a and b: a unified diff for text."""
    view = UiRequest(request)
    volume = view.volume()

    def diff_one_file() -> dict[str, Any]:
        a = view.snapshot(volume, "a")
        b = view.snapshot(volume, "b")
        path = view.path()
        return {"path": printable(path), "q": quote(path),
                **file_diff(view.store, a, b, path, printable(path))}

    # Both sides (up to DIFF_FILE_LIMIT each) and the diff: held as the API holds answers.
    async with view.answers(4 * DIFF_FILE_LIMIT):
        return await _sent(request, _json(await view.run(diff_one_file)))


# -- rejected change sets ---------------------------------------------------------------------

async def api_rejected(request: web.Request) -> web.Response:
    """A rejected change set beside what it conflicted with.

    `rejected/<run>` holds the refused change set published on the snapshot
    the run started from. What it conflicted with is on the volume's other
    branches: the snapshots published since that base that touched the same
    paths.
    """
    view = UiRequest(request)
    volume = view.volume()
    branch = view.branch(volume)

    def analyse_rejection() -> dict[str, Any]:
        heads = view.heads(volume)
        if branch not in heads:
            raise NotFound(f"no branch {branch!r} in volume {volume!r}")
        r = rejection(view.store, heads, branch, DIFF_LIMIT)
        against = [{"branch": other, "snapshots": [
            {"id": t.info.id, "parent": t.info.parent, "message": t.info.message,
             "time": t.info.time_ns / 1e9,
             "paths": [{"path": printable(p), "q": quote(p)} for p in t.paths]}
            for t in touched]} for other, touched in r.conflicts_with]
        return {"volume": volume, "branch": branch, "head": r.head.id, "base": r.head.parent,
                "message": r.head.message, "time": r.head.time_ns / 1e9,
                "changes": [{"path": printable(p), "q": quote(p), "change": c}
                            for p, c in r.changes.items()],
                "conflicts_with": against}

    return _json(await view.run(analyse_rejection))


# -- live updates -------------------------------------------------------------------------

async def ui_events(request: web.Request) -> web.StreamResponse:
    """The session's own event stream (the cookie's scope; same events as GET /events)."""
    view = UiRequest(request)
    resp: web.StreamResponse = await events_mod.answer(request, view.state, view.scope)
    return resp


def register(app: web.Application, state: Any) -> None:
    app[STATE_KEY] = state
    app[SHARES_KEY] = Shares()
    r = app.router
    r.add_get("/ui", _to_root)
    r.add_get("/ui/", page)
    r.add_get("/ui/login", login)
    r.add_get("/ui/static/{name}", static)
    r.add_get("/ui/api/volumes", api_volumes)
    r.add_get("/ui/api/log", api_log)
    r.add_get("/ui/api/tree", api_tree)
    r.add_get("/ui/api/file", api_file)
    r.add_get("/ui/api/diff", api_diff)
    r.add_get("/ui/api/filediff", api_filediff)
    r.add_get("/ui/api/rejected", api_rejected)
    r.add_get("/ui/raw", raw)
    r.add_get("/ui/events", ui_events)


async def _to_root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")
