"""The stat cache: what a mount's last commit published, per upper file.

Like git's index, it remembers for each regular file of a volume's upper
directory the lstat fields that change whenever the file does (size, mtime,
ctime, inode, device) and the entry the commit published for it. A later
scan takes that entry again for a file whose fields are all the same, and
reads and hashes only the others, so `status` and `commit` cost what
changed since the last commit rather than what the upper directory holds.

What it must never do is hand back an entry for bytes that changed. So:
- ctime is in the key: chmod, chown, xattrs, and resetting the mtime with
  utime all move it, and nobody can set it back.
- The racy-clean rule (git's): a file is remembered only if its mtime and
  ctime are strictly older than a timestamp the upper filesystem itself gave
  when the scan began. A file written in the same timestamp tick as the scan
  could be written again in that tick, after it was read, with the same size
  and times; such a file is read again by every scan until it is older.
- The file is written only by a commit that published, for a scan of the
  same pinned snapshot and base; a file that is damaged, of another version,
  or of another base or pin is ignored (and replaced by the next commit),
  never trusted.

Layout (docs/format.md, "The mount's stat cache"): 8-byte magic, u16 version,
2 bytes zero, the BLAKE3 of the body, then the body in msgpack.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any

import blake3

from strata.engine.objects import K_FILE, Entry, packb, unpackb

MAGIC = b"STRATASC"
VERSION = 1
_HEAD = struct.Struct("<8sHH32s")  # magic, version, zero, BLAKE3 of the body

Key = tuple[int, int, int, int, int]  # size, mtime_ns, ctime_ns, inode, device


def stat_key(st: os.stat_result) -> Key:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


@dataclass
class StatCache:
    """Files remembered by path, and why a file on disk was not used (if it was not).

    A record is the file's row of the body (see `save`), kept as decoded;
    its entry is built only when a scan asks for that path.
    """

    records: dict[str, list[Any]] = field(default_factory=dict)
    ignored: str = ""

    def get(self, path: str, key: Key) -> tuple[Entry, str] | None:
        """The entry remembered for `path` and its digest, if `key` is still its key."""
        r = self.records.get(path)
        if r is None or (r[1], r[2], r[3], r[4], r[5]) != key:
            return None
        e = Entry(K_FILE, r[6], r[7], r[8], r[2], r[1], r[9], r[10], 0,
                  tuple((bytes(k), bytes(v)) for k, v in r[11]) if r[11] else (), 0, 1)
        return e, r[12]


def fs_now(directory: str) -> tuple[int, int]:
    """(now as the filesystem of `directory` stamps it, that filesystem's device).

    A new file's mtime: the same clock and granularity as the upper files'
    own times, which a reading of the system clock would not be (a
    filesystem with one-second times would make every same-second rewrite
    look older than the scan).
    """
    fd, name = tempfile.mkstemp(dir=directory, prefix=".stamp-")
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
        os.unlink(name)
    return st.st_mtime_ns, st.st_dev


def load(path: str, *, volume: str, pinned: str, base: str) -> StatCache:
    """The cache at `path`; an empty one (with the reason) when it cannot be trusted."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return StatCache()
    except OSError as exc:
        return StatCache(ignored=f"unreadable: {exc}")
    if len(raw) < _HEAD.size:
        return StatCache(ignored="truncated")
    magic, version, _zero, digest = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        return StatCache(ignored="not a stat cache")
    if version != VERSION:
        return StatCache(ignored=f"unknown version {version} (this strata reads {VERSION})")
    body = raw[_HEAD.size:]
    if blake3.blake3(body).digest() != digest:
        return StatCache(ignored="checksum mismatch")
    try:
        return _decode(unpackb(body), volume, pinned, base)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        return StatCache(ignored=f"malformed: {exc}")


def _decode(doc: Any, volume: str, pinned: str, base: str) -> StatCache:
    if not isinstance(doc, list) or len(doc) != 5:
        raise ValueError("body is not [volume, pinned, base, stamp, files]")
    if (doc[0], doc[1], doc[2]) != (volume, pinned, base):
        return StatCache(ignored=f"made for {doc[0]} at {str(doc[2])[:12]} "
                                 f"(pinned {str(doc[1])[:12]})")
    out: dict[str, list[Any]] = {}
    for r in doc[4]:
        # The checksum vouches that this strata wrote it; the types are checked
        # anyway, cheaply, since an entry built from them is published as is.
        if (not isinstance(r, list) or len(r) != 13 or not isinstance(r[0], bytes)
                or not all(type(x) is int for x in r[1:9])
                or not (r[9] is None or (isinstance(r[9], bytes) and len(r[9]) == 32))
                or not (r[10] is None or isinstance(r[10], bytes))
                or (r[9] is None) == (r[10] is None)
                or not (r[11] is None or isinstance(r[11], list))
                or not isinstance(r[12], str)):
            raise ValueError("a file record does not have the documented fields")
        out[os.fsdecode(r[0])] = r
    return StatCache(out)


def record(path: str, key: Key, e: Entry, digest: str, stamp_ns: int) -> list[Any] | None:
    """A file's row of the body, or None when it may not be remembered.

    `digest` is the entry's digest as state.json's are made. A file whose
    mtime or ctime is not older than `stamp_ns` (the scan's start, from
    fs_now) is left out: see the racy-clean rule above.
    """
    if not (key[1] < stamp_ns and key[2] < stamp_ns and e.kind == K_FILE
            and e.mtime_ns == key[1] and e.size == key[0]):
        return None
    return [os.fsencode(path), *key, e.mode, e.uid, e.gid, e.ref, e.data,
            [list(x) for x in e.xattrs] or None, digest]


def save(path: str, *, volume: str, pinned: str, base: str, stamp_ns: int,
         files: list[list[Any]]) -> None:
    """Write what a commit published: rows from `record`, or rows of the cache it read.

    No fsync: a torn file fails its checksum and is rebuilt, at the cost of
    one full scan.
    """
    body = packb([volume, pinned, base, stamp_ns, files])
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(MAGIC, VERSION, 0, blake3.blake3(body).digest()))
            f.write(body)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
