"""The volume catalog: which store of the fleet holds each volume, and the placement rule.

One record per volume, `fleet/volumes/<volume>` under the fleet prefix (a
fleet record: magic `STRF`, version 1, BLAKE3 of the msgpack body; see
docs/fleet.md, "Placement"). Its body:

    {"format": 1, "volume": NAME, "store": STORE, "state": STATE,
     "nonce": 8 bytes, "wall": time written (display only)}

`state` is `creating` (written before the volume exists in its store),
`ready`, `deleting` or `deleted`. A record is created once with a
create-only write, then only replaced with If-Match on the etag read, and
never removed: a name is never reused for another object, and a deleted
volume created again goes back to the store its record names.

The bucket's bytes are not trusted: a record larger than `MAX_ENTRY`, with
an unknown format, a name that is not a volume or store name, or a volume
name that differs from its object's name, is refused as `Corrupt`.

This module never routes or serves; fleet/front.py does, with it.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from strata.engine.errors import AlreadyExists, Corrupt, InvalidInput, NotFound
from strata.engine.names import check_volume
from strata.fleet.records import FleetRecords, _decode, _encode, check_name, put_marked

FORMAT = 1                  # the placement record's own format, inside the fleet frame
MAX_ENTRY = 4096            # bytes: a record is ~150; anything larger is not ours
STATES = ("creating", "ready", "deleting", "deleted")
PREFIX = "fleet/volumes/"


@dataclass
class Placement:
    """One volume's catalog record, as last read (with the etag that read it)."""

    volume: str
    store: str
    state: str = "creating"
    nonce: bytes = field(default_factory=lambda: os.urandom(8))
    etag: str | None = None

    def body(self) -> dict[str, Any]:
        return {"format": FORMAT, "volume": self.volume, "store": self.store,
                "state": self.state, "nonce": self.nonce, "wall": time.time()}


def place(volume: str, stores: list[str]) -> str:
    """The store a new volume goes to: highest `blake2b(volume, store)` first.

    Rendezvous hashing, for three reasons: two members placing the same name
    at the same time pick the same store without talking (so a race of two
    creators ends in one volume, not two half-made ones); it needs no count
    of volumes per store (a LIST of the catalog on every create); and a
    store added later takes only its share of new names, never moving an
    existing volume (a record, once written, is where the volume lives).
    """
    if not stores:
        raise InvalidInput("the fleet has no stores to place a volume in "
                           "(add one: strata fleet add-store)")

    def weight(s: str) -> bytes:
        return hashlib.blake2b(f"{volume}\0{s}".encode(), digest_size=8).digest()
    return max(stores, key=weight)


def placement_from(name: str, data: bytes, etag: str) -> Placement:
    """A record read from the bucket, checked field by field (its bytes are untrusted)."""
    if len(data) > MAX_ENTRY:
        raise Corrupt(name, 0, f"volume catalog record of {len(data)} bytes "
                               f"(at most {MAX_ENTRY})")
    body = _decode(name, data)
    fmt = body.get("format")
    if fmt != FORMAT:
        raise Corrupt(name, 0, f"volume catalog record format {fmt!r}: this strata reads "
                               f"format {FORMAT} only (upgrade strata)")
    try:
        volume = check_volume(str(body["volume"]))
        store = check_name(str(body["store"]), "store")
        state = str(body["state"])
        nonce = body["nonce"]
    except (KeyError, InvalidInput) as exc:
        raise Corrupt(name, 0, f"volume catalog record is not valid: {exc}") from None
    if name != PREFIX + volume or state not in STATES or not isinstance(nonce, bytes):
        raise Corrupt(name, 0, "volume catalog record does not match its name, or its "
                               f"state {state!r} is unknown")
    return Placement(volume, store, state, nonce, etag)


class VolumeCatalog:
    """Reads and conditional writes of the volume catalog under one fleet prefix."""

    def __init__(self, records: FleetRecords) -> None:
        self.bucket = records.bucket

    def get(self, volume: str) -> Placement | None:
        name = PREFIX + check_volume(volume)
        try:
            data, etag = self.bucket.get_tagged(name)
        except NotFound:
            return None
        return placement_from(name, data, etag)

    def create(self, volume: str, store: str) -> tuple[Placement, bool]:
        """Write a `creating` record (create-only); or the record already there.

        True if this call wrote it. An answer lost on the way back is sent
        again by obstore; if that retry meets our own write, the record holds
        our nonce and counts as ours.
        """
        p = Placement(check_volume(volume), check_name(store, "store"))
        try:
            p.etag = self.bucket.put_tagged(PREFIX + p.volume, _encode(p.body()), None)
            return p, True
        except AlreadyExists:
            now = self.get(volume)
            if now is None:  # removed by hand between the two: a plain conflict
                raise
            return now, now.nonce == p.nonce

    def set_state(self, p: Placement, state: str) -> Placement:
        """Replace the record `p` was read as (If-Match); `AlreadyExists` if it changed."""
        new = Placement(p.volume, p.store, state)
        new.etag = put_marked(self.bucket, PREFIX + p.volume, _encode(new.body()), p.etag,
                              new.nonce, lambda: self.get(p.volume))
        return new

    def names(self) -> list[str]:
        """Every volume with a record (names that are not volume names are skipped)."""
        out = []
        for name in self.bucket.names(PREFIX):
            v = name[len(PREFIX):]
            try:
                out.append(check_volume(v))
            except InvalidInput:
                continue
        return sorted(out)
