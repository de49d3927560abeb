"""Encodings shared by the server and the remote client.

- id lists: concatenated 32-byte ids (application/octet-stream);
- object batches: records of kind (u8), id (32 bytes), length (u32 LE), raw
  bytes; the receiver recomputes every id and refuses a batch in which any
  object does not match its id;
- change sets: msgpack (entries as in docs/format.md);
- errors: JSON `{"error": <class>, "message": ..., "paths": [...]}`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from strata.engine import errors
from strata.engine.errors import InvalidInput, StrataError
from strata.engine.interface import ChangeSet
from strata.engine.names import check_name
from strata.engine.objects import (
    BLOCK,
    FILENODE,
    ID_LEN,
    KIND_NAMES,
    SNAPSHOT,
    TREE,
    TXID_LEN,
    Entry,
    FileNode,
    Snapshot,
    TreeNode,
    check_entry,
    object_id,
    packb,
    unpackb,
)

OBJ_HEAD = struct.Struct("<B32sI")
MAX_BODY = 128 * 1024 * 1024  # a batch of 32 MiB plus one object of up to 64 MiB fits
LEAN_SUFFIX = ".lean"  # the lean stream's socket is the unix HTTP socket's path + this


def lean_path(http_socket: str) -> str:
    """Where the lean stream (server/lean.py, docs/api.md) listens beside a unix socket."""
    return http_socket + LEAN_SUFFIX
MAX_IDS = 1_000_000


def encode_ids(ids: Sequence[bytes]) -> bytes:
    return b"".join(ids)


def decode_ids(body: bytes) -> list[bytes]:
    if len(body) % ID_LEN:
        raise InvalidInput("id list length is not a multiple of 32 bytes")
    if len(body) // ID_LEN > MAX_IDS:
        raise InvalidInput(f"more than {MAX_IDS} ids in one request")
    return [body[i:i + ID_LEN] for i in range(0, len(body), ID_LEN)]


BLOB_LEN = struct.Struct("<I")


def encode_blobs(blobs: Sequence[bytes]) -> bytes:
    """A batch read's answer: each object's length (u32 LE) then its bytes."""
    out = []
    for b in blobs:
        out.append(BLOB_LEN.pack(len(b)))
        out.append(b)
    return b"".join(out)


def decode_blobs(body: bytes, count: int) -> list[bytes]:
    out = []
    pos = 0
    for _ in range(count):
        if pos + BLOB_LEN.size > len(body):
            raise InvalidInput("batch read answer truncated")
        (n,) = BLOB_LEN.unpack_from(body, pos)
        pos += BLOB_LEN.size
        if pos + n > len(body):
            raise InvalidInput("batch read answer truncated")
        out.append(body[pos:pos + n])
        pos += n
    return out


def encode_objects(objects: Sequence[tuple[int, bytes]]) -> bytes:
    out = []
    for kind, raw in objects:
        out.append(OBJ_HEAD.pack(kind, object_id(kind, raw), len(raw)))
        out.append(raw)
    return b"".join(out)


def decode_objects(body: bytes) -> list[tuple[int, bytes]]:
    """Parse and verify an object batch; any bad record refuses the whole batch."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    view = memoryview(body)
    while pos < len(body):
        if pos + OBJ_HEAD.size > len(body):
            raise InvalidInput(f"object batch truncated in a record header at byte {pos}")
        kind, oid, length = OBJ_HEAD.unpack_from(body, pos)
        pos += OBJ_HEAD.size
        if kind not in KIND_NAMES:
            raise InvalidInput(f"unknown object kind {kind} at byte {pos - OBJ_HEAD.size}")
        if pos + length > len(body):
            raise InvalidInput(f"object batch truncated: object {oid.hex()} needs {length} "
                               f"bytes, {len(body) - pos} left")
        raw = bytes(view[pos:pos + length])
        pos += length
        if object_id(kind, raw) != oid:
            raise InvalidInput(f"object content does not match its id {oid.hex()}")
        if kind != BLOCK:
            _check_structure(kind, raw, oid)
        out.append((kind, raw))
    return out


def _check_structure(kind: int, raw: bytes, oid: bytes) -> None:
    """File nodes, tree nodes and snapshots must decode, so no branch can point at junk.

    Types are checked before decoding: the decoders call bytes() on what
    should be ids, and bytes(2**40) would allocate a terabyte.
    """
    def ok_id(x: Any) -> bool:
        return isinstance(x, bytes) and len(x) == ID_LEN

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    try:
        if kind == FILENODE:
            # The decoder checks every field of both versions, and refuses a version 2
            # node by its length before unpacking it (docs/format.md "File node").
            node = FileNode.decode(raw)
            if node.version == 1 and not 4096 <= node.block_size <= 16 * 1024 * 1024:
                raise TypeError("version 1 file node with a block size out of range")
            return
        v = unpackb(raw)
        if kind == TREE:
            # Version 1 is [level, items], version 2 [2, level, items, links]
            # (docs/format.md "Tree node"); the decoder checks the links.
            if isinstance(v, list) and len(v) == 4 and v[0] == 2:
                v = v[1:3]
            if not (isinstance(v, list) and len(v) == 2 and is_int(v[0])
                    and isinstance(v[1], list)):
                TreeNode.decode(raw)  # names an unknown version, if that is what it is
                raise TypeError("malformed tree node")
            prev = None
            for x in v[1]:
                if not isinstance(x, list) or not x or not isinstance(x[0], bytes):
                    raise TypeError("malformed tree node entry")
                if v[0] == 0:
                    # Names are what export and the mount create: one component each.
                    check_name(x[0])
                    check_entry(_entry(x[1:]))
                elif not (len(x) == 3 and ok_id(x[1]) and is_int(x[2]) and x[2] > 0):
                    raise TypeError("malformed tree node child")
                if prev is not None and not prev < x[0]:
                    raise TypeError("tree node names are not in strictly increasing order")
                prev = x[0]
            TreeNode.decode(raw)
        elif kind == SNAPSHOT:
            if not (isinstance(v, dict) and v.get("v") == 1 and is_int(v.get("time"))
                    and isinstance(v.get("msg"), str) and isinstance(v.get("meta"), dict)
                    and (v.get("parent") is None or isinstance(v.get("parent"), str))):
                raise TypeError("malformed snapshot")
            _entry(v.get("root"))
            Snapshot.decode(raw)
    except (TypeError, ValueError, KeyError, InvalidInput) as exc:
        raise InvalidInput(f"object {oid.hex()} is not a valid {KIND_NAMES[kind]}: "
                           f"{exc}") from None


class Publish(NamedTuple):
    """A decoded publish request."""

    changesets: list[ChangeSet]
    objects: list[tuple[int, bytes]]
    txid: bytes | None        # None if the client sent none
    prefetch: bool            # send the new snapshots and tree nodes back


def encode_publish(changesets: Sequence[ChangeSet],
                   objects: Sequence[tuple[int, bytes]] = (), *,
                   txid: bytes | None = None, prefetch: bool = True) -> bytes:
    """A publish request: the change sets plus objects to store with them.

    `prefetch=False` asks for the heads alone: a client that keeps its own
    map of what it published (a workspace device) reads nothing back.
    """
    req: dict[str, Any] = {"changesets": _changesets(changesets),
                           "objects": encode_objects(objects) if objects else None,
                           "txid": txid}
    if not prefetch:
        req["prefetch"] = False
    return packb(req)


def decode_publish(body: bytes) -> Publish:
    """Change sets, objects, the publish id and whether to prefetch."""
    try:
        raw = unpackb(body)
    except ValueError as exc:
        raise InvalidInput(f"publish body is not msgpack: {exc}") from exc
    if not isinstance(raw, dict) or "changesets" not in raw:
        raise InvalidInput("publish body must be a map with 'changesets'")
    objs = raw.get("objects")
    if objs is not None and not isinstance(objs, bytes):
        raise InvalidInput("'objects' must be a binary object batch")
    txid = raw.get("txid")
    if txid is not None and (not isinstance(txid, bytes) or len(txid) != TXID_LEN):
        raise InvalidInput(f"'txid' must be {TXID_LEN} bytes")
    prefetch = raw.get("prefetch", True)
    if not isinstance(prefetch, bool):
        raise InvalidInput("'prefetch' must be true or false")
    return Publish(_decode_changesets(raw["changesets"]),
                   decode_objects(objs) if objs else [], txid, prefetch)


def _changesets(changesets: Sequence[ChangeSet]) -> list[dict[str, Any]]:
    return [{
        "volume": cs.volume, "branch": cs.branch, "base": cs.base,
        # Paths travel as bytes: a name may hold any byte but / and NUL (not UTF-8).
        "changes": [[p.encode("utf-8", "surrogateescape"), None if e is None else e.to_list()]
                    for p, e in cs.changes.items()],
        "message": cs.message, "meta": cs.meta, "lease": cs.lease,
        "identical": cs.identical,
    } for cs in changesets]


def _decode_changesets(raw: Any) -> list[ChangeSet]:
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("publish body must be a non-empty list of change sets")
    out = []
    for cs in raw:
        try:
            if not isinstance(cs, dict):
                raise TypeError("change set is not a map")
            changes: dict[str, Entry | None] = {}
            for item in cs["changes"]:
                path, e = item
                if isinstance(path, bytes):
                    path = path.decode("utf-8", "surrogateescape")
                if not isinstance(path, str):
                    raise TypeError("path is not a string")
                if path in changes:
                    raise TypeError(f"path {path!r} appears twice")
                changes[path] = None if e is None else _entry(e)
            meta = cs.get("meta") or {}
            lease = cs.get("lease")
            if not isinstance(meta, dict) or (lease is not None and not isinstance(lease, str)):
                raise TypeError("meta must be a map and lease a lease id (string)")
            identical = cs.get("identical", False)
            if not isinstance(identical, bool):
                raise TypeError("identical must be a boolean")
            for field in ("volume", "branch", "base"):
                if not isinstance(cs[field], str):
                    raise TypeError(f"{field} must be a string")
            out.append(ChangeSet(cs["volume"], cs["branch"], cs["base"], changes,
                                 str(cs.get("message") or ""), meta, lease, identical))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"malformed change set: {exc}") from exc
    return out


def _entry(v: Any) -> Entry:
    if not isinstance(v, list) or len(v) != 12:
        raise TypeError("entry must be a list of 12 fields")
    for i in (0, 1, 2, 3, 4, 5, 8, 10, 11):
        if not isinstance(v[i], int) or isinstance(v[i], bool):
            raise TypeError(f"entry field {i} must be an integer")
    for i in (6, 7):
        if v[i] is not None and not isinstance(v[i], bytes):
            raise TypeError(f"entry field {i} must be bytes or nil")
    if v[9] is not None and not (isinstance(v[9], list) and all(
            isinstance(x, list) and len(x) == 2 and all(isinstance(y, bytes) for y in x)
            for x in v[9])):
        raise TypeError("xattrs must be a list of [name, value] byte pairs")
    return Entry.from_list(v)


ERROR_CLASSES: dict[str, type[StrataError]] = {
    cls.__name__: cls for cls in (
        errors.InvalidInput, errors.NotFound, errors.Expired, errors.AlreadyExists,
        errors.Conflict,
        errors.Corrupt, errors.Unavailable, errors.Locked, errors.Forbidden,
        errors.Unauthenticated,
        errors.StoreFailed,
        errors.StrataError)
}


def error_body(exc: StrataError) -> dict[str, Any]:
    body: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, errors.Conflict):
        body["paths"] = exc.paths
    return body


def raise_error(status: int, body: dict[str, Any]) -> None:
    """Turn an error response back into the exception the server raised."""
    name = str(body.get("error", ""))
    message = str(body.get("message") or f"server answered {status}")
    if name == "Conflict":
        raise errors.Conflict(list(body.get("paths") or []), message)
    if name == "Corrupt":
        raise errors.StrataError(message)
    if name == "Locked" or status == 423:
        raise errors.Locked(message)
    if name == "Unavailable" or status == 503:
        raise errors.Unavailable(message)
    cls = ERROR_CLASSES.get(name)
    if cls is None:
        cls = {400: errors.InvalidInput, 401: errors.Forbidden, 403: errors.Forbidden,
               404: errors.NotFound, 409: errors.AlreadyExists, 410: errors.Expired,
               413: errors.InvalidInput, 415: errors.InvalidInput,
               }.get(status, errors.StrataError)
    raise cls(message)
