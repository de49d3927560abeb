"""The pyfuse3 adapter: translate FUSE requests to `SnapshotFS` calls.

Only translation lives here: inode numbers, attributes, errno, and moving
blocking store calls off the trio loop. Snapshots never change, so entries
and attributes are cached by the kernel for a day and file pages are kept
across opens. The one kernel setting it makes is the mount's read-ahead
(`READ_AHEAD_KB`, see `_ReadAheadTuner`).
"""

from __future__ import annotations

import ctypes.util
import errno
import logging
import os
import stat as statmod
from collections.abc import Callable
from typing import Any, TypeVar

_real_find_library = ctypes.util.find_library


def _find_library(name: str) -> str | None:
    # trio looks up libpthread when imported, only to name its threads, and
    # find_library runs `ldconfig -p` in a child process for that: 18 ms of every
    # mount and every step. The C library already loaded answers (glibc 2.34 and
    # later hold pthread_setname_np; elsewhere trio finds none and names nothing).
    return "libc.so.6" if name == "pthread" else _real_find_library(name)


ctypes.util.find_library = _find_library
try:
    import pyfuse3
    import trio
finally:
    ctypes.util.find_library = _real_find_library

from strata.engine.objects import K_DIR, K_FILE, FileNode  # noqa: E402
from strata.mount import mountinfo  # noqa: E402
from strata.mount.idshift import shift  # noqa: E402
from strata.mount.vfs import FsError, Node, SnapshotFS  # noqa: E402

log = logging.getLogger(__name__)

T = TypeVar("T")
CACHE_SECONDS = 86400.0
# The kernel's read-ahead for this mount, in KiB. A new FUSE mount gets 128 KiB, so a
# sequential read reached the mount process as 128 KiB requests: 4,096 round trips for
# 512 MiB, each a trio task, a thread-free lookup of 2 blocks and a reply (about half of
# the mount's CPU in a cold read). At 1 MiB the kernel sends 1 MiB requests (the FUSE
# maximum, 256 pages), and the same read costs half the CPU. Random reads are not
# affected (the kernel reads ahead only for sequential access); a page fault in a
# mapped lower file reads up to this much around it.
READ_AHEAD_KB = 1024


class _ReadAheadTuner:
    """Sets the mount's read-ahead once the kernel has taken the FUSE INIT answer.

    The kernel sets a FUSE mount's read-ahead from the INIT answer (never above
    its 128 KiB default), after `init` has run, so the setting is written on the
    first request instead: the kernel sends none before INIT is done, and every
    open of a file (which takes the read-ahead size) follows a lookup. The device
    comes from /proc/self/mountinfo: a stat of the mount point would be a request
    to this very process, which is not serving yet. Best effort: without /sys or
    root, reads only keep the kernel's default.
    """

    def __init__(self, target: str) -> None:
        # `target` is the mount point's real path, resolved before mounting: after
        # it, resolving the path would stat the mount's root, a request nobody serves.
        self.path: str | None = None
        try:
            for m in mountinfo.read():
                if m.point == target:
                    self.path = f"/sys/class/bdi/{m.device}/read_ahead_kb"
        except OSError:
            pass

    def apply(self) -> None:
        path, self.path = self.path, None
        if path is not None:
            try:
                with open(path, "w") as f:
                    f.write(str(READ_AHEAD_KB))
            except OSError as exc:  # best effort (see above): the kernel's default stays
                log.debug("read-ahead not set: %s", exc)


async def _call(fn: Callable[..., T], *args: Any) -> T:
    try:
        return await trio.to_thread.run_sync(fn, *args)
    except FsError as exc:
        raise pyfuse3.FUSEError(exc.errno) from None
    except FileNotFoundError:
        raise pyfuse3.FUSEError(errno.ENOENT) from None
    except Exception as exc:  # the store is unreachable or damaged: an I/O error, not a crash
        log.warning("a request fails with EIO: %s: %s", type(exc).__name__, exc,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        raise pyfuse3.FUSEError(errno.EIO) from None


def _fast(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except FsError as exc:
        raise pyfuse3.FUSEError(exc.errno) from None


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, fs: SnapshotFS, id_shift: int = 0) -> None:
        super().__init__()
        self.fs = fs
        self.id_shift = id_shift  # owners as a sandboxed step's host view shows them
        self._dirs: dict[int, list[tuple[bytes, Node]]] = {}
        self._files: dict[int, tuple[int, FileNode | None]] = {}
        self._next_fh = 1
        self.tuner: _ReadAheadTuner | None = None  # set by `run` once mounted

    def _tune(self) -> None:
        tuner, self.tuner = self.tuner, None
        if tuner is not None:
            tuner.apply()

    def _attr(self, n: Node) -> pyfuse3.EntryAttributes:
        e = n.entry
        a = pyfuse3.EntryAttributes()
        a.st_ino = n.ino
        a.generation = 0
        a.entry_timeout = CACHE_SECONDS
        a.attr_timeout = CACHE_SECONDS
        a.st_mode = e.st_mode
        a.st_nlink = e.nlink if e.kind == K_FILE else (2 if e.kind == K_DIR else 1)
        if self.id_shift:
            a.st_uid = shift(e.uid, self.id_shift)
            a.st_gid = shift(e.gid, self.id_shift)
        else:
            a.st_uid = e.uid
            a.st_gid = e.gid
        a.st_rdev = e.rdev
        a.st_size = e.size
        a.st_blksize = 65536
        a.st_blocks = (e.size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = e.mtime_ns
        return a

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None
                     ) -> pyfuse3.EntryAttributes:
        if self.tuner is not None:
            self._tune()
        node = self.fs._nodes.get(parent_inode)
        if node is not None and node.children is not None and name in node.children:
            return self._attr(self.fs._nodes[node.children[name]])  # warm: no thread hop
        return self._attr(await _call(self.fs.lookup, parent_inode, name))

    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        if self.tuner is not None:
            self._tune()
        return self._attr(_fast(self.fs.node, inode))

    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return _fast(self.fs.readlink, inode)

    async def opendir(self, inode: int, ctx: Any) -> int:
        listing = await _call(self.fs.listdir, inode)
        # "." and ".." come first, as from a disk filesystem: overlayfs passes a
        # directory that only the snapshot has straight through, and programs count
        # on them (`ls -a`, "empty if it has two entries" checks).
        node = _fast(self.fs.node, inode)
        dots = [(b".", node), (b"..", _fast(self.fs.node, node.parent))]
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = dots + listing
        return fh

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        listing = self._dirs.get(fh, [])
        for i in range(start_id, len(listing)):
            name, node = listing[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(node), i + 1):
                break

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if self.tuner is not None:
            self._tune()
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        node = _fast(self.fs.node, inode)
        if not statmod.S_ISREG(node.entry.st_mode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        fnode = await _call(self.fs.file_node, inode)
        await _call(self.fs.prefetch, inode)
        fh = self._next_fh
        self._next_fh += 1
        self._files[fh] = (inode, fnode)
        fi = pyfuse3.FileInfo(fh=fh)
        fi.keep_cache = True
        return fi

    async def read(self, fh: int, off: int, size: int) -> bytes:
        inode, fnode = self._files[fh]
        # Blocks already fetched ahead (and verified) are served without a thread hop.
        data = self.fs.read_nowait(inode, off, size, fnode)
        if data is not None:
            return data
        return await _call(self.fs.read, inode, off, size, fnode)

    async def release(self, fh: int) -> None:
        inode, _fnode = self._files.pop(fh, (0, None))
        if inode and not any(i == inode for i, _f in self._files.values()):
            self.fs.readahead.forget(inode)

    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        return _fast(self.fs.getxattr, inode, name)

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        return _fast(self.fs.listxattr, inode)

    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return True  # default_permissions: the kernel checks modes itself

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = 65536
        s.f_frsize = 65536
        s.f_blocks = s.f_bfree = s.f_bavail = 1 << 24
        s.f_files = s.f_ffree = s.f_favail = 1 << 24
        s.f_namemax = 255
        return s

    async def forget(self, inode_list: Any) -> None:
        return None  # inodes of an immutable snapshot are kept for the mount's life


def run(fs: SnapshotFS, mountpoint: str, *, fsname: str = "strata",
        on_ready: Callable[[], None] | None = None, id_shift: int = 0,
        privileged: bool = False) -> None:
    """Mount and serve until unmounted (blocks); owners shown plus `id_shift` (idshift.py).

    libfuse mounts nosuid,nodev unless told `suid` and `dev` (`privileged`).
    """
    options = set(pyfuse3.default_options)
    options |= {f"fsname={fsname}", "ro", "allow_other", "subtype=strata"}
    if privileged:
        options |= {"suid", "dev"}
    options.discard("default_permissions")
    options.add("default_permissions")
    ops = Operations(fs, id_shift)
    target = os.path.realpath(mountpoint)
    pyfuse3.init(ops, mountpoint, options)
    ops.tuner = _ReadAheadTuner(target)

    async def main() -> None:
        if on_ready is not None:
            on_ready()
        await pyfuse3.main(min_tasks=4, max_tasks=64)

    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=True)
