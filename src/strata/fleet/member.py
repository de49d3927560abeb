"""A fleet member: routes for every store, owns some, stands by for the rest.

One process per host (`strata fleet join`). It

- writes its heartbeat to the bucket (fleet/records.py);
- for each store it owns, runs the ordinary owner (`server/serve.run_server`
  on the store's unix socket, in this process and event loop) and a
  `LeaseKeeper` whose gate the store's tier asks before acknowledging;
- answers every API request on its TCP address for any volume, through the
  store the volume catalog places it in (fleet/front.py), or for the store
  named in the `X-Strata-Store` header: its own stores through their unix
  sockets, the others forwarded, as they came, to the owner the lease names
  (cached; refreshed by the scan, and dropped when a forward fails). No
  owner right now: 503 with Retry-After, and the client sends the same
  request again;
- counts where each store's requests enter the fleet, and hands a store it
  owns to the member doing most of its work (fleet/traffic.py);
- watches every lease and claims a store when its lease expired (by its own
  clock: unchanged for `expiry_wait`), when it is free, or when it is handed
  to this member. Among live members, a rendezvous hash picks who claims
  first; the next in line waits one TTL more, and so on. A claim writes the
  lease (If-Match) and then runs the fenced takeover of the store's owner log
  (restore without download, new epoch).

Nothing here decides who may acknowledge: the owner log's fence and the
lease window (fleet/lease.py) do. This module never prints; the CLI does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import logging
import os
import shutil
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from strata.engine.errors import AlreadyExists, InvalidInput, StrataError, Unavailable
from strata.engine.gc import PIN_LIFETIME, inherit_pins
from strata.engine.local import LocalStore
from strata.engine.names import check_volume
from strata.fleet import tokens as fleet_tokens
from strata.fleet import ui as fleet_ui
from strata.fleet.forward import (
    HOP,
    Unreachable,
    is_stream,
    proxy_session,
    relay,
    request_body,
    request_headers,
)
from strata.fleet.front import VolumeFront
from strata.fleet.lease import (
    HEARTBEAT_EVERY,
    LEASE_TTL,
    MEMBER_TTL,
    LeaseKeeper,
    clock,
    expiry_wait,
    pin_span,
    pins_end,
    ship_lag_gate,
)
from strata.fleet.quickhop import QuickHops
from strata.fleet.records import FleetRecords, Lease, rendezvous, store_url
from strata.fleet.traffic import MovePolicy, Traffic
from strata.fleet.tunnel import TUNNEL_PATH, Target, Tunnels
from strata.server.bodies import MAX_BODY
from strata.server.client import default_socket

log = logging.getLogger(__name__)

SCAN_EVERY = 0.2          # seconds between reads of the leases
CATALOG_EVERY = 2.0       # seconds between LISTs of stores and members
FORWARD_TIMEOUT = 4.0     # a forward that waits this long for an owner gives up (503)
# What a 503 tells a client to wait before it tries the next member. A takeover or a
# move ends the moment the new owner serves, so a client polls finely: at 0.20 s a
# client waited on average 0.1 s past the end of every gap (measured in bench/fleet.py).
RETRY_AFTER = "0.05"
CLAIM_TIMEOUT = 30.0      # a claim that has not restored and opened by then gives up
# What a restore waits when the old owner's pins are unknown (engine/gc.py's blanket).
UNKNOWN_PINS = 1.5 * PIN_LIFETIME
OWNER_TIMEOUT = 120.0     # the owner's own server, in this process: only a stuck one waits this
# Connections to an owned store's token listener (loopback TCP, where the store's server
# admits at most 64 per peer): API requests and event streams apart, so streams that
# idle for hours never keep a request waiting for a connection.
TOKEN_CONNECTIONS, TOKEN_STREAMS = 40, 16


def _warm() -> None:
    """Import what a claim needs before the first claim, not during it.

    A claim restores (the tier, obstore) and opens a server (the server's
    app and its handlers): imported lazily, the first claim of a member's
    life paid for them inside its gap, most of a second on a loaded host.
    """
    import strata.engine.tier  # noqa: F401
    import strata.server.serve  # noqa: F401


def _stopped(store: LocalStore) -> str | None:
    """Why an owned store can acknowledge nothing more: fenced, or its tier stopped.

    A tier stopped for another reason kept its lease renewed by a store that
    refused every publish: nobody else could claim it (seen in the fault rounds).
    """
    why = store.fenced()
    if why is None:
        why = (store.tier_report() or {}).get("failed")
    return str(why) if why else None


@dataclass
class Owned:
    store: str
    path: str
    keeper: LeaseKeeper
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    serving: bool = False
    epoch: int | None = None
    local: LocalStore | None = None
    session: aiohttp.ClientSession | None = None
    task: asyncio.Task[Any] | None = None
    claimed_in: float = 0.0
    # The store's token listener (loopback TCP, checked as any TCP listener is) and
    # the sessions that reach it: for requests that carry a scoped token, not the secret.
    token_url: str | None = None
    token_sessions: tuple[aiohttp.ClientSession, aiohttp.ClientSession] | None = None
    tokens_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tokens_saved: tuple[int, int] | None = None  # the tokens file as last saved or restored


@dataclass
class Seen:
    """A record as this member last saw it, and since when (its own monotonic clock)."""

    version: Any
    since: float
    body: Any


class Member:
    def __init__(self, url: str, name: str, host: str, port: int, data_dir: str, *,
                 key: bytes | None = None, ttl: float = LEASE_TTL,
                 token: str | None = None, advertise: str | None = None,
                 move: MovePolicy | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.host, self.port = host, port
        self.addr = advertise or f"http://{host}:{port}"
        self.dir = os.path.abspath(data_dir)
        self.key = key
        self.ttl = ttl
        if not token:  # the port answers as every store's owner: never open to anyone
            raise InvalidInput("a fleet member needs the fleet's shared secret: set "
                               "STRATA_FLEET_TOKEN (the same on every member and client)")
        self.token = token
        self.records = FleetRecords(self.url)
        self.owned: dict[str, Owned] = {}
        self.claiming: set[str] = set()
        self.catalog: dict[str, dict[str, Any]] = {}
        self.leases: dict[str, Seen] = {}        # store -> the lease as seen
        self.members: dict[str, Seen] = {}       # name -> heartbeat as seen
        self.leaving = False
        self.done = asyncio.Event()
        self.started = clock()
        self._beat = 0
        self._session: aiohttp.ClientSession | None = None
        self._hops = QuickHops(FORWARD_TIMEOUT, FORWARD_TIMEOUT)  # small forwards' fast path
        self._tasks: list[asyncio.Task[Any]] = []
        # The member's own blocking work (bucket records, restores) never queues behind
        # the default executor, where a store's server drains: a drain stuck on a
        # fenced store must not starve the next claim (seen in a 100-round run).
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="strata-fleet")
        self.claims: list[dict[str, Any]] = []   # for status: how long each claim took
        self.scanned_at = clock()  # when the last scan of the leases finished
        self.front = VolumeFront(self)           # volumes -> stores (fleet/front.py)
        self.traffic = Traffic(move or MovePolicy())
        self.moving: set[str] = set()            # stores being handed off by the policy
        self.moves: list[dict[str, Any]] = []    # for status: the policy's handoffs
        # Connections other members carry to this one (fleet/tunnel.py): each request
        # on one entered the fleet at that member.
        self._tunneled: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.tunnels: Tunnels | None = None

    # -- running ----------------------------------------------------------------------

    async def run(self) -> None:
        os.makedirs(os.path.join(self.dir, "stores"), exist_ok=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self.records.bucket.check_conditional)
        await loop.run_in_executor(self._pool, _warm)
        self._session = proxy_session(aiohttp.TCPConnector(limit=256))
        app = web.Application(client_max_size=MAX_BODY)  # a larger body: 413, unread
        app.router.add_get("/fleet/v1/status", self._status)
        app.router.add_post("/fleet/v1/move", self._move)
        app.router.add_post("/fleet/v1/leave", self._leave)
        app.router.add_post("/fleet/v1/claim", self._claim_now)
        app.router.add_get("/fleet/v1/volumes/{volume}", self.front.where)
        app.router.add_post(TUNNEL_PATH, self._tunnel_hello)
        fleet_ui.register(app, self)  # the fleet page (fleet/ui.py)
        app.router.add_route("*", "/{tail:.*}", self._route)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        # Every connection starts with the tunnels' protocol: a CONNECT is carried to
        # the store's owner; anything else goes to the app as it came.
        assert runner.server is not None
        self.tunnels = tunnels = Tunnels(self.name, runner.server, self._tunnel_target,
                                         lambda: self._mark_for(self.name), FORWARD_TIMEOUT)
        listener = await loop.create_server(tunnels.protocol, self.host, self.port,
                                            reuse_address=True)
        await self._heartbeat_once()
        self._tasks = [asyncio.ensure_future(self._heartbeats()),
                       asyncio.ensure_future(self._scans())]
        log.info("member %s of %s serving on %s", self.name, self.url, self.addr)
        try:
            await self.done.wait()
        finally:
            for t in self._tasks:
                t.cancel()
            for owned in list(self.owned.values()):
                await self._release(owned)
            listener.close()
            tunnels.close()
            await runner.cleanup()
            await self._session.close()
            self._hops.close()

    def stop(self) -> None:
        self.done.set()

    # -- heartbeats and scans ---------------------------------------------------------

    def _info(self) -> dict[str, Any]:
        stores = {}
        for s, o in self.owned.items():
            rep = (o.local.tier_report() if o.local is not None else None) or {}
            last = rep.get("last_ship")
            stores[s] = {"epoch": o.epoch, "serving": o.serving, "sync": o.keeper.lease.sync,
                         "lease_age": round(o.keeper.age(), 3),
                         "unshipped_bytes": rep.get("unshipped_bytes"),
                         # 0.0: not shipped yet since the store opened (no lag to show)
                         "lag": round(time.time() - last, 3) if isinstance(last, float)
                         and last > 0 else None, "claimed_in": round(o.claimed_in, 3)}
        return {"stores": stores, "leaving": self.leaving}

    async def _heartbeat_once(self) -> None:
        self._beat += 1
        info = self._info()
        await asyncio.get_running_loop().run_in_executor(
            None, self.records.heartbeat, self.name, self.addr, self._beat, info)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_EVERY)
            if self.leaving:
                continue
            try:
                await self._heartbeat_once()
            except StrataError as exc:
                log.warning("heartbeat failed: %s", exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a member that stops beating looks dead
                log.exception("heartbeat failed")

    def live_members(self) -> list[str]:
        now = clock()
        live = [n for n, s in self.members.items()
                if now - s.since < MEMBER_TTL and not s.body.get("leaving")]
        if not self.leaving and self.name not in live:
            live.append(self.name)
        return live

    async def _scans(self) -> None:
        loop = asyncio.get_running_loop()
        listed = 0.0
        while True:
            try:
                if clock() - listed >= CATALOG_EVERY or not self.catalog:
                    self.catalog = await loop.run_in_executor(self._pool, self.records.stores)
                    members = await loop.run_in_executor(self._pool, self.records.members)
                    self._observe_members(members)
                    listed = clock()
                elif clock() - listed >= HEARTBEAT_EVERY:
                    pass
                leases = await asyncio.gather(*[
                    loop.run_in_executor(self._pool, self.records.lease, s) for s in self.catalog])
                for store, lease in zip(list(self.catalog), leases, strict=True):
                    self._observe_lease(store, lease)
                if self.tunnels is not None:
                    self.tunnels.sweep()  # carried connections to owners no longer
                for owned in list(self.owned.values()):
                    why = _stopped(owned.local) if owned.local is not None else None
                    if why is not None:
                        self._abandon(owned, why)
                self._decide()
                self._move_to_work()
                self.scanned_at = clock()
            except StrataError as exc:
                log.warning("fleet scan failed: %s", exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a member that stops scanning never claims
                log.exception("fleet scan failed")
            await asyncio.sleep(SCAN_EVERY)

    def _observe_members(self, members: dict[str, dict[str, Any]]) -> None:
        now = clock()
        for name, body in members.items():
            seen = self.members.get(name)
            version = body.get("seq")
            if seen is None or seen.version != version:
                self.members[name] = Seen(version, now, body)
        for name in list(self.members):
            if name not in members:
                del self.members[name]

    def _observe_lease(self, store: str, lease: Lease | None) -> None:
        seen = self.leases.get(store)
        version = lease.version() if lease is not None else None
        if seen is None or seen.version != version:
            self.leases[store] = Seen(version, clock(), lease)

    def route(self, store: str) -> Lease | None:
        seen = self.leases.get(store)
        return seen.body if seen is not None else None

    def _decide(self) -> None:
        if self.leaving:
            return
        now = clock()
        live = self.live_members()
        for store, meta in self.catalog.items():
            if store in self.owned or store in self.claiming:
                continue
            seen = self.leases.get(store)
            lease: Lease | None = seen.body if seen is not None else None
            if lease is not None and lease.state == "handoff" and lease.target == self.name:
                self._claim(store, lease, meta)
                continue
            if lease is not None and lease.state in ("serving", "claiming", "handoff"):
                if seen is None or now - seen.since < expiry_wait(lease.ttl):
                    continue  # live (or not seen long enough to tell)
                expired_for = now - seen.since - expiry_wait(lease.ttl)
                holder = lease.holder
            else:
                # Never owned, or freed: no wait beyond the order among members.
                expired_for = now - (seen.since if seen else now)
                holder = None
            order = rendezvous(store, [m for m in live if m != holder])
            if self.name not in order:
                continue
            rank = order.index(self.name)
            if expired_for >= rank * self.ttl:
                self._claim(store, lease, meta)

    # -- claiming and owning ----------------------------------------------------------

    def _claim(self, store: str, old: Lease | None, meta: dict[str, Any]) -> None:
        self.claiming.add(store)
        # Until when (this clock) the old owner's pins may be held; None: unknown.
        pins_over: float | None = 0.0  # no owner before: none
        if old is not None:
            seen = self.leases.get(store)
            since = seen.since if seen is not None and seen.version == old.version() \
                else clock()
            pins_over = pins_end(since, old.pins) if old.pins is not None else None
        asyncio.ensure_future(self._claim_task(store, old, meta, pins_over))

    async def _claim_task(self, store: str, old: Lease | None, meta: dict[str, Any],
                          pins_over: float | None) -> None:
        loop = asyncio.get_running_loop()
        t0 = clock()
        try:
            sync = str(meta.get("sync", "local"))
            # Unknown pins are waited out for a restore's blanket span; either way this
            # member's records carry the wait on, for a quick next owner.
            pins_until = pins_over if pins_over is not None else t0 + UNKNOWN_PINS
            lease = Lease(store=store, holder=self.name, addr=self.addr, state="claiming",
                          epoch=None, seq=(old.seq + 1) if old else 0, ttl=self.ttl,
                          sync=sync, pins=pin_span(pins_until, t0))
            try:
                t_write = clock()
                lease = await loop.run_in_executor(
                    None, self.records.write_lease, lease, old.etag if old else None)
            except AlreadyExists:
                log.info("store %s: another member claimed it first", store)
                return
            path = os.path.join(self.dir, "stores", store)
            owned = Owned(store, path, keeper=None)  # type: ignore[arg-type]

            def lost(why: str) -> None:
                loop.call_soon_threadsafe(self._abandon, owned, why)

            owned.keeper = LeaseKeeper(self.records, lease, acquired_at=t_write, on_lost=lost,
                                       pins_until=pins_until)
            owned.keeper.start()
            self.owned[store] = owned
            log.info("store %s: claiming (lease was %s)", store,
                     f"{old.holder}/{old.state}" if old else "absent")
            t_restore = clock()
            try:
                await asyncio.wait_for(loop.run_in_executor(self._pool, self._prepare, path,
                                                            store, sync, pins_over), CLAIM_TIMEOUT)
            except TimeoutError:
                raise Unavailable(f"store {store}: restore took over {CLAIM_TIMEOUT:g} s") \
                    from None
            if owned.keeper.lost is not None:  # another member took the claim over meanwhile
                raise AlreadyExists(f"store {store}: lease lost while claiming "
                                    f"({owned.keeper.lost})")
            owned.tokens_saved = fleet_tokens.stamp(path)
            t_open = clock()
            ready = asyncio.Event()
            owned.task = asyncio.ensure_future(self._serve(owned, ready))
            waiter = asyncio.ensure_future(ready.wait())
            await asyncio.wait([owned.task, waiter], return_when=asyncio.FIRST_COMPLETED,
                               timeout=CLAIM_TIMEOUT)
            if not ready.is_set():
                waiter.cancel()
                self._abandon(owned, "the store did not open in time")
                return
            rep = owned.local.tier_report() if owned.local is not None else None
            owned.epoch = int(rep["epoch"]) if rep and rep.get("epoch") is not None else None
            owned.session = proxy_session(aiohttp.UnixConnector(path=default_socket(path)))
            owned.token_sessions = (
                proxy_session(aiohttp.TCPConnector(limit=TOKEN_CONNECTIONS)),
                proxy_session(aiohttp.TCPConnector(limit=TOKEN_STREAMS)))
            # Serve at once: the store is fenced to us and the lease, renewed since the
            # claim, gates every acknowledgement already; "serving" in the lease only
            # tells the other members where to forward (one bucket write saved from
            # the gap a client here sees).
            owned.serving = True
            self.traffic.reset(store)  # its counts, and its cooldown, start now
            t_serving = clock()
            await loop.run_in_executor(self._pool, owned.keeper.rewrite, self._serving(owned.epoch))
            owned.claimed_in = clock() - t0
            self.claims.append({"store": store, "seconds": owned.claimed_in,
                                "epoch": owned.epoch})
            log.info("store %s: serving, epoch %s, claimed in %.0f ms (lease %.0f, restore "
                     "%.0f, open %.0f, then the lease %.0f)", store, owned.epoch,
                     owned.claimed_in * 1000, (t_restore - t0) * 1000,
                     (t_open - t_restore) * 1000, (t_serving - t_open) * 1000,
                     (clock() - t_serving) * 1000)
        except (StrataError, OSError) as exc:
            log.warning("store %s: claim failed: %s", store, exc)
            o = self.owned.get(store)
            if o is not None and o.task is None:
                # Never served: give the store back at once (a lease that stops
                # changing would do it too, a TTL later).
                del self.owned[store]
                o.keeper.stop()

                def free(lease: Lease) -> None:
                    lease.state, lease.target = "free", None
                with contextlib.suppress(StrataError):
                    await loop.run_in_executor(self._pool, o.keeper.rewrite, free)
            elif o is not None:
                o.serving = False
                o.stop.set()
        finally:
            self.claiming.discard(store)

    def _serving(self, epoch: int | None) -> Any:
        def change(lease: Lease) -> None:
            lease.state, lease.epoch, lease.addr, lease.target = "serving", epoch, self.addr, None
        return change

    def _prepare(self, path: str, store: str, sync: str, pins_over: float | None) -> str:
        from strata.engine.tier import prepare  # obstore: only with a bucket
        if os.path.exists(path):
            # An older copy from when this member owned the store: its epoch is over,
            # and the engine refuses to open it. The bucket holds everything.
            gone = f"{path}.old-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(path, gone)
            shutil.rmtree(gone, ignore_errors=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        made = prepare(path, store_url(self.url, store), takeover=True, key=self.key,
                       sync=sync)
        if pins_over is not None:  # known: wait out the old owner's pins, not a blanket span
            inherit_pins(path, pins_over - clock())
        # Before the store serves: its scoped tokens, as its last owner saved them.
        fleet_tokens.restore(self.records.bucket, self.key, store, path)
        return made

    async def _serve(self, owned: Owned, ready: asyncio.Event) -> None:
        from strata.server.serve import ServeResult, run_server

        def opened(store: LocalStore) -> None:
            owned.local = store

            def gate() -> None:
                owned.keeper.gate()
                if owned.keeper.lease.sync != "bucket":
                    ship_lag_gate(owned.store, store.unshipped_for)
            store.set_ack_gate(gate)
            store.pins.cover = owned.keeper.cover_pins

        def serving(result: ServeResult) -> None:
            # The store's token listener: loopback TCP on a port of the kernel's choosing.
            owned.token_url = f"http://{result.tcp[0]}" if result.tcp else None
            ready.set()

        try:
            # Its own unix socket (the owner: requests with the fleet's secret) and a TCP
            # listener for requests that carry only a scoped token: the store's server
            # checks those exactly as on any TCP listener, never with the socket's trust.
            result = await run_server(owned.path, ["tcp:127.0.0.1:0"], on_open=opened,
                                      stop=owned.stop, on_ready=serving)
            log.info("store %s: owner stopped (%s)", owned.store,
                     "; ".join(result.notes) or "asked")
        except (StrataError, OSError) as exc:
            log.warning("store %s: owner failed: %s", owned.store, exc)
        finally:
            owned.serving = False
            owned.keeper.stop()
            if owned.session is not None:
                await owned.session.close()
            for session in owned.token_sessions or ():
                await session.close()
            if self.owned.get(owned.store) is owned:
                del self.owned[owned.store]

    def _abandon(self, owned: Owned, why: str) -> None:
        """Give a store up at once: fenced, or its lease lost.

        Its gate refuses from now on, so nothing more is acknowledged; its
        server stops in the background, however long a drain takes (a publish
        stuck on a fenced tier). The store may be claimed again meanwhile: a
        claim restores into a fresh directory, and the old one holds its own
        lock and socket.
        """
        if owned.keeper.lost is None:
            owned.keeper.lost = why
            owned.keeper.deadline = 0.0
        owned.serving = False
        owned.stop.set()
        if self.owned.get(owned.store) is owned:
            del self.owned[owned.store]
            log.info("store %s: given up (%s)", owned.store, why)

    async def _release(self, owned: Owned) -> None:
        owned.serving = False
        owned.stop.set()
        if owned.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await owned.task

    async def handoff(self, store: str, to: str | None) -> dict[str, Any]:
        """Planned move: stop acknowledging, close (all shipped), hand the lease to `to`."""
        owned = self.owned.get(store)
        if owned is None or not owned.serving:
            raise AlreadyExists(f"store {store} is not served by {self.name}")
        t0 = clock()
        loop = asyncio.get_running_loop()
        await self._release(owned)  # drains, ships and checkpoints on close
        await self._save_tokens(owned)  # tokens made on the owner's own socket too

        def change(lease: Lease) -> None:
            lease.state, lease.target = ("handoff", to) if to else ("free", None)
        # The store is closed: the lease is ours to hand over even if its window ran out.
        owned.keeper.lost = None
        await loop.run_in_executor(self._pool, owned.keeper.rewrite, change)
        released = clock() - t0
        seen = self.members.get(to) if to else None
        if seen is not None and self._session is not None:
            # Tell the target at once rather than wait for its next scan (it would
            # find the handoff there too, so a lost nudge only costs a scan).
            headers = {"X-Strata-Fleet-Token": self.token} if self.token else {}
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self._session.post(
                        str(seen.body.get("addr")) + "/fleet/v1/claim", json={"store": store},
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT)) as r:
                    await r.read()
        return {"store": store, "to": to, "released_in": released}

    def _move_to_work(self) -> None:
        """Hand each owned store to the member doing most of its work (fleet/traffic.py)."""
        if self.leaving:
            return
        live = self.live_members()
        for store, owned in list(self.owned.items()):
            if not owned.serving or store in self.moving:
                continue
            to = self.traffic.target(store, self.name)
            if to is None or to not in live:
                continue
            self.moving.add(store)
            log.info("store %s: %s does most of its work: handing it over", store, to)
            asyncio.ensure_future(self._move_task(store, to, self.traffic.counts(store)))

    async def _move_task(self, store: str, to: str, counts: Any) -> None:
        try:
            got = await self.handoff(store, to)
            self.moves.append({**got, "why": dict(counts)})
        except (StrataError, OSError) as exc:
            log.warning("store %s: move to %s failed: %s", store, to, exc)
        finally:
            self.moving.discard(store)

    async def _claim_now(self, request: web.Request) -> web.Response:
        """A handoff to this member: claim without waiting for the next scan."""
        if not self._authorized(request):
            return self._forbidden()
        store = str((await request.json()).get("store"))
        lease = await asyncio.get_running_loop().run_in_executor(self._pool, self.records.lease,
                                                                 store)
        if lease is not None and lease.state == "handoff" and lease.target == self.name \
                and store not in self.owned and store not in self.claiming:
            self._observe_lease(store, lease)
            self._claim(store, lease, self.catalog.get(store) or {"sync": lease.sync})
            return web.json_response({"claiming": store}, status=202)
        return web.json_response({"claiming": None})

    # -- the API front ----------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("X-Strata-Fleet-Token", "")
        return hmac.compare_digest(given.encode(), self.token.encode())

    async def _status(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._forbidden()
        return web.json_response(self.status())

    def status(self) -> dict[str, Any]:
        now = clock()
        leases = {}
        for store, seen in self.leases.items():
            lease: Lease | None = seen.body
            leases[store] = None if lease is None else {
                "holder": lease.holder, "state": lease.state, "epoch": lease.epoch,
                "sync": lease.sync, "addr": lease.addr, "target": lease.target,
                "unchanged_for": round(now - seen.since, 3)}
        return {"member": self.name, "addr": self.addr, "leaving": self.leaving,
                "live": sorted(self.live_members()), "leases": leases,
                "owned": self._info()["stores"], "claims": self.claims[-20:],
                "claiming": sorted(self.claiming),
                "last_scan_age": round(now - self.scanned_at, 3),
                "traffic": self.traffic.report(), "moves": self.moves[-20:],
                "tunnels": None if self.tunnels is None else {
                    "opened": self.tunnels.opened, "open": len(self.tunnels.carried) // 2,
                    "spliced": self.tunnels.spliced}}

    async def _move(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._forbidden()
        body = await request.json()
        store, to = str(body.get("store")), body.get("to")
        try:
            return web.json_response(await self.handoff(store, to))
        except AlreadyExists as exc:
            return web.json_response({"error": str(exc)}, status=409)

    async def _leave(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._forbidden()
        moved = await self.leave()
        asyncio.get_running_loop().call_later(0.2, self.done.set)
        return web.json_response({"member": self.name, "moved": moved})

    async def leave(self) -> list[dict[str, Any]]:
        """Hand every owned store to the next member in its order, then stop."""
        self.leaving = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self.records.heartbeat, self.name, self.addr,
                                   self._beat + 1, self._info())
        moved = []
        for store in list(self.owned):
            order = rendezvous(store, [m for m in self.live_members() if m != self.name])
            with contextlib.suppress(AlreadyExists):
                moved.append(await self.handoff(store, order[0] if order else None))
        await loop.run_in_executor(self._pool, self.records.forget_member, self.name)
        return moved

    async def _route(self, request: web.Request) -> web.StreamResponse:
        """Pass an API request to its store's owner: here, or the member the lease names.

        Who may ask: a caller with the fleet's secret is the owner of every store
        (its requests reach the store's unix socket); a caller with only a bearer
        token gets exactly what that token gets on a store's TCP listener (its
        requests reach the store's token listener, which checks it before reading
        the body). Anyone else: 403, before the body is read.

        Which store: a forwarded request names it (`X-Strata-Store`); a client's
        request names it too, or names a volume, which the catalog places
        (fleet/front.py). A token holder names its store: tokens are a store's,
        and a catalog lookup would tell it which volumes exist elsewhere.
        """
        secret = self._authorized(request)
        if not secret and ("X-Strata-Fleet-Token" in request.headers
                           or not request.headers.get("Authorization", "").startswith("Bearer ")):
            return self._forbidden()
        if (request.content_length or 0) > MAX_BODY:  # refused unread (413, as the API does)
            return web.json_response({"error": "TooLarge", "message": "request body over "
                                      f"{MAX_BODY} bytes"}, status=413)
        store = request.headers.get("X-Strata-Store")
        origin = self._forwarded_by(request)
        # Carried here by another member's tunnel: a client's request as any other, that
        # entered the fleet there.
        via = self._tunneled.get(request.transport) if self._tunneled else None
        if origin is None and secret:
            # From a client: the volume catalog places it (or answers it: create, list).
            placed = await self.front.route(request, store)
            if isinstance(placed, web.StreamResponse):
                return placed
            store = placed
        if not store:
            return web.json_response({"error": "InvalidInput", "message":
                                      "name a volume or the store: X-Strata-Store header"
                                      if secret else "a request with a token names its "
                                      "store: X-Strata-Store header"}, status=400)
        owned = self.owned.get(store)
        if owned is not None and owned.serving and owned.session is not None \
                and owned.keeper.valid():
            self.traffic.note(store, origin or via or self.name)
            out = await self._to_store(request, owned, secret)
        elif origin is not None:
            # Sent here by a member whose cache is stale: never forward twice.
            return self._retry(f"{self.name} does not own store {store}")
        else:
            lease = self.route(store)
            if lease is None or lease.state != "serving" or lease.holder == self.name:
                return self._retry(f"store {store} has no owner right now")
            self.traffic.note(store, via or self.name)
            out = await self._to_member(request, store, lease, secret)
        if not out.prepared:
            out.headers["X-Strata-Store"] = store
        return out

    async def _tunnel_hello(self, request: web.Request) -> web.Response:
        """`POST /fleet/v1/tunnel`: a member opens a connection it will carry clients on.

        Only a member (its forwarding mark verifies); what follows on the
        connection is clients' requests, each checked as any client's.
        """
        origin = self._forwarded_by(request)
        if origin is None or request.transport is None:
            return self._forbidden()
        self._tunneled[request.transport] = origin
        return web.Response(status=200)

    async def _tunnel_target(self, target: bytes, head: dict[bytes, bytes]) -> Target:
        """Where a client's CONNECT goes (fleet/tunnel.py): its store's owner, or None.

        None keeps the connection on this member's own server: the store is
        owned here or has no owner now, the volume is not in the catalog, or
        the caller may not ask (it then gets the usual 403, request by request).
        Only a caller with the fleet's secret names a volume (the catalog's
        answer would tell a token holder which volumes exist); a token holder
        names its store, as on any request.
        """
        kind, _, name = target.decode("utf-8", "replace").partition("/")
        given = head.get(b"x-strata-fleet-token", b"")
        secret = hmac.compare_digest(given, self.token.encode())
        try:
            if kind == "volume" and secret:
                placed = await self.front.lookup(check_volume(name))
                store = placed.store if placed is not None else None
            elif kind == "store" and (secret or (not given and head.get(
                    b"authorization", b"").startswith(b"Bearer "))):
                store = check_volume(name)  # a store's name follows a volume's rules
            else:
                return None
        except StrataError:
            return None
        if store is None or store in self.owned:
            return None
        lease = self.route(store)
        if lease is None or lease.state != "serving" or lease.holder == self.name:
            return None
        host, _, port = lease.addr.removeprefix("http://").rpartition(":")
        if not port.isdigit():
            return None
        self.traffic.note(store, self.name)
        return host.strip("[]"), int(port), lease.holder, \
            self._still_serving(store, lease.holder, unowned=True), secret

    def _still_serving(self, store: str, holder: str, *, unowned: bool = False
                       ) -> Callable[[], bool]:
        """A check: does this member's view of `store`'s lease still name `holder`?

        Serving, and with `unowned`, not come to be owned by this member since.
        """
        def still() -> bool:
            now = self.route(store)
            return now is not None and now.state == "serving" and now.holder == holder \
                and not (unowned and store in self.owned)
        return still

    def _mark_for(self, name: str) -> str:
        """What this member's forwards carry: its name, signed with the fleet's secret."""
        sig = hmac.new(self.token.encode(), b"strata fleet: forwarded by " + name.encode(),
                       hashlib.sha256).hexdigest()
        return f"{name} {sig}"

    def _forwarded_by(self, request: web.Request) -> str | None:
        """The member a request was forwarded by, if its mark verifies (else None)."""
        name, _, _sig = request.headers.get("X-Strata-Forwarded", "").partition(" ")
        if not name or len(name) > 128:
            return None
        if not hmac.compare_digest(request.headers["X-Strata-Forwarded"].encode(),
                                   self._mark_for(name).encode()):
            return None
        return name

    async def forward(self, store: str, method: str, path_qs: str, headers: dict[str, str],
                      body: bytes) -> web.Response:
        """One small request of this member's own for `store`, read whole.

        The volume catalog's create, delete and checks: to the store's server if
        owned here, else to its owner. Clients' requests take `_route`'s way.
        """
        owned = self.owned.get(store)
        headers = {k: v for k, v in headers.items() if k.lower() not in HOP}
        headers.update({"X-Strata-Store": store, "X-Strata-Fleet-Token": self.token})
        headers.pop("X-Strata-Forwarded", None)
        if owned is not None and owned.serving and owned.session is not None \
                and owned.keeper.valid():
            self.traffic.note(store, self.name)
            session, url = owned.session, "http://owner" + path_qs
        else:
            lease = self.route(store)
            if lease is None or lease.state != "serving" or lease.holder == self.name:
                return self._retry(f"store {store} has no owner right now")
            assert self._session is not None
            headers["X-Strata-Forwarded"] = self._mark_for(self.name)
            session, url = self._session, lease.addr + path_qs
        try:
            async with session.request(method, url, data=body, headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT)
                                       ) as resp:
                data = await resp.read()
        except (TimeoutError, aiohttp.ClientError):
            return self._retry(f"store {store} is changing owner")
        out = web.Response(status=resp.status, body=data)
        for k, v in resp.headers.items():
            if k.lower() not in HOP and k.lower() not in ("date", "server"):
                out.headers[k] = v
        return out

    async def _to_store(self, request: web.Request, owned: Owned,
                        secret: bool) -> web.StreamResponse:
        """The owner's hop: to the store's own server, in this process."""
        store = owned.store
        if secret:
            assert owned.session is not None
            session, base = owned.session, "http://owner"
        elif owned.token_sessions is not None and owned.token_url is not None:
            session = owned.token_sessions[1 if is_stream(request) else 0]
            base = owned.token_url
        else:
            return self._retry(f"store {store} is still opening")
        stream = is_stream(request)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=FORWARD_TIMEOUT,
                                        sock_read=None if stream else OWNER_TIMEOUT)
        body = await request_body(request, whole=secret)
        try:
            out = await relay(request, session, base + request.path_qs,
                              request_headers(request), body, timeout=timeout,
                              alive=lambda: owned.serving,
                              extra={"X-Strata-Epoch": str(owned.epoch),
                                     "X-Strata-Owner": self.name})
        except Unreachable:
            return self._retry(f"store {store} is changing owner")
        if out.status == 503 and "Retry-After" not in out.headers and not out.prepared \
                and (clock() >= owned.keeper.deadline or not owned.serving):
            out.headers["Retry-After"] = RETRY_AFTER  # the lease gate: try the next owner
        if secret and request.method in ("POST", "DELETE") and out.status < 300 \
                and request.path.startswith("/v1/admin/tokens"):
            # A token made or revoked is in the bucket before the caller hears so: it
            # holds on whichever member owns the store next (docs/fleet.md).
            if not await self._save_tokens(owned):
                return web.json_response({"error": "Unavailable", "message": (
                    "the change is made on the store's owner but not yet in the bucket: "
                    "another owner would not know it; list the tokens and try again")},
                    status=503)
        return out

    async def _to_member(self, request: web.Request, store: str, lease: Lease,
                         secret: bool) -> web.StreamResponse:
        """The forward: to the member the lease names, marked so it goes no further."""
        assert self._session is not None
        headers = request_headers(request)
        headers["X-Strata-Forwarded"] = self._mark_for(self.name)
        headers["X-Strata-Store"] = store  # the client may have named only a volume
        if secret:  # a token-bearing request travels on without the secret it lacked
            headers["X-Strata-Fleet-Token"] = self.token
        stream = is_stream(request)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=FORWARD_TIMEOUT,
                                        sock_read=None if stream else FORWARD_TIMEOUT)
        holder = lease.holder
        still_owner = self._still_serving(store, holder)
        body = await request_body(request, whole=secret)
        try:
            if not stream and (body is None or isinstance(body, bytes)):
                return await self._hops.relay(request, lease.addr, headers, body,
                                              alive=still_owner)
            return await relay(request, self._session, lease.addr + request.path_qs, headers,
                               body, timeout=timeout, alive=still_owner, extra={})
        except Unreachable:
            return self._retry(f"store {store}: its owner {holder} does not answer")

    async def _save_tokens(self, owned: Owned) -> bool:
        """Copy the store's tokens file to the bucket if it changed (the newest lands last)."""
        loop = asyncio.get_running_loop()
        async with owned.tokens_lock:
            now = fleet_tokens.stamp(owned.path)
            if now is None or now == owned.tokens_saved:
                return True  # nothing new: a handoff costs no bucket write for it
            try:
                await loop.run_in_executor(self._pool, fleet_tokens.save, self.records.bucket,
                                           self.key, owned.store, owned.path)
            except (StrataError, OSError) as exc:
                log.warning("store %s: tokens not saved to the bucket: %s", owned.store, exc)
                return False
            owned.tokens_saved = now
        return True

    @staticmethod
    def _forbidden() -> web.Response:
        return web.json_response({"error": "Forbidden", "message": "fleet token needed"},
                                 status=403)

    @staticmethod
    def _retry(message: str) -> web.Response:
        return web.json_response({"error": "Unavailable", "message": message}, status=503,
                                 headers={"Retry-After": RETRY_AFTER})
