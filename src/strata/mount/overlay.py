"""Kernel overlayfs over the FUSE view, and its upper directory as a change set.

The upper directory is the change set. Overlayfs records, as root:
- new and copied-up files, symlinks, special files and directories;
- a whiteout (a 0:0 character device) where a lower entry was deleted;
- `trusted.overlay.opaque = "y"` on a directory that replaced a lower one;
- `trusted.overlay.redirect` on a directory renamed from elsewhere in the
  lower layer (with `redirect_dir=on`): its lower contents come from there.

`scan_upper` turns that into final entries per path, as `ChangeSet` wants,
cutting files into blocks: blocks the lower file already had keep their ids,
so only changed blocks need uploading.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat as statmod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from strata import localfile
from strata.engine.errors import StrataError, Unavailable
from strata.engine.objects import (
    BLOCK,
    EMPTY_TREE_ID,
    FILENODE,
    K_DIR,
    K_FIFO,
    K_FILE,
    Entry,
    FileNode,
    link_group,
    object_id,
)
from strata.engine.tree import Trees, encode_name
from strata.mount import mountinfo
from strata.mount.idshift import unshift
from strata.mount.statcache import Key, StatCache, stat_key

log = logging.getLogger(__name__)

OVERLAY_PREFIX = b"trusted.overlay."  # overlayfs' own markers, never published
OPAQUE = OVERLAY_PREFIX + b"opaque"
REDIRECT = OVERLAY_PREFIX + b"redirect"
OVERLAY_OPTIONS = "redirect_dir=on,index=off,metacopy=off,xino=off"


class MountError(StrataError):
    """A mount or unmount system call failed."""


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MNT_DETACH = 2


def sys_mount(source: str, target: str, fstype: str | None, flags: int, data: str | None,
              what: str) -> None:
    """The mount(2) system call, raising MountError.

    A step mounts and unmounts three times; running mount(8) or umount(8)
    for each cost a fork and an exec of a program that reads the mount table.
    """
    import ctypes
    libc = _libc()
    if libc.mount(os.fsencode(source), os.fsencode(target),
                  None if fstype is None else fstype.encode(), ctypes.c_ulong(flags),
                  None if data is None else os.fsencode(data)) != 0:
        err = ctypes.get_errno()
        raise MountError(f"{what} on {target} failed: {os.strerror(err)}")


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        import ctypes
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def mount_overlay(lower: str, upper: str, work: str, target: str, *,
                  volatile: bool = False, secure: bool = False) -> None:
    """Mount overlayfs on `target`; `volatile` skips every sync of the upper directory.

    Only for a scratch that is thrown away whenever its process dies (a
    step's): syncs there buy nothing, and the one at unmount writes back the
    upper filesystem. `secure` mounts it nosuid and nodev: a setuid file or a
    device node in the volume is then only bytes (a step's volumes); and it
    names its layers by descriptor, so the mount table the step reads shows
    /proc/self/fd/N, not where its scratch lives on the host.
    """
    _adopt_root(lower, upper)
    fds = [os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for p in (lower, upper, work)
           ] if secure else []
    try:
        lower, upper, work = (f"/proc/self/fd/{fd}" for fd in fds) if fds else (
            lower, upper, work)
        opts = f"lowerdir={lower},upperdir={upper},workdir={work},{OVERLAY_OPTIONS}"
        sys_mount("strata", target, "overlay", MS_NOSUID | MS_NODEV if secure else 0,
                  opts + (",volatile" if volatile else ""), "overlay mount")
    finally:
        for fd in fds:
            os.close(fd)


def _adopt_root(lower: str, upper: str) -> None:
    """Give a new upper directory the lower root's mode, owner, xattrs and mtime.

    overlayfs shows the upper root's attributes for the mount's root, and a
    scratch directory made for the mount would otherwise replace the
    snapshot's (and be published by the next commit).
    """
    st = os.stat(lower)
    for name in os.listxattr(lower):
        with contextlib.suppress(OSError):  # a namespace the upper filesystem refuses
            os.setxattr(upper, name, os.getxattr(lower, name))
    os.chown(upper, st.st_uid, st.st_gid)
    os.chmod(upper, statmod.S_IMODE(st.st_mode))
    os.utime(upper, ns=(st.st_atime_ns, st.st_mtime_ns))


def unmount(target: str, *, lazy: bool = False) -> None:
    import ctypes
    if _libc().umount2(os.fsencode(target), MNT_DETACH if lazy else 0) != 0:
        err = ctypes.get_errno()
        raise MountError(f"unmount of {target} failed: {os.strerror(err)}")


def mount_points() -> list[str]:
    """Every mount point of this mount namespace, in mount order."""
    return [m.point for m in mountinfo.read()]


def is_mountpoint(path: str) -> bool:
    return os.path.realpath(path) in mount_points()


def unmount_under(path: str) -> None:
    """Lazily unmount `path` and everything mounted below it, deepest first."""
    real = os.path.realpath(path)
    for mp in reversed(mount_points()):
        if mp == real or mp.startswith(real + "/"):
            with contextlib.suppress(MountError):
                unmount(mp, lazy=True)


HELD_BYTES = 64 * 1024 * 1024  # new blocks a scan keeps in memory; the rest are read back


class ObjectSet(Mapping[bytes, tuple[int, bytes]]):
    """Objects a commit may upload, by id: (kind, raw bytes).

    The first HELD_BYTES of new blocks are kept in memory; beyond that a block
    is kept as (file, offset, length) and read back, and checked against its
    id, when it is asked for. Committing a 10 GiB file then needs memory for
    one upload batch, not for the file.
    """

    def __init__(self) -> None:
        self._held: dict[bytes, tuple[int, bytes]] = {}
        self._refs: dict[bytes, tuple[str, int, int]] = {}
        self.held_bytes = 0

    def put(self, oid: bytes, kind: int, raw: bytes) -> None:
        self._held[oid] = (kind, raw)
        self.held_bytes += len(raw)

    def put_block(self, oid: bytes, path: str, offset: int, length: int) -> None:
        if oid not in self._held:
            self._refs[oid] = (path, offset, length)

    def size(self, oid: bytes) -> int:
        held = self._held.get(oid)
        return len(held[1]) if held is not None else self._refs[oid][2]

    def __getitem__(self, oid: bytes) -> tuple[int, bytes]:
        held = self._held.get(oid)
        if held is not None:
            return held
        path, offset, length = self._refs[oid]
        try:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), length, offset)
        except OSError as exc:
            raise Unavailable(f"{path} changed while it was being committed ({exc}); "
                              "commit again") from exc
        if object_id(BLOCK, data) != oid:
            raise Unavailable(f"{path} changed while it was being committed; commit again")
        return BLOCK, data

    def __contains__(self, oid: object) -> bool:
        return oid in self._held or oid in self._refs

    def __iter__(self) -> Iterator[bytes]:
        yield from self._held
        yield from self._refs

    def __len__(self) -> int:
        return len(self._held) + len(self._refs)


@dataclass
class Scan:
    """The upper directory read as a change set (paths -> final entries)."""

    changes: dict[str, Entry | None] = field(default_factory=dict)
    objects: ObjectSet = field(default_factory=ObjectSet)  # to upload
    files_hashed: int = 0
    bytes_hashed: int = 0
    # Every regular file's lstat key and entry (before link groups), for the stat cache,
    # and the paths whose entry came from that cache instead of being read (with the
    # entry's digest as the cache holds it).
    seen: dict[str, tuple[Key, Entry]] = field(default_factory=dict)
    cached: dict[str, str] = field(default_factory=dict)
    stamp_ns: int | None = None  # the upper filesystem's time when the scan began
    known: StatCache | None = None  # the stat cache the scan used
    # of `changes`, set by uncommitted_changes()
    digests: dict[str, str] = field(default_factory=dict)
    cache_ignored: str = ""      # why a stat cache on disk was not used

    def summary(self) -> list[dict[str, str]]:
        out = []
        for path, e in sorted(self.changes.items()):
            path = path or "."
            if e is None:
                out.append({"path": path, "change": "deleted"})
            elif e.kind == K_DIR and e.ref is None:
                out.append({"path": path, "change": "directory"})
            else:
                out.append({"path": path, "change": "changed"})
        return out


def _is_whiteout(st: os.stat_result) -> bool:
    return statmod.S_ISCHR(st.st_mode) and st.st_rdev == 0


class UpperScanner:
    """Reads an overlay upper directory against the lower snapshot's tree.

    Hard links: names linked inside the mount share an upper inode and are
    published as one link group. A link group from the snapshot that the
    mount split (overlayfs with index=off copies up one name on its own, and
    an unlink leaves the other names in the lower layer) is published with
    the count of the names that are left, so the new snapshot's groups are
    consistent; finding those names walks the pinned tree, which happens only
    when a commit touches a linked file from the snapshot.
    """

    def __init__(self, trees: Trees, lower_root: Entry, block_size: int,
                 cache: StatCache | None = None, id_shift: int = 0) -> None:
        self.trees = trees
        self.lower_root = lower_root
        self.block_size = block_size
        self.cache = cache  # entries of files unchanged since they were published
        self.id_shift = id_shift  # a sandboxed step's id range (mount/idshift.py)

    def _entry(self, real: str, st: os.stat_result, **kw: Any) -> Entry:
        """The entry of an upper file, its owners as stored (not as the step's view shifts them)."""
        e = localfile.entry(real, st, exclude=OVERLAY_PREFIX, **kw)
        if not self.id_shift:
            return e
        return e.with_(uid=unshift(e.uid, self.id_shift), gid=unshift(e.gid, self.id_shift))

    def scan(self, upper: str) -> Scan:
        out = Scan()
        links: dict[int, list[str]] = {}
        touched: set[int] = set()  # link groups of the snapshot the upper layer changed
        redirects: list[tuple[str, tuple[str, ...]]] = []  # (path, lower source)
        self._walk(upper, "", self.lower_root, (), out, links, touched, redirects)
        # The upper root is the mount's root (see _adopt_root).
        root = self._entry(upper, os.lstat(upper))
        if root.attrs() != self.lower_root.attrs() or root.mtime_ns != self.lower_root.mtime_ns:
            out.changes[""] = root  # path "" is the root: attributes only
        for paths in links.values():  # hard links made inside the mount
            if len(paths) > 1:
                group = link_group(encode_name("\0".join(sorted(paths))))
                for p in paths:
                    e = out.changes.get(p)
                    if e is not None:
                        out.changes[p] = e.with_(ino=group, nlink=len(paths))
        if touched:
            self._split_groups(out, touched, redirects)
        return out

    def _split_groups(self, out: Scan, touched: set[int],
                      redirects: list[tuple[str, tuple[str, ...]]]) -> None:
        """Give the names left of each touched snapshot link group their new count."""
        members: dict[int, list[tuple[str, Entry]]] = {}
        for path, e in self.trees.walk(self.lower_root):
            if e.kind == K_FILE and e.ino in touched:
                members.setdefault(e.ino, []).append((path, e))
        for group in members.values():
            left = [(p, e) for lp, e in group for p in _final_paths(lp, out.changes, redirects)]
            for p, e in left:
                new = e.with_(nlink=len(left), ino=e.ino if len(left) > 1 else 0)
                if new != e:
                    out.changes[p] = new

    def _walk(self, real: str, prefix: str, lower_dir: Entry | None,
              lower_parts: tuple[str, ...] | None, out: Scan, links: dict[int, list[str]],
              touched: set[int], redirects: list[tuple[str, tuple[str, ...]]]) -> None:
        with os.scandir(real) as it:
            items = sorted(it, key=lambda d: d.name)
        for d in items:
            path = f"{prefix}/{d.name}" if prefix else d.name
            st = d.stat(follow_symlinks=False)
            lower = self.trees.child(lower_dir, encode_name(d.name))
            if lower is not None and lower.kind == K_FILE and lower.ino:
                touched.add(lower.ino)
            if _is_whiteout(st):
                if lower is not None:
                    out.changes[path] = None
                continue
            if statmod.S_ISDIR(st.st_mode):
                child_parts = None if lower_parts is None else (*lower_parts, d.name)
                self._dir(d.path, path, st, lower, lower_parts, child_parts, out, links,
                          touched, redirects)
                continue
            linked = statmod.S_ISREG(st.st_mode) and st.st_nlink > 1
            # A linked name is published even when it equals the lower file: every
            # name of the group must carry the group's inode and count.
            entry = self._leaf(d.path, path, st, lower, out, keep=linked)
            if entry is not None:
                out.changes[path] = entry
            if linked:
                links.setdefault(st.st_ino, []).append(path)

    def _dir(self, real: str, path: str, st: os.stat_result, lower: Entry | None,
             lower_parent_parts: tuple[str, ...] | None, lower_parts: tuple[str, ...] | None,
             out: Scan, links: dict[int, list[str]],
             touched: set[int], redirects: list[tuple[str, tuple[str, ...]]]) -> None:
        mine = self._entry(real, st)
        opaque = localfile.read_xattr(real, OPAQUE) == b"y"
        redirect = localfile.read_xattr(real, REDIRECT)
        if redirect is not None:
            target = redirect.decode("utf-8", "surrogateescape")
            if target.startswith("/"):
                parts = tuple(p for p in target.split("/") if p)
            elif lower_parent_parts is not None:
                # A relative redirect names an entry of the parent's lower directory,
                # which is itself elsewhere when the parent was renamed too.
                parts = (*lower_parent_parts, target)
            else:
                parts = (*[p for p in path.split("/")[:-1] if p], target)
            src = self.trees.resolve(self.lower_root, parts)
            src_dir = src if src is not None and src.kind == K_DIR else None
            base_ref = src_dir.ref if src_dir is not None else EMPTY_TREE_ID
            out.changes[path] = mine.with_(ref=base_ref)
            if src_dir is not None:
                redirects.append((path, parts))
            self._walk(real, path, src_dir, parts if src_dir is not None else None, out, links,
                       touched, redirects)
            return
        if opaque or lower is None or lower.kind != K_DIR:
            if lower is not None and lower.kind == K_DIR:
                # Opaque over a lower directory: replace it with an empty one, then
                # add what the upper holds.
                out.changes[path] = mine.with_(ref=EMPTY_TREE_ID)
            else:
                out.changes[path] = mine
            self._walk(real, path, None, None, out, links, touched, redirects)
            return
        if mine.attrs() != lower.attrs() or mine.mtime_ns != lower.mtime_ns:
            out.changes[path] = mine  # merge directory: attributes only
        self._walk(real, path, lower, lower_parts, out, links, touched, redirects)

    def _leaf(self, real: str, path: str, st: os.stat_result, lower: Entry | None, out: Scan,
              keep: bool = False) -> Entry | None:
        """A non-directory's entry (None for a file equal to `lower`, unless `keep`)."""
        if not statmod.S_ISREG(st.st_mode):
            return self._entry(real, st)
        key = stat_key(st)
        hit = self.cache.get(path, key) if self.cache is not None else None
        if hit is not None:
            # Published by the last commit and unchanged since (statcache.py says
            # why the key is enough): its objects are in the store already.
            e, out.cached[path] = hit
        else:
            e = self._read_file(real, st, lower, out)
        out.seen[path] = (key, e)
        return None if _same_file(e, lower) and not keep else e

    def _read_file(self, real: str, st: os.stat_result, lower: Entry | None, out: Scan
                   ) -> Entry:
        """A regular file's entry, read and hashed; its new objects go into `out`."""
        size = st.st_size
        out.files_hashed += 1
        out.bytes_hashed += size
        new: dict[bytes, tuple[int, int, bytes | None]] = {}  # id -> offset, length, bytes
        nodes: dict[bytes, bytes] = {}
        holding = 0

        def put(offset: int, data: bytes) -> bytes:
            nonlocal holding
            oid = object_id(BLOCK, data)
            if oid not in new:
                held = out.objects.held_bytes + holding + len(data) <= HELD_BYTES
                new[oid] = (offset, len(data), data if held else None)
                holding += len(data) if held else 0
            return oid

        def put_node(kind: int, raw: bytes) -> bytes:
            oid = object_id(kind, raw)
            nodes[oid] = raw
            return oid

        content = localfile.file_content(real, size, put, put_node)
        if not isinstance(content, tuple):
            return self._entry(real, st, size=size, data=content)
        _root, ref = content
        e = self._entry(real, st, size=size, ref=ref)
        if _same_file(e, lower):
            return e  # the snapshot's own file: nothing to upload
        lower_blocks: set[bytes] = set()
        if lower is not None and lower.kind == K_FILE and lower.ref is not None:
            get = self.trees.source.get_object
            with contextlib.suppress(StrataError, ValueError):
                lower_blocks = set(FileNode.decode(get(lower.ref)).all_block_ids(get))
        for oid, (offset, length, kept) in new.items():
            if oid in lower_blocks:
                continue
            if kept is not None:
                out.objects.put(oid, BLOCK, kept)
            else:
                out.objects.put_block(oid, real, offset, length)
        for oid, raw in nodes.items():
            out.objects.put(oid, FILENODE, raw)
        return e


def _final_paths(lower_path: str, changes: dict[str, Entry | None],
                 redirects: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """Where a lower entry that the upper layer did not replace is seen after the scan.

    At its own path unless it, or a directory above it, was deleted, replaced or
    made opaque; and below every directory redirected from one of its ancestors.
    """
    parts = lower_path.split("/")
    out = []
    for new, src in [("", ()), *redirects]:
        if len(parts) <= len(src) or tuple(parts[:len(src)]) != src:
            continue
        base = new.split("/") if new else []
        rest = parts[len(src):]
        for i in range(1, len(rest) + 1):
            c = changes.get("/".join(base + rest[:i]), _ABSENT)
            if c is _ABSENT:
                continue
            if i == len(rest) or c is None or c.kind != K_DIR or c.ref is not None:
                break  # replaced, deleted, or a directory whose contents come from elsewhere
        else:
            out.append("/".join(base + rest))
    return out


_ABSENT = Entry(kind=K_FIFO)


def _same_file(e: Entry, lower: Entry | None) -> bool:
    if lower is None or lower.kind != K_FILE:
        return False
    return (e.size == lower.size and e.ref == lower.ref and e.data == lower.data
            and e.attrs() == lower.attrs() and e.mtime_ns == lower.mtime_ns)

