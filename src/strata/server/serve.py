"""The owning process: open the store, listen, hand off, stop.

`strata serve` holds the store's lock for as long as it runs. A second
`serve` without `--takeover` fails at once naming the owner. With
`--takeover` the new process binds its listeners first (a fresh unix socket
renamed over the old path; TCP ports shared through SO_REUSEPORT), answers
503 "retry" on them, asks the old owner to drain and release the store, then
opens it. Clients retry through the gap, so no call fails.

It logs (to STORE/serve.log, set up by the CLI) when it serves, takes over,
hands off and stops; what it prints on the terminal is the CLI's
(cli/serve.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from strata.engine.errors import InvalidInput, StrataError, Unavailable
from strata.engine.local import LocalStore, StoreConfig, read_store_meta
from strata.memtrim import return_large_buffers_to_the_os
from strata.server.admission import Admission, AdmittedSite
from strata.server.app import LOGGED, ServerState, make_app
from strata.server.client import default_socket, http_connection
from strata.server.lean import LeanServer
from strata.server.tokens import TokenStore
from strata.server.wire import lean_path

log = logging.getLogger(__name__)

GC_INTERVAL = 600.0  # seconds between background garbage collection passes (0: none)
# A connection must finish sending each request's head (request line and headers)
# within this of its start or of the previous answer, or it is closed: this is
# aiohttp's keep-alive timeout, which closes a connection whose next request is not
# complete by then (idle or trickling alike). Its default, an hour, let 3,000
# half-open requests sit for as long as their clients liked. Bodies have their
# own timeout (bodies.BODY_TIMEOUT).
HEADER_TIMEOUT = 10.0


@dataclass
class Listener:
    spec: str
    sock: socket.socket
    unix_path: str | None = None
    tmp_path: str | None = None
    unix_ino: int = 0  # the socket file's inode, to tell ours from a successor's


@dataclass
class ServeResult:
    gap_seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    fenced: str | None = None  # another owner took the store over (the bucket tier)
    tcp: list[str] = field(default_factory=list)  # HOST:PORT of each TCP listener, as bound


def _bind(spec: str, store_dir: str) -> Listener:
    if spec.startswith("unix:"):
        path = os.path.abspath(spec[5:])
        tmp = f"{path}.new-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: only the store's owner connects
        try:
            s.bind(tmp)
        finally:
            os.umask(old)
        s.listen(512)
        s.setblocking(False)
        return Listener(spec, s, unix_path=path, tmp_path=tmp, unix_ino=os.stat(tmp).st_ino)
    if spec.startswith("tcp:"):
        host, _, port = spec[4:].rpartition(":")
        if not host or not port.isdigit():
            raise InvalidInput(f"listen address must be tcp:HOST:PORT, not {spec!r}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # shared during a handoff
        s.bind((host.strip("[]"), int(port)))
        s.listen(512)
        s.setblocking(False)
        return Listener(spec, s)
    raise InvalidInput(f"listen address must be unix:PATH or tcp:HOST:PORT, not {spec!r}")


def _owner_connection(path: str) -> http.client.HTTPConnection | None:
    conn = http_connection("unix", path, 0, timeout=60.0)
    try:
        conn.connect()
    except OSError:
        return None
    return conn


async def run_server(store_dir: str, listens: list[str], *, takeover: bool = False,
                     config: StoreConfig | None = None,
                     on_ready: object = None,
                     idle_exit: float | None = None,
                     on_open: Callable[[LocalStore], None] | None = None,
                     stop: asyncio.Event | None = None) -> ServeResult:
    """Serve `store_dir` until stopped or handed off; returns what happened.

    `on_open` sees the store once it is open, before any request reaches it;
    with `stop` (a fleet member serving several stores in one process), that
    event stops the server and SIGTERM/SIGINT are left to the caller.
    """
    store_dir = os.path.abspath(store_dir)
    read_store_meta(store_dir)  # a clear error if this is not a store
    return_large_buffers_to_the_os()  # keeps the body and answer budgets honest
    result = ServeResult()
    # The store's own socket is always served: --takeover, --stop and the CLI reach the
    # owner through it, whatever else it listens on.
    own = f"unix:{default_socket(store_dir)}"
    if not any(os.path.abspath(s[5:]) == own[5:] for s in listens if s.startswith("unix:")):
        listens = [own, *listens]
    listeners = [_bind(spec, store_dir) for spec in listens]
    # As bound: a port of 0 is the kernel's choice (a fleet member's token listener).
    result.tcp = ["{}:{}".format(*lst.sock.getsockname()[:2]) for lst in listeners
                  if lst.unix_path is None]
    state = ServerState(store_dir)
    state.listens = list(listens)
    app = make_app(state)
    _quiet_bad_requests()
    # auto_decompress off: a compressed body is never inflated (bodies.UnsupportedEncoding).
    runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False,
                           keepalive_timeout=HEADER_TIMEOUT)
    await runner.setup()
    admission = Admission()  # TCP only: the unix sockets keep what TCP may not take
    state.admission = admission
    for lst in listeners:
        if lst.unix_path is None:
            await AdmittedSite(runner, lst.sock, admission).start()
        else:
            await web.SockSite(runner, lst.sock).start()
    # The lean stream beside the store's own socket (server/lean.py): published,
    # handed off and removed with the HTTP listeners.
    lean_listener = _bind(f"unix:{lean_path(own[5:])}", store_dir)
    lean_listener.sock.setblocking(True)  # accepted in a thread of its own
    lean = LeanServer(state, lean_listener.sock)
    lean.start()
    listeners.append(lean_listener)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    # Ask the previous owner to step aside (it keeps its connections answered with 503).
    old = None
    if takeover:
        for lst in listeners:
            if lst.unix_path is not None and old is None:
                old = await loop.run_in_executor(None, _owner_connection, lst.unix_path)
    def publish_sockets() -> None:
        for lst in listeners:
            if lst.tmp_path is not None and lst.unix_path is not None:
                os.rename(lst.tmp_path, lst.unix_path)
                lst.tmp_path = None

    if takeover:
        publish_sockets()  # new connections reach us now, and get 503 until we own the store
    gap_start = time.monotonic()
    if old is not None:
        def ask() -> None:
            old.request("POST", "/v1/admin/handoff", body=b"{}",
                        headers={"Content-Type": "application/json"})
            resp = old.getresponse()
            resp.read()
            if resp.status != 200:
                raise Unavailable(f"previous owner refused the handoff ({resp.status})")
        try:
            await loop.run_in_executor(None, ask)
        finally:
            old.close()
    try:
        meta = read_store_meta(store_dir)  # the settings chosen at init time hold here too
        cfg = config or StoreConfig(
            lock_timeout=30.0 if takeover else 0.0,
            pack_size_limit=int(meta.get("pack_size_limit", StoreConfig().pack_size_limit)),
            pack_age_limit=float(meta.get("pack_age_limit", StoreConfig().pack_age_limit)))
        state.store = await loop.run_in_executor(state.executor,
                                                 lambda: LocalStore(store_dir, cfg))
        if on_open is not None:
            on_open(state.store)
    except BaseException as exc:
        # Info, not error: the CLI reports the failure itself, on the terminal.
        log.info("store %s not opened (%s); listeners closed", store_dir,
                 str(exc) or type(exc).__name__)
        await loop.run_in_executor(None, lean.close)
        await _close_listeners(runner, listeners)
        raise
    # Read the tokens again: the previous owner may have created or revoked some
    # since we started (a revocation must not come back to life).
    state.tokens = TokenStore(store_dir)
    publish_sockets()  # without --takeover only once the store's lock is ours
    state.mode = "serving"
    log.info("serving store %s on %s", store_dir, ", ".join(listens))
    if old is not None:
        result.gap_seconds = time.monotonic() - gap_start
        log.info("took the store over from its previous owner; requests waited %d ms",
                 result.gap_seconds * 1000)

    async def release() -> None:
        """Drain in-flight requests, close the store, keep answering 503."""
        if state.mode != "serving":
            return
        state.mode = "draining"
        state.events.close()  # event streams end; their readers resume from the successor
        await state.idle.wait()
        await loop.run_in_executor(None, lean.drain)
        store, state.store = state.store, None
        if store is not None:
            await loop.run_in_executor(state.executor, store.close)

    async def on_handoff() -> None:
        log.info("handing the store to a new owner")
        await release()
        result.notes.append("handed off")
        # Our listeners stay up a moment so late requests get 503, not refusals.
        loop.call_later(0.5, done.set)

    async def on_stop() -> None:
        if state.mode == "serving":
            log.info("stopping")
        await release()
        done.set()

    state.on_handoff = on_handoff
    state.on_stop = on_stop
    if stop is None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(on_stop()))
    if callable(on_ready):
        on_ready(result)  # gap_seconds is known by now: the CLI reports it at once

    async def watch_idle(limit: float) -> None:
        while not done.is_set():
            await asyncio.sleep(min(limit, 1.0))
            quiet = time.monotonic() - state.last_request > limit
            if quiet and state.inflight == 0 and state.watchers == 0 and not lean.busy():
                log.info("no request for %g s: stopping", limit)
                await on_stop()
                return

    async def watch_fence() -> None:
        """Stop once a bucket store's tier finds it was taken over.

        Serving on could only answer refusals, and the new owner may be on another host.
        """
        while not done.is_set():
            await asyncio.sleep(0.2)
            store = state.store
            why = store.fenced() if store is not None else None
            if why is not None:
                log.info("the store was taken over elsewhere: %s", why)  # the CLI says so too
                result.fenced = why
                result.notes.append(f"stopped: {why}")
                await on_stop()
                return

    async def collect_garbage(every: float) -> None:
        """Garbage collection in the background (engine/gc.py), with the default age cutoff."""
        while not done.is_set():
            await asyncio.sleep(every)
            store = state.store
            if store is None or state.mode != "serving":
                continue
            try:
                await loop.run_in_executor(state.executor, store.gc)
            except StrataError as exc:
                # Also reported by the next `strata stats`; tried again later.
                log.warning("background garbage collection failed: %s", exc)
                continue

    async def watch_stop(event: asyncio.Event) -> None:
        await event.wait()
        await on_stop()

    tasks = [asyncio.ensure_future(watch_fence())]
    if stop is not None:
        tasks.append(asyncio.ensure_future(watch_stop(stop)))
    gc_every = float(os.environ.get("STRATA_GC_INTERVAL", GC_INTERVAL))
    if gc_every > 0:
        tasks.append(asyncio.ensure_future(collect_garbage(gc_every)))
    if idle_exit:
        tasks.append(asyncio.ensure_future(watch_idle(idle_exit)))
    await done.wait()
    for task in tasks:
        task.cancel()
    # Off the event loop: a fleet member serves many stores on one loop, and a store
    # given up after a fence may take a long while to let its last requests go.
    await loop.run_in_executor(None, lean.close)
    await _close_listeners(runner, listeners, unlink="handed off" not in result.notes)
    await loop.run_in_executor(None, functools.partial(state.executor.shutdown, wait=True))
    log.info("stopped (%s)", "; ".join(result.notes) or "asked to stop")
    return result


def _quiet_bad_requests() -> None:
    """Keep a client's malformed HTTP, and errors logged already, out of the log.

    aiohttp answers malformed HTTP 400 itself (e.g. both Content-Length and
    Transfer-Encoding), then logs "Error handling request" with a traceback,
    which reads like a fault of the server's. Such records are dropped, and
    so are aiohttp's records of exceptions the API's middleware has logged
    already (it names the request; app.LOGGED). Any other error is logged as
    before.
    """
    from aiohttp.http_exceptions import HttpProcessingError

    def keep(record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, HttpProcessingError) and not getattr(exc, LOGGED, False)

    log = logging.getLogger("aiohttp.server")
    if not any(getattr(f, "__name__", "") == keep.__name__ for f in log.filters):
        log.addFilter(keep)


async def _close_listeners(runner: web.AppRunner, listeners: list[Listener],
                           unlink: bool = True) -> None:
    for lst in listeners:
        if unlink and lst.unix_path is not None:
            # Remove the path only if it is still our socket (not a successor's).
            try:
                if os.stat(lst.unix_path).st_ino == lst.unix_ino:
                    os.unlink(lst.unix_path)
            except OSError:
                pass  # already gone: nothing to remove
        if lst.tmp_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(lst.tmp_path)
    await runner.cleanup()


def stop_server(socket_path: str, timeout: float = 30.0) -> bool:
    """Ask the server on `socket_path` to stop; wait until it is gone."""
    conn = _owner_connection(socket_path)
    if conn is None:
        return False
    try:
        conn.request("POST", "/v1/admin/stop", body=b"{}",
                     headers={"Content-Type": "application/json"})
        conn.getresponse().read()
    except (OSError, http.client.HTTPException):
        pass  # it may hang up as it stops, before answering: the wait below tells
    finally:
        conn.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe = _owner_connection(socket_path)
        if probe is None:
            return True
        probe.close()
        time.sleep(0.05)
    raise Unavailable(f"server on {socket_path} did not stop within {timeout:g}s")

