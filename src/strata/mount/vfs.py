"""The mount's core: a read-only, lazy view of pinned snapshots.

Inode numbers are handed out on first lookup and never change (snapshots are
immutable); members of one hard-link group share an inode. Tree nodes are
fetched only when a lookup or listing needs them, and file bytes only when
read, block by block, through the shared content cache; large files read in
order are fetched ahead of the reader by `readahead.ReadAhead`. This module
knows nothing of FUSE: `fuse.py` translates it.
"""

from __future__ import annotations

import errno
import logging
import threading
from dataclasses import dataclass, field

from strata.engine.interface import Store
from strata.engine.objects import (
    BLOCK,
    FILENODE,
    K_DIR,
    K_FILE,
    K_SYMLINK,
    ZERO_ID,
    Entry,
    FileNode,
    dir_entry,
)
from strata.engine.tree import NodeCache, Trees
from strata.mount.boottrace import Recorder
from strata.mount.cache import ContentCache
from strata.mount.readahead import ReadAhead

log = logging.getLogger(__name__)

ROOT_INO = 1
HIDDEN_XATTR_PREFIX = b"trusted.overlay."  # never show overlayfs' own markers from below


class FsError(Exception):
    """An errno for the adapter to return."""

    def __init__(self, err: int) -> None:
        super().__init__(errno.errorcode.get(err, str(err)))
        self.errno = err


@dataclass(slots=True)
class Node:
    ino: int
    entry: Entry
    parent: int
    children: dict[bytes, int] | None = None
    names: list[bytes] | None = None  # sorted listing, filled on first readdir
    lock: threading.Lock = field(default_factory=threading.Lock)


class _CachedSource:
    """Objects through the shared disk cache, so a second mount fetches nothing."""

    def __init__(self, store: Store, cache: ContentCache) -> None:
        self.store = store
        self.cache = cache

    def get_object(self, oid: bytes) -> bytes:
        return self.cache.get(oid, self.store.get_object)


@dataclass(frozen=True, slots=True)
class Volume:
    name: str
    store: Store
    snapshot: str


class SnapshotFS:
    """Pinned snapshots as one tree: either one volume at the root, or one per name."""

    def __init__(self, volumes: list[Volume], cache: ContentCache, *, single: bool = True,
                 large_file: int = 8 * 1024 * 1024, cache_streams: bool = True) -> None:
        if single and len(volumes) != 1:
            raise ValueError("a single-volume view needs exactly one volume")
        self.cache = cache
        self.large_file = large_file
        self._lock = threading.Lock()
        self._nodes: dict[int, Node] = {}
        self._groups: dict[tuple[int, int], int] = {}  # (volume index, link ino) -> inode
        self._next = ROOT_INO + 1
        self.readahead = ReadAhead(cache, cache_streams=cache_streams)
        self._vol_of: dict[int, int] = {}  # inode -> volume index
        self.volumes = volumes
        self._trees = [Trees(_CachedSource(v.store, cache), NodeCache()) for v in volumes]
        self._sources = [_CachedSource(v.store, cache) for v in volumes]
        # Boot tracing (mount/boottrace.py): one volume's reads recorded by path.
        self.recorder: Recorder | None = None
        self._traced = -2
        self._trace_root = ROOT_INO
        self._names: dict[int, bytes] = {}
        if single:
            root = volumes[0].store.snapshot(volumes[0].snapshot).root
            self._nodes[ROOT_INO] = Node(ROOT_INO, root, ROOT_INO)
            self._vol_of[ROOT_INO] = 0
        else:
            self._nodes[ROOT_INO] = Node(ROOT_INO, dir_entry(0o755), ROOT_INO, children={},
                                         names=[])
            self._vol_of[ROOT_INO] = -1
            for i, v in enumerate(volumes):
                root = v.store.snapshot(v.snapshot).root
                name = v.name.encode()
                ino = self._alloc(root, ROOT_INO, i)
                assert self._nodes[ROOT_INO].children is not None
                self._nodes[ROOT_INO].children[name] = ino  # type: ignore[index]
            self._nodes[ROOT_INO].names = sorted(v.name.encode() for v in volumes)

    def trace(self, vol: int, recorder: Recorder) -> None:
        """Record volume `vol`'s first touches into `recorder`, by path in the volume."""
        root = self._nodes[ROOT_INO]
        if root.children is not None and self._vol_of[ROOT_INO] == -1:
            self._trace_root = root.children[self.volumes[vol].name.encode()]
        self._traced = vol
        self.recorder = recorder

    def _path(self, ino: int) -> bytes | None:
        """The traced volume's path of `ino` (the name it was first found by)."""
        parts = []
        while ino != self._trace_root:
            name = self._names.get(ino)
            if name is None:
                return None
            parts.append(name)
            ino = self._nodes[ino].parent
        return b"/".join(reversed(parts))

    def _recording(self, ino: int) -> Recorder | None:
        rec = self.recorder
        if rec is None or not rec.active or self._vol_of.get(ino) != self._traced:
            return None
        return rec

    def _alloc(self, entry: Entry, parent: int, vol: int, name: bytes = b"") -> int:
        with self._lock:
            if entry.kind == K_FILE and entry.ino:
                ino = self._groups.get((vol, entry.ino))
                if ino is not None:
                    return ino
            ino = self._next
            self._next += 1
            self._nodes[ino] = Node(ino, entry, parent)
            self._vol_of[ino] = vol
            if vol == self._traced and name and self.recorder is not None \
                    and self.recorder.active:
                self._names[ino] = name  # while recording: paths are only for the trace
            if entry.kind == K_FILE and entry.ino:
                self._groups[(vol, entry.ino)] = ino
            return ino

    def root_of(self, vol: int) -> Entry:
        """The root directory entry of volume `vol`."""
        root = self._nodes[ROOT_INO]
        if self._vol_of[ROOT_INO] == -1:
            assert root.children is not None
            return self._nodes[root.children[self.volumes[vol].name.encode()]].entry
        return root.entry

    def node(self, ino: int) -> Node:
        n = self._nodes.get(ino)
        if n is None:
            raise FsError(errno.ENOENT)
        return n

    # -- namespace -----------------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Node:
        p = self.node(parent)
        if p.entry.kind != K_DIR:
            raise FsError(errno.ENOTDIR)
        if name == b".":
            return p
        if name == b"..":
            return self.node(p.parent)
        with p.lock:
            if p.children is None:
                p.children = {}
            ino = p.children.get(name)
            if ino is not None:
                return self._nodes[ino]
            if p.names is not None and self._vol_of[parent] == -1:
                raise FsError(errno.ENOENT)
            vol = self._vol_of[parent]
            if p.entry.ref is None:
                raise FsError(errno.ENOENT)
            e = self._trees[vol].lookup(p.entry.ref, name)
            if e is None:
                raise FsError(errno.ENOENT)
            ino = self._alloc(e, parent, vol, name)
            p.children[name] = ino
            return self._nodes[ino]

    def listdir(self, ino: int) -> list[tuple[bytes, Node]]:
        """All entries of a directory, sorted by name, each with its node."""
        p = self.node(ino)
        if p.entry.kind != K_DIR:
            raise FsError(errno.ENOTDIR)
        vol = self._vol_of[ino]
        with p.lock:
            if p.children is None:
                p.children = {}
            if p.names is None:
                names = []
                if p.entry.ref is not None:
                    for name, e in self._trees[vol].iter_dir(p.entry.ref):
                        names.append(name)
                        if name not in p.children:
                            p.children[name] = self._alloc(e, ino, vol, name)
                p.names = names
                rec = self._recording(ino)
                if rec is not None and (path := self._path(ino)) is not None:
                    rec.listed(path)
            return [(n, self._nodes[p.children[n]]) for n in p.names]

    def readlink(self, ino: int) -> bytes:
        n = self.node(ino)
        if n.entry.kind != K_SYMLINK:
            raise FsError(errno.EINVAL)
        return n.entry.data or b""

    # -- xattrs --------------------------------------------------------------------

    def getxattr(self, ino: int, name: bytes) -> bytes:
        if name.startswith(HIDDEN_XATTR_PREFIX):
            raise FsError(errno.ENODATA)
        for k, v in self.node(ino).entry.xattrs:
            if k == name:
                return v
        raise FsError(errno.ENODATA)

    def listxattr(self, ino: int) -> list[bytes]:
        return [k for k, _v in self.node(ino).entry.xattrs
                if not k.startswith(HIDDEN_XATTR_PREFIX)]

    # -- content -------------------------------------------------------------------

    def file_node(self, ino: int) -> FileNode | None:
        """The block list of a file (None for inline content)."""
        n = self.node(ino)
        if n.entry.kind != K_FILE:
            raise FsError(errno.EISDIR if n.entry.kind == K_DIR else errno.EINVAL)
        if n.entry.ref is None:
            return None
        src = self._sources[self._vol_of[ino]]
        raw = self.cache.get(n.entry.ref, src.store.get_object, (FILENODE,))
        return FileNode.decode(raw)

    def prefetch(self, ino: int) -> None:
        """Fetch a small file's blocks at open; large files are fetched as read."""
        n = self.node(ino)
        rec = self._recording(ino)
        if rec is not None and n.entry.kind == K_FILE and n.entry.size <= self.large_file \
                and (path := self._path(ino)) is not None:
            rec.read(path, 0, n.entry.size)  # all of it is fetched at open
        if n.entry.kind != K_FILE or n.entry.ref is None or n.entry.size > self.large_file:
            return
        fnode = self.file_node(ino)
        if fnode is None:
            return
        src = self._sources[self._vol_of[ino]]
        self.cache.get_many([b for b in fnode.blocks if b != ZERO_ID], src.store.get_objects,
                            (BLOCK,))

    def read_nowait(self, ino: int, offset: int, size: int, fnode: FileNode | None
                    ) -> bytes | None:
        """A large file's bytes if every block they need is verified and in memory, else None.

        Never blocks (the adapter calls it on its event loop); it still plans the
        read-ahead, so the threaded `read` that follows a None finds windows in flight.
        """
        n = self._nodes.get(ino)
        if n is None or fnode is None or n.entry.kind != K_FILE or n.entry.size <= self.large_file:
            return None
        end = min(n.entry.size, offset + size)
        if offset >= end:
            return None
        rec = self._recording(ino)
        if rec is not None and (path := self._path(ino)) is not None:
            rec.read(path, offset, end)
        bs = fnode.block_size
        first, last = offset // bs, (end - 1) // bs
        self.readahead.plan(ino, fnode.blocks, bs, first, last,
                            self._sources[self._vol_of[ino]].store)
        got: dict[bytes, bytes] = {}
        for oid in fnode.blocks[first:last + 1]:
            if oid != ZERO_ID and oid not in got:
                data = self.readahead.ready(oid)
                if data is None:
                    return None
                got[oid] = data
        return fnode.read(offset, end, got.__getitem__)

    def read(self, ino: int, offset: int, size: int, fnode: FileNode | None = None) -> bytes:
        n = self.node(ino)
        e = n.entry
        if e.kind != K_FILE:
            raise FsError(errno.EISDIR if e.kind == K_DIR else errno.EINVAL)
        end = min(e.size, offset + size)
        if offset >= end:
            return b""
        if e.ref is None:
            return (e.data or b"")[offset:end]
        if fnode is None:
            fnode = self.file_node(ino)
        assert fnode is not None
        src = self._sources[self._vol_of[ino]]
        bs = fnode.block_size
        if e.size > self.large_file:
            rec = self._recording(ino)
            if rec is not None and (path := self._path(ino)) is not None:
                rec.read(path, offset, end)
            store = src.store
            self.readahead.plan(ino, fnode.blocks, bs, offset // bs, (end - 1) // bs, store)
            return fnode.read(offset, end, lambda oid: self.readahead.block(oid, store))
        return fnode.read(offset, end,
                          lambda oid: self.cache.get(oid, src.store.get_object, (BLOCK,)))
