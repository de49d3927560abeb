"""Loop devices, set up with one `LOOP_CONFIGURE` ioctl.

The device is configured with direct I/O (its reads and writes go straight to
the FUSE file, so pages are not cached twice) and autoclear (it goes away by
itself when the filesystem on it is unmounted, also when a host's mount
namespace dies with it).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import time

log = logging.getLogger(__name__)

LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LOOP_CLR_FD = 0x4C01
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
# struct loop_config { u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]; }
# struct loop_info64 { u64 device, inode, rdevice, offset, sizelimit; u32 number,
#   encrypt_type, encrypt_key_size, flags; u8 file_name[64], crypt_name[64],
#   encrypt_key[32]; u64 init[2]; }
_CONFIG = struct.Struct("=II QQQQQ IIII 64s64s32s QQ 64x")


def attach(path: str, *, block_size: int = 4096) -> tuple[str, int]:
    """A new loop device on `path`: its name (/dev/loopN) and an open descriptor.

    Keep the descriptor open until the filesystem is mounted: autoclear
    detaches the device at its last close.
    """
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        for _attempt in range(20):
            ctl = os.open("/dev/loop-control", os.O_RDWR)
            try:
                n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
            finally:
                os.close(ctl)
            dev = f"/dev/loop{n}"
            if not os.path.exists(dev):
                os.mknod(dev, 0o660 | 0o060000, os.makedev(7, n))
            lfd = os.open(dev, os.O_RDWR)
            try:
                cfg = _CONFIG.pack(fd, block_size, 0, 0, 0, 0, 0, 0, 0, 0,
                                   LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO,
                                   os.fsencode(path)[:63], b"", b"", 0, 0)
                fcntl.ioctl(lfd, LOOP_CONFIGURE, cfg)
                return dev, lfd
            except OSError as exc:
                os.close(lfd)
                if exc.errno != errno.EBUSY:  # taken by someone else meanwhile: next one
                    raise
            time.sleep(0.01)
        raise OSError(errno.EBUSY, "no free loop device")
    finally:
        os.close(fd)


def detach(dev: str) -> None:
    """Detach now (when nothing has it open); autoclear covers the rest."""
    try:
        fd = os.open(dev, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.ioctl(fd, LOOP_CLR_FD)
    except OSError as exc:
        if exc.errno not in (errno.ENXIO, errno.EBUSY):
            raise
    finally:
        os.close(fd)
