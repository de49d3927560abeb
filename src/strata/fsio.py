"""Copying between a local directory and a snapshot: import and export.

This module sits directly above the engine and speaks only the `Store`
interface. `import_dir` turns a directory into one change set against a base
snapshot (so a stale base replays or conflicts like any other publish);
`export_snapshot` writes a snapshot out with its metadata. It never prints and
never reads environment variables; what it could not restore is returned to
the caller.

Change detection follows rsync's quick check: a regular file whose size and
nanosecond mtime equal the base entry's keeps the base's content without being
read. Metadata (mode, owner, xattrs, link count) is always compared.
"""

from __future__ import annotations

import errno
import os
import stat as st
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from strata import localfile
from strata.engine.errors import InvalidInput, NotFound
from strata.engine.interface import ChangeSet, Store
from strata.engine.names import MAX_NAME, MAX_PATH, check_name
from strata.engine.objects import (
    K_BLK,
    K_CHR,
    K_DIR,
    K_FIFO,
    K_FILE,
    K_SOCK,
    K_SYMLINK,
    Entry,
    FileNode,
    link_group,
)
from strata.engine.tree import NodeCache, Trees, decode_name
from strata.engine.txn import ContentWriter

Progress = Callable[[int, int], None]
# Extended attributes that grant privileges (security.capability acts on exec like a
# setuid bit) or belong to the kernel and root: restored only by a privileged export.
GUARDED_XATTRS = (b"security.", b"trusted.")
# A target that refuses an xattr (no support, or a namespace only root may set) is reported.
_UNSETTABLE_XATTR = (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES)
_PROGRESS_EVERY = 256


# -- import ------------------------------------------------------------------------


@dataclass(slots=True)
class _Local:
    """One scanned path: its lstat and kind."""

    rel: str
    abs: str
    st: os.stat_result
    kind: int


def _scan(root: str) -> Iterator[_Local]:
    """Every path below `root`, each directory before its children."""
    stack = [("", root)]
    while stack:
        rel_dir, abs_dir = stack.pop()
        with os.scandir(abs_dir) as it:
            items = sorted(it, key=lambda d: d.name)  # a stable order for link groups
        for d in items:
            rel = f"{rel_dir}/{d.name}" if rel_dir else d.name
            if len(os.fsencode(d.name)) > MAX_NAME or len(os.fsencode(rel)) > MAX_PATH:
                raise InvalidInput(f"cannot import {d.path!r}: name or path too long for a volume "
                                   f"({MAX_NAME}-byte names, {MAX_PATH}-byte paths)")
            s = d.stat(follow_symlinks=False)
            kind = localfile.kind_of(s.st_mode)
            if kind is None:
                raise InvalidInput(f"cannot import {d.path!r}: unknown file type")
            yield _Local(rel, d.path, s, kind)
            if kind == K_DIR:
                stack.append((rel, d.path))


def _quick_same(loc: _Local, base: Entry | None) -> bool:
    """The quick check rsync makes: same size and mtime means the same content."""
    return (base is not None and base.kind == K_FILE and base.size == loc.st.st_size
            and base.mtime_ns == loc.st.st_mtime_ns)


def _read_file(cw: ContentWriter, loc: _Local) -> tuple[bytes | None, bytes | None]:
    """Read a file's content into `cw`: (file node id, inline data)."""
    content = localfile.file_content(loc.abs, loc.st.st_size,
                                     lambda _off, data: cw.block(data), cw.add)
    if isinstance(content, tuple):
        return content[1], None
    return None, content


def import_dir(store: Store, volume: str, branch: str, src_dir: str, *,
               base: str | None = None, message: str = "",
               progress: Progress | None = None, identical: bool = False,
               snapshot_meta: dict[str, Any] | None = None) -> str:
    """Make the branch's tree equal to `src_dir`, as one change set; return the new head.

    The change set holds only what differs from `base` (default: the branch
    head): new or changed entries, and None for paths the directory no longer
    has. Publishing replays it onto a moved head or raises `Conflict`.
    """
    if not os.path.isdir(src_dir):
        raise NotFound(f"no such directory: {src_dir!r}")
    src_dir = os.path.realpath(src_dir)  # a symlink to a directory imports the directory
    if base is None:
        base = store.head(volume, branch)
    else:
        store.head(volume, branch)  # the branch must exist
    base_root = store.snapshot(base).root
    cw = ContentWriter(store)
    trees = Trees(cw, NodeCache())

    def base_children(e: Entry | None) -> dict[str, Entry]:
        if e is None or e.kind != K_DIR or e.ref is None:
            return {}
        return {decode_name(n): c for n, c in trees.iter_dir(e.ref)}

    # 1. Scan: every local path with its base entry (None when new).
    root_stat = os.lstat(src_dir)
    scanned: list[tuple[_Local, Entry | None]] = []
    changes: dict[str, Entry | None] = {}
    base_dirs: dict[str, dict[str, Entry]] = {"": base_children(base_root)}
    seen: dict[str, set[str]] = {"": set()}
    for loc in _scan(src_dir):
        parent, _, name = loc.rel.rpartition("/")
        seen[parent].add(name)
        b = base_dirs[parent].get(name)
        scanned.append((loc, b))
        if loc.kind == K_DIR:
            base_dirs[loc.rel] = base_children(b)
            seen[loc.rel] = set()
    for parent, children in base_dirs.items():
        for name in children.keys() - seen[parent]:
            changes[f"{parent}/{name}" if parent else name] = None
    del base_dirs, seen

    # 2. Hard-link groups: regular files sharing (st_dev, st_ino) inside the tree.
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (loc, _b) in enumerate(scanned):
        if loc.kind == K_FILE and loc.st.st_nlink > 1:
            groups.setdefault((loc.st.st_dev, loc.st.st_ino), []).append(i)
    ino_of: dict[int, tuple[int, int]] = {}  # scanned index -> (ino, nlink)
    used: set[int] = set()
    for members in sorted((m for m in groups.values() if len(m) > 1), key=lambda m: m[0]):
        ino = 0
        for i in members:  # keep the base's number when it still names this group
            b = scanned[i][1]
            if b is not None and b.kind == K_FILE and b.ino and b.ino not in used:
                ino = b.ino
                break
        if not ino:
            first = scanned[members[0]][0].rel
            ino = link_group(b"import\0" + os.fsencode(first))
            while ino in used:
                ino += 2
        used.add(ino)
        for i in members:
            ino_of[i] = (ino, len(members))

    # 3. Entries: read only files whose quick check fails.
    root_meta = localfile.entry(src_dir, root_stat)
    if _dir_differs(root_meta, base_root):
        changes[""] = root_meta
    total = sum(1 for loc, _ in scanned if loc.kind != K_DIR)
    done = 0
    linked: dict[int, Entry] = {}  # ino -> the group's entry, once built
    for i, (loc, b) in enumerate(scanned):
        if loc.kind == K_DIR:
            meta = localfile.entry(loc.abs, loc.st)
            if _dir_differs(meta, b):
                changes[loc.rel] = meta
            continue
        done += 1
        if loc.kind != K_FILE:
            new = localfile.entry(loc.abs, loc.st)
        else:
            ino, nlink = ino_of.get(i, (0, 1))
            hit = linked.get(ino) if ino else None
            if hit is not None:
                new = hit
            else:
                src = b if _quick_same(loc, b) else None
                if src is None and ino:
                    src = next((scanned[j][1] for j in groups[(loc.st.st_dev, loc.st.st_ino)]
                                if _quick_same(loc, scanned[j][1])), None)
                if src is not None:
                    new = localfile.entry(loc.abs, loc.st, size=src.size, ref=src.ref,
                                          data=src.data, ino=ino, nlink=nlink)
                else:
                    ref, data = _read_file(cw, loc)
                    new = localfile.entry(loc.abs, loc.st, size=loc.st.st_size, ref=ref,
                                          data=data, ino=ino, nlink=nlink)
                if ino:
                    linked[ino] = new
        if new != b:
            changes[loc.rel] = new
        if progress is not None and done % _PROGRESS_EVERY == 0:
            progress(done, total)
    if progress is not None:
        progress(done, total)
    cw.flush()
    (sid,) = store.publish([ChangeSet(volume, branch, base, changes, message,
                                      dict(snapshot_meta or {}),
                                      identical=identical)])
    return sid


def _dir_differs(meta: Entry, base: Entry | None) -> bool:
    return (base is None or base.kind != K_DIR or base.attrs() != meta.attrs()
            or base.mtime_ns != meta.mtime_ns)


# -- export ------------------------------------------------------------------------


@dataclass(slots=True)
class ExportReport:
    """What an export wrote, and what it could not restore (with the reason)."""

    files: int = 0
    dirs: int = 0
    links: int = 0
    skipped: list[str] = field(default_factory=list)


def _write_content(fd: int, cw: ContentWriter, e: Entry) -> None:
    if e.ref is None:
        data = e.data or b""
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return
    node = FileNode.decode(cw.get_object(e.ref))
    for length, piece in node.pieces(0, node.size, cw.get_object):
        if piece is None:  # a hole stays a hole
            os.lseek(fd, length, os.SEEK_CUR)
            continue
        view = memoryview(piece)
        while view:
            view = view[os.write(fd, view):]
    os.ftruncate(fd, node.size)


class _Exporter:
    """Writes a snapshot below one directory and nowhere else.

    Every entry is created relative to an open descriptor of the directory
    that holds it (mkdirat, openat with O_EXCL|O_NOFOLLOW, symlinkat, mknodat)
    and every name is checked to be a single component first, so neither a
    hostile name (``..``, ``a/b``) nor a symlink in the snapshot followed by
    an entry "under" it can reach outside the target, even if validation on
    publish missed something. Symlinks are created, never followed.
    """

    def __init__(self, store: Store, report: ExportReport, privileged: bool) -> None:
        self.cw = ContentWriter(store)
        self.trees = Trees(self.cw, NodeCache())
        self.report = report
        self.root = os.geteuid() == 0
        self.privileged = privileged
        self.unowned = 0
        self.setid = 0
        self.guarded = 0  # entries whose security.* / trusted.* xattrs were left out
        self.progress: Callable[[int, int], None] | None = None
        self.links: dict[int, str] = {}  # hard-link group -> first path (from the root fd)

    def owner(self, dfd: int, name: str, e: Entry) -> None:
        try:
            os.chown(name, e.uid, e.gid, dir_fd=dfd, follow_symlinks=False)
        except PermissionError:
            if self.root:
                raise
            self.unowned += 1  # reported once: every entry of a foreign tree fails alike

    def xattrs(self, dfd: int, name: str, rel: str, e: Entry) -> None:
        # No *at form of setxattr: /proc/self/fd/N is the directory we hold open, and
        # `name` in it is the entry this export just created (never followed).
        path = f"/proc/self/fd/{dfd}/{name}"
        guarded = False
        for key, value in e.xattrs:
            if key.startswith(GUARDED_XATTRS) and not self.privileged:
                # security.capability grants privileges on exec like a setuid bit, and
                # security.* / trusted.* are the kernel's and root's: only when asked.
                guarded = True
                continue
            try:
                os.setxattr(path, key, value, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in _UNSETTABLE_XATTR:
                    raise
                self.report.skipped.append(
                    f"xattr {os.fsdecode(key)} on {rel} ({exc.strerror})")
        self.guarded += guarded

    def mode_of(self, e: Entry) -> int:
        if e.mode & 0o6000 and not self.privileged:
            self.setid += 1
            return e.mode & ~0o6000
        return e.mode

    def finish(self, dfd: int, name: str, rel: str, e: Entry) -> None:
        """Owner, xattrs, mode, mtime, in the order that keeps each one."""
        if self.root or (e.uid, e.gid) != (os.geteuid(), os.getegid()):
            self.owner(dfd, name, e)  # before chmod: chown clears set-id bits
        self.xattrs(dfd, name, rel, e)
        if e.kind != K_SYMLINK:
            os.chmod(f"/proc/self/fd/{dfd}/{name}", self.mode_of(e))
        os.utime(name, ns=(e.mtime_ns, e.mtime_ns), dir_fd=dfd, follow_symlinks=False)

    def special(self, dfd: int, name: str, rel: str, e: Entry) -> bool:
        if e.kind in (K_CHR, K_BLK) and not self.privileged:
            self.report.skipped.append(f"device node {rel} (export with --privileged)")
            return False
        fmt = {K_FIFO: st.S_IFIFO, K_CHR: st.S_IFCHR, K_BLK: st.S_IFBLK,
               K_SOCK: st.S_IFSOCK}[e.kind]
        try:
            os.mknod(name, fmt | 0o600, e.rdev, dir_fd=dfd)
        except PermissionError as exc:
            self.report.skipped.append(f"special file {rel} ({exc.strerror})")
            return False
        return True

    def finish_root(self, rootfd: int, root: Entry) -> None:
        if self.root or (root.uid, root.gid) != (os.geteuid(), os.getegid()):
            try:
                os.fchown(rootfd, root.uid, root.gid)
            except PermissionError:
                if self.root:
                    raise
        self.xattrs(rootfd, ".", ".", root)
        os.fchmod(rootfd, self.mode_of(root))
        os.utime(rootfd, ns=(root.mtime_ns, root.mtime_ns))

    def run(self, root: Entry, rootfd: int) -> None:
        self.directory(rootfd, rootfd, "", root)
        if self.unowned:
            self.report.skipped.append(
                f"the owners of {self.unowned} entries (only root may give files away)")
        if self.setid:
            self.report.skipped.append(
                f"setuid/setgid bits of {self.setid} entries (export with --privileged)")
        if self.guarded:
            self.report.skipped.append(
                f"security.* and trusted.* xattrs (file capabilities among them) of "
                f"{self.guarded} entries (export with --privileged)")

    def directory(self, rootfd: int, dfd: int, rel: str, d: Entry) -> None:
        """Create the children of directory `d` (open as `dfd`), then finish them."""
        if d.ref is None:
            return
        subdirs: list[tuple[str, str, Entry]] = []
        for raw, e in self.trees.iter_dir(d.ref):
            name = os.fsdecode(check_name(raw))
            path = f"{rel}/{name}" if rel else name
            if self.progress is not None:
                done = self.report.files + self.report.dirs + self.report.links
                self.progress(done, 0)  # entries written; the total is not known ahead
            if e.kind == K_DIR:
                os.mkdir(name, 0o700, dir_fd=dfd)
                self.report.dirs += 1
                subdirs.append((name, path, e))
                continue
            if e.kind == K_FILE:
                if e.ino and e.ino in self.links:
                    os.link(self.links[e.ino], name, src_dir_fd=rootfd, dst_dir_fd=dfd,
                            follow_symlinks=False)
                    self.report.links += 1
                    continue
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=dfd)
                try:
                    _write_content(fd, self.cw, e)
                finally:
                    os.close(fd)
                self.report.files += 1
                if e.ino:
                    self.links[e.ino] = path
            elif e.kind == K_SYMLINK:
                os.symlink(os.fsdecode(e.data or b""), name, dir_fd=dfd)
            elif not self.special(dfd, name, path, e):
                continue
            self.finish(dfd, name, path, e)
        # Directories after their contents: their mtimes move as children appear, and
        # a read-only mode must not stop the children being written.
        for name, path, e in subdirs:
            cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=dfd)
            try:
                self.directory(rootfd, cfd, path, e)
            finally:
                os.close(cfd)
            self.finish(dfd, name, path, e)


def export_snapshot(store: Store, snapshot_id: str, dst_dir: str, *,
                    privileged: bool = False,
                    progress: Callable[[int, int], None] | None = None) -> ExportReport:
    """Write snapshot `snapshot_id` into `dst_dir`, which must be empty or absent.

    Setuid/setgid bits, device nodes and security.* / trusted.* xattrs (file
    capabilities) are restored only with `privileged` (what a snapshot holds is
    not trusted to grant privileges on this host).
    """
    root = store.snapshot(snapshot_id).root
    if os.path.lexists(dst_dir):
        if not os.path.isdir(dst_dir) or os.path.islink(dst_dir):
            raise InvalidInput(f"export target {dst_dir!r} is not a directory")
        if os.listdir(dst_dir):
            raise InvalidInput(f"export target {dst_dir!r} is not empty")
    else:
        os.makedirs(dst_dir)
    report = ExportReport()
    exporter = _Exporter(store, report, privileged)
    exporter.progress = progress
    rootfd = os.open(dst_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        exporter.run(root, rootfd)
        exporter.finish_root(rootfd, root)
    finally:
        os.close(rootfd)
    return report
