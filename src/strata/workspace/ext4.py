"""The kernel's side of an attach: ext4 on the loop device, and the mounts around it.

How the filesystem is made (`MKFS`), mounted (`MOUNT_OPTIONS`), frozen for a
snapshot (`FIFREEZE`, `FITHAW`), and which of its blocks are free after an
unmount (`free_ranges`, from dumpe2fs); and the clean-up of what a daemon
leaves mounted: other views of its filesystem, its FUSE directory, its FUSE
connections. Nothing here talks to a store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Iterable

from strata.mount import mountinfo
from strata.mount.mountinfo import Mount

log = logging.getLogger(__name__)

FIFREEZE = 0xC0045877
FITHAW = 0xC0045878
# No fast_commit: it made an fsync ~15% cheaper (one small block instead of a
# journal transaction), but its replay after a host loss made the first
# `git status` on host 2 slower (0.76-1.37 s against 0.64-0.81 s; docs/workspaces.md).
MKFS = ["mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"]
# Ordered journal commits, not journal_async_commit (which needs data=writeback):
# async commits made an fsync one durable publish instead of two (p50 2.1-2.3 ms
# against 2.9-4.2), but jbd2 ignores the result of the flush after an async
# commit, so a flush that fails (this daemon killed, the server refusing a fenced
# host) still acknowledges the fsync. Host-loss tests lost acknowledged O_DSYNC
# appends that way (docs/workspaces.md, "Why ordered journal commits").
MOUNT_OPTIONS = "noatime,nosuid,nodev"  # what a workspace holds never raises privilege


def free_ranges(dumpe2fs: str) -> list[tuple[int, int]]:
    """(offset, length) in bytes of every free range `dumpe2fs` lists per group."""
    bsize = 0
    out: list[tuple[int, int]] = []
    for line in dumpe2fs.splitlines():
        if line.startswith("Block size:"):
            bsize = int(line.split(":")[1])
        elif line.startswith("  Free blocks: ") and bsize:
            for part in line.split(":", 1)[1].split(","):
                part = part.strip()
                if not part:
                    continue
                a, _, b = part.partition("-")
                first, last = int(a), int(b or a)
                out.append((first * bsize, (last - first + 1) * bsize))
    return out


def fuse_connections(mounts: str | Iterable[Mount], fstype: str = "fuse.strata") -> list[int]:
    """The FUSE connection numbers of the `fstype` mounts listed (a mountinfo text, or parsed)."""
    listed = mountinfo.parse(mounts) if isinstance(mounts, str) else mounts
    return [m.fuse_connection for m in listed
            if m.fstype == fstype and m.fuse_connection is not None]


def abort_fuse(connections: list[int]) -> None:
    """Abort FUSE connections whose daemon is dead, so what waits on them fails now.

    A daemon killed with requests in flight can leave its connection waiting
    (and the loop device and ext4 above it alive) until it is aborted.
    """
    ctl = "/sys/fs/fuse/connections"
    if connections and not os.listdir(ctl):
        subprocess.run(["mount", "-t", "fusectl", "none", ctl], capture_output=True)
    for conn in connections:
        with contextlib.suppress(OSError), open(os.path.join(ctl, str(conn), "abort"), "w") as f:
            f.write("1")


def unmount_views(directory: str) -> None:
    """Lazily unmount every other mount of the filesystem at `directory`.

    A step's runner shows a workspace root to its sandbox through an idmapped
    copy of this mount; a runner that died leaves that copy behind, and it
    would keep the filesystem (and the device) busy forever.
    """
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return
    want = f"{os.major(dev)}:{os.minor(dev)}"
    real = os.path.realpath(directory)
    views = [m.point for m in mountinfo.read() if m.device == want]
    for mp in reversed(views):
        if mp != real:
            subprocess.run(["umount", "-l", mp], capture_output=True)


def release_device(devdir: str, deadline: float | None, every: float = 0.05) -> bool:
    """Unmount the daemon's FUSE directory once the loop device lets go of it.

    The loop device holds the file until autoclear has run after the
    filesystem on it is gone. False if it is still held at `deadline`.
    """
    while True:
        q = subprocess.run(["fusermount3", "-u", devdir], capture_output=True)
        if q.returncode == 0 or not os.path.ismount(devdir):
            return True
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(every)
