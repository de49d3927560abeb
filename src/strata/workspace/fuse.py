"""The pyfuse3 adapter: one directory holding one file, the workspace device.

A loop device is set up on `DIR/disk` and the filesystem mounted on it. The
loop driver turns the filesystem's writes into writes of this file and its
flushes (journal commits, `fsync`, `sync`) into `fsync` of this file, which
`Device.flush` answers only once the store holds the data durably.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from strata.workspace.device import Device, DeviceError

log = logging.getLogger(__name__)
T = TypeVar("T")
ROOT = pyfuse3.ROOT_INODE
DISK = ROOT + 1
NAME = b"disk"


# A flush of at most this many dirty bytes runs on the event loop: its publish
# takes about a millisecond, less than the hop to a thread and back costs
# beside it. Larger ones (write-back of a big copy) run in a thread, so
# reads and writes go on meanwhile.
INLINE_FLUSH = 1 << 20


def _report(exc: Exception) -> None:
    """Log why a request fails with EIO (the store is unreachable, damaged, or fenced us)."""
    if isinstance(exc, DeviceError):
        log.warning("%s", exc)
    else:  # not one strata expects: keep where it came from
        log.warning("%s: %s", type(exc).__name__, exc, exc_info=exc)


async def _call(fn: Callable[..., T], *args: Any) -> T:
    try:
        return await trio.to_thread.run_sync(fn, *args)
    except Exception as exc:
        _report(exc)
        raise pyfuse3.FUSEError(errno.EIO) from None


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, device: Device) -> None:
        super().__init__()
        self.device = device

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.entry_timeout = a.attr_timeout = 3600.0
        if inode == ROOT:
            a.st_mode = stat.S_IFDIR | 0o700
            a.st_nlink = 2
        elif inode == DISK:
            a.st_mode = stat.S_IFREG | 0o600
            a.st_nlink = 1
            a.st_size = self.device.layout.size
            a.st_blksize = self.device.layout.block
            a.st_blocks = a.st_size // 512
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        a.st_uid = os.getuid()
        a.st_gid = os.getgid()
        return a

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None
                     ) -> pyfuse3.EntryAttributes:
        if parent_inode == ROOT and name == NAME:
            return self._attr(DISK)
        if parent_inode == ROOT and name in (b".", b".."):
            return self._attr(ROOT)
        raise pyfuse3.FUSEError(errno.ENOENT)

    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attr(inode)

    async def setattr(self, inode: int, attr: Any, fields: Any, fh: int | None,
                      ctx: Any) -> pyfuse3.EntryAttributes:
        if fields.update_size and attr.st_size != self.device.layout.size:
            raise pyfuse3.FUSEError(errno.EPERM)  # the device's size is its layout's
        return self._attr(inode)

    async def opendir(self, inode: int, ctx: Any) -> int:
        if inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return ROOT

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        if start_id < 1:
            pyfuse3.readdir_reply(token, NAME, self._attr(DISK), 1)

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if inode != DISK:
            raise pyfuse3.FUSEError(errno.EISDIR)
        fi = pyfuse3.FileInfo(fh=DISK)
        fi.direct_io = True   # the loop device and the filesystem cache pages already
        self.device.opened()
        return fi

    async def read(self, fh: int, off: int, size: int) -> bytes:
        data = self.device.try_read(off, size)  # in memory: no thread hop
        return data if data is not None else await _call(self.device.read, off, size)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        try:
            if self.device.try_write(off, buf):  # nothing to fetch: no thread hop
                return len(buf)
        except DeviceError as exc:
            _report(exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        return await _call(self.device.write, off, buf)

    async def fsync(self, fh: int, datasync: bool) -> None:
        if self.device.deferring:
            return  # mkfs or mount is running: the attach publishes once it returns
        try:
            if self.device.try_flush(INLINE_FLUSH):  # a journal commit: no thread hop
                return
        except Exception as exc:
            _report(exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        await _call(self.device.flush)

    async def flush(self, fh: int) -> None:
        return None  # close() is not a barrier; fsync is

    async def release(self, fh: int) -> None:
        self.device.closed()

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = self.device.layout.block
        s.f_blocks = self.device.layout.size // self.device.layout.block
        s.f_namemax = 255
        return s


def serve(device: Device, mountpoint: str, *, on_ready: Callable[[], None] | None = None
          ) -> None:
    """Serve the device file at `mountpoint/disk` until unmounted (blocks)."""
    options = set(pyfuse3.default_options)
    options |= {"fsname=strata-workspace", "subtype=strata"}
    options.discard("default_permissions")
    pyfuse3.init(Operations(device), mountpoint, options)

    async def main() -> None:
        if on_ready is not None:
            on_ready()
        await pyfuse3.main(min_tasks=4, max_tasks=32)

    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=True)
