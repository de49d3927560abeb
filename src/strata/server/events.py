"""The server's event feed: publishes, conflicts, forks and branch moves, in order.

The API handlers *note* what happened (a cheap, thread-safe append) from the
executor thread that did it; one worker thread turns notes into events:

- it puts each branch's publishes in publish order. Handlers finish in any
  order (several publishes share one fsync and wake together), but a publish's
  snapshot names its parent, the head it replaced, so an event whose parent has
  not been announced yet waits for it (at most `PARK_SECONDS`);
- it counts what each publish changed (+ added, - deleted, M modified) by
  diffing the parent's tree with the new one (`history.count_changes`), off
  the publish path: at once
  when a reader is listening, else when a reader first reads the event (a
  store nobody watches diffs nothing);
- it numbers events and keeps the newest `ring` of them in memory.

A reader (`Subscription`) follows the ring from a sequence number. A reader
that falls behind the ring never skips silently: it catches up from the
branches' history instead (walking each watched head back to the snapshot it
last reported), then resumes from the ring, skipping what the catch-up already
covered. What is only in memory (conflicts of runs that left no rejected
branch) can be lost in that case; publishes, forks and deletions cannot.

Sequence numbers belong to one server process (`epoch`): after a restart or a
handoff a reader resumes from history the same way.

This module never touches HTTP beyond the SSE answer at the end, and never
changes the store. A note that cannot be turned into an event is logged and
dropped: one bad note must not stop the feed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from strata.engine.errors import NotFound, StrataError
from strata.engine.interface import ChangeSet, Store
from strata.server.history import UNCOUNTED, count_changes, describe_publish, run_of, walk_back

log = logging.getLogger(__name__)

RING = 4096            # events kept in memory
PARK_SECONDS = 2.0     # the longest a publish waits for its parent's event
CATCHUP_LIMIT = 10_000  # snapshots walked back per branch when catching up
MAX_PATHS = 100        # conflicting paths carried by one event

Key = tuple[str, str]  # (volume, branch)


@dataclass
class _Note:
    kind: str
    data: dict[str, Any]
    at: float = field(default_factory=time.monotonic)


class EventFeed:
    """Numbered events in a bounded ring, filled by a worker thread (module docstring)."""

    def __init__(self, store: Callable[[], Store | None], ring: int = RING) -> None:
        self.epoch = secrets.token_hex(4)
        self._store = store
        self._lock = threading.Condition()
        self._notes: collections.deque[_Note] = collections.deque()
        self._ring: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(
            maxlen=ring)
        self.last_seq = 0
        self._heads: dict[Key, str] = {}  # the head each branch's last event left
        self._parked: dict[tuple[str, str, str], _Note] = {}
        self._announced: collections.OrderedDict[tuple[Key, str], None] = (
            collections.OrderedDict())
        self._closed = False
        self._counts: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._ring_size = ring
        self._listeners: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._work, name="strata-events", daemon=True)
        self._thread.start()

    # -- noting (any thread) -----------------------------------------------------------

    def _note(self, kind: str, **data: Any) -> None:
        with self._lock:
            if self._closed:
                return
            self._notes.append(_Note(kind, data))
            self._lock.notify()

    def note_publish(self, changesets: Iterable[ChangeSet], heads: list[str],
                     txid: bytes | None) -> None:
        """A publish landed: `heads[i]` is what changesets[i]'s branch now points at.

        A publish that changed nothing answers with the old head, and a retry of
        one that had landed with the snapshots it made: the worker announces a
        snapshot once, and only one this publish made (its `tx` is `txid`).
        """
        for cs, head in zip(changesets, heads, strict=True):
            self._note("publish", volume=cs.volume, branch=cs.branch, snapshot=head,
                       message=cs.message, run=run_of(cs.meta), txid=txid)

    def note_conflict(self, changesets: Iterable[ChangeSet], paths: list[str]) -> None:
        for cs in changesets:
            self._note("conflict", volume=cs.volume, branch=cs.branch, base=cs.base,
                       message=cs.message, run=run_of(cs.meta), paths=paths[:MAX_PATHS],
                       npaths=len(paths))

    def note_step(self, volume: str, branch: str, run: str, status: int, *,
                  timed_out: bool, oom: bool, argv: list[str]) -> None:
        """A step on this branch ended without publishing: failed, timed out or killed."""
        self._note("step", volume=volume, branch=branch, run=run, status=status,
                   timed_out=timed_out, oom=oom, argv=argv)

    def note_fork(self, volume: str, branch: str, snapshot: str) -> None:
        self._note("fork", volume=volume, branch=branch, snapshot=snapshot)

    def note_branch_deleted(self, volume: str, branch: str) -> None:
        self._note("branch_deleted", volume=volume, branch=branch)

    def note_volume(self, volume: str, created: bool, head: str | None = None) -> None:
        self._note("volume_created" if created else "volume_deleted", volume=volume,
                   snapshot=head)

    # -- reading (the event loop) ------------------------------------------------------

    def listen(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake` (from the worker thread) whenever events are added; returns undo."""
        with self._lock:
            self._listeners.append(wake)

        def undo() -> None:
            with self._lock:
                if wake in self._listeners:
                    self._listeners.remove(wake)
        return undo

    def since(self, seq: int) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
        """Events after `seq`, and whether any were lost (the ring moved past them)."""
        with self._lock:
            if not self._ring:
                return [], seq < self.last_seq
            first = self._ring[0][0]
            lost = seq < first - 1
            return [(s, e) for s, e in self._ring if s > seq], lost

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
            listeners = list(self._listeners)
        for wake in listeners:
            wake()

    @property
    def closed(self) -> bool:
        return self._closed

    def counted(self, store: Store | None, event: dict[str, Any]) -> dict[str, Any]:
        """`event` as a reader gets it: with its change counts, computed once.

        The ring's event is never changed (another reader may be sending it);
        the counts are kept by snapshot. A snapshot collected before anyone read
        its event goes out without counts.
        """
        if not event.get(UNCOUNTED):
            return event
        out = {k: v for k, v in event.items() if k != UNCOUNTED}
        sid = event["snapshot"]
        with self._lock:
            counts = self._counts.get(sid)
        if counts is None and store is not None:
            try:
                counts = count_changes(store, sid)
            except StrataError:
                return out  # the snapshot was collected before anyone read it: no counts
            with self._lock:
                self._counts[sid] = counts
                while len(self._counts) > self._ring_size:
                    self._counts.popitem(last=False)
        return {**out, **(counts or {})}

    # -- the worker ----------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._notes and not self._closed:
                    self._lock.wait(timeout=PARK_SECONDS / 2 if self._parked else None)
                    if self._parked and not self._notes:
                        break
                if self._closed:
                    return
                notes = list(self._notes)
                self._notes.clear()
            for note in notes:
                try:
                    self._take(note)
                except Exception:  # noqa: BLE001 - one bad note must not stop the feed
                    log.warning("event %s on %s@%s dropped", note.kind,
                                note.data.get("volume"), note.data.get("branch"),
                                exc_info=True)
                    continue
            self._flush_overdue()

    def _take(self, note: _Note) -> None:
        if note.kind != "publish":
            self._announce(note)
            return
        store = self._store()
        if store is None:
            return
        key = (note.data["volume"], note.data["branch"])
        txid = note.data.pop("txid", None)
        info = store.snapshot(note.data["snapshot"])
        if ((key, info.id) in self._announced or self._heads.get(key) == info.id
                or (txid is not None and info.tx != txid)):
            return  # announced already, or an old head handed back by a no-op publish
        parent = info.parent
        note.data["parent"] = parent
        known = self._heads.get(key)
        if known is not None and parent is not None and known != parent:
            self._parked[(key[0], key[1], parent)] = note  # its parent's event comes first
            return
        self._announce(note)

    def _flush_overdue(self) -> None:
        now = time.monotonic()
        for k, note in sorted(self._parked.items(), key=lambda kv: kv[1].at):
            if now - note.at >= PARK_SECONDS and self._parked.get(k) is note:
                del self._parked[k]
                self._announce(note)

    def _announce(self, note: _Note) -> None:
        event = dict(note.data, type=note.kind, time=time.time())
        if note.kind == "publish":
            store = self._store()
            if store is None:
                return
            with self._lock:
                watched = bool(self._listeners)
            # Counting the changes diffs two trees: done now for a reader that waits,
            # else by the first reader that reads the event (`EventFeed.counted`).
            event.update(describe_publish(store, event["snapshot"], counts=watched))
            event["status"] = 0 if event.get("run") else None
        elif note.kind == "conflict":
            event["status"] = 3 if event.get("run") else None
        key = (event.get("volume", ""), event.get("branch", ""))
        if note.kind == "publish":
            self._announced[(key, event["snapshot"])] = None
            if len(self._announced) > 4 * RING:
                self._announced.popitem(last=False)
        if note.kind in ("publish", "fork"):
            self._heads[key] = event["snapshot"]
        elif note.kind == "branch_deleted":
            self._heads.pop(key, None)
        with self._lock:
            self.last_seq += 1
            event["seq"] = self.last_seq
            self._ring.append((self.last_seq, event))
            listeners = list(self._listeners)
        for wake in listeners:
            wake()
        if note.kind == "publish":  # a child that waited for this one goes next
            child = self._parked.pop((key[0], key[1], event["snapshot"]), None)
            if child is not None:
                self._take(child)


# -- one reader ----------------------------------------------------------------------------

@dataclass
class Watch:
    """What a reader follows: whole volumes and/or single branches, within its scope."""

    volumes: set[str]
    branches: set[Key]
    scope_volume: str | None = None  # a token's volume (None: the owner sees all)
    scope_branch: str | None = None

    def wants(self, volume: str, branch: str | None) -> bool:
        if self.scope_volume is not None and volume != self.scope_volume:
            return False
        if branch is not None and self.scope_branch is not None and branch != self.scope_branch:
            return False
        if not self.volumes and not self.branches:
            return True
        if volume in self.volumes:
            return True
        return branch is not None and (volume, branch) in self.branches

    def heads(self, store: Store) -> dict[Key, str]:
        """The current heads of every watched branch that exists."""
        vols = set(self.volumes) | {v for v, _b in self.branches}
        if not vols:
            vols = set(store.list_volumes())
        out: dict[Key, str] = {}
        for v in sorted(vols):
            if self.scope_volume is not None and v != self.scope_volume:
                continue
            try:
                branches = store.list_branches(v)
            except NotFound:
                continue
            for b, h in branches.items():
                if self.wants(v, b):
                    out[(v, b)] = h
        return out


class Subscription:
    """One reader's position in the feed and the heads it has been told about."""

    def __init__(self, feed: EventFeed, watch: Watch) -> None:
        self.feed = feed
        self.watch = watch
        self.pos = 0
        self.known: dict[Key, str] = {}
        self._caught_up: set[tuple[str, str, str]] = set()

    def start(self, store: Store, since: str | None, known: dict[Key, str]) -> list[dict[str, Any]]:
        """First events for a reader: a hello, plus a catch-up when it resumes (blocking)."""
        epoch, _, seq = (since or "").partition(":")
        if since and epoch == self.feed.epoch and seq.isdigit():
            self.pos = int(seq)
            self.known = dict(known)
            _events, lost = self.feed.since(self.pos)
            if not lost:
                return []
        resuming = bool(since)
        self.pos = self.feed.last_seq  # before reading heads: later events still come
        heads = self.watch.heads(store)
        out: list[dict[str, Any]] = []
        if resuming and known:
            self.known = dict(known)
            out = self._catch_up(store, heads)
        self.known = heads
        hello = {"type": "hello", "epoch": self.feed.epoch, "seq": self.pos,
                 "heads": {f"{v}@{b}": h for (v, b), h in sorted(heads.items())},
                 "resync": resuming}
        return [*out, hello]

    def _catch_up(self, store: Store, heads: dict[Key, str]) -> list[dict[str, Any]]:
        """Events for what changed between `self.known` and `heads`, read from history."""
        out: list[dict[str, Any]] = []
        for key, head in sorted(heads.items()):
            old = self.known.get(key)
            if old == head:
                continue
            chain, cur = walk_back(store, head, old, CATCHUP_LIMIT)
            if old is None:
                out.append({"type": "fork", "volume": key[0], "branch": key[1],
                            "snapshot": head, "replayed": True})
                self._caught_up.add(("fork", f"{key[0]}@{key[1]}", head))
                continue
            if cur != old:  # not a descendant: the branch was moved, not published to
                out.append({"type": "branch_moved", "volume": key[0], "branch": key[1],
                            "snapshot": head, "previous": old, "replayed": True})
                continue
            for sid in reversed(chain):
                ev = {"type": "publish", "volume": key[0], "branch": key[1], "replayed": True}
                ev.update(describe_publish(store, sid))
                ev["status"] = 0 if ev.get("run") else None
                out.append(ev)
                self._caught_up.add(("publish", f"{key[0]}@{key[1]}", sid))
        for key in sorted(set(self.known) - set(heads)):
            out.append({"type": "branch_deleted", "volume": key[0], "branch": key[1],
                        "replayed": True})
        return out

    def poll(self, store: Store | None) -> list[dict[str, Any]]:
        """Events after this reader's position (blocking: a catch-up reads history)."""
        events, lost = self.feed.since(self.pos)
        if lost and store is not None:
            self.pos = self.feed.last_seq
            heads = self.watch.heads(store)
            out = self._catch_up(store, heads)
            self.known = heads
            return [*out, {"type": "resync", "epoch": self.feed.epoch, "seq": self.pos}]
        out = []
        for seq, ev in events:
            self.pos = seq
            if not self.watch.wants(ev.get("volume", ""), ev.get("branch")):
                continue
            ref = f"{ev.get('volume')}@{ev.get('branch')}"
            if (ev["type"], ref, ev.get("snapshot")) in self._caught_up:
                continue
            key = (ev.get("volume", ""), ev.get("branch", ""))
            if ev["type"] in ("publish", "fork"):
                self.known[key] = ev["snapshot"]
            elif ev["type"] == "branch_deleted":
                self.known.pop(key, None)
            out.append(self.feed.counted(store, ev))
        return out


# -- the SSE answer ------------------------------------------------------------------------

HEARTBEAT = 15.0


def sse_frame(event: dict[str, Any], epoch: str) -> bytes:
    data = json.dumps(event, separators=(",", ":"))
    head = f"id: {epoch}:{event['seq']}\n" if "seq" in event else ""
    return f"{head}data: {data}\n\n".encode()


async def stream(request: web.Request, feed: EventFeed, sub: Subscription,
                 run: Callable[..., Any], store: Callable[[], Store | None],
                 since: str | None, known: dict[Key, str],
                 alive: Callable[[], None]) -> web.StreamResponse:
    """Answer `request` with a server-sent event stream until the client or server goes."""
    s = store()
    if s is None:
        raise StrataError("store is not open")
    first: list[dict[str, Any]] = await run(sub.start, s, since, known)
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(ready.set)

    undo = feed.listen(wake)
    try:
        for ev in first:
            await resp.write(sse_frame(ev, feed.epoch))
        while not feed.closed:
            ready.clear()
            events: list[dict[str, Any]] = await run(sub.poll, store())
            for ev in events:
                await resp.write(sse_frame(ev, feed.epoch))
            if events:
                continue
            try:
                await asyncio.wait_for(ready.wait(), HEARTBEAT)
            except TimeoutError:
                await resp.write(b": ping\n\n")
                alive()
    except (ConnectionResetError, asyncio.CancelledError):
        pass  # the reader left, or the server is stopping: nobody to tell
    finally:
        undo()
    return resp


def parse_watch(query: Any, scope: Any) -> tuple[Watch, dict[Key, str]]:
    """`ref=VOLUME[@BRANCH]` (repeatable) and `head=VOLUME@BRANCH=SID` from a query.

    A token sees only its own volume (and branch): naming another is refused
    with the same words whether it exists or not (`Scope.check_volume`).
    """
    from strata.engine.names import check_branch, check_hex_id, check_volume
    volumes: set[str] = set()
    branches: set[Key] = set()
    for ref in query.getall("ref", []):
        vol, sep, branch = ref.partition("@")
        check_volume(vol)
        scope.check_volume(vol)
        if sep:
            branches.add((vol, check_branch(branch)))
        else:
            volumes.add(vol)
    known: dict[Key, str] = {}
    for item in query.getall("head", [])[:4096]:
        ref, _, sid = item.rpartition("=")
        vol, _, branch = ref.partition("@")
        check_volume(vol)
        known[(vol, check_branch(branch))] = check_hex_id(sid)
    watch = Watch(volumes, branches, scope.volume, scope.branch)
    return watch, known


async def answer(request: web.Request, state: Any, scope: Any) -> web.StreamResponse:
    """The SSE answer for `GET /events` (and the web view's own stream)."""
    watch, known = parse_watch(request.query, scope)
    since = request.query.get("since") or request.headers.get("Last-Event-ID")
    state.need_store()
    feed: EventFeed = state.events
    sub = Subscription(feed, watch)

    def alive() -> None:
        state.last_request = time.monotonic()

    # A watched server does not idle-exit: the stream holds it (not `inflight`, which a
    # stop or handoff waits to drain).
    state.watchers += 1
    try:
        return await stream(request, feed, sub, state.run, lambda: state.store, since,
                            known, alive)
    finally:
        state.watchers -= 1
        alive()
