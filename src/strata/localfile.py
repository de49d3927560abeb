"""A local file as a snapshot stores it: its entry, its xattrs and its chunks.

Import and the mount's commit both turn files of a local filesystem into
entries and blocks. They share this one module so that the same file always
becomes the same entry: holes are never read, all-zero chunks are holes (ZERO_ID),
symlink targets and xattr names are the raw bytes, and a filesystem without
xattrs reads as having none while any other error stops the caller (a
silently dropped xattr would vanish from the snapshot).
"""

from __future__ import annotations

import errno
import os
import stat as statmod
from collections.abc import Callable, Iterator

from strata.engine import filetree
from strata.engine.errors import InvalidInput, Unavailable
from strata.engine.kinds import KIND_OF_IFMT
from strata.engine.objects import (
    INLINE_MAX,
    K_BLK,
    K_CHR,
    K_SYMLINK,
    ZERO_ID,
    Entry,
    FileNode,
)

XAttrs = tuple[tuple[bytes, bytes], ...]

_NO_XATTR = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)  # absent, or unsupported here


def kind_of(mode: int) -> int | None:
    """The entry kind of an st_mode (None for a file type snapshots cannot hold)."""
    return KIND_OF_IFMT.get(statmod.S_IFMT(mode))


def read_xattr(path: str, name: bytes) -> bytes | None:
    """One xattr of `path` itself (never followed), or None when it has none."""
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in _NO_XATTR:
            return None
        raise


def read_xattrs(path: str, *, exclude: bytes | None = None) -> XAttrs:
    """The xattrs of `path` itself, sorted, leaving out names starting with `exclude`.

    `exclude` keeps a layer's own bookkeeping (overlayfs' ``trusted.overlay.``)
    out of the snapshot.
    """
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in _NO_XATTR:
            return ()
        raise
    out = []
    for name in names:
        key = os.fsencode(name)
        if exclude is not None and key.startswith(exclude):
            continue
        value = read_xattr(path, key)
        if value is not None:  # removed since it was listed
            out.append((key, value))
    return tuple(sorted(out))


def entry(path: str, s: os.stat_result, *, exclude: bytes | None = None, size: int = 0,
          ref: bytes | None = None, data: bytes | None = None, ino: int = 0,
          nlink: int = 1) -> Entry:
    """The entry of `path` from its lstat `s`; a file's content and link group come from the caller.

    Built in one call: dataclasses.replace() was a third of a 20k-file import.
    A symlink's mode is 0o777 whatever lstat says, as Linux ignores it and a
    link made through a transaction has that mode too.
    """
    kind = kind_of(s.st_mode)
    if kind is None:
        raise InvalidInput(f"unsupported file type at {path!r}")
    mode = statmod.S_IMODE(s.st_mode)
    if kind == K_SYMLINK:
        mode = 0o777
        data = os.readlink(os.fsencode(path))
        size = len(data)
    return Entry(kind, mode, s.st_uid, s.st_gid, s.st_mtime_ns, size, ref, data,
                 s.st_rdev if kind in (K_CHR, K_BLK) else 0, read_xattrs(path, exclude=exclude),
                 ino, nlink)


def _data_spans(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """Byte spans of the file that may hold data: all of it when the filesystem cannot tell."""
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: only a hole from here to the end
                yield off, size
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end <= start:
            return
        yield start, end
        off = end


READ_WINDOW = 4 * 1024 * 1024  # bytes read at a time while chunking a file


def file_chunks(path: str, size: int) -> Iterator[tuple[int, int, bytes | None]]:
    """(offset, length, bytes) of each chunk of the first `size` bytes; None for zeros.

    Data is cut by content (engine/filetree.py) a window at a time, carrying
    the last, unfinished chunk of each window into the next, so the cuts are
    those of the whole content in one buffer. Holes are never read: each is
    one entry however long, so a sparse 5 GiB file with a few bytes of data
    costs a few reads, not 5 GiB of zeros; a chunk read as zeros is reported
    as a hole too. A file shorter than `size` changed while being read and
    raises Unavailable.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        pos = 0  # everything before pos has been reported
        for start, end in _data_spans(fd, size):
            if start > pos:
                yield pos, start - pos, None
            chunker = filetree.Chunker()
            off = start  # file offset of the next chunk
            while True:
                want = min(READ_WINDOW, end - off - chunker.pending)
                if want:
                    data = os.pread(fd, want, off + chunker.pending)
                    if len(data) < want:
                        raise Unavailable(f"{path} changed while it was being read; try again")
                    pieces = chunker.feed(data)
                else:
                    pieces = chunker.finish()
                for piece in pieces:
                    yield off, len(piece), None if filetree.is_zero(piece) else piece
                    off += len(piece)
                if not want:
                    break
            pos = end
        if pos < size:
            yield pos, size - pos, None
    finally:
        os.close(fd)


def file_content(path: str, size: int, put_block: Callable[[int, bytes], bytes],
                 put_node: filetree.Put) -> bytes | tuple[FileNode, bytes]:
    """The first `size` bytes of a regular file: inline bytes when small, else its root node.

    `put_block(offset, data)` stores one chunk that holds data and returns its
    id; chunks of zeros become holes without a call. `put_node(kind, raw)`
    stores each file node of the tree; the root and its id are returned.
    """
    if size <= INLINE_MAX:
        return b"".join(bytes(n) if data is None else data
                        for _off, n, data in file_chunks(path, size))
    builder = filetree.TreeBuilder(put_node)
    for off, n, data in file_chunks(path, size):
        builder.add(n, ZERO_ID if data is None else put_block(off, data))
    return builder.finish()
