"""Directory trees: split B-tree nodes, path lookup, batch update and diff.

A directory is a B-tree of `TreeNode`s. Leaves end where an entry name's
CRC-32 hits a boundary pattern (content-defined, so an insert or delete moves
only nearby boundaries), and no node holds more than `MAX_FANOUT` items. A
one-entry change in a 100k-entry directory therefore rewrites one leaf and the
few index nodes above it. Every node written records how many hard-linked
files lie under each of its items, so `link_group` reads only the paths that
lead to linked files.

This module works on any object source with `get_object`; it never touches
packs or the index directly.
"""

from __future__ import annotations

import bisect
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from strata.engine.errors import InvalidInput, NotFound
from strata.engine.objects import (
    EMPTY_TREE_ID,
    K_DIR,
    K_FILE,
    TREE,
    Entry,
    TreeNode,
    entry_links,
    object_id,
)

TARGET_FANOUT = 64
BOUNDARY_MASK = TARGET_FANOUT - 1
MAX_FANOUT = 256
T = TypeVar("T", bound=tuple[Any, ...])
# What a node's builder hands up: (first name, node id, entry count, linked files or None).
Item = tuple[bytes, bytes, int, int | None]


class ObjectSource(Protocol):
    def get_object(self, oid: bytes) -> bytes: ...


# What a decoded node costs beyond its encoded bytes: each entry (or child) is a
# tuple, an Entry and their ints, ~330 bytes measured on CPython 3.11.
NODE_ITEM_COST = 330
NODE_COST = 400
NODE_CACHE_BYTES = 32 << 20


class NodeCache:
    """A bounded LRU of decoded tree nodes; nodes are immutable, so sharing is safe.

    Bounded by count and by the nodes' estimated decoded size (`max_bytes`):
    a node ranges from one small entry to 256 entries with inline data, so a
    count alone would let the same cache hold 1 MiB or several GiB.
    """

    def __init__(self, capacity: int = 20000, max_bytes: int = NODE_CACHE_BYTES) -> None:
        self._d: OrderedDict[bytes, tuple[TreeNode, int]] = OrderedDict()
        self._cap = capacity
        self._max_bytes = max_bytes
        self.bytes = 0
        self._lock = threading.Lock()

    def get(self, oid: bytes) -> TreeNode | None:
        with self._lock:
            got = self._d.get(oid)
            if got is None:
                return None
            self._d.move_to_end(oid)
            return got[0]

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.bytes = 0

    def put(self, oid: bytes, node: TreeNode, encoded: int) -> None:
        """Keep `node`, whose encoding is `encoded` bytes long."""
        cost = NODE_COST + encoded + NODE_ITEM_COST * (len(node.entries) + len(node.children))
        with self._lock:
            old = self._d.pop(oid, None)
            if old is not None:
                self.bytes -= old[1]
            self._d[oid] = (node, cost)
            self.bytes += cost
            while len(self._d) > self._cap or self.bytes > self._max_bytes and len(self._d) > 1:
                self.bytes -= self._d.popitem(last=False)[1][1]


def _is_boundary(name: bytes, level: int) -> bool:
    return (zlib.crc32(name, level) & BOUNDARY_MASK) == 0


def _chunk(items: Sequence[T], level: int) -> list[list[T]]:
    """Cut sorted items (whose first field is the name) at content-defined boundaries."""
    chunks: list[list[T]] = []
    cur: list[T] = []
    for item in items:
        cur.append(item)
        if _is_boundary(item[0], level) or len(cur) >= MAX_FANOUT:
            chunks.append(cur)
            cur = []
    if cur:
        chunks.append(cur)
    return chunks


class Trees:
    """Reads and writes directory trees through an object source.

    New nodes are kept in `self.new` (id -> raw bytes) until the caller stores
    them; reads see them too, so a batch of updates can build on itself.
    """

    def __init__(self, source: ObjectSource, cache: NodeCache | None = None, *,
                 prefetch: Callable[[bytes, list[bytes]], None] | None = None) -> None:
        self.source = source
        self.cache = cache if cache is not None else NodeCache()
        self.new: dict[bytes, bytes] = {}
        # Called with (directory node, names below it) when `resolve_changed` is
        # about to read a node it lacks: a remote source fetches the path at once.
        self.prefetch = prefetch

    # -- nodes ---------------------------------------------------------------

    def node(self, oid: bytes) -> TreeNode:
        node = self.cache.get(oid)
        if node is None:
            raw = self.new.get(oid)
            if raw is None:
                raw = self.source.get_object(oid)
            try:
                node = TreeNode.decode(raw)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                raise NotFound(f"object {oid.hex()} is not a tree node: {exc}") from exc
            self.cache.put(oid, node, len(raw))
        return node

    def _store(self, node: TreeNode) -> bytes:
        raw = node.encode()
        oid = object_id(TREE, raw)
        if oid not in self.new:
            self.new[oid] = raw
            self.cache.put(oid, node, len(raw))
        return oid

    # -- reading -------------------------------------------------------------

    def iter_dir(self, oid: bytes) -> Iterator[tuple[bytes, Entry]]:
        node = self.node(oid)
        if node.level == 0:
            yield from node.entries
        else:
            for _first, child, _count in node.children:
                yield from self.iter_dir(child)

    def count(self, oid: bytes) -> int:
        return self.node(oid).count

    def lookup(self, oid: bytes, name: bytes) -> Entry | None:
        node = self.node(oid)
        while node.level > 0:
            firsts = [c[0] for c in node.children]
            i = max(bisect.bisect_right(firsts, name) - 1, 0)
            node = self.node(node.children[i][1])
        names = [n for n, _ in node.entries]
        i = bisect.bisect_left(names, name)
        if i < len(names) and names[i] == name:
            return node.entries[i][1]
        return None

    def leaves(self, oid: bytes) -> list[bytes]:
        node = self.node(oid)
        if node.level == 0:
            return [oid]
        out: list[bytes] = []
        for _f, child, _c in node.children:
            out.extend(self.leaves(child))
        return out

    def child(self, d: Entry | None, name: bytes) -> Entry | None:
        """The entry `name` in directory `d`; None if it is missing or `d` is no directory."""
        if d is None or d.kind != K_DIR or d.ref is None:
            return None
        return self.lookup(d.ref, name)

    def resolve(self, root: Entry, parts: Sequence[str]) -> Entry | None:
        """The entry at `parts` below `root`, or None if any component is missing."""
        cur: Entry | None = root
        for part in parts:
            cur = self.child(cur, encode_name(part))
        return cur

    def resolve_changed(self, root: Entry, changes: Mapping[str, Entry | None],
                        parts: Sequence[str], *, skip_last: bool = False) -> Entry | None:
        """The entry at `parts` once `changes` (path -> final entry) apply to `root`.

        What a transaction, or a mount's commit, sees before it publishes: the
        rules of `apply` and `rebase`, one path at a time. The root's change
        sets attributes only; a directory change with `ref` None keeps the
        contents of the directory it covers (none if it covers something
        else). `skip_last` ignores the change to the path itself and answers
        what is underneath it.
        """
        top = changes.get("")
        cur: Entry | None = root if top is None else top.with_(ref=root.ref)
        for i, name in enumerate(parts):
            if cur is None or cur.kind != K_DIR:
                return None
            if (self.prefetch is not None and cur.ref is not None and cur.ref not in self.new
                    and self.cache.get(cur.ref) is None):
                self.prefetch(cur.ref, [encode_name(p) for p in parts[i:]])
            under = self.child(cur, encode_name(name))
            key = "/".join(parts[:i + 1])
            if key not in changes or (skip_last and i == len(parts) - 1):
                cur = under
                continue
            cur = changes[key]
            if cur is not None and cur.kind == K_DIR and cur.ref is None:
                cur = cur.with_(ref=under.ref if under is not None and under.kind == K_DIR
                                else EMPTY_TREE_ID)
        return cur

    def walk(self, root: Entry, prefix: str = "") -> Iterator[tuple[str, Entry]]:
        """Every (path, entry) below `root`, parents before children, in name order."""
        if root.kind != K_DIR or root.ref is None:
            return
        for name, e in self.iter_dir(root.ref):
            path = f"{prefix}/{decode_name(name)}" if prefix else decode_name(name)
            yield path, e
            if e.kind == K_DIR:
                yield from self.walk(e, path)

    def link_group(self, root: Entry, ino: int, prefix: str = ""
                   ) -> Iterator[tuple[str, Entry]]:
        """Every file of hard-link group `ino` below directory `root`, in no set order.

        Reads only the nodes whose counts say a linked file lies below (or
        do not say: version 1 nodes), so the cost follows the paths to
        linked files, not the size of the tree. Counts are only as honest as
        whoever wrote the nodes: callers that know the group's size check
        what they found against it (Transaction falls back to `walk`).
        """
        if root.kind != K_DIR or root.ref is None:
            return
        stack = [(root.ref, prefix)]
        while stack:
            oid, path = stack.pop()
            node = self.node(oid)
            if node.level:
                stack.extend((c[1], path) for c, n in zip(node.children, node.item_links,
                                                          strict=True) if n != 0)
                continue
            for (name, e), n in zip(node.entries, node.item_links, strict=True):
                if n == 0:
                    continue
                sub = f"{path}/{decode_name(name)}" if path else decode_name(name)
                if e.kind == K_FILE and e.ino == ino:
                    yield sub, e
                elif e.kind == K_DIR and e.ref is not None:
                    stack.append((e.ref, sub))

    # -- writing -------------------------------------------------------------

    def _links(self, e: Entry) -> int | None:
        return entry_links(e, self.node)

    def _leaf(self, chunk: Sequence[tuple[bytes, Entry, int | None]]) -> Item:
        leaf = TreeNode(0, entries=tuple((n, e) for n, e, _l in chunk),
                        links=tuple(n for _n, _e, n in chunk))
        return chunk[0][0], self._store(leaf), len(chunk), leaf.linked

    def _inner(self, level: int, chunk: Sequence[Item]) -> Item:
        node = TreeNode(level, children=tuple((f, c, n) for f, c, n, _l in chunk),
                        links=tuple(n for _f, _c, _n, n in chunk))
        return chunk[0][0], self._store(node), node.count, node.linked

    def build(self, entries: Sequence[tuple[bytes, Entry]]) -> bytes:
        """Store a directory from entries sorted by name; return its root node id."""
        if not entries:
            return EMPTY_TREE_ID
        items = [(n, e, self._links(e)) for n, e in entries]
        return self._build_up([self._leaf(chunk) for chunk in _chunk(items, 0)], 1)

    def _build_up(self, items: list[Item], level: int) -> bytes:
        while len(items) > 1:
            items = [self._inner(level, chunk) for chunk in _chunk(items, level)]
            level += 1
        return items[0][1]

    def update(self, oid: bytes, edits: dict[bytes, Entry | None]) -> bytes:
        """Apply set (Entry) and delete (None) edits to a directory; return the new id."""
        if not edits:
            return oid
        root = self.node(oid)
        items = self._update(root, sorted(edits.items()))
        if not items:
            return EMPTY_TREE_ID
        new_id = self._build_up(items, root.level + 1) if len(items) > 1 else items[0][1]
        node = self.node(new_id)
        while node.level > 0 and len(node.children) == 1:
            new_id = node.children[0][1]
            node = self.node(new_id)
        return new_id

    def _update(self, node: TreeNode, edits: list[tuple[bytes, Entry | None]]) -> list[Item]:
        if node.level == 0:
            merged = {n: (e, links) for (n, e), links in zip(node.entries, node.item_links,
                                                                strict=True)}
            for name, e in edits:
                if e is None:
                    merged.pop(name, None)
                else:
                    merged[name] = (e, self._links(e))
            rows = [(n, e, links) for n, (e, links) in sorted(merged.items())]
            return [self._leaf(chunk) for chunk in _chunk(rows, 0)]
        firsts = [c[0] for c in node.children]
        groups: dict[int, list[tuple[bytes, Entry | None]]] = {}
        for name, e in edits:
            i = max(bisect.bisect_right(firsts, name) - 1, 0)
            groups.setdefault(i, []).append((name, e))
        children: list[Item] = []
        for i, (child, links) in enumerate(zip(node.children, node.item_links, strict=True)):
            if i in groups:
                children.extend(self._update(self.node(child[1]), groups[i]))
            else:
                children.append((*child, links))
        return [self._inner(node.level, kids) for kids in _chunk(children, node.level)]

    def apply(self, root: Entry, changes: Sequence[tuple[tuple[str, ...], Entry | None]],
              *, merge_time: Callable[[int, int], int] = max) -> Entry:
        """Apply path-level changes to a directory entry; return the new entry.

        A directory entry with `ref` None merges with what is there: an existing
        directory keeps its contents and takes the new attributes (mtime is the
        later of the two); anything else is replaced by an empty directory.
        """
        if root.kind != K_DIR or root.ref is None:
            raise InvalidInput("changes apply only to a directory")
        direct: dict[str, Entry | None] = {}
        deeper: dict[str, list[tuple[tuple[str, ...], Entry | None]]] = {}
        for parts, e in changes:
            if not parts:
                raise InvalidInput("empty path in change set")
            if len(parts) == 1:
                direct[parts[0]] = e
            else:
                deeper.setdefault(parts[0], []).append((parts[1:], e))
        edits: dict[bytes, Entry | None] = {}
        for name in direct.keys() | deeper.keys():
            bname = encode_name(name)
            cur = self.lookup(root.ref, bname)
            if name in direct:
                new = direct[name]
                if new is not None and new.kind == K_DIR and new.ref is None:
                    if cur is not None and cur.kind == K_DIR:
                        new = new.with_(ref=cur.ref,
                                        mtime_ns=merge_time(cur.mtime_ns, new.mtime_ns))
                    else:
                        new = new.with_(ref=EMPTY_TREE_ID)
            else:
                new = cur
            if name in deeper:
                if new is None or new.kind != K_DIR:
                    raise NotFound(f"parent directory {name!r} does not exist")
                new = self.apply(new, deeper[name], merge_time=merge_time)
            edits[bname] = new
        return root.with_(ref=self.update(root.ref, edits))

    # -- diff ----------------------------------------------------------------

    def diff(self, a: Entry | None, b: Entry | None, prefix: str = ""
             ) -> Iterator[tuple[str, Entry | None, Entry | None]]:
        """Leaf-level differences between two directories, in path order.

        Yields (path, old, new). Directories present on both sides are entered;
        a directory's own line appears when its attributes changed or when it
        was added or removed (its contents follow as added or removed).
        """
        a_ref = a.ref if a is not None and a.kind == K_DIR else None
        b_ref = b.ref if b is not None and b.kind == K_DIR else None
        if a_ref == b_ref:
            return
        a_items = self._unshared(a_ref, b_ref)
        b_items = self._unshared(b_ref, a_ref)
        names = sorted(a_items.keys() | b_items.keys())
        for name in names:
            ea, eb = a_items.get(name), b_items.get(name)
            if ea == eb:
                continue
            path = f"{prefix}/{decode_name(name)}" if prefix else decode_name(name)
            a_dir = ea is not None and ea.kind == K_DIR
            b_dir = eb is not None and eb.kind == K_DIR
            if a_dir and b_dir:
                assert ea is not None and eb is not None
                if ea.attrs() != eb.attrs() or ea.mtime_ns != eb.mtime_ns:
                    yield path, ea, eb
                yield from self.diff(ea, eb, path)
                continue
            if a_dir:
                yield from self.diff(ea, None, path)
                yield path, ea, (eb if eb is not None else None)
                continue
            yield path, ea, eb
            if b_dir:
                yield from self.diff(None, eb, path)

    def _unshared(self, oid: bytes | None, other: bytes | None) -> dict[bytes, Entry]:
        if oid is None:
            return {}
        mine = self.leaves(oid)
        theirs = set(self.leaves(other)) if other is not None else set()
        out: dict[bytes, Entry] = {}
        for leaf in mine:
            if leaf not in theirs:
                out.update(self.node(leaf).entries)
        return out


def encode_name(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


def decode_name(name: bytes) -> str:
    return name.decode("utf-8", "surrogateescape")


def change_kind(old: Entry | None, new: Entry | None) -> str:
    """What a line of `Trees.diff` did to its path: "added", "deleted" or "modified"."""
    return "added" if old is None else "deleted" if new is None else "modified"
