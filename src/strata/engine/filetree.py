"""File content as chunks cut by content, and the tree of file nodes that lists them.

This module owns the chunker's parameters (FastCDC, docs/format.md "File
node (kind 2)") and the shape of a version 2 file node tree: how a list of
chunks becomes nodes, and how a change to a byte range rewrites only the
nodes on the path from the touched leaf to the root. It stores nothing
itself: callers hand it `put` (store one object, return its id) and `get`
(fetch one by id), so it works the same over a local store, a remote one or
a writer's pending batch.

Why content-defined: two files that share a run of bytes (consecutive image
versions, a file with bytes inserted near its front) share the chunks of
that run, where fixed-size blocks would all shift and share nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import pyfastcdc

from strata.engine.objects import FILE_FANOUT_MAX, FILENODE, ZERO_ID, FileNode, object_id

# FastCDC 2020 (normalized chunking level 1, the reference gear table). These
# decide where chunks end, not how they are read: changing them costs dedup
# against content cut before, never correctness. Measured on random data the
# mean chunk is ~78 KiB (FastCDC's cut-point skipping adds part of the minimum
# to the nominal average).
CDC_MIN = 16 * 1024
CDC_AVG = 64 * 1024
CDC_MAX = 256 * 1024

# A node ends after an entry whose id has its low 7 bits clear (1 in 128), or
# at FILE_FANOUT_MAX entries: nodes hold ~128 entries (~5.5 KiB) on average,
# and the same chunks always give the same nodes, whatever wrote them.
NODE_MASK = 127

Entries = list[tuple[int, bytes]]
Put = Callable[[int, bytes], bytes]   # (object kind, raw bytes) -> id
Get = Callable[[bytes], bytes]        # id -> raw bytes

_local = threading.local()


def _chunker() -> pyfastcdc.FastCDC:
    c = getattr(_local, "cdc", None)
    if c is None:  # one per thread: the chunker object is documented as not thread-safe
        c = _local.cdc = pyfastcdc.FastCDC(CDC_AVG, min_size=CDC_MIN, max_size=CDC_MAX)
    return c


def cut(data: bytes | bytearray) -> Iterator[tuple[int, int]]:
    """(offset, length) of each chunk of `data`, in order.

    A run of at least ZERO_RUN zero bytes is one piece of its own (it becomes
    a hole); the bytes between such runs are cut by FastCDC. Without this a
    zero run shorter than two chunks (a database's free pages, padding) would
    be stored inside the chunks around it.
    """
    pos, n = 0, len(data)
    view = memoryview(data)
    while pos < n:
        run = _zero_run(data, pos)
        stop = run[0] if run is not None else n
        if stop > pos:
            for ch in _chunker().cut_buf(view[pos:stop]):
                yield pos + ch.offset, ch.length
        if run is None:
            return
        yield run[0], run[1] - run[0]
        pos = run[1]


ZERO_RUN = 64 * 1024      # zeros at least this long are a hole, whatever the chunks say
_PROBE = bytes(4096)
_ZEROS = bytes(ZERO_RUN)


def _zero_run(data: bytes | bytearray, pos: int) -> tuple[int, int] | None:
    """[start, end) of the first run of >= ZERO_RUN zero bytes at or after `pos`.

    Found with bytes.find of a 4 KiB zero probe (C speed; random or text data
    never holds one), then widened to the run's edges.
    """
    n = len(data)
    while True:
        i = data.find(_PROBE, pos)
        if i < 0:
            return None
        start = i
        while start > pos and data[start - 1] == 0:
            start -= 1
        end = i + len(_PROBE)
        while end + ZERO_RUN <= n and data[end:end + ZERO_RUN] == _ZEROS:
            end += ZERO_RUN
        while end + len(_PROBE) <= n and data[end:end + len(_PROBE)] == _PROBE:
            end += len(_PROBE)
        while end < n and data[end] == 0:
            end += 1
        if end - start >= ZERO_RUN:
            return start, end
        pos = end


class Chunker:
    """Cuts a stream fed in pieces of any size into the chunks of the whole.

    The last chunk of what was fed so far may have ended only because the
    bytes did; it is kept and cut again with what comes next. A cut FastCDC
    finds before the end of its buffer depends only on the bytes since the
    chunk's start, so the chunks are those of the whole stream in one buffer.
    """

    def __init__(self) -> None:
        self._carry = b""

    @property
    def pending(self) -> int:
        """Bytes fed and not yet returned as chunks."""
        return len(self._carry)

    def feed(self, data: bytes) -> list[bytes]:
        """The chunks that `data` completes (possibly none)."""
        buf = self._carry + data if self._carry else data
        cuts = list(cut(buf))
        if not cuts:
            return []
        last = cuts.pop()
        if last[1] > ZERO_RUN and is_zero(buf[last[0]:last[0] + last[1]]):
            # A zero run at the end: all but ZERO_RUN of it is a hole whatever
            # follows (the holes merge), and the carry stays small however long it is.
            cuts.append((last[0], last[1] - ZERO_RUN))
        done = cuts[-1][0] + cuts[-1][1] if cuts else 0
        self._carry = buf[done:]
        return [buf[o:o + n] for o, n in cuts]

    def finish(self) -> list[bytes]:
        """The chunks of what is left (the stream ended)."""
        buf, self._carry = self._carry, b""
        return [buf[o:o + n] for o, n in cut(buf)]


def chunk_entries(data: bytes | bytearray, put_block: Callable[[bytes], bytes]
                  ) -> Entries:
    """Chunk `data` and store each chunk; all-zero chunks become holes (ZERO_ID), merged."""
    out: Entries = []
    view = memoryview(data)
    for off, n in cut(data):
        piece = bytes(view[off:off + n])
        oid = ZERO_ID if is_zero(piece) else put_block(piece)
        append_entry(out, n, oid)
    return out


def is_zero(data: bytes) -> bool:
    """Whether `data` is all zero bytes (a memcmp, not a loop over bytes in Python)."""
    return not data or (data[0] == 0 and data == bytes(len(data)))


def append_entry(out: Entries, n: int, oid: bytes) -> None:
    """Append (n, oid) to a level 0 list, merging a hole into a hole before it."""
    if oid == ZERO_ID and out and out[-1][1] == ZERO_ID:
        out[-1] = (out[-1][0] + n, ZERO_ID)
    elif n:
        out.append((n, oid))


def is_boundary(oid: bytes) -> bool:
    """Whether a node ends after this entry (holes never end one)."""
    return oid != ZERO_ID and oid[0] & NODE_MASK == 0


class TreeBuilder:
    """Builds a file's node tree from its entries in order, keeping one open node a level.

    Memory is one open node per level, so a 100 GiB file never holds its
    1.5 million chunk entries at once.
    """

    def __init__(self, put: Put) -> None:
        self.put = put
        self.levels: list[Entries] = [[]]
        self._last: dict[int, tuple[bytes, FileNode]] = {}  # level -> last node emitted

    def add(self, n: int, oid: bytes) -> None:
        self._add(0, n, oid)

    def extend(self, entries: Iterable[tuple[int, bytes]]) -> None:
        for n, oid in entries:
            self._add(0, n, oid)

    def _add(self, level: int, n: int, oid: bytes) -> None:
        cur = self.levels[level]
        if level == 0:
            append_entry(cur, n, oid)
        else:
            cur.append((n, oid))
        if len(cur) >= FILE_FANOUT_MAX or is_boundary(oid):
            self._emit(level)

    def _emit(self, level: int) -> None:
        cur = self.levels[level]
        node = FileNode(sum(n for n, _ in cur), level, tuple(cur))
        oid = self.put(FILENODE, node.encode())
        self._last[level] = (oid, node)
        self.levels[level] = []
        if len(self.levels) == level + 1:
            self.levels.append([])
        self._add(level + 1, node.size, oid)

    def finish(self) -> tuple[FileNode, bytes]:
        """The root node and its id (stored through `put`)."""
        level = 0
        while True:
            cur = self.levels[level]
            if not any(self.levels[level + 1:]):
                if level and len(cur) == 1:  # one child: it is the root
                    oid, node = self._last[level - 1]
                    return node, oid
                node = FileNode(sum(n for n, _ in cur), level, tuple(cur))
                return node, self.put(FILENODE, node.encode())
            if cur:
                self._emit(level)
            level += 1


def build(entries: Iterable[tuple[int, bytes]], put: Put) -> tuple[FileNode, bytes]:
    """The root of the tree listing `entries` (level 0), stored through `put`."""
    b = TreeBuilder(put)
    b.extend(entries)
    return b.finish()


def as_tree(node: FileNode, put: Put) -> tuple[FileNode, bytes]:
    """A version 2 root for any node: a version 1 node's blocks become its chunks, unread."""
    if node.version == 2:
        raw = node.encode()
        return node, object_id(FILENODE, raw)
    entries: Entries = []
    for n, oid in node.entries:
        append_entry(entries, n, oid)
    return build(entries, put)


class _Edit:
    """One replacement of a byte range: remembers the nodes it made, to collapse the root."""

    def __init__(self, get: Get, put: Put) -> None:
        self.get = get
        self.put = put
        self.made: dict[bytes, FileNode] = {}

    def node(self, oid: bytes) -> FileNode:
        hit = self.made.get(oid)
        return hit if hit is not None else FileNode.decode(self.get(oid))

    def cut(self, level: int, entries: Sequence[tuple[int, bytes]]) -> Entries:
        """Store `entries` as nodes of `level`, cut by the boundary rule; their (size, id)."""
        out: Entries = []
        cur: Entries = []
        for n, oid in entries:
            cur.append((n, oid))
            if len(cur) >= FILE_FANOUT_MAX or is_boundary(oid):
                out.append(self._store(level, cur))
                cur = []
        if cur:
            out.append(self._store(level, cur))
        return out

    def _store(self, level: int, entries: Entries) -> tuple[int, bytes]:
        node = FileNode(sum(n for n, _ in entries), level, tuple(entries))
        oid = self.put(FILENODE, node.encode())
        self.made[oid] = node
        return node.size, oid

    def replace(self, node: FileNode, base: int, a: int, b: int, new: Entries) -> Entries:
        """This node's part of the file with [a, b) replaced by `new`: nodes of its level."""
        last = len(node.entries) - 1
        out: Entries = []
        placed = False
        pos = base
        for i, (n, oid) in enumerate(node.entries):
            s, e = pos, pos + n
            pos = e
            # The entry `new` goes into: the first one overlapping [a, b), or for an
            # insertion (a == b) the one holding a, or the last one when a is the end.
            target = not placed and (s < b and e > a if a < b else
                                     s <= a < e or (i == last and a == e))
            touched = s < b and e > a
            if not target and not touched:
                out.append((n, oid))
                continue
            if node.level == 0 and a == b and oid != ZERO_ID and a in (s, e):
                # An insertion at a chunk's edge (growing a file at its end).
                out.extend([*new, (n, oid)] if a == s else [(n, oid), *new])
                placed = True
                continue
            if node.level == 0:
                if (s < a or e > b) and oid != ZERO_ID:
                    raise ValueError("a file range replaced must start and end on chunk "
                                     "boundaries or inside holes")
                if s < a:
                    out.append((a - s, ZERO_ID))
                if target:
                    out.extend(new)
                    placed = True
                if e > b:
                    out.append((e - b, ZERO_ID))
                continue
            if not target and a <= s and e <= b:
                continue  # wholly inside the range: dropped unread
            child = node.child(i, self.get(oid)) if oid not in self.made else self.made[oid]
            out.extend(self.replace(child, s, a, b, new if target else []))
            placed = placed or target
        if node.level == 0:
            merged: Entries = []
            for n, oid in out:
                append_entry(merged, n, oid)
            out = merged
        if not out:
            return []
        return self.cut(node.level, out)


def replace_range(root: FileNode, a: int, b: int, new: Entries, get: Get, put: Put
                  ) -> tuple[FileNode, bytes]:
    """The tree of a version 2 file with bytes [a, b) replaced by the chunks `new`.

    `a` and `b` must fall on chunk boundaries or inside holes (a hole cut by
    them keeps its outer parts). Only the nodes on the paths from the touched
    leaves to the root are read and rewritten; nodes wholly inside the range
    are dropped without being read. The new root's id is returned with it.
    """
    if not 0 <= a <= b <= root.size:
        raise ValueError(f"range [{a}, {b}) is outside a file of {root.size} bytes")
    edit = _Edit(get, put)
    if not root.entries:
        parts = edit.cut(0, new) if new else []
    else:
        parts = edit.replace(root, 0, a, b, list(new))
    level = root.level
    while len(parts) > 1:
        level += 1
        parts = edit.cut(level, parts)
    if not parts:
        node = FileNode(0, 0, ())
        return node, put(FILENODE, node.encode())
    oid = parts[0][1]
    node = edit.node(oid)
    while node.level and len(node.entries) == 1:  # a root with one child: the child is root
        oid = node.entries[0][1]
        node = edit.node(oid)
    return node, oid
