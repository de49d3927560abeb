"""Content-addressed objects: blocks, file nodes, tree nodes, snapshots.

An object id is BLAKE3-256 over one kind byte followed by the object's raw
bytes, so equal content of the same kind always has the same id and is stored
once. This module encodes and decodes objects; it never reads or writes files.
The byte layouts are documented in docs/format.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
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


FILE_NODE_VERSIONS = (1, 2)  # 2: a tree of (length, id) entries cut by content (CDC)
FILE_FANOUT_MAX = 512         # entries in one version 2 node: at most ~22 KiB encoded
FILE_LEVEL_MAX = 8            # 512**8 entries is far past any file a size can name
FILE_NODE_V2_MAX = 64 * 1024  # bytes of one encoded version 2 node (512 * 44 < 23 KiB)
_V1_BLOCKS_MAX = 2 * 1024 * 1024  # a 64 MiB object holds no more 32-byte ids


@dataclass(frozen=True, slots=True)
class FileNode:
    """One node of a file's content: a list of (length, id) entries.

    Version 2 (written now) is a tree: a level 0 node lists the file's chunks
    in order, a zero id standing for a hole of that length; a node at level
    L > 0 lists (length of the subtree, child file node id) with children of
    level L - 1. The lengths of a node add up to its `size`. Version 1 (read
    only) is one node of fixed-size blocks; decoding turns it into the same
    level 0 entries, so readers walk both the same way.
    """

    size: int
    level: int
    entries: tuple[tuple[int, bytes], ...]
    version: int = 2
    block_size: int = 0  # version 1: the block size the file was cut with

    @classmethod
    def v1(cls, size: int, block_size: int, blocks: Sequence[bytes]) -> FileNode:
        """A version 1 node of fixed-size blocks (workspace block device extents)."""
        entries = tuple((min(block_size, size - i * block_size), b)
                        for i, b in enumerate(blocks))
        return cls(size, 0, entries, 1, block_size)

    @property
    def blocks(self) -> tuple[bytes, ...]:
        """The ids of a level 0 node's entries in order (zero id: hole)."""
        if self.level:
            raise ValueError("an inner file node holds child nodes, not blocks")
        return tuple(oid for _n, oid in self.entries)

    def encode(self) -> bytes:
        if self.version == 1:
            return packb([1, self.size, self.block_size, list(self.blocks)])
        return packb([2, self.size, self.level, [[n, oid] for n, oid in self.entries]])

    @classmethod
    def decode(cls, raw: bytes) -> FileNode:
        """Decode and check a node of either version; ValueError names what is wrong.

        Nodes come from clients and bucket writers: every count, length and id
        is checked here, and a version 2 node is refused by its size before it
        is unpacked, so a hostile one never costs more than 64 KiB to decode.
        """
        if len(raw) >= 2 and raw[0] == 0x94 and raw[1] not in FILE_NODE_VERSIONS and raw[1] < 0x80:
            raise ValueError(f"file node format version {raw[1]} is not one this strata "
                             f"reads ({', '.join(map(str, FILE_NODE_VERSIONS))}); "
                             f"upgrade strata")
        if raw[:2] == b"\x94\x02" and len(raw) > FILE_NODE_V2_MAX:
            raise ValueError(f"file node of {len(raw)} bytes is larger than a version 2 node "
                             f"can be ({FILE_NODE_V2_MAX})")
        v = unpackb(raw)
        if not isinstance(v, list) or len(v) != 4 or not all(_is_int(x) for x in v[:3]):
            raise ValueError("malformed file node")
        version, size, third, items = v
        if not isinstance(items, list) or not 0 <= size <= _I63:
            raise ValueError("malformed file node: bad size or entry list")
        if version == 1:
            bs = third
            if not 1 <= bs <= 1 << 30 or len(items) > _V1_BLOCKS_MAX or len(items) != -(
                    -size // bs) or not all(isinstance(b, bytes) and len(b) == ID_LEN
                                            for b in items):
                raise ValueError("malformed version 1 file node: size, block size and "
                                 "blocks disagree")
            return cls.v1(size, bs, items)
        if version != 2:
            raise ValueError(f"file node format version {version} is not one this strata "
                             f"reads ({', '.join(map(str, FILE_NODE_VERSIONS))}); "
                             f"upgrade strata")
        level = third
        if not 0 <= level <= FILE_LEVEL_MAX or len(items) > FILE_FANOUT_MAX or (
                not items and (size or level)):
            raise ValueError("malformed file node: level or entry count out of range")
        entries = []
        total = 0
        for x in items:
            if not (isinstance(x, list) and len(x) == 2 and _is_int(x[0]) and x[0] > 0
                    and isinstance(x[1], bytes) and len(x[1]) == ID_LEN):
                raise ValueError("malformed file node entry: not [length > 0, 32-byte id]")
            if level and x[1] == ZERO_ID:
                raise ValueError("an inner file node names a hole as a child")
            total += x[0]
            entries.append((x[0], x[1]))
        if total != size:
            raise ValueError(f"file node entries add up to {total} bytes, its size says {size}")
        return cls(size, level, tuple(entries))

    def child(self, i: int, raw: bytes) -> FileNode:
        """Decode the node this one names at entry `i`, checking that the two agree."""
        node = FileNode.decode(raw)
        length = self.entries[i][0]
        if node.version != 2 or node.level != self.level - 1 or node.size != length:
            raise ValueError(f"file node {self.entries[i][1].hex()} is not the level "
                             f"{self.level - 1} node of {length} bytes its parent names")
        return node

    def spans(self, offset: int, end: int, get: Callable[[bytes], bytes]
              ) -> Iterator[tuple[int, int, bytes]]:
        """(file offset, length, id) of each chunk or hole overlapping [offset, end), in order.

        Child nodes are fetched with `get` only where they cover the range, so
        a read of a few bytes of a large file costs one node per level.
        """
        yield from self._spans(0, offset, end, get)

    def _spans(self, base: int, offset: int, end: int, get: Callable[[bytes], bytes]
               ) -> Iterator[tuple[int, int, bytes]]:
        if end <= offset:
            return
        pos = base
        for i, (n, oid) in enumerate(self.entries):
            if pos >= end:
                return
            if pos + n > offset:
                if self.level:
                    yield from self.child(i, get(oid))._spans(pos, offset, end, get)
                else:
                    yield pos, n, oid
            pos += n

    def range_ids(self, offset: int, end: int, get: Callable[[bytes], bytes]
                  ) -> Iterator[tuple[int, bytes]]:
        """(kind, id) of the nodes below this one and the stored chunks that cover a range.

        In the order a reader needs them (each node before what it names),
        each id once, no holes: the order `get_file` answers in. `get` is
        called for a child node only after its id has been yielded.
        """
        seen: set[bytes] = set()
        yield from self._range_ids(0, offset, end, get, seen)

    def _range_ids(self, base: int, offset: int, end: int, get: Callable[[bytes], bytes],
                   seen: set[bytes]) -> Iterator[tuple[int, bytes]]:
        if end <= offset:
            return
        pos = base
        for i, (n, oid) in enumerate(self.entries):
            if pos >= end:
                return
            if pos + n > offset and oid not in seen and oid != ZERO_ID:
                seen.add(oid)
                if self.level:
                    yield FILENODE, oid
                    yield from self.child(i, get(oid))._range_ids(pos, offset, end, get, seen)
                else:
                    yield BLOCK, oid
            pos += n

    def block_ids(self, offset: int, end: int, get: Callable[[bytes], bytes] | None = None
                  ) -> list[bytes]:
        """The stored chunks covering bytes [offset, end): each id once, in order, no holes."""
        def no_get(oid: bytes) -> bytes:
            raise ValueError("reading an inner file node needs a way to fetch its children")

        return [oid for kind, oid in self.range_ids(offset, end, get or no_get)
                if kind == BLOCK]

    def all_block_ids(self, get: Callable[[bytes], bytes]) -> list[bytes]:
        """Every stored chunk of the file, each once, in order."""
        return self.block_ids(0, self.size, get)

    def pieces(self, offset: int, end: int, fetch: Callable[[bytes], bytes],
               get_node: Callable[[bytes], bytes] | None = None
               ) -> Iterator[tuple[int, bytes | None]]:
        """(length, bytes) for each chunk's share of bytes [offset, end); None for a hole.

        Holes are never fetched, so a caller may keep them holes (export) or
        read them as zeros. `fetch` returns a stored object by id: chunks, and
        child file nodes too unless `get_node` is given for those.
        """
        for start, n, oid in self.spans(offset, end, get_node or fetch):
            lo = max(offset - start, 0)
            hi = min(end - start, n)
            if oid == ZERO_ID:
                yield hi - lo, None
            else:
                yield hi - lo, fit_block(fetch(oid), n)[lo:hi]

    def read(self, offset: int, end: int, fetch: Callable[[bytes], bytes],
             get_node: Callable[[bytes], bytes] | None = None) -> bytes:
        """Bytes [offset, end) of the file, holes as zeros (see `pieces`)."""
        return b"".join(bytes(n) if data is None else data
                        for n, data in self.pieces(offset, end, fetch, get_node))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def fit_block(raw: bytes, length: int) -> bytes:
    """A stored block as `length` bytes of its file: zero-padded or cut."""
    return raw + bytes(length - len(raw)) if len(raw) < length else raw[:length]


TREE_NODE_VERSIONS = (1, 2)  # 2 adds the count of hard-linked files under each item
_TREE_LEVEL_MAX = 64  # far above any real directory: 256**64 entries


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One node of a directory's B-tree.

    Level 0 nodes hold (name, Entry) pairs sorted by name; higher levels hold
    (first name, child id, entry count) triples. `links` (version 2) counts,
    for each item, the hard-linked files (`ino` non-zero) at or below it,
    through subdirectories too, or holds None where that is unknown (a
    directory written before version 2). A version 1 node has `links` None:
    its files count as they are, its directories and children as unknown.
    A search for a link group descends only where the count is not zero.
    """

    level: int
    entries: tuple[tuple[bytes, Entry], ...] = ()
    children: tuple[tuple[bytes, bytes, int], ...] = ()
    links: tuple[int | None, ...] | None = None

    @property
    def version(self) -> int:
        return 1 if self.links is None else 2

    def encode(self) -> bytes:
        items: list[Any] = ([[n, *e.to_list()] for n, e in self.entries] if self.level == 0
                            else [list(c) for c in self.children])
        if self.links is None or not items:  # the empty directory keeps its id: [0, []]
            return packb([self.level, items])
        return packb([2, self.level, items, list(self.links)])

    @classmethod
    def decode(cls, raw: bytes) -> TreeNode:
        """Decode a node of version 1 (`[level, items]`) or 2 (`[2, level, items, links]`).

        The counts of a version 2 leaf's non-directory items are checked
        against the entries here; those of directories and children are
        checked against the nodes they name when a client sends the node
        (LocalStore.check_tree_refs).
        """
        v = unpackb(raw)
        if not isinstance(v, list) or not v or not _is_int(v[0]):
            raise ValueError("malformed tree node")
        if len(v) == 2:
            level, items, links = v[0], v[1], None
        elif v[0] == 2 and len(v) == 4:
            _version, level, items, links = v
        else:
            raise ValueError(f"tree node format version {v[0]} is not one this strata reads "
                             f"({', '.join(map(str, TREE_NODE_VERSIONS))}); upgrade strata")
        if not _is_int(level) or not 0 <= level <= _TREE_LEVEL_MAX or not isinstance(
                items, list):
            raise ValueError("malformed tree node: bad level or item list")
        if level == 0:
            node = cls(0, entries=tuple((bytes(x[0]), Entry.from_list(x[1:])) for x in items))
        else:
            node = cls(level, children=tuple((bytes(c[0]), bytes(c[1]), int(c[2]))
                                             for c in items))
        if links is None:
            return node
        if not isinstance(links, list) or len(links) != len(items):
            raise ValueError("malformed tree node: link counts do not match its items")
        for n in links:  # a plain loop: every cold tree node read passes here
            if n is not None and (type(n) is not int or not 0 <= n <= _I63):
                raise ValueError("malformed tree node: link counts do not match its items")
        for (name, e), n in zip(node.entries, links, strict=False):
            if e.kind != K_DIR and n != (1 if e.kind == K_FILE and e.ino else 0):
                raise ValueError(f"tree node counts {n} linked files at {name!r}, a "
                                 f"{ENTRY_KIND_NAMES[e.kind]} with inode group {e.ino}")
        return replace(node, links=tuple(links))

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

    @property
    def item_links(self) -> tuple[int | None, ...]:
        """Linked files at or below each item (None: unknown, descend to find out)."""
        if self.links is not None:
            return self.links
        if self.level:
            return (None,) * len(self.children)
        return tuple(None if e.kind == K_DIR else _own_links(e) for _n, e in self.entries)

    @property
    def linked(self) -> int | None:
        """Hard-linked files anywhere under this node, or None if some count is unknown."""
        total = 0
        for n in self.item_links:
            if n is None:
                return None
            total += n
        return total


def _own_links(e: Entry) -> int:
    """1 for a hard-linked file (the entry itself), 0 for any other non-directory."""
    return 1 if e.kind == K_FILE and e.ino else 0


def entry_links(e: Entry, node: Callable[[bytes], TreeNode]) -> int | None:
    """What a tree node records for entry `e`: for a directory, its tree's count.

    `node` reads a tree node by id; only directories call it.
    """
    if e.kind != K_DIR:
        return _own_links(e)
    return node(e.ref).linked if e.ref is not None else None


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
            fnode = FileNode.decode(raw)
            child = FILENODE if fnode.level else BLOCK
            return [(child, b) for b in dict.fromkeys(oid for _n, oid in fnode.entries)
                    if b != ZERO_ID]
        if kind == SNAPSHOT:
            root = Snapshot.decode(raw).root
            return [(TREE, root.ref)] if root.ref is not None else []
    except (TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ValueError(f"malformed {KIND_NAMES.get(kind, 'object')}: {exc}") from None
    return []
