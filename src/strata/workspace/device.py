"""A workspace's block device, kept in a strata volume.

The device is cut into extents (`Layout.extent` bytes, 1 MiB by default), and
each extent that was ever written is one file of the volume, `disk/%08x`,
whose blocks are the device's blocks (holes where nothing was written, or only
zeros). Everything else falls out of the engine: a snapshot is the block map
at one moment, copy-on-write trees make a flush cost what it changed, a fork
is a branch, blocks are deduplicated and compressed, GC and the bucket tier
apply as to any volume.

`Device` is the block layer the FUSE adapter serves: reads fetch blocks
lazily, writes stay in memory, and `flush` publishes every dirty block under
the workspace's writer lease and returns only when the store holds it
durably. A flush is a device FLUSH: what was written before it is durable
after it, which is all a journaling filesystem on top asks of a disk. Once a
publish is refused because another host took the lease (fenced), the device
fails every later write and flush: nothing of this host reaches the
workspace again.

`create` and `read_layout` make and read the layout (`workspace.json`) at a
workspace volume's root. Nothing here mounts, forks or knows of FUSE.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from strata.engine.errors import Forbidden, InvalidInput, StrataError
from strata.engine.interface import ChangeSet, Store
from strata.engine.objects import (
    BLOCK,
    FILENODE,
    K_DIR,
    K_FILE,
    ZERO_ID,
    Entry,
    FileNode,
    object_id,
)
from strata.engine.tree import Trees
from strata.workspace import LAYOUT_PATH

log = logging.getLogger(__name__)

SNAPSHOT_PATH = "snapshot.json"   # the message of the last named snapshot
DISK_DIR = "disk"
LAYOUT_VERSION = 1
UPLOAD_BATCH = 8 << 20     # bytes of blocks sent ahead of a large flush per request


class DeviceError(StrataError):
    """The device cannot serve this request (fenced, store unreachable, bad layout)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """The shape of a workspace device, kept in `workspace.json` at the volume root."""

    size: int
    block: int = 64 * 1024
    extent: int = 1 << 20
    fs: str = "ext4"

    def __post_init__(self) -> None:
        if self.block <= 0 or self.block & (self.block - 1) or not 4096 <= self.block <= 1 << 20:
            raise DeviceError(f"block size {self.block} is not a power of two in 4 KiB..1 MiB")
        if self.extent % self.block or not self.block <= self.extent <= 64 << 20:
            raise DeviceError(f"extent size {self.extent} is not a multiple of the block size")
        if self.size <= 0 or self.size % self.extent or self.size > 1 << 50:
            raise DeviceError(f"device size {self.size} is not a positive multiple of "
                              f"{self.extent} bytes (at most 1 PiB)")

    @property
    def per_extent(self) -> int:
        return self.extent // self.block

    def encode(self) -> bytes:
        return json.dumps({"format": LAYOUT_VERSION, "size": self.size, "block": self.block,
                           "extent": self.extent, "fs": self.fs}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Layout:
        try:
            v = json.loads(raw)
        except ValueError:
            raise DeviceError("workspace.json is not JSON: not a workspace") from None
        if not isinstance(v, dict) or v.get("format") != LAYOUT_VERSION:
            fmt = v.get("format") if isinstance(v, dict) else None
            raise DeviceError(f"workspace layout format {fmt!r} is not one this strata "
                              f"reads (it reads {LAYOUT_VERSION})")
        try:
            return cls(size=int(v["size"]), block=int(v["block"]), extent=int(v["extent"]),
                       fs=str(v["fs"]))
        except (KeyError, TypeError, ValueError):
            raise DeviceError("workspace.json lacks a field: not a workspace") from None


def extent_path(index: int) -> str:
    return f"{DISK_DIR}/{index:08x}"


def trim_zeros(block: bytes) -> bytes:
    """A block without its trailing zeros (stored blocks are zero-padded on read)."""
    return block.rstrip(b"\0")


class Device:
    """The block map of one workspace branch, served lazily, written back on flush."""

    def __init__(self, store: Store, volume: str, branch: str, head: str, layout: Layout,
                 *, lease: str | None = None, cache_bytes: int = 256 << 20,
                 scratch: bool = False) -> None:
        self.store = store
        self.volume = volume
        self.branch = branch
        self.head = head
        self.layout = layout
        self.lease = lease
        self.scratch = scratch   # a read-only view: writes stay in memory, never published
        self._trees = Trees(store)
        self._root = store.snapshot(head).root
        # disk/ stays once made (an empty extent is removed, never the directory).
        self._has_disk_dir = self._trees.resolve(self._root, [DISK_DIR]) is not None
        self._lock = threading.Lock()          # guards every map below
        self._flush_lock = threading.Lock()    # one flush at a time; later ones wait
        self._extents: dict[int, tuple[bytes, ...]] = {}   # published block ids, by extent
        self._clean: OrderedDict[int, bytes] = OrderedDict()
        self._clean_bytes = 0
        self._cache_bytes = cache_bytes
        self._dirty: dict[int, bytes] = {}       # block index -> new content (b"" = zeros)
        self._flushing: dict[int, bytes] = {}    # being published now
        self._dirty_bytes = 0
        self._writes = 0                         # counts writes, for read-modify-write
        self._written: set[int] | None = None    # extents the head holds, once listed
        self.fenced: str | None = None           # why writes are refused, once fenced
        self.refused_bytes = 0                   # writes refused since (detach reports them)
        self.on_fenced: Callable[[], None] | None = None  # told once, when fenced
        # While the filesystem is being made or mounted (mkfs, journal replay), the
        # kernel's flushes are answered without a publish; the attach publishes once
        # after (see `_mount_fs` and docs/workspaces.md, "Attach, write, flush").
        self.deferring = False
        self._opens = 0                          # open handles on the device file
        self._opens_changed = threading.Condition(self._lock)

    # -- reading ---------------------------------------------------------------------

    def _extent_ids(self, x: int) -> tuple[bytes, ...]:
        ids = self._extents.get(x)
        if ids is not None:
            return ids
        e = self._trees.resolve(self._root, [DISK_DIR, f"{x:08x}"])
        if e is None:
            ids = (ZERO_ID,) * self.layout.per_extent
        else:
            if e.kind != K_FILE or e.ref is None:
                raise DeviceError(f"{extent_path(x)} is not an extent file")
            node = FileNode.decode(self.store.get_object(e.ref))
            if node.block_size != self.layout.block or len(node.blocks) != self.layout.per_extent:
                raise DeviceError(f"{extent_path(x)} does not match the workspace layout")
            ids = node.blocks
        with self._lock:
            return self._extents.setdefault(x, ids)

    def _pending(self, i: int) -> bytes | None:
        """Unpublished or cached content of block `i` (caller holds the lock)."""
        data = self._dirty.get(i)
        if data is None:
            data = self._flushing.get(i)
        if data is None:
            data = self._clean.get(i)
            if data is not None:
                self._clean.move_to_end(i)
        return data

    def _pending_or_hole(self, i: int) -> bytes | None:
        """`_pending`, or b"" for a block the published map knows is a hole (holds the lock).

        A journal or a file growing into blocks never written needs no fetch.
        """
        data = self._pending(i)
        if data is None:
            x, k = divmod(i, self.layout.per_extent)
            ids = self._extents.get(x)
            if ids is not None and ids[k] == ZERO_ID:
                return b""
        return data

    def _fetch(self, i: int) -> bytes:
        """Block `i` as published: from the cache or the store, zeros for a hole."""
        bs = self.layout.block
        x, k = divmod(i, self.layout.per_extent)
        oid = self._extent_ids(x)[k]
        if oid == ZERO_ID:
            return b""
        raw = self.store.get_object(oid)
        if len(raw) > bs:
            raise DeviceError(f"block {oid.hex()} of {extent_path(x)} is longer than a block")
        with self._lock:
            if i not in self._clean:
                self._remember(i, raw)
        return raw

    def _remember(self, i: int, data: bytes) -> None:
        old = self._clean.pop(i, None)
        if old is not None:
            self._clean_bytes -= len(old)
        self._clean[i] = data
        self._clean_bytes += len(data)
        while self._clean_bytes > self._cache_bytes and self._clean:
            _j, gone = self._clean.popitem(last=False)
            self._clean_bytes -= len(gone)

    def _block(self, i: int) -> bytes:
        with self._lock:
            data = self._pending(i)
        return self._fetch(i) if data is None else data

    def _fetch_many(self, blocks: list[int]) -> None:
        """Bring published blocks into the cache with one request (a read's misses)."""
        per = self.layout.per_extent
        want: dict[bytes, list[int]] = {}
        for i in blocks:
            oid = self._extent_ids(i // per)[i % per]
            if oid != ZERO_ID:
                want.setdefault(oid, []).append(i)
        if not want:
            return
        ids = list(want)
        got = self.store.get_objects(ids)
        with self._lock:
            for oid, raw in zip(ids, got, strict=True):
                if len(raw) > self.layout.block:
                    raise DeviceError(f"block {oid.hex()} is longer than a block")
                for i in want[oid]:
                    if self._pending(i) is None:
                        self._remember(i, raw)

    def read(self, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` (short at the end of the device)."""
        end = min(offset + size, self.layout.size)
        bs, per = self.layout.block, self.layout.per_extent
        first, last = offset // bs, (end - 1) // bs
        with self._lock:
            missing = [i for i in range(first, last + 1) if self._pending(i) is None]
        if missing:
            # A miss brings in the rest of its extents too, in the same request:
            # filesystem metadata (inode tables, directories, the journal) is read
            # in small pieces that sit together, one round trip each otherwise.
            with self._lock:
                around = [i for i in range(first // per * per, (last // per + 1) * per)
                          if self._pending(i) is None]
            self._fetch_many(around if self._cache_bytes >= 4 * len(around) * bs
                             else missing)
        out = []
        pos = offset
        while pos < end:
            i, lo = divmod(pos, bs)
            n = min(bs - lo, end - pos)
            data = self._block(i)[lo:lo + n]
            out.append(data + bytes(n - len(data)) if len(data) < n else data)
            pos += n
        return b"".join(out)

    # -- writing ---------------------------------------------------------------------

    def _check_writable(self, n: int = 0) -> None:
        if self.fenced is not None:
            self.refused_bytes += n  # what the filesystem above meant to write, and lost
            raise DeviceError(self.fenced)

    def write(self, offset: int, data: bytes) -> int:
        """Write `data` at `offset` into memory; `flush` makes it durable."""
        self._check_writable(len(data))
        if offset < 0 or offset + len(data) > self.layout.size:
            raise DeviceError("write past the end of the device")
        bs = self.layout.block
        view = memoryview(data)
        pos = 0
        while pos < len(data):
            i, lo = divmod(offset + pos, bs)
            n = min(bs - lo, len(data) - pos)
            piece = view[pos:pos + n]
            if n == bs:
                self._set(i, trim_zeros(bytes(piece)))
            else:
                self._patch(i, lo, piece)
            pos += n
        return len(data)

    def try_write(self, offset: int, data: bytes) -> bool:
        """`write` if it needs no fetch (every partly written block is in memory).

        All or nothing, under one lock: the FUSE adapter calls this on its event
        loop and falls back to `write` in a thread when it returns False.
        """
        self._check_writable()
        if offset < 0 or offset + len(data) > self.layout.size:
            return False
        bs = self.layout.block
        end = offset + len(data)
        with self._lock:
            first, last = offset // bs, (end - 1) // bs
            for i in {first, last}:
                lo, hi = max(offset - i * bs, 0), min(end - i * bs, bs)
                if (lo, hi) != (0, bs) and self._pending_or_hole(i) is None:
                    return False
            view = memoryview(data)
            for i in range(first, last + 1):
                lo, hi = max(offset - i * bs, 0), min(end - i * bs, bs)
                piece = view[i * bs + lo - offset:i * bs + hi - offset]
                if (lo, hi) == (0, bs):
                    self._store_dirty(i, trim_zeros(bytes(piece)))
                    continue
                base = self._pending_or_hole(i)
                assert base is not None
                buf = bytearray(base)
                if len(buf) < hi:
                    buf.extend(bytes(hi - len(buf)))
                buf[lo:hi] = piece
                self._store_dirty(i, trim_zeros(bytes(buf)))
        return True

    def try_read(self, offset: int, size: int) -> bytes | None:
        """`read` if every block is in memory (or a known hole), else None."""
        end = min(offset + size, self.layout.size)
        bs = self.layout.block
        out = []
        with self._lock:
            pos = offset
            while pos < end:
                i, lo = divmod(pos, bs)
                n = min(bs - lo, end - pos)
                data = self._pending_or_hole(i)
                if data is None:
                    return None
                data = data[lo:lo + n]
                out.append(data + bytes(n - len(data)) if len(data) < n else data)
                pos += n
        return b"".join(out)

    def _set(self, i: int, content: bytes) -> None:
        with self._lock:
            self._store_dirty(i, content)

    def _store_dirty(self, i: int, content: bytes) -> None:
        old = self._dirty.get(i)
        self._dirty_bytes += len(content) - (len(old) if old is not None else 0)
        self._dirty[i] = content
        self._writes += 1

    def _patch(self, i: int, lo: int, piece: memoryview) -> None:
        fetched: bytes | None = None
        seen = -1
        while True:
            with self._lock:
                base = self._pending(i)
                if base is None and self._writes == seen:
                    base = fetched  # nothing was written since we fetched it
                if base is not None:
                    buf = bytearray(base)
                    if len(buf) < lo + len(piece):
                        buf.extend(bytes(lo + len(piece) - len(buf)))
                    buf[lo:lo + len(piece)] = piece
                    self._store_dirty(i, trim_zeros(bytes(buf)))
                    return
                seen = self._writes
            fetched = self._fetch(i)  # outside the lock; then patch what is current

    def punch(self, offset: int, size: int) -> None:
        """Make [offset, offset+size) read as zeros: whole blocks become holes.

        Whole extents that were never written (and hold nothing dirty) are
        skipped, so punching a mostly empty device costs what was written.
        """
        self._check_writable()
        bs, ext, per = self.layout.block, self.layout.extent, self.layout.per_extent
        end = min(offset + size, self.layout.size)
        written = self._written_extents()
        pos = offset
        while pos < end:
            x = pos // ext
            if pos == x * ext and end >= (x + 1) * ext:  # the whole extent
                with self._lock:
                    busy = any(i in self._dirty or i in self._flushing
                               for i in range(x * per, (x + 1) * per))
                if x in written or busy:
                    for i in range(x * per, (x + 1) * per):
                        self._set(i, b"")
                pos = (x + 1) * ext
                continue
            i, lo = divmod(pos, bs)
            n = min(bs - lo, end - pos, (x + 1) * ext - pos)
            if n == bs:
                self._set(i, b"")
            else:
                self._patch(i, lo, memoryview(bytes(n)))
            pos += n

    def _written_extents(self) -> set[int]:
        """Extents the published head holds (listed once, then kept up to date)."""
        if self._written is None:
            found = set(written_extents(self._trees, self._root))
            with self._lock:
                if self._written is None:
                    self._written = found | {x for x, ids in self._extents.items()
                                             if any(oid != ZERO_ID for oid in ids)}
        return self._written

    def opened(self) -> None:
        with self._lock:
            self._opens += 1

    def closed(self) -> None:
        with self._lock:
            self._opens -= 1
            self._opens_changed.notify_all()

    def wait_unused(self, timeout: float) -> bool:
        """True once nothing has the device file open; False if something still does.

        The loop device holds it until the filesystem on it is gone everywhere:
        an unmount in one mount namespace leaves it alive while another (a
        sandbox's) still holds it, writing back what it had cached.
        """
        with self._lock:
            return self._opens_changed.wait_for(lambda: self._opens <= 0, timeout)

    @property
    def dirty_bytes(self) -> int:
        return self._dirty_bytes

    # -- flushing --------------------------------------------------------------------

    def flush(self, message: str = "", meta: dict[str, object] | None = None) -> str:
        """Publish every block written so far; return the durable head.

        With a message, publish a snapshot even if nothing changed (a named
        point in the workspace's log).
        """
        if self.scratch:
            return self.head
        with self._flush_lock:
            return self._flush_locked(message, meta or {})

    def try_flush(self, limit: int) -> bool:
        """`flush` now if at most `limit` bytes are dirty and no other flush runs.

        The FUSE adapter calls this on its event loop (a small flush, such as
        a journal commit's, costs one publish and no thread hop) and falls
        back to `flush` in a thread when it returns False.
        """
        if self.scratch:
            return True
        if self._dirty_bytes > limit or not self._flush_lock.acquire(blocking=False):
            return False
        try:
            self._flush_locked("", {})
        finally:
            self._flush_lock.release()
        return True

    def _flush_locked(self, message: str, meta: dict[str, object]) -> str:
        self._check_writable()
        with self._lock:
            if not self._dirty and not message:
                return self.head
            self._flushing, self._dirty = self._dirty, {}
            self._dirty_bytes = 0
            batch = dict(self._flushing)
        try:
            head = self._publish(batch, message, meta)
        except BaseException:
            with self._lock:  # keep what did not land, under anything written since
                batch.update(self._dirty)
                self._dirty = batch
                self._dirty_bytes = sum(len(v) for v in batch.values())
                self._flushing = {}
            raise
        with self._lock:
            for i, content in batch.items():
                self._remember(i, content)
            self._flushing = {}
        return head

    def _publish(self, batch: dict[int, bytes], message: str,
                 meta: dict[str, object]) -> str:
        per = self.layout.per_extent
        by_extent: dict[int, dict[int, bytes]] = {}
        for i, content in batch.items():
            x, k = divmod(i, per)
            by_extent.setdefault(x, {})[k] = content
        blocks: dict[bytes, bytes] = {}
        nodes: list[tuple[int, bytes]] = []
        changes: dict[str, Entry | None] = {}
        new_ids: dict[int, tuple[bytes, ...]] = {}
        if by_extent and not self._has_disk_dir:
            changes[DISK_DIR] = Entry(kind=K_DIR, mode=0o700)  # make sure disk/ exists
        if message:  # a named snapshot is a snapshot even when no block changed
            changes[SNAPSHOT_PATH] = snapshot_entry(message)
        for x, edits in sorted(by_extent.items()):
            ids = list(self._extent_ids(x))
            for k, content in edits.items():
                if content:
                    oid = object_id(BLOCK, content)
                    blocks.setdefault(oid, content)
                    ids[k] = oid
                else:
                    ids[k] = ZERO_ID
            new_ids[x] = tuple(ids)
            if all(oid == ZERO_ID for oid in ids):
                changes[extent_path(x)] = None
                continue
            raw = FileNode.v1(self.layout.extent, self.layout.block, ids).encode()
            nodes.append((FILENODE, raw))
            changes[extent_path(x)] = Entry(kind=K_FILE, mode=0o600, size=self.layout.extent,
                                            ref=object_id(FILENODE, raw))
        inline = self._upload(list(blocks.values()))
        cs = ChangeSet(self.volume, self.branch, self.head, changes, message or "flush",
                       {"workspace": "snapshot" if message else "flush", **meta},
                       lease=self.lease)
        try:
            head = self.store.publish([cs], inline + nodes)[0]
        except Forbidden as exc:
            self.fenced = f"this host no longer holds the workspace's lease: {exc}"
            if self.on_fenced is not None:
                self.on_fenced()  # recorded before the failing flush returns
            raise DeviceError(self.fenced) from exc
        with self._lock:
            self._has_disk_dir = self._has_disk_dir or bool(by_extent)
            self._extents.update(new_ids)
            if self._written is not None:
                for x, new in new_ids.items():
                    if any(oid != ZERO_ID for oid in new):
                        self._written.add(x)
                    else:
                        self._written.discard(x)
            self.head = head  # extents not cached yet are unchanged since `_root`
        return head

    def _upload(self, contents: list[bytes]) -> list[tuple[int, bytes]]:
        """Send large flushes' blocks ahead in batches; return the rest to send inline."""
        total = sum(len(c) for c in contents)
        if total <= UPLOAD_BATCH:
            return [(BLOCK, c) for c in contents]
        batch: list[tuple[int, bytes]] = []
        size = 0
        for c in contents:
            batch.append((BLOCK, c))
            size += len(c)
            if size >= UPLOAD_BATCH:
                self.store.put_objects(batch)
                batch, size = [], 0
        if batch:
            self.store.put_objects(batch)
        return []


def snapshot_entry(message: str) -> Entry:
    raw = json.dumps({"message": message, "time_ns": time.time_ns()}).encode()[:4096]
    return Entry(kind=K_FILE, mode=0o644, size=len(raw), data=raw)


def written_extents(trees: Trees, root: Entry) -> Iterable[int]:
    """Indexes of the extents a snapshot holds (the rest of the device is holes)."""
    disk = trees.resolve(root, [DISK_DIR])
    if disk is None or disk.ref is None:
        return
    for name, _e in trees.iter_dir(disk.ref):
        try:
            yield int(name, 16)
        except ValueError:
            continue


# -- the workspace in the store --------------------------------------------------------

def create(store: Store, volume: str, layout: Layout) -> str:
    """A new volume holding an empty (never written) device; returns its head."""
    store.create_volume(volume)
    head = store.head(volume, "live")
    raw = layout.encode()
    return store.publish([ChangeSet(volume, "live", head, {
        LAYOUT_PATH: Entry(kind=K_FILE, mode=0o644, size=len(raw), data=raw)},
        "create workspace", {"workspace": "create"})])[0]


def read_layout(store: Store, sid: str) -> Layout:
    e = Trees(store).resolve(store.snapshot(sid).root, [LAYOUT_PATH])
    if e is None or e.kind != K_FILE:
        raise InvalidInput("this volume is not a workspace (it has no workspace.json)")
    if e.data is not None:
        raw = e.data
    elif e.ref is not None and e.size <= 4096:
        raw = FileNode.decode(store.get_object(e.ref)).read(0, e.size, store.get_object)
    else:
        raise InvalidInput("workspace.json is not a workspace layout")
    return Layout.decode(raw)
