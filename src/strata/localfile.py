"""A local file as a snapshot stores it: its entry, its xattrs and its blocks.

Import and the mount's commit both turn files of a local filesystem into
entries and blocks. They share this one module so that the same file always
becomes the same entry: holes are never read, all-zero blocks are ZERO_ID,
symlink targets and xattr names are the raw bytes, and a filesystem without
xattrs reads as having none while any other error stops the caller (a
silently dropped xattr would vanish from the snapshot).
"""

from __future__ import annotations

import errno
import os
import stat as statmod
from collections.abc import Callable, Iterator

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


def file_blocks(path: str, size: int, block_size: int) -> Iterator[tuple[int, bytes | None]]:
    """(offset, bytes) for each block of the first `size` bytes; None for a block of zeros.

    Holes are never read, so a sparse 5 GiB file with a few bytes of data
    costs a few reads, not 5 GiB of zeros; a read block of zeros is reported
    as one too, so both are stored as ZERO_ID. A file shorter than `size`
    changed while being read and raises Unavailable.
    """
    bs = block_size
    nblocks = -(-size // bs)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        i = 0  # the next block to report
        for start, end in _data_spans(fd, size):
            first, stop = start // bs, (end - 1) // bs + 1
            for j in range(i, first):
                yield j * bs, None
            for j in range(max(i, first), stop):
                length = min(bs, size - j * bs)
                data = os.pread(fd, length, j * bs)
                if len(data) < length:
                    raise Unavailable(f"{path} changed while it was being read; try again")
                yield j * bs, None if data == bytes(length) else data
            i = max(i, stop)
        for j in range(i, nblocks):
            yield j * bs, None
    finally:
        os.close(fd)


def file_content(path: str, size: int, block_size: int,
                 put: Callable[[int, bytes], bytes]) -> bytes | FileNode:
    """The first `size` bytes of a regular file: inline bytes when small, else a file node.

    `put(offset, data)` stores one block that holds data and returns its id;
    blocks of zeros become ZERO_ID without a call.
    """
    if size <= INLINE_MAX:
        return b"".join(bytes(min(block_size, size - off)) if data is None else data
                        for off, data in file_blocks(path, size, block_size))
    blocks = tuple(ZERO_ID if data is None else put(off, data)
                   for off, data in file_blocks(path, size, block_size))
    return FileNode(size=size, block_size=block_size, blocks=blocks)
