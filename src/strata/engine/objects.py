"""Content-addressed objects: blocks, file nodes, tree nodes, snapshots.

An object id is BLAKE3-256 over one kind byte followed by the object's raw
bytes, so equal content of the same kind always has the same id and is stored
once. This module encodes and decodes objects; it never reads or writes files.
The byte layouts are documented in docs/format.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import blake3
import msgpack

from strata.engine.errors import InvalidInput

# Entry kinds live in their own module, for code that only shows entries.
from strata.engine.kinds import ENTRY_KIND_NAMES as ENTRY_KIND_NAMES
from strata.engine.kinds import IFMT as _IFMT
from strata.engine.kinds import K_BLK as K_BLK
from strata.engine.kinds import K_CHR as K_CHR
from strata.engine.kinds import K_DIR as K_DIR
from strata.engine.kinds import K_FIFO as K_FIFO
from strata.engine.kinds import K_FILE as K_FILE
from strata.engine.kinds import K_SOCK as K_SOCK
from strata.engine.kinds import K_SYMLINK as K_SYMLINK

# Object kinds (the first byte hashed into every id).
BLOCK = 1
FILENODE = 2
TREE = 3
SNAPSHOT = 4
KIND_NAMES = {BLOCK: "block", FILENODE: "file", TREE: "tree", SNAPSHOT: "snapshot"}

ID_LEN = 32
ZERO_ID = bytes(ID_LEN)
INLINE_MAX = 4096          # files up to this size keep their bytes in the entry
DEFAULT_BLOCK_SIZE = 64 * 1024


def object_id(kind: int, raw: bytes) -> bytes:
    """BLAKE3-256 of the kind byte followed by the raw object bytes."""
    h = blake3.blake3(bytes((kind,)))
    h.update(raw)
    return h.digest()


_packers = threading.local()


def packb(obj: Any) -> bytes:
    """Canonical msgpack encoding used for every structured object."""
    packer = getattr(_packers, "p", None)
    if packer is None:  # msgpack.packb builds a Packer per call; keep one per thread
        packer = _packers.p = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)  # type: ignore[no-any-return]


def unpackb(raw: bytes) -> Any:
    """Decode msgpack written by `packb`; raises ValueError on malformed input."""
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"malformed object encoding: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Entry:
    """One name in a directory: its type, metadata and content reference.

    For files, `ref` names a file node and `data` is None, or `ref` is None and
    `data` holds the whole (small) content inline. For directories, `ref` names
    the tree node; in a change set a directory entry with `ref` None means
    "make sure this directory exists with these attributes" and merges with
    concurrent changes beneath it. For symlinks `data` is the target. `ino` is
    non-zero for files that are hard-linked: every entry of a link group
    carries the same `ino`, content and `nlink`.
    """

    kind: int
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    ref: bytes | None = None
    data: bytes | None = None
    rdev: int = 0
    xattrs: tuple[tuple[bytes, bytes], ...] = ()
    ino: int = 0
    nlink: int = 1

    @property
    def is_dir(self) -> bool:
        return self.kind == K_DIR

    @property
    def st_mode(self) -> int:
        """The full st_mode (file type bits plus permission bits)."""
        return _IFMT[self.kind] | (self.mode & 0o7777)

    def attrs(self) -> tuple[int, int, int, tuple[tuple[bytes, bytes], ...]]:
        """The attributes that matter for conflicts (mtime excluded)."""
        return (self.mode & 0o7777, self.uid, self.gid, self.xattrs)

    def with_(self, **changes: Any) -> Entry:
        return replace(self, **changes)

    def to_list(self) -> list[Any]:
        return [self.kind, self.mode, self.uid, self.gid, self.mtime_ns, self.size, self.ref,
                self.data, self.rdev, [list(x) for x in self.xattrs] or None, self.ino,
                self.nlink]

    @classmethod
    def from_list(cls, v: list[Any]) -> Entry:
        if not isinstance(v, list) or len(v) < 12:
            raise ValueError("malformed entry")
        xattrs = tuple((bytes(k), bytes(val)) for k, val in v[9]) if v[9] else ()
        e = cls(kind=int(v[0]), mode=int(v[1]), uid=int(v[2]), gid=int(v[3]),
                mtime_ns=int(v[4]), size=int(v[5]), ref=v[6], data=v[7], rdev=int(v[8]),
                xattrs=xattrs, ino=int(v[10]), nlink=int(v[11]))
        if e.kind not in ENTRY_KIND_NAMES:
            raise ValueError(f"unknown entry kind {e.kind}")
        return e


def link_group(seed: bytes) -> int:
    """A number for a new hard-link group (Entry.ino): 48 bits of a hash, odd so never 0.

    Each caller picks a seed that makes its numbers stable where it needs
    them to be (import: the group's first path, so re-imports agree).
    """
    return int.from_bytes(object_id(0, seed)[:6], "little") | 1


def dir_entry(mode: int = 0o755, *, ref: bytes | None = None, uid: int = 0, gid: int = 0,
              mtime_ns: int = 0) -> Entry:
    return Entry(kind=K_DIR, mode=mode, uid=uid, gid=gid, mtime_ns=mtime_ns, ref=ref)


@dataclass(frozen=True, slots=True)
class FileNode:
    """A file's size and its blocks in order; a zero id marks a hole."""

    size: int
    block_size: int
    blocks: tuple[bytes, ...]

    def encode(self) -> bytes:
        return packb([1, self.size, self.block_size, list(self.blocks)])

    @classmethod
    def decode(cls, raw: bytes) -> FileNode:
        v = unpackb(raw)
        if not isinstance(v, list) or len(v) != 4 or v[0] != 1:
            raise ValueError("malformed file node")
        return cls(size=int(v[1]), block_size=int(v[2]), blocks=tuple(bytes(b) for b in v[3]))

    def block_ids(self, offset: int, end: int) -> list[bytes]:
        """The stored blocks covering bytes [offset, end): each id once, in order, no holes."""
        if end <= offset:
            return []
        bs = self.block_size
        span = self.blocks[offset // bs:(end - 1) // bs + 1]
        return [b for b in dict.fromkeys(span) if b != ZERO_ID]

    def pieces(self, offset: int, end: int, fetch: Callable[[bytes], bytes]
               ) -> Iterator[tuple[int, bytes | None]]:
        """(length, bytes) for each block's share of bytes [offset, end); None for a hole.

        Holes are never fetched, so a caller may keep them holes (export) or
        read them as zeros. `fetch` returns a stored block by id.
        """
        bs = self.block_size
        for i in range(offset // bs, (end - 1) // bs + 1):
            lo = max(offset - i * bs, 0)
            hi = min(end - i * bs, bs)
            oid = self.blocks[i]
            if oid == ZERO_ID:
                yield hi - lo, None
            else:
                yield hi - lo, fit_block(fetch(oid), min(bs, self.size - i * bs))[lo:hi]

    def read(self, offset: int, end: int, fetch: Callable[[bytes], bytes]) -> bytes:
        """Bytes [offset, end) of the file, holes as zeros."""
        return b"".join(bytes(n) if data is None else data
                        for n, data in self.pieces(offset, end, fetch))


def fit_block(raw: bytes, length: int) -> bytes:
    """A stored block as `length` bytes of its file: zero-padded or cut."""
    return raw + bytes(length - len(raw)) if len(raw) < length else raw[:length]


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One node of a directory's B-tree.

    Level 0 nodes hold (name, Entry) pairs sorted by name; higher levels hold
    (first name, child id, entry count) triples.
    """

    level: int
    entries: tuple[tuple[bytes, Entry], ...] = ()
    children: tuple[tuple[bytes, bytes, int], ...] = ()

    def encode(self) -> bytes:
        if self.level == 0:
            return packb([0, [[n, *e.to_list()] for n, e in self.entries]])
        return packb([self.level, [list(c) for c in self.children]])

    @classmethod
    def decode(cls, raw: bytes) -> TreeNode:
        v = unpackb(raw)
        if not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], int):
            raise ValueError("malformed tree node")
        if v[0] == 0:
            return cls(0, entries=tuple((bytes(x[0]), Entry.from_list(x[1:])) for x in v[1]))
        return cls(v[0], children=tuple((bytes(c[0]), bytes(c[1]), int(c[2])) for c in v[1]))

    @property
    def count(self) -> int:
        if self.level == 0:
            return len(self.entries)
        return sum(c[2] for c in self.children)

    @property
    def first(self) -> bytes:
        if self.level == 0:
            return self.entries[0][0] if self.entries else b""
        return self.children[0][0] if self.children else b""


SNAPSHOT_VERSIONS = (1, 2)  # 2 adds "tx", the id of the publish that made the snapshot
TXID_LEN = 16


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable version of a volume: its root directory plus history."""

    root: Entry
    parent: str | None
    time_ns: int
    message: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    tx: bytes | None = None  # the publish that made it (see Store.publish), version 2 on

    def encode(self) -> bytes:
        body = {"v": 1, "root": self.root.to_list(), "parent": self.parent,
                "time": self.time_ns, "msg": self.message, "meta": self.meta}
        if self.tx is not None:  # without one, version 1: the empty snapshot keeps its id
            body["v"] = 2
            body["tx"] = self.tx
        return packb(body)

    @classmethod
    def decode(cls, raw: bytes) -> Snapshot:
        v = unpackb(raw)
        if not isinstance(v, dict) or v.get("v") not in SNAPSHOT_VERSIONS:
            version = v.get("v") if isinstance(v, dict) else None
            if isinstance(version, int) and version > max(SNAPSHOT_VERSIONS):
                raise ValueError(f"snapshot format version {version} is newer than this "
                                 f"strata reads ({max(SNAPSHOT_VERSIONS)}); upgrade strata")
            raise ValueError("malformed snapshot")
        tx = v.get("tx") if v["v"] >= 2 else None
        if tx is not None and (not isinstance(tx, bytes) or len(tx) != TXID_LEN):
            raise ValueError("malformed snapshot: bad publish id")
        return cls(root=Entry.from_list(v["root"]), parent=v["parent"], time_ns=int(v["time"]),
                   message=str(v["msg"]), meta=dict(v["meta"]), tx=tx)


EMPTY_TREE = TreeNode(0).encode()
EMPTY_TREE_ID = object_id(TREE, EMPTY_TREE)
EMPTY_SNAPSHOT = Snapshot(root=dir_entry(0o755, ref=EMPTY_TREE_ID), parent=None, time_ns=0)
EMPTY_SNAPSHOT_RAW = EMPTY_SNAPSHOT.encode()
EMPTY_SNAPSHOT_ID = object_id(SNAPSHOT, EMPTY_SNAPSHOT_RAW).hex()


def check_entry(e: Entry) -> None:
    """Refuse structurally impossible entries sent by a client."""
    if e.kind not in ENTRY_KIND_NAMES:
        raise InvalidInput(f"unknown entry kind {e.kind}")
    if e.size < 0 or e.mode < 0 or e.mode > 0o7777 or e.uid < 0 or e.gid < 0:
        raise InvalidInput("entry has a negative size, owner or an invalid mode")
    if e.ref is not None and len(e.ref) != ID_LEN:
        raise InvalidInput("entry reference is not a 32-byte id")
    if e.kind == K_FILE and e.ref is None and len(e.data or b"") != e.size:
        raise InvalidInput("inline file data does not match its size")
    if e.kind == K_SYMLINK and not e.data:
        raise InvalidInput("symlink without a target")
    if e.uid > _U32 or e.gid > _U32 or e.size > _I63 or not -_I63 <= e.mtime_ns <= _I63:
        raise InvalidInput("entry owner, size or time is out of range")
    if not 0 <= e.rdev <= _U64 or not 0 <= e.ino <= _U64 or not 1 <= e.nlink <= _U32:
        raise InvalidInput("entry device, inode number or link count is out of range")
    if e.kind == K_DIR and e.data is not None:
        raise InvalidInput("a directory entry with inline data")
    if e.kind not in (K_FILE, K_DIR) and e.ref is not None:
        raise InvalidInput(f"a {ENTRY_KIND_NAMES[e.kind]} entry with a reference")
    if e.kind in (K_FILE, K_SYMLINK) and len(e.data or b"") > INLINE_MAX + 4096:
        raise InvalidInput("entry inline data is too long")
    if e.kind not in (K_FILE, K_SYMLINK) and e.data:
        raise InvalidInput(f"a {ENTRY_KIND_NAMES[e.kind]} entry with data")
    if e.kind == K_SYMLINK and b"\0" in (e.data or b""):
        raise InvalidInput("symlink target contains NUL")
    names = [name for name, _v in e.xattrs]
    if any(not n or b"\0" in n or len(n) > 255 for n in names) or len(set(names)) != len(
            names):
        raise InvalidInput("an xattr name is empty, repeated, too long or contains NUL")


def check_entry_size(path: str, size: int, node: FileNode) -> None:
    """A file entry says the size its file node holds (readers trust the node's).

    An entry claiming 1,000 bytes over a 256 MiB node once passed the web
    view's 64 MiB limit for SQLite files and had all 256 MiB copied.
    """
    if size != node.size:
        raise InvalidInput(f"entry for {path!r} says {size} bytes, its file node holds "
                           f"{node.size}")


_U32 = 2**32 - 1
_U64 = 2**64 - 1
_I63 = 2**63 - 1


def references(kind: int, raw: bytes) -> list[tuple[int, bytes]]:
    """The (kind, id) of every object this one refers to; ValueError if it does not decode."""
    try:
        if kind == TREE:
            node = TreeNode.decode(raw)
            out = [(TREE, c[1]) for c in node.children]
            out.extend((TREE if e.kind == K_DIR else FILENODE, e.ref)
                       for _n, e in node.entries
                       if e.ref is not None and e.kind in (K_DIR, K_FILE))
            return out
        if kind == FILENODE:
            return [(BLOCK, b) for b in dict.fromkeys(FileNode.decode(raw).blocks)
                    if b != ZERO_ID]
        if kind == SNAPSHOT:
            root = Snapshot.decode(raw).root
            return [(TREE, root.ref)] if root.ref is not None else []
    except (TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ValueError(f"malformed {KIND_NAMES.get(kind, 'object')}: {exc}") from None
    return []
