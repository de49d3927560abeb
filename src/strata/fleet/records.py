"""The fleet's records in the bucket: members, stores and leases.

Under one bucket prefix (the fleet URL):

- `fleet/members/<name>`: a member's heartbeat (address, counter), rewritten
  by that member alone every `HEARTBEAT_EVERY` seconds.
- `fleet/stores/<store>`: the catalog of stores, each created once with a
  create-only write (If-None-Match) and never changed: its sync mode.
- `fleet/leases/<store>`: who owns the store, or is claiming it, or is
  handing it to whom; replaced only with If-Match on the etag read, so two
  writers never both succeed from one version.
- `stores/<store>/...`: the store itself, with its own owner log
  (engine/bucket.py); the epoch is fenced there, never here.

These records are liveness and routing hints, unsealed: safety (one owner
acknowledging at a time) rests on the owner log and on the lease timing in
fleet/lease.py, not on anything a record says. Liveness is judged only by
whether a record *changed* within a span of the reader's own monotonic
clock, never by comparing timestamps across hosts.

This module never starts threads or serves anything; it reads and writes.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from strata.engine.bucket import Bucket, frame_record, open_record
from strata.engine.errors import AlreadyExists, Corrupt, InvalidInput, NotFound
from strata.engine.names import check_volume

MAGIC = b"STRF"
VERSION = 1


def store_url(fleet_url: str, store: str) -> str:
    """Where a store of the fleet keeps its bucket tier (its own owner log)."""
    return f"{fleet_url.rstrip('/')}/stores/{store}"


def check_name(name: str, what: str) -> str:
    try:
        return check_volume(name)  # the same rules as a volume name: one path segment
    except InvalidInput:
        raise InvalidInput(f"not a valid {what} name: {name!r}") from None


@dataclass
class Lease:
    """One store's lease record, as last read (with the etag that read it)."""

    store: str
    holder: str                 # member name
    addr: str                   # the holder's http://HOST:PORT
    state: str                  # "claiming", "serving", "handoff" (to `target`), "free"
    epoch: int | None = None    # the owner log's epoch, once serving
    seq: int = 0                # renewal counter: a change is what proves liveness
    ttl: float = 2.0
    sync: str = "local"
    target: str | None = None   # the member a handoff goes to
    # Seconds after this record was written that pins its holder granted may still
    # be held, on the holder's clock (lease.py); None: unknown (an older writer).
    pins: float | None = None
    nonce: bytes = field(default_factory=lambda: os.urandom(8))
    etag: str | None = None

    def body(self) -> dict[str, Any]:
        return {"store": self.store, "holder": self.holder, "addr": self.addr,
                "state": self.state, "epoch": self.epoch, "seq": self.seq, "ttl": self.ttl,
                "sync": self.sync, "target": self.target, "nonce": self.nonce,
                "pins": self.pins,
                "wall": time.time()}  # shown by status only, never compared

    def version(self) -> tuple[Any, ...]:
        """What a reader compares to tell that the record changed."""
        return (self.holder, self.state, self.epoch, self.seq, self.nonce)


def _encode(body: dict[str, Any]) -> bytes:
    return frame_record(MAGIC, VERSION, body)


def _decode(name: str, data: bytes) -> dict[str, Any]:
    return open_record(name, data, MAGIC, VERSION, "fleet record")


def _span(v: Any) -> float | None:
    """A lease's pin span as read: a finite number of seconds, at least 0, else unknown."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < float("inf"):
        return None
    return float(v)


def lease_from(name: str, body: dict[str, Any], etag: str) -> Lease:
    try:
        return Lease(store=str(body["store"]), holder=str(body["holder"]),
                     addr=str(body["addr"]), state=str(body["state"]),
                     epoch=body["epoch"] if isinstance(body["epoch"], int) else None,
                     seq=int(body["seq"]), ttl=float(body["ttl"]), sync=str(body["sync"]),
                     target=body.get("target") if isinstance(body.get("target"), str) else None,
                     pins=_span(body.get("pins")), nonce=bytes(body["nonce"]), etag=etag)
    except (KeyError, TypeError, ValueError) as exc:
        raise Corrupt(name, 0, f"lease record lacks a field: {exc}") from None


class FleetRecords:
    """Reads and conditional writes of the fleet's records under one prefix."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.bucket = Bucket(self.url)

    # -- stores (the catalog) ---------------------------------------------------------

    def add_store(self, store: str, sync: str = "local") -> bool:
        """Add a store to the catalog; False if it was there already (create-only)."""
        if sync not in ("local", "bucket"):
            raise InvalidInput(f"sync must be local or bucket, not {sync!r}")
        name = f"fleet/stores/{check_name(store, 'store')}"
        try:
            self.bucket.put_tagged(name, _encode({"store": store, "sync": sync,
                                                  "created": time.time()}), None)
        except AlreadyExists:
            return False
        return True

    def stores(self) -> dict[str, dict[str, Any]]:
        """Every store in the catalog: name -> its record (sync mode)."""
        out: dict[str, dict[str, Any]] = {}
        for name in self.bucket.names("fleet/stores/"):
            try:
                data, _etag = self.bucket.get_tagged(name)
            except NotFound:
                continue
            body = _decode(name, data)
            out[str(body["store"])] = body
        return out

    # -- members ----------------------------------------------------------------------

    def heartbeat(self, member: str, addr: str, seq: int, info: dict[str, Any]) -> None:
        """Rewrite this member's record (only it writes it: a plain put)."""
        self.bucket.put(f"fleet/members/{member}",
                        _encode({"name": member, "addr": addr, "seq": seq,
                                 "wall": time.time(), **info}))

    def members(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name in self.bucket.names("fleet/members/"):
            try:
                body = _decode(name, self.bucket.get_stored(name))
            except NotFound:
                continue
            out[str(body["name"])] = body
        return out

    def forget_member(self, member: str) -> None:
        self.bucket.delete(f"fleet/members/{member}")

    # -- leases -----------------------------------------------------------------------

    def lease(self, store: str) -> Lease | None:
        name = f"fleet/leases/{store}"
        try:
            data, etag = self.bucket.get_tagged(name)
        except NotFound:
            return None
        return lease_from(name, _decode(name, data), etag)

    def write_lease(self, lease: Lease, prior: str | None) -> Lease:
        """Write `lease` over the version `prior` names (None: create); returns it, tagged.

        `AlreadyExists` if the record changed since `prior`. An answer lost on
        the way back is sent again by obstore; if that retry meets our own
        write, the record holds our nonce and counts as written.
        """
        lease.nonce = os.urandom(8)
        lease.etag = put_marked(self.bucket, f"fleet/leases/{lease.store}",
                                _encode(lease.body()), prior, lease.nonce,
                                lambda: self.lease(lease.store))
        return lease


def put_marked(bucket: Any, name: str, data: bytes, prior: str | None, nonce: bytes,
               reread: Any) -> str:
    """Write `data` over version `prior` (None: create); returns the new etag.

    `AlreadyExists` if the object changed since `prior`. An answer lost on the
    way back is sent again by obstore; if that retry meets our own write,
    `reread()` (the record as it is now, or None) holds our `nonce` and the
    write counts as done.
    """
    try:
        return str(bucket.put_tagged(name, data, prior))
    except AlreadyExists:
        now = reread()
        if now is None or now.nonce != nonce:
            raise
        return str(now.etag)


def rendezvous(store: str, members: list[str]) -> list[str]:
    """Members in the order they should claim `store` (highest random weight first).

    Every member computes the same order from the same live set, so one
    claimant goes first and the rest wait their turn instead of stampeding;
    a member joining or leaving moves only the stores it ranks first for.
    """
    def weight(m: str) -> bytes:
        return hashlib.blake2b(f"{store}\0{m}".encode(), digest_size=8).digest()
    return sorted(members, key=weight, reverse=True)
