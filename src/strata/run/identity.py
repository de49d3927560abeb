"""Who a sandboxed step is on the host: its own unprivileged id range, and the views that map it.

A bwrap step runs as root inside a user namespace that maps its ids 0..65535
to a range of host ids nobody else uses: root inside is an ordinary,
unprivileged user outside, and two steps running at once are two different
users. Each step takes one of SLOTS ranges by holding an flock on the slot's
file for as long as it runs (a runner that dies lets go with its descriptors).

Stored owners survive the mapping two ways. A workspace root (ext4) is shown
through an idmapped mount (mount_setattr with MOUNT_ATTR_IDMAP), so a file
stored as uid 42 is uid 42 inside and written back as 42. A volume's lower
layer is a FUSE view that this kernel cannot idmap (libfuse 3.14 predates
FUSE_ALLOW_IDMAP) and overlayfs refuses an idmap of itself, so the mount
shows a step's volumes with every owner shifted by the range's base, and
the commit shifts the upper layer's owners back (mount/idshift.py).

This module never runs the step; it only allocates, creates and mounts.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import random
import subprocess
import time

from strata.engine.errors import StrataError, Unavailable

log = logging.getLogger(__name__)

RUN_DIR = "/run/strata"   # slot locks and the steps' staging directories
RANGE = 65536             # ids a step's user namespace maps (0..65535 inside)
FIRST = 0x40000000        # the first host id strata hands out; above any distro's ranges
SLOTS = 4096              # concurrent ranges: FIRST .. FIRST + SLOTS*RANGE (2**30 ids)

# x86_64 system call numbers and flags of the new mount API (Linux 5.12+).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC = 1, 0o2000000
_AT_FDCWD, _AT_EMPTY_PATH, _AT_RECURSIVE = -100, 0x1000, 0x8000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
MOUNT_ATTR_IDMAP = 0x00100000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class IdRange:
    """One step's host id range, held until close()."""

    def __init__(self, base: int, lock_fd: int) -> None:
        self.base = base
        self._lock_fd = lock_fd

    @classmethod
    def allocate(cls) -> IdRange:
        """A range no other running step holds (a random free slot)."""
        ensure_dir(RUN_DIR, 0o755)
        locks = os.path.join(RUN_DIR, "ids")
        ensure_dir(locks, 0o700)
        start = random.randrange(SLOTS)
        for i in range(SLOTS):
            slot = (start + i) % SLOTS
            fd = os.open(os.path.join(locks, str(slot)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(FIRST + slot * RANGE, fd)
        raise Unavailable(f"all {SLOTS} sandbox id ranges are in use; retry")

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


class UserNamespace:
    """A new user namespace mapping ids 0..count-1 to base..base+count-1, until close().

    A small `unshare --user cat` makes it and holds it (started by vfork, no
    Python in the child); this process, root on the host, writes both maps.
    Others enter it by `path`; `fd` is this process's own (close-on-exec)
    handle, for idmapped mounts. setgroups stays allowed: package managers
    drop to their own users with initgroups().
    """

    def __init__(self, base: int, count: int = RANGE) -> None:
        self.fd = -1
        self._proc = subprocess.Popen(["unshare", "--user", "--", "cat"],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE)
        try:
            pid = self._proc.pid
            ours = os.readlink("/proc/self/ns/user")
            deadline = time.monotonic() + 10.0
            while True:
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/ns/user") != ours:
                        break
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    err = (self._proc.stderr.read().decode(errors="replace")
                           if self._proc.stderr else "")
                    raise StrataError(f"could not create the step's user namespace: "
                                      f"{err.strip() or 'unshare did not start'}")
                time.sleep(0.0002)
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(f"0 {base} {count}\n")
            self.fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            self.path = f"/proc/{pid}/ns/user"
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        with contextlib.suppress(OSError):
            self._proc.kill()
        self._proc.wait()
        if self._proc.stderr is not None:
            self._proc.stderr.close()


_LIBC: list[ctypes.CDLL] = []


def _libc() -> ctypes.CDLL:
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise StrataError(f"{what}: {os.strerror(err)}")
    return rc


def idmapped_mount(src: str, target: str, userns_fd: int, *, readonly: bool = False) -> None:
    """Mount a copy of the mount at `src` on `target`, its owners seen through `userns_fd`.

    Also nosuid and nodev: what a step is shown never raises privilege.
    """
    libc = _libc()
    fd = _check(libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(src),
                             _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC), f"cloning the mount {src}")
    try:
        flags = MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
        if readonly:
            flags |= MOUNT_ATTR_RDONLY
        attr = _MountAttr(flags, 0, 0, userns_fd)
        _check(libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr),
                            ctypes.sizeof(attr)), f"idmapping the mount {src}")
        _check(libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, os.fsencode(target),
                            _MOVE_MOUNT_F_EMPTY_PATH), f"mounting {src} on {target}")
    finally:
        os.close(fd)


STEPS_DIR = os.path.join(RUN_DIR, "steps")


def ensure_dir(path: str, mode: int) -> None:
    """`path` as a directory of root's with exactly `mode` (whatever the caller's umask)."""
    os.makedirs(path, exist_ok=True)
    st = os.stat(path)
    if st.st_mode & 0o7777 != mode or st.st_uid != 0:
        os.chown(path, 0, 0)
        os.chmod(path, mode)


def make_stage(name: str, owner: int | None) -> str:
    """A step's staging directory: what its sandbox is built from, reachable by it alone.

    /run/strata/steps is searchable but not listable; the step's own
    directory is 0700 and belongs to the step's host root id (`owner`), so
    bwrap, started as that id, can bind from it and no other step can.
    """
    ensure_dir(RUN_DIR, 0o755)
    ensure_dir(STEPS_DIR, 0o711)
    stage = os.path.join(STEPS_DIR, name)
    os.mkdir(stage, 0o700)
    if owner is not None:
        os.chown(stage, owner, owner)
    return stage
