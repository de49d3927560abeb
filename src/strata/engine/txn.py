"""Transactions: stage changes against a pinned snapshot, then publish them.

A `Transaction` pins a branch's head, lets the caller read and change files
as if the snapshot were a private copy, and on `commit` sends the change set
to the store, which replays it onto a moved head or reports a conflict. It
works against any `Store` (in-process or remote): content is cut into blocks
here (docs/format.md, File node) and only objects the store lacks are uploaded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from strata.engine import filetree
from strata.engine.errors import AlreadyExists, InvalidInput, NotFound
from strata.engine.interface import ChangeSet, Store
from strata.engine.names import check_branch, check_volume, split_path
from strata.engine.objects import (
    BLOCK,
    EMPTY_TREE_ID,
    INLINE_MAX,
    K_DIR,
    K_FILE,
    K_SYMLINK,
    ZERO_ID,
    Entry,
    FileNode,
    fit_block,
    link_group,
    object_id,
)
from strata.engine.tree import NodeCache, Trees, decode_name, encode_name

FLUSH_BYTES = 8 * 1024 * 1024
INLINE_PUBLISH_BYTES = 4 * 1024 * 1024  # pending objects up to this size ride with the publish


class ContentWriter:
    """Cuts file content into chunks and file nodes, uploading in batches.

    Objects wait in `pending` until `flush`, which asks the store which ones it
    lacks and uploads only those. Reads see pending objects too.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.block_size = store.block_size
        self.pending: dict[bytes, tuple[int, bytes]] = {}
        self._pending_bytes = 0

    def get_object(self, oid: bytes) -> bytes:
        hit = self.pending.get(oid)
        if hit is not None:
            return hit[1]
        return self.store.get_object(oid)

    def add(self, kind: int, raw: bytes) -> bytes:
        oid = object_id(kind, raw)
        if oid not in self.pending:
            self.pending[oid] = (kind, raw)
            self._pending_bytes += len(raw)
            if self._pending_bytes >= FLUSH_BYTES:
                self.flush()
        return oid

    def flush(self) -> None:
        if not self.pending:
            return
        ids = list(self.pending)
        lacking = set(self.store.missing(ids))
        objs = [self.pending[i] for i in ids if i in lacking]
        for start in range(0, len(objs), 256):
            self.store.put_objects(objs[start:start + 256])
        self.pending.clear()
        self._pending_bytes = 0

    def take(self, limit: int = INLINE_PUBLISH_BYTES) -> list[tuple[int, bytes]]:
        """Hand over pending objects to send with the publish, or upload them if large."""
        if self._pending_bytes > limit:
            self.flush()
            return []
        objs = list(self.pending.values())
        self.pending.clear()
        self._pending_bytes = 0
        return objs

    def block(self, data: bytes) -> bytes:
        if filetree.is_zero(data):
            return ZERO_ID
        return self.add(BLOCK, data)

    def file_entry(self, data: bytes, base: Entry) -> Entry:
        """An entry holding `data`, with the metadata of `base`: cut into chunks by content."""
        if len(data) <= INLINE_MAX:
            return base.with_(kind=K_FILE, size=len(data), data=data, ref=None)
        _node, ref = filetree.build(filetree.chunk_entries(data, self.block), self.add)
        return base.with_(kind=K_FILE, size=len(data), ref=ref, data=None)

    def builder(self) -> FileBuilder:
        """A file fed in pieces of any size (a tar member, a stream), cut as it comes."""
        return FileBuilder(self)

    def node_entry(self, blocks: Sequence[bytes], size: int, base: Entry) -> Entry:
        """An entry over blocks cut at every `block_size` bytes (ids from `block`).

        Kept for writers that cut fixed-size blocks themselves; their files
        share nothing once bytes shift. `builder()` cuts by content.
        """
        bs = self.block_size
        root, ref = filetree.build(
            ((min(bs, size - i * bs), oid) for i, oid in enumerate(blocks)), self.add)
        return self.tree_entry(root, ref, base)

    def tree_entry(self, root: FileNode, ref: bytes, base: Entry) -> Entry:
        """An entry for a file whose root node is `root`; small files go inline."""
        if root.size <= INLINE_MAX:
            data = root.read(0, root.size, self.get_object)
            return base.with_(kind=K_FILE, size=root.size, data=data, ref=None)
        return base.with_(kind=K_FILE, size=root.size, ref=ref, data=None)

    def tree_of(self, e: Entry) -> tuple[FileNode, bytes]:
        """A file's version 2 root node and its id.

        Inline content is chunked; a version 1 node's blocks become chunks
        without being read.
        """
        if e.ref is None:
            return filetree.build(filetree.chunk_entries(e.data or b"", self.block), self.add)
        node = FileNode.decode(self.get_object(e.ref))
        if node.version == 2:
            return node, e.ref
        return filetree.as_tree(node, self.add)

    def read_block(self, oid: bytes, length: int) -> bytes:
        if oid == ZERO_ID:
            return bytes(length)
        return fit_block(self.get_object(oid), length)

    def read(self, e: Entry, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of a file entry; only the nodes and chunks covering the range are fetched."""
        if e.kind != K_FILE:
            raise InvalidInput("not a regular file")
        end = e.size if length is None else min(e.size, offset + length)
        if offset >= end:
            return b""
        if e.ref is None:
            return (e.data or b"")[offset:end]
        fetched: dict[bytes, bytes] = {}
        if e.ref in self.pending:
            node = FileNode.decode(self.get_object(e.ref))
        else:  # the nodes and chunks in one round trip from a remote store
            node, fetched = self.store.get_file(e.ref, offset, end)

        def fetch(oid: bytes) -> bytes:
            return fetched[oid] if oid in fetched else self.get_object(oid)

        wanted = [b for b in node.block_ids(offset, end, fetch)
                  if b not in self.pending and b not in fetched]
        if len(wanted) > 1:
            fetched.update(zip(wanted, self.store.get_objects(wanted), strict=True))
        return node.read(offset, end, fetch)

    def splice(self, e: Entry, offset: int, data: bytes | None, new_size: int | None = None
               ) -> Entry:
        """Write `data` at `offset` (and/or resize), rewriting only what the change touches.

        The chunks the write overlaps are re-cut by content from the start
        of the first to the end of the last (inside a hole only the written
        bytes are), and the nodes from those leaves to the root are
        rewritten: a 4 KiB write into a 100 GiB file stores a few KiB.
        """
        root, ref = self.tree_of(e)
        get = self.get_object
        size = root.size
        if new_size is None:  # an empty write never changes the size, even past the end
            new_size = max(size, offset + len(data)) if data else size
        if data:
            end = offset + len(data)
            if end > size:  # grow with a hole first, then write into it
                root, ref = filetree.replace_range(root, size, size, [(end - size, ZERO_ID)],
                                                   get, self.add)
                size = end
            spans = list(root.spans(offset, end, get))
            lo = spans[0][0] if spans[0][2] != ZERO_ID else offset
            if offset and spans[0][2] == ZERO_ID and spans[0][0] == offset:
                # Written right after a chunk (an append): cut that chunk again with the
                # new bytes, so appends make the chunks of the whole written at once.
                prev = next(root.spans(offset - 1, offset, get))
                if prev[2] != ZERO_ID:
                    spans.insert(0, prev)
                    lo = prev[0]
            last = spans[-1]
            hi = last[0] + last[1] if last[2] != ZERO_ID else end
            buf = bytearray(hi - lo)
            for start, n, oid in spans:
                if oid != ZERO_ID:
                    buf[start - lo:start - lo + n] = self.read_block(oid, n)
            buf[offset - lo:end - lo] = data
            root, ref = filetree.replace_range(
                root, lo, hi, filetree.chunk_entries(buf, self.block), get, self.add)
        if new_size > size:
            root, ref = filetree.replace_range(root, size, size, [(new_size - size, ZERO_ID)],
                                               get, self.add)
        elif new_size < size:
            start, n, oid = next(root.spans(new_size, new_size + 1, get))
            if oid == ZERO_ID or start == new_size:
                root, ref = filetree.replace_range(root, new_size, size, [], get, self.add)
            else:
                head = self.read_block(oid, n)[:new_size - start]
                root, ref = filetree.replace_range(root, start, size,
                                                   [(len(head), self.block(head))], get,
                                                   self.add)
        return self.tree_entry(root, ref, e)


class FileBuilder:
    """One file's content written in pieces through a ContentWriter, cut by content.

    Memory is the piece being written plus one unfinished chunk; the chunks
    and nodes are those of the same bytes written whole with `file_entry`.
    """

    def __init__(self, cw: ContentWriter) -> None:
        self.cw = cw
        self.size = 0
        self._small = bytearray()  # the first bytes, while the file could still be inline
        self._chunker = filetree.Chunker()
        self._tree = filetree.TreeBuilder(cw.add)

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size <= INLINE_MAX:
            self._small += data
            return
        if self._small:
            data, self._small = bytes(self._small) + data, bytearray()
        self._add(self._chunker.feed(data))

    def _add(self, pieces: list[bytes]) -> None:
        for piece in pieces:
            self._tree.add(len(piece), self.cw.block(piece))

    def entry(self, base: Entry) -> Entry:
        """The finished file's entry, with the metadata of `base`."""
        if self.size <= INLINE_MAX:
            return base.with_(kind=K_FILE, size=self.size, data=bytes(self._small), ref=None)
        self._add(self._chunker.finish())
        root, ref = self._tree.finish()
        return self.cw.tree_entry(root, ref, base)


class Transaction:
    """Staged changes to one branch, read through as a private copy of its snapshot."""

    def __init__(self, store: Store, volume: str, branch: str = "live", *,
                 base: str | None = None, cache: NodeCache | None = None) -> None:
        self.store = store
        self.volume = check_volume(volume)
        self.branch = check_branch(branch)
        self.base = base if base is not None else store.protected_head(volume, branch)
        self.content = ContentWriter(store)
        self.trees = Trees(self.content, cache if cache is not None else store.node_cache,
                           prefetch=self._prefetch)
        if base is not None:
            store.protect_base(base)  # garbage collection leaves it until our publish lands
        self._base_root: Entry | None = store.snapshot(self.base).root
        self.lease: str | None = None  # lease id sent with every publish, if set
        self.identical = False  # accept paths the head already holds as we want them
        self.changes: dict[str, Entry | None] = {}
        self._children: dict[str, set[str]] = {}
        # Changed paths that may hold link group members: linked files, and
        # directories set with a tree of their own (a rename). See `_group`.
        self._linked_changes: set[str] = set()

    # -- the view ----------------------------------------------------------------

    def _prefetch(self, tree: bytes, names: list[bytes]) -> None:
        if tree not in self.content.pending:  # the store has not seen it yet
            self.store.prefetch_path(tree, names)

    def _set(self, key: str, e: Entry | None) -> None:
        self.changes[key] = e
        if key and e is not None and (e.ino and e.kind == K_FILE
                                      or e.kind == K_DIR and e.ref is not None):
            self._linked_changes.add(key)
        else:
            self._linked_changes.discard(key)
        if key:
            parent, _, name = key.rpartition("/")
            self._children.setdefault(parent, set()).add(name)

    def _drop_under(self, key: str) -> None:
        prefix = key + "/" if key else ""
        for k in [k for k in self.changes if k.startswith(prefix) and k != key]:
            del self.changes[k]
            self._linked_changes.discard(k)
        for k in [k for k in self._children if k == key or k.startswith(prefix)]:
            del self._children[k]

    def _resolve(self, parts: tuple[str, ...], *, skip_last: bool = False) -> Entry | None:
        return self.trees.resolve_changed(self.base_root, self.changes, parts,
                                          skip_last=skip_last)

    def lookup(self, path: str) -> Entry | None:
        """The entry at `path` as this transaction sees it, or None."""
        return self._resolve(split_path(path))

    def _need(self, path: str) -> Entry:
        e = self.lookup(path)
        if e is None:
            raise NotFound(f"no such file or directory: {path!r}")
        return e

    def _need_dir_parent(self, parts: tuple[str, ...]) -> None:
        if not parts:
            raise InvalidInput("operation not allowed on the volume root")
        # Every caller looks the path itself up next: resolving it first reads all
        # of it in one round trip from a remote store (Store.prefetch_path).
        self._resolve(parts)
        parent = self._resolve(parts[:-1])
        if parent is None:
            raise NotFound(f"parent directory of {'/'.join(parts)!r} does not exist")
        if parent.kind != K_DIR:
            raise InvalidInput(f"parent of {'/'.join(parts)!r} is not a directory")

    def listdir(self, path: str = "") -> list[tuple[str, Entry]]:
        parts = split_path(path)
        d = self._resolve(parts)
        if d is None:
            raise NotFound(f"no such directory: {path!r}")
        if d.kind != K_DIR:
            raise InvalidInput(f"not a directory: {path!r}")
        out: dict[str, Entry] = {}
        if d.ref is not None:
            for name, e in self.trees.iter_dir(d.ref):
                out[decode_name(name)] = e
        for cname in self._children.get(path, ()):
            child = f"{path}/{cname}" if path else cname
            ce = self._resolve(split_path(child))
            if ce is None:
                out.pop(cname, None)
            else:
                out[cname] = ce
        return sorted(out.items())

    def walk(self, path: str = "") -> Iterator[tuple[str, Entry]]:
        for name, e in self.listdir(path):
            child = f"{path}/{name}" if path else name
            yield child, e
            if e.kind == K_DIR:
                yield from self.walk(child)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        e = self._need(path)
        if e.kind == K_SYMLINK:
            raise InvalidInput(f"{path!r} is a symlink")
        if e.kind != K_FILE:
            raise InvalidInput(f"{path!r} is not a regular file")
        return self.content.read(e, offset, length)

    # -- changes -------------------------------------------------------------------

    def _put_file(self, path: str, new: Entry) -> Entry:
        """Set a file entry, keeping every member of its hard-link group in step."""
        if new.ino:
            for other, _e in self._group(new.ino, new.nlink):
                if other != path:
                    self._set(other, new)
        self._set(path, new)
        return new

    def _group(self, ino: int, nlink: int) -> list[tuple[str, Entry]]:
        """The members of hard-link group `ino` in this transaction's view, by path.

        Candidates come from the base tree and from the trees this
        transaction set (a renamed directory), both searched only where
        their nodes count linked files, and from the files it set; each is
        then looked up, so only what the view shows counts. If that finds
        other than the `nlink` members the group's entries claim, some count
        or entry is wrong (a hostile upload, data from before counts): the
        whole view is walked instead, as before counts existed, so a member
        is never left out of step silently.
        """
        found: dict[str, None] = {}
        for p, _e in self.trees.link_group(self.base_root, ino):
            found[p] = None
        for key in self._linked_changes:
            e = self.changes.get(key)
            if e is None:
                continue
            if e.kind == K_DIR:
                for p, _e in self.trees.link_group(e, ino, key):
                    found[p] = None
            elif e.ino == ino:
                found[key] = None
        members = []
        for p in found:
            e = self.lookup(p)
            if e is not None and e.kind == K_FILE and e.ino == ino:
                members.append((p, e))
        if len(members) != nlink:
            members = [(p, e) for p, e in self.walk("") if e.kind == K_FILE and e.ino == ino]
        return sorted(members)

    def write(self, path: str, data: bytes, *, mode: int | None = None,
              mtime_ns: int | None = None, uid: int | None = None,
              gid: int | None = None) -> Entry:
        """Replace the whole content of a file, creating it if needed."""
        parts = split_path(path)
        self._need_dir_parent(parts)
        old = self._resolve(parts)
        if old is not None and old.kind != K_FILE:
            raise InvalidInput(f"{path!r} exists and is not a regular file")
        base = old if old is not None else Entry(kind=K_FILE)
        base = base.with_(mode=base.mode if mode is None else mode,
                          uid=base.uid if uid is None else uid,
                          gid=base.gid if gid is None else gid,
                          mtime_ns=time.time_ns() if mtime_ns is None else mtime_ns)
        return self._put_file(path, self.content.file_entry(bytes(data), base))

    def write_at(self, path: str, offset: int, data: bytes) -> Entry:
        """Write bytes at an offset of an existing file (holes fill with zeros)."""
        if offset < 0:
            raise InvalidInput("negative offset")
        e = self._need(path)
        if e.kind != K_FILE:
            raise InvalidInput(f"{path!r} is not a regular file")
        new = self.content.splice(e, offset, bytes(data)).with_(mtime_ns=time.time_ns())
        return self._put_file(path, new)

    def truncate(self, path: str, size: int) -> Entry:
        if size < 0:
            raise InvalidInput("negative size")
        e = self._need(path)
        if e.kind != K_FILE:
            raise InvalidInput(f"{path!r} is not a regular file")
        new = self.content.splice(e, 0, None, new_size=size).with_(mtime_ns=time.time_ns())
        return self._put_file(path, new)

    def mkdir(self, path: str, mode: int = 0o755, *, parents: bool = False,
              exist_ok: bool = False, mtime_ns: int | None = None) -> None:
        parts = split_path(path)
        if not parts:
            if exist_ok:
                return
            raise AlreadyExists("the root directory exists")
        if parents:
            for i in range(1, len(parts)):
                sub = "/".join(parts[:i])
                if self._resolve(parts[:i]) is None:
                    self.mkdir(sub, 0o755)
        self._need_dir_parent(parts)
        old = self._resolve(parts)
        if old is not None:
            if exist_ok and old.kind == K_DIR:
                return
            raise AlreadyExists(f"{path!r} already exists")
        now = time.time_ns() if mtime_ns is None else mtime_ns
        # Where this transaction removed something, the new directory starts empty:
        # a merge entry (ref None) would bring the removed contents back.
        replaced = self._resolve(parts, skip_last=True) is not None
        self._set(path, Entry(kind=K_DIR, mode=mode, mtime_ns=now,
                              ref=EMPTY_TREE_ID if replaced else None))

    def symlink(self, path: str, target: str, *, mtime_ns: int | None = None) -> None:
        parts = split_path(path)
        self._need_dir_parent(parts)
        if self._resolve(parts) is not None:
            raise AlreadyExists(f"{path!r} already exists")
        if not target or "\0" in target:
            raise InvalidInput("symlink target must be non-empty and contain no NUL")
        data = target.encode("utf-8", "surrogateescape")
        self._set(path, Entry(kind=K_SYMLINK, mode=0o777, size=len(data), data=data,
                              mtime_ns=time.time_ns() if mtime_ns is None else mtime_ns))

    def set_entry(self, path: str, e: Entry) -> None:
        """Set a raw entry (special files, or metadata restored by import)."""
        parts = split_path(path)
        self._need_dir_parent(parts)
        self._set(path, e)

    def hardlink(self, src: str, dst: str) -> None:
        e = self._need(src)
        if e.kind != K_FILE:
            raise InvalidInput("hard links are only supported for regular files")
        parts = split_path(dst)
        self._need_dir_parent(parts)
        if self._resolve(parts) is not None:
            raise AlreadyExists(f"{dst!r} already exists")
        ino = e.ino or link_group(encode_name(f"{src}\0{time.time_ns()}"))
        members = [p for p, _ in self._group(e.ino, e.nlink)] if e.ino else [src]
        new = e.with_(ino=ino, nlink=len(members) + 1)
        for p in members:
            self._set(p, new)
        self._set(dst, new)

    def rename(self, src: str, dst: str, *, noreplace: bool = False) -> None:
        """Atomic rename with POSIX rules (a directory may replace an empty one)."""
        sparts, dparts = split_path(src), split_path(dst)
        if not sparts or not dparts:
            raise InvalidInput("cannot rename the volume root")
        if dparts[:len(sparts)] == sparts:
            if dparts == sparts:
                return
            raise InvalidInput(f"cannot move {src!r} inside itself")
        e = self._need(src)
        self._need_dir_parent(dparts)
        old = self._resolve(dparts)
        if old is not None:
            if noreplace:
                raise AlreadyExists(f"{dst!r} already exists")
            if old.kind == K_DIR and e.kind != K_DIR:
                raise InvalidInput(f"cannot replace directory {dst!r} with a non-directory")
            if old.kind != K_DIR and e.kind == K_DIR:
                raise InvalidInput(f"cannot replace non-directory {dst!r} with a directory")
            if old.kind == K_DIR and self.listdir(dst):
                raise InvalidInput(f"directory {dst!r} is not empty")
            if old.kind == K_FILE and old.ino:
                self._unlink_member(dst, old)
        moved = {k[len(src):]: v for k, v in self.changes.items() if k.startswith(src + "/")}
        self._drop_under(dst)
        self._set(dst, e)
        for suffix, v in sorted(moved.items()):
            self._set(dst + suffix, v)
        self._delete(src)

    def _delete(self, path: str) -> None:
        parts = split_path(path)
        self._drop_under(path)
        if self._resolve(parts, skip_last=True) is None:
            self.changes.pop(path, None)  # nothing underneath: nothing to delete
        else:
            self._set(path, None)

    def _unlink_member(self, path: str, e: Entry) -> None:
        rest = [p for p, _ in self._group(e.ino, e.nlink) if p != path]
        for p in rest:
            self._set(p, e.with_(nlink=len(rest), ino=e.ino if len(rest) > 1 else 0))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        e = self._need(path)
        if not split_path(path):
            raise InvalidInput("cannot remove the volume root")
        if e.kind == K_DIR and not recursive and self.listdir(path):
            raise InvalidInput(f"directory {path!r} is not empty")
        if e.kind == K_FILE and e.ino:
            self._unlink_member(path, e)
        self._delete(path)

    def _set_attrs(self, path: str, **attrs: Any) -> None:
        e = self._need(path)
        if e.kind == K_DIR:
            cur = self.changes.get(path)
            keep_ref = cur is not None and cur.ref is not None
            self._set(path, e.with_(ref=e.ref if keep_ref else None, **attrs))
        elif e.kind == K_FILE:
            self._put_file(path, e.with_(**attrs))
        else:
            self._set(path, e.with_(**attrs))

    def chmod(self, path: str, mode: int) -> None:
        if not 0 <= mode <= 0o7777:
            raise InvalidInput(f"invalid mode {mode:o}")
        self._set_attrs(path, mode=mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        if uid < 0 or gid < 0:
            raise InvalidInput("negative owner")
        self._set_attrs(path, uid=uid, gid=gid)

    def utimes(self, path: str, mtime_ns: int) -> None:
        self._set_attrs(path, mtime_ns=mtime_ns)

    def setxattr(self, path: str, name: bytes, value: bytes) -> None:
        if not name or b"\0" in name or len(name) > 255:
            raise InvalidInput("invalid xattr name")
        e = self._need(path)
        xattrs = dict(e.xattrs)
        xattrs[bytes(name)] = bytes(value)
        self._set_attrs(path, xattrs=tuple(sorted(xattrs.items())))

    def removexattr(self, path: str, name: bytes) -> None:
        e = self._need(path)
        xattrs = dict(e.xattrs)
        if name not in xattrs:
            raise NotFound(f"no xattr {name!r} on {path!r}")
        del xattrs[name]
        self._set_attrs(path, xattrs=tuple(sorted(xattrs.items())))

    # -- publishing ----------------------------------------------------------------

    def changeset(self, message: str = "", meta: dict[str, Any] | None = None) -> ChangeSet:
        self.content.flush()
        return ChangeSet(self.volume, self.branch, self.base, dict(self.changes), message,
                         dict(meta or {}), self.lease, self.identical)

    def _prepared(self, message: str, meta: dict[str, Any] | None
                  ) -> tuple[ChangeSet, list[tuple[int, bytes]]]:
        objects = self.content.take()
        cs = ChangeSet(self.volume, self.branch, self.base, dict(self.changes), message,
                       dict(meta or {}), self.lease, self.identical)
        return cs, objects

    def commit(self, message: str = "", meta: dict[str, Any] | None = None) -> str:
        """Publish; on success the transaction continues from the new snapshot."""
        cs, objects = self._prepared(message, meta)
        try:
            (sid,) = self.store.publish([cs], objects)
        except BaseException:
            self._restore(objects)
            raise
        self._rebase_to(sid)
        return sid

    def _restore(self, objects: list[tuple[int, bytes]]) -> None:
        for kind, raw in objects:  # a failed publish stored nothing: keep them for a retry
            self.content.add(kind, raw)

    def _rebase_to(self, sid: str) -> None:
        self.base = sid
        self._base_root = None
        self.changes.clear()
        self._children.clear()
        self._linked_changes.clear()

    @property
    def base_root(self) -> Entry:
        if self._base_root is None:
            self._base_root = self.store.snapshot(self.base).root
        return self._base_root


def commit_all(txns: Sequence[Transaction], message: str = "",
               meta: dict[str, Any] | None = None) -> list[str]:
    """Publish several transactions (of several volumes) in one atomic commit."""
    if not txns:
        return []
    store = txns[0].store
    prepared = [t._prepared(message, meta) for t in txns]
    objects = [o for _cs, objs in prepared for o in objs]
    try:
        ids = store.publish([cs for cs, _o in prepared], objects)
    except BaseException:
        for t, (_cs, objs) in zip(txns, prepared, strict=True):
            t._restore(objs)
        raise
    for t, sid in zip(txns, ids, strict=True):
        t._rebase_to(sid)
    return ids
