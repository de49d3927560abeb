"""Applying layer tarballs, which are untrusted input, to an in-memory image tree.

Each layer is read once, as a stream (tarfile's ``r|`` mode over our own
decompressor), and changes `ImageTree`, a model of directories and entries
that lives in memory; file contents go to the store through the
`ContentWriter` as they stream by, a block at a time, so a member costs one
block of memory whatever its size. Nothing is ever written to the local
filesystem, so no member can reach outside the image: the checks below are
about refusing hostile layers with a clear error, not about containment.

Rules (docs/images.md, "Layers"):

- A leading ``/`` or ``./`` is read as tar reads it, relative to the image
  root; empty and ``.`` components are dropped. A ``..`` component is
  refused, as is a parent path or a hard link whose symlinks climb above the
  root, a whiteout of ``.``/``..``, a path named twice in one layer, and a
  member type that is not a file, directory, symlink, hard link, device or
  fifo.
- Symlinks met in a parent path are followed inside the image (absolute
  targets from the image root), as umoci's SecureJoin does; a symlink whose
  own target climbs above the root is refused.
- ``.wh.NAME`` removes NAME from the layers below; ``.wh..wh..opq`` empties
  its directory of what the layers below put there.
- A hard link names the same file node as its target (strata keeps hard
  links of regular files; one to a symlink or special file becomes a copy).
- `Limits`: the bytes members declare (a sparse member's full size, before
  any is read), the decompressed bytes, and the number of members, each
  against a budget fixed before the first layer, so a tar bomb stops early.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from strata.engine.errors import InvalidInput
from strata.engine.names import MAX_NAME, MAX_PATH
from strata.engine.objects import (
    INLINE_MAX,
    K_BLK,
    K_CHR,
    K_DIR,
    K_FIFO,
    K_FILE,
    K_SYMLINK,
    TREE,
    Entry,
    link_group,
)
from strata.engine.tree import NodeCache, Trees, encode_name
from strata.engine.txn import ContentWriter, FileBuilder

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_HEADER = 1 << 20       # a PAX or GNU long-name header larger than this is refused
MAX_SYMLINK_HOPS = 40      # as Linux's ELOOP
MAX_DEPTH = 512            # deeper paths are refused (the tree is built recursively)
PIECE = 1 << 20            # a file member is read and cut in pieces of this size
GiB = 1 << 30


class LayerRefused(InvalidInput):
    """A layer (or the image around it) is hostile or malformed; nothing was published."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one image import may expand to (docs/images.md, "Tar bombs").

    The byte budget is ``min(max_bytes, max(floor_bytes, max_ratio *
    compressed))``, where `compressed` is the size of the layer blobs as
    stored: real layers expand 2-10x, a zero-filled or sparse bomb by
    thousands. Declared member sizes and decompressed stream bytes are each
    held to it; `max_entries` bounds the members of all layers together.
    """

    max_bytes: int = 64 * GiB
    floor_bytes: int = 1 * GiB
    max_ratio: int = 100
    max_entries: int = 1_000_000

    def budget(self, compressed: int) -> int:
        return min(self.max_bytes, max(self.floor_bytes, self.max_ratio * compressed))


class Budget:
    """The running totals of one import against its `Limits`."""

    def __init__(self, limits: Limits, compressed: int) -> None:
        self.bytes_allowed = limits.budget(compressed)
        self.entries_allowed = limits.max_entries
        self.declared = 0
        self.stream = 0
        self.entries = 0

    def declare(self, size: int, name: str) -> None:
        self.declared += max(size, 0)
        if self.declared > self.bytes_allowed:
            raise LayerRefused(
                f"refusing the image: its members declare more than {self.bytes_allowed} bytes "
                f"(at {name!r}, {size} bytes); a tar bomb? (raise --max-bytes/--max-ratio "
                f"if the image is real)")

    def entry(self) -> None:
        self.entries += 1
        if self.entries > self.entries_allowed:
            raise LayerRefused(f"refusing the image: more than {self.entries_allowed} "
                               f"entries (raise --max-entries if the image is real)")

    def read(self, n: int) -> None:
        self.stream += n
        if self.stream > self.bytes_allowed:
            raise LayerRefused(f"refusing the image: its layers decompress to more than "
                               f"{self.bytes_allowed} bytes; a tar bomb? (raise --max-bytes/"
                               f"--max-ratio if the image is real)")


class CountingReader:
    """A decompressed layer stream: counted against the budget, hashed for the diff id."""

    def __init__(self, inner: IO[bytes], budget: Budget, label: str = "the layer") -> None:
        self.inner = inner
        self.budget = budget
        self.label = label
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        try:
            data = self.inner.read(n if n is not None and n >= 0 else 1 << 20)
        except InvalidInput:
            raise
        except Exception as exc:  # zlib.error, ZstdError, BadGzipFile, EOFError: bad input
            raise LayerRefused(f"refusing {self.label}: it does not decompress "
                               f"({type(exc).__name__}: {exc})") from exc
        if data:
            self.budget.read(len(data))
            self.sha.update(data)
        return data

    def drain(self) -> None:
        """Read to the end (what follows tar's end marker still counts for the diff id)."""
        while self.read(1 << 20):
            pass


class _SafeTarInfo(tarfile.TarInfo):
    """tarfile reads a PAX or long-name header whole into memory: cap it first."""

    def _proc_member(self, archive: Any) -> Any:  # noqa: ANN401 - tarfile's own signature
        if self.type in _EXTENDED and self.size > MAX_HEADER:
            raise LayerRefused(f"refusing the layer: a {self.size}-byte extended header")
        return super()._proc_member(archive)  # type: ignore[misc]


_EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
             tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


class Node:
    """One entry of the image tree; a directory's children are Nodes too.

    Hard links are one Node under several names.
    """

    __slots__ = ("children", "entry")

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.children: dict[str, Node] | None = {} if entry.kind == K_DIR else None


def _parts(name: str, what: str) -> list[str]:
    """A member name as components below the image root, as tar reads it."""
    if "\0" in name:
        raise LayerRefused(f"refusing the layer: {what} {name!r} contains NUL")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise LayerRefused(f"refusing the layer: {what} {name!r} contains '..'")
    if len(parts) > MAX_DEPTH or len(encode_name("/".join(parts))) > MAX_PATH or any(
            len(encode_name(p)) > MAX_NAME for p in parts):
        raise LayerRefused(f"refusing the layer: {what} {name[:200]!r}... is too long")
    return parts


def _mtime_ns(ti: tarfile.TarInfo) -> int:
    """The member's mtime in nanoseconds, exact when a PAX header gives decimals."""
    raw = ti.pax_headers.get("mtime")
    if raw:
        whole, _, frac = raw.partition(".")
        try:
            sign = -1 if whole.startswith("-") else 1
            ns = abs(int(whole)) * 10**9 + int((frac + "000000000")[:9] or 0)
            return sign * ns
        except ValueError:
            pass
    return int(ti.mtime) * 10**9


def _xattrs(ti: tarfile.TarInfo) -> tuple[tuple[bytes, bytes], ...]:
    out: dict[bytes, bytes] = {}
    for key, value in ti.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            out[encode_name(key[13:])] = value.encode("utf-8", "surrogateescape")
        elif key.startswith("LIBARCHIVE.xattr."):
            try:
                out[encode_name(key[17:])] = base64.b64decode(value + "=" * (-len(value) % 4))
            except ValueError as exc:
                raise LayerRefused(f"refusing the layer: bad xattr {key!r} on "
                                   f"{ti.name!r}") from exc
    for name in out:
        if not name or len(name) > 255 or b"\0" in name:
            raise LayerRefused(f"refusing the layer: bad xattr name on {ti.name!r}")
    return tuple(sorted(out.items()))


_KINDS = {tarfile.REGTYPE: K_FILE, tarfile.AREGTYPE: K_FILE, tarfile.CONTTYPE: K_FILE,
          tarfile.GNUTYPE_SPARSE: K_FILE, tarfile.DIRTYPE: K_DIR, tarfile.SYMTYPE: K_SYMLINK,
          tarfile.CHRTYPE: K_CHR, tarfile.BLKTYPE: K_BLK, tarfile.FIFOTYPE: K_FIFO}


class ImageTree:
    """The image's tree as layers build it, in memory (metadata only; content is stored)."""

    def __init__(self, cw: ContentWriter) -> None:
        self.cw = cw
        self.root = Node(Entry(kind=K_DIR, mode=0o755))
        # Per layer: which (directory, name) slots this layer filled, for opaque
        # directories and whiteouts (both act on the layers below only).
        self._added: set[tuple[Node, str]] = set()  # the Node held: an id could be reused
        self._seen: set[str] = set()
        self._depth = 0  # of the directory `_dir` found last

    # -- paths -----------------------------------------------------------------

    def _dir(self, parts: list[str], *, create: bool, what: str) -> Node | None:
        """The directory at `parts`, following symlinks inside the image."""
        stack = [self.root]
        todo = list(reversed(parts))
        hops = 0
        while todo:
            c = todo.pop()
            if c in ("", "."):
                continue
            if c == "..":
                if len(stack) == 1:
                    raise LayerRefused(f"refusing the layer: {what} climbs out of the image "
                                       f"through a symlink")
                stack.pop()
                continue
            if len(stack) > MAX_DEPTH:
                raise LayerRefused(f"refusing the layer: {what} is too deep")
            cur = stack[-1]
            assert cur.children is not None
            child = cur.children.get(c)
            if child is None:
                if not create:
                    return None
                # tar makes a missing parent; umoci does too (root's, 0755).
                child = cur.children[c] = Node(Entry(kind=K_DIR, mode=0o755))
            elif child.entry.kind == K_SYMLINK:
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise LayerRefused(f"refusing the layer: too many symlinks in {what}")
                target = (child.entry.data or b"").decode("utf-8", "surrogateescape")
                if target.startswith("/"):
                    stack = [self.root]
                todo.extend(reversed(target.split("/")))
                continue
            elif child.entry.kind != K_DIR:
                raise LayerRefused(f"refusing the layer: a parent of {what} is not a directory")
            stack.append(child)
        self._depth = len(stack) - 1  # where the path really is, symlinks followed
        return stack[-1]

    # -- one layer ---------------------------------------------------------------

    def apply(self, stream: IO[bytes], budget: Budget, label: str) -> None:
        """Apply one (decompressed) layer tar, read as a stream."""
        self._added = set()
        self._seen = set()
        try:
            tf = tarfile.open(fileobj=stream, mode="r|", tarinfo=_SafeTarInfo,  # noqa: SIM115
                              encoding="utf-8", errors="surrogateescape")
        except tarfile.TarError as exc:
            raise LayerRefused(f"refusing {label}: not a tar archive ({exc})") from exc
        try:
            while True:
                try:
                    ti = tf.next()
                except tarfile.TarError as exc:
                    raise LayerRefused(f"refusing {label}: a malformed tar header ({exc})"
                                       ) from exc
                if ti is None:
                    break
                tf.members.clear()  # type: ignore[attr-defined]  # stream mode keeps every member otherwise
                budget.entry()
                self._member(tf, ti, budget)
        except tarfile.TarError as exc:
            raise LayerRefused(f"refusing {label}: {exc}") from exc
        except EOFError as exc:
            raise LayerRefused(f"refusing {label}: the archive ends early ({exc})") from exc

    def _member(self, tf: tarfile.TarFile, ti: tarfile.TarInfo, budget: Budget) -> None:
        parts = _parts(ti.name, "member")
        key = "/".join(parts)
        if key in self._seen:
            raise LayerRefused(f"refusing the layer: {ti.name!r} appears twice in one layer")
        self._seen.add(key)
        if not parts:  # the root itself ("./")
            if not ti.isdir():
                raise LayerRefused("refusing the layer: the image root must be a directory")
            self.root.entry = self._meta(ti, K_DIR)
            return
        base = parts[-1]
        if base.startswith(WHITEOUT):
            self._whiteout(parts, ti)
            return
        parent = self._dir(parts[:-1], create=True, what=repr(ti.name))
        assert parent is not None and parent.children is not None
        slot = (parent, base)
        old = parent.children.get(base)
        if ti.islnk():
            node = self._hardlink(ti)
        else:
            kind = _KINDS.get(ti.type)
            if kind is None:
                raise LayerRefused(f"refusing the layer: {ti.name!r} has member type "
                                   f"{ti.type!r}, which an image cannot hold")
            if kind == K_DIR and old is not None and old.entry.kind == K_DIR:
                old.entry = self._meta(ti, K_DIR)  # metadata only: the contents stay
                self._added.add(slot)
                return
            node = Node(self._entry(tf, ti, kind, self._depth, budget))
        parent.children[base] = node
        self._added.add(slot)

    def _whiteout(self, parts: list[str], ti: tarfile.TarInfo) -> None:
        parent = self._dir(parts[:-1], create=False, what=repr(ti.name))
        if parent is None:
            return  # nothing below to hide
        assert parent.children is not None
        base = parts[-1]
        if base == OPAQUE:
            for name in list(parent.children):
                if (parent, name) not in self._added:
                    del parent.children[name]
            return
        name = base[len(WHITEOUT):]
        if name in ("", ".", "..") or name.startswith(".wh."):
            raise LayerRefused(f"refusing the layer: a whiteout of {name!r} ({ti.name!r})")
        if (parent, name) not in self._added:  # a whiteout hides lower layers only
            parent.children.pop(name, None)

    def _hardlink(self, ti: tarfile.TarInfo) -> Node:
        parts = _parts(ti.linkname, "hard link target")
        if not parts:
            raise LayerRefused(f"refusing the layer: hard link {ti.name!r} to the image root")
        parent = self._dir(parts[:-1], create=False, what=f"hard link {ti.name!r}")
        target = parent.children.get(parts[-1]) if parent and parent.children else None
        if target is None:
            raise LayerRefused(f"refusing the layer: hard link {ti.name!r} names "
                               f"{ti.linkname!r}, which the image does not hold")
        if target.entry.kind == K_DIR:
            raise LayerRefused(f"refusing the layer: hard link {ti.name!r} to a directory")
        if target.entry.kind != K_FILE:
            return Node(target.entry)  # only regular files are linked in a snapshot
        return target

    def _meta(self, ti: tarfile.TarInfo, kind: int) -> Entry:
        return Entry(kind=kind, mode=ti.mode & 0o7777, uid=ti.uid, gid=ti.gid,
                     mtime_ns=_mtime_ns(ti), xattrs=_xattrs(ti))

    def _entry(self, tf: tarfile.TarFile, ti: tarfile.TarInfo, kind: int, depth: int,
               budget: Budget) -> Entry:
        """A new entry; `depth` is where its directory really is (symlinks followed)."""
        meta = self._meta(ti, kind)
        if kind == K_SYMLINK:
            target = ti.linkname
            if not target or "\0" in target or len(encode_name(target)) > MAX_PATH:
                raise LayerRefused(f"refusing the layer: symlink {ti.name!r} has a bad target")
            # Relative targets start where the link really sits (its directory's
            # depth with symlinks followed), absolute ones at the image root.
            if target.startswith("/"):
                depth = 0
            for c in target.split("/"):
                if c == "..":
                    depth -= 1
                    if depth < 0:
                        raise LayerRefused(f"refusing the layer: symlink {ti.name!r} -> "
                                           f"{target!r} climbs out of the image")
                elif c not in ("", "."):
                    depth += 1
            data = encode_name(target)
            return meta.with_(mode=0o777, size=len(data), data=data)
        if kind in (K_CHR, K_BLK):
            return meta.with_(rdev=os.makedev(ti.devmajor, ti.devminor))
        if kind != K_FILE:
            return meta
        budget.declare(ti.size, ti.name)
        f = tf.extractfile(ti)
        if f is None:
            raise LayerRefused(f"refusing the layer: no content for {ti.name!r}")
        return self._content(f, ti.size, meta, ti.name)

    def _content(self, f: IO[bytes], size: int, meta: Entry, name: str) -> Entry:
        cw = self.cw
        if size <= INLINE_MAX:
            data = f.read(size)
            if len(data) != size:
                raise LayerRefused(f"refusing the layer: {name!r} ends early")
            return cw.file_entry(data, meta)
        builder = FileBuilder(cw)  # cut by content, so image versions share chunks
        left = size
        while left:
            data = f.read(min(PIECE, left))
            if not data:
                raise LayerRefused(f"refusing the layer: {name!r} ends early")
            builder.write(data)
            left -= len(data)
        return builder.entry(meta)

    # -- the result ----------------------------------------------------------------

    def top_entries(self, progress: Callable[[int], None] | None = None
                    ) -> tuple[Entry, dict[str, Entry]]:
        """The root's entry and its children, each directory's tree stored via the writer.

        Hard-linked files get one link group each (numbered from their
        first path, so a re-import agrees) and their link count.
        """
        counts: dict[int, int] = {}
        first: dict[int, str] = {}
        self._count(self.root, "", counts, first)
        groups = {nid: (link_group(b"image\0" + encode_name(first[nid])), n)
                  for nid, n in counts.items() if n > 1}
        trees = Trees(self.cw, NodeCache(1024))
        top = {name: self._built(child, trees, groups)
               for name, child in self._children(self.root)}
        for raw in trees.new.values():
            self.cw.add(TREE, raw)
        trees.new.clear()
        return self.root.entry, top

    def _children(self, node: Node) -> list[tuple[str, Node]]:
        assert node.children is not None
        return sorted(node.children.items(), key=lambda kv: encode_name(kv[0]))

    def _count(self, node: Node, path: str, counts: dict[int, int], first: dict[int, str]
               ) -> None:
        stack = [(node, path)]
        while stack:
            n, p = stack.pop()
            for name, child in self._children(n):
                cp = f"{p}/{name}" if p else name
                if child.entry.kind == K_DIR:
                    stack.append((child, cp))
                elif child.entry.kind == K_FILE:
                    k = id(child)
                    counts[k] = counts.get(k, 0) + 1
                    if k not in first or cp < first[k]:
                        first[k] = cp

    def _built(self, node: Node, trees: Trees, groups: dict[int, tuple[int, int]]) -> Entry:
        if node.entry.kind == K_FILE:
            g = groups.get(id(node))
            return node.entry.with_(ino=g[0], nlink=g[1]) if g else node.entry
        if node.entry.kind != K_DIR:
            return node.entry
        items = [(encode_name(name), self._built(child, trees, groups))
                 for name, child in self._children(node)]
        ref = trees.build(items)
        if len(trees.new) > 4096:  # hand finished nodes to the writer as we go
            for raw in trees.new.values():
                self.cw.add(TREE, raw)
            trees.new.clear()
        return node.entry.with_(ref=ref, size=0, data=None)
