"""A FUSE filesystem that forgets every write not yet fsynced: a power cut on command.

Usage: python dropfs.py BACKING MOUNTPOINT

Everything under MOUNTPOINT is BACKING, passed through. Every write and every
truncation is applied to BACKING at once (so reads are plain), and the bytes
it overwrote are remembered per file. `fsync` and `fdatasync` of a file
forget that file's list: what it holds is now durable. SIGUSR1 is the power
cut: every remembered change is undone, newest first, so BACKING holds exactly
what was synced, and the filesystem unmounts. SIGKILL of the process using the
store keeps nothing of the page cache here: the kernel sends writes through
at once (no writeback cache), so the only copy of unsynced data is BACKING,
and the undo log takes it back.

What it models is the data that a lost page cache loses (LazyFS's default
"clear-cache" fault). Directory operations (create, rename, unlink, mkdir)
are passed through as if durable at once, so this does not test directory
fsyncs. A file created and never synced keeps its name but loses its data.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
from collections import defaultdict
from typing import Any

import pyfuse3
import trio

Undo = tuple[int, int, bytes, int]  # (sequence, offset, old bytes, old size)


class DropFS(pyfuse3.Operations):
    enable_writeback_cache = False  # every write reaches us before write(2) returns

    def __init__(self, backing: str) -> None:
        super().__init__()
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: backing}
        self.root_ino = os.lstat(backing).st_ino
        self.fds: dict[int, int] = {}          # fh -> os fd
        self.fh_ino: dict[int, int] = {}       # fh -> inode
        self.undo: dict[int, list[Undo]] = defaultdict(list)  # inode -> unsynced changes
        self.undo_paths: dict[int, str] = {}
        self.seq = 0
        self.next_fh = 1

    # -- inodes and paths ------------------------------------------------------------

    def _ino(self, st: os.stat_result) -> int:
        return pyfuse3.ROOT_INODE if st.st_ino == self.root_ino else st.st_ino

    def _path(self, inode: int) -> str:
        try:
            return self.paths[inode]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def _child(self, parent: int, name: bytes) -> str:
        return os.path.join(self._path(parent), os.fsdecode(name))

    def _attr(self, path: str) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        a = pyfuse3.EntryAttributes()
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                     "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(a, name, getattr(st, name))
        a.st_ino = self._ino(st)
        a.st_blksize = 4096
        a.st_blocks = st.st_blocks
        a.entry_timeout = 0
        a.attr_timeout = 0
        self.paths[a.st_ino] = path
        return a

    @staticmethod
    def _os(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None

    # -- lookups and directories ------------------------------------------------------

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None
                     ) -> pyfuse3.EntryAttributes:
        return self._attr(self._child(parent_inode, name))

    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attr(self._path(inode))

    async def forget(self, inode_list: Any) -> None:
        return None  # paths stay known: inodes of the backing filesystem are stable

    async def opendir(self, inode: int, ctx: Any) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        path = self._path(fh)
        names = sorted(self._os(os.listdir, path))
        for i, name in enumerate(names[start_id:], start_id):
            attr = self._attr(os.path.join(path, name))
            if not pyfuse3.readdir_reply(token, os.fsencode(name), attr, i + 1):
                break

    async def releasedir(self, fh: int) -> None:
        return None

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # directory operations are durable at once here

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any
                    ) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name)
        self._os(os.mkdir, path, mode & ~ctx.umask)
        return self._attr(path)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self._os(os.rmdir, self._child(parent_inode, name))

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        path = self._child(parent_inode, name)
        st = self._os(os.lstat, path)
        self._os(os.unlink, path)
        if st.st_nlink == 1:
            self.undo.pop(self._ino(st), None)  # nothing left to take back

    async def rename(self, parent_old: int, name_old: bytes, parent_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        if flags:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old, new = self._child(parent_old, name_old), self._child(parent_new, name_new)
        self._os(os.rename, old, new)
        ino = self._ino(os.lstat(new))
        self.paths[ino] = new
        if ino in self.undo_paths:
            self.undo_paths[ino] = new

    async def link(self, inode: int, new_parent: int, new_name: bytes, ctx: Any
                   ) -> pyfuse3.EntryAttributes:
        path = self._child(new_parent, new_name)
        self._os(os.link, self._path(inode), path)
        return self._attr(path)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any
                      ) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name)
        self._os(os.symlink, target, path)
        return self._attr(path)

    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return os.fsencode(self._os(os.readlink, self._path(inode)))

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = self._os(os.statvfs, self._path(pyfuse3.ROOT_INODE))
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):
            setattr(out, name, getattr(st, name))
        return out

    # -- files --------------------------------------------------------------------------

    def _remember(self, inode: int, fd: int, offset: int, length: int) -> None:
        """Keep what [offset, offset+length) and the size were, before a change."""
        size = os.fstat(fd).st_size
        old = os.pread(fd, length, offset) if offset < size else b""
        self.seq += 1
        self.undo[inode].append((self.seq, offset, old, size))
        self.undo_paths[inode] = self._path(inode)

    def _new_fh(self, fd: int, inode: int) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.fds[fh] = fd
        self.fh_ino[fh] = inode
        return fh

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        fd = self._os(os.open, self._path(inode), flags & ~(os.O_CREAT | os.O_APPEND))
        if flags & os.O_TRUNC:
            self._remember(inode, fd, 0, os.fstat(fd).st_size)
        return pyfuse3.FileInfo(fh=self._new_fh(fd, inode))

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = self._child(parent_inode, name)
        fd = self._os(os.open, path, (flags | os.O_CREAT) & ~os.O_APPEND, mode & ~ctx.umask)
        attr = self._attr(path)
        return pyfuse3.FileInfo(fh=self._new_fh(fd, attr.st_ino)), attr

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return bytes(self._os(os.pread, self.fds[fh], size, off))

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        fd = self.fds[fh]
        self._remember(self.fh_ino[fh], fd, off, len(buf))
        return int(self._os(os.pwrite, fd, buf, off))

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: Any,
                      fh: int | None, ctx: Any) -> pyfuse3.EntryAttributes:
        path = self._path(inode)
        if fields.update_size:
            fd = self._os(os.open, path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                if attr.st_size < size:
                    self._remember(inode, fd, attr.st_size, size - attr.st_size)
                else:
                    self._remember(inode, fd, size, 0)
                self._os(os.ftruncate, fd, attr.st_size)
            finally:
                os.close(fd)
        if fields.update_mode:
            self._os(os.chmod, path, stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            self._os(os.chown, path, attr.st_uid if fields.update_uid else -1,
                     attr.st_gid if fields.update_gid else -1)
        if fields.update_mtime or fields.update_atime:
            st = os.lstat(path)
            self._os(os.utime, path, None, (
                attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
        return self._attr(path)

    async def fsync(self, fh: int, datasync: bool) -> None:
        self.undo.pop(self.fh_ino[fh], None)  # synced: no power cut takes it back
        self._os(os.fsync, self.fds[fh])

    async def flush(self, fh: int) -> None:
        return None  # close(2) makes nothing durable

    async def release(self, fh: int) -> None:
        os.close(self.fds.pop(fh))
        self.fh_ino.pop(fh, None)

    # -- the power cut --------------------------------------------------------------------

    def power_cut(self) -> int:
        """Undo every unsynced change, newest first; return how many were undone."""
        changes = sorted(((seq, ino, off, old, size) for ino, log in self.undo.items()
                          for seq, off, old, size in log), reverse=True)
        for _seq, ino, off, old, size in changes:
            path = self.undo_paths.get(ino)
            if path is None or not os.path.exists(path):
                continue
            fd = os.open(path, os.O_RDWR)
            try:
                os.ftruncate(fd, size)  # the size it had; `old` lies within it
                if old:
                    os.pwrite(fd, old, off)
            finally:
                os.close(fd)
        self.undo.clear()
        return len(changes)


async def _serve(fs: DropFS) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pyfuse3.main)
        with trio.open_signal_receiver(signal.SIGUSR1, signal.SIGTERM) as signals:
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    undone = fs.power_cut()
                    sys.stdout.write(f"power cut: {undone} unsynced change(s) undone\n")
                    sys.stdout.flush()
                nursery.cancel_scope.cancel()
                return


def main() -> None:
    backing, mountpoint = sys.argv[1], sys.argv[2]
    fs = DropFS(os.path.abspath(backing))
    options = set(pyfuse3.default_options)
    options.discard("default_permissions")
    options |= {"fsname=dropfs", "allow_other"}
    pyfuse3.init(fs, mountpoint, options)
    try:
        trio.run(_serve, fs)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
