"""Helpers for the POSIX and real-tool mount suites.

`SharedMount` is one store, one writable mount and fresh mounts of new heads,
shared by every test of a module (a mount costs about a second to set up and
tear down, so the suites run many small checks on one). `tree_state` reads a
directory tree into a comparable value: what a commit and a remount must
preserve.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import stat as statmod
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mount_harness import MountEnv, strata_mounts

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(src: str | os.PathLike[str], dst: str | os.PathLike[str], flags: int) -> None:
    """Rename with flags (the renameat2 system call); raises OSError like os.rename."""
    r = _libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                        ctypes.c_uint(flags))
    if r != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))


class SharedMount:
    """A store with volume `v`, a writable mount of it, and fresh mounts of new heads."""

    def __init__(self, root: Path, seed: Path | None = None) -> None:
        self.env = MountEnv(root)
        self.root = root
        self.env.run("init")
        self.env.run("volume", "create", "v")
        if seed is not None:
            self.env.run("import", "v", str(seed))
        self.m = self.env.mount("v")
        self._n = 0

    def commit(self, message: str = "") -> str:
        head = self.env.run("commit", str(self.m), "-m", message).stdout.strip()
        assert len(head) == 64, head
        return head

    @contextlib.contextmanager
    def fresh(self, commit: bool = True) -> Iterator[Path]:
        """Commit the shared mount, then mount the new head elsewhere (a new process)."""
        if commit:
            self.commit()
        self._n += 1
        other = self.env.mount("v", f"fresh{self._n}")
        try:
            yield other
        finally:
            self.env.unmount(other, "--discard")

    def close(self) -> None:
        for target in list(self.env.mounts):
            self.env.run("unmount", str(target), "--discard", rc=None)
        for mp in sorted(strata_mounts(str(self.root)), key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        self.env.run("serve", "--stop", rc=None)
        left = strata_mounts(str(self.root))
        assert not left, f"mounts left behind: {left}"


def file_digest(path: str, size: int, sample_over: int = 64 << 20) -> str:
    """Content hash; files over `sample_over` are sampled (never read whole)."""
    h = hashlib.blake2b()
    with open(path, "rb") as f:
        if size <= sample_over:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            for off in (0, size // 2, max(size - 65536, 0)):
                f.seek(off)
                h.update(f.read(65536))
    return h.hexdigest()


def xattrs_of(path: str) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    return {n: os.getxattr(path, n, follow_symlinks=False) for n in sorted(names)}


def tree_state(root: Path, *, skip: Callable[[str], bool] = lambda p: False,
               times: bool = True) -> dict[str, Any]:
    """Every path under `root` with what a commit must keep.

    Per path: type, permission bits, owner, size, content digest or symlink
    target, user xattrs, mtime in nanoseconds (directories included) and, for
    regular files with several names, the set of names sharing its inode.
    """
    out: dict[str, Any] = {}
    by_inode: dict[tuple[int, int], list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if skip(rel):
                continue
            st = os.lstat(full)
            rec: dict[str, Any] = {"type": statmod.S_IFMT(st.st_mode),
                                   "mode": oct(statmod.S_IMODE(st.st_mode)),
                                   "uid": st.st_uid, "gid": st.st_gid,
                                   "xattrs": xattrs_of(full)}
            if times:
                rec["mtime_ns"] = st.st_mtime_ns
            if statmod.S_ISLNK(st.st_mode):
                rec["target"] = os.readlink(full)
                rec.pop("mode")  # always 0777 on Linux
            elif statmod.S_ISREG(st.st_mode):
                rec["size"] = st.st_size
                rec["digest"] = file_digest(full, st.st_size)
                rec["nlink"] = st.st_nlink
                by_inode.setdefault((st.st_dev, st.st_ino), []).append(rel)
            out[rel] = rec
    for names in by_inode.values():
        for n in names:
            out[n]["links"] = sorted(names)
    return out


def diff_states(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Readable differences between two `tree_state` values (empty when equal)."""
    out = []
    for p in sorted(set(a) | set(b)):
        if p not in a:
            out.append(f"only in second: {p}")
        elif p not in b:
            out.append(f"only in first: {p}")
        elif a[p] != b[p]:
            keys = sorted(k for k in set(a[p]) | set(b[p]) if a[p].get(k) != b[p].get(k))
            out.append(f"{p}: " + ", ".join(f"{k} {a[p].get(k)!r} != {b[p].get(k)!r}"
                                             for k in keys))
    return out


def run_as(uid: int, gid: int, cwd: Path, fn: Callable[[], Any]) -> Any:
    """Run `fn` in a forked child with cwd `cwd` as uid/gid; return its result (or exception).

    The child changes directory while still root, so the test's private
    temporary directories above the mount do not get in the way.
    """
    import pickle

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.chdir(cwd)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            result: Any = fn()
        except BaseException as exc:  # handed back to the parent
            result = exc
        try:
            data = pickle.dumps(result)
        except Exception as exc:
            data = pickle.dumps(RuntimeError(f"unpicklable result: {exc!r}"))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


def varied_tree(root: Path, *, sparse: bool = True, fifo: bool = True) -> None:
    """A local directory with every kind of thing a commit must keep."""
    root.mkdir()
    (root / "dir" / "deeper" / "deepest").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    (root / "inline").write_bytes(b"tiny")
    (root / "empty").write_bytes(b"")
    (root / "exact_inline").write_bytes(os.urandom(4096))
    (root / "just_over_inline").write_bytes(os.urandom(4097))
    (root / "exact_block").write_bytes(os.urandom(65536))
    (root / "multi_block").write_bytes(os.urandom(65536 * 3 + 17))
    (root / "zeros").write_bytes(bytes(200_000))
    (root / "dir" / "text").write_text("some text\n" * 100)
    (root / "dir" / "deeper" / "deepest" / "leaf").write_bytes(os.urandom(5000))
    (root / "dir" / ("long" * 60)).write_text("a 240-byte name")
    (root / "dir" / "ünïcødé name with spaces").write_text("unicode")
    (root / "setuid").write_text("#!/bin/sh\n")
    if sparse:
        with open(root / "holey", "wb") as f:
            f.write(b"x")
            f.seek(1 << 20)
            f.write(b"y")
    os.symlink("dir/text", root / "link_rel")
    os.symlink("/etc/hostname", root / "link_abs")
    os.symlink("missing", root / "dir" / "dangling")
    os.link(root / "multi_block", root / "dir" / "hard_multi")
    os.link(root / "inline", root / "dir" / "deeper" / "hard_inline")
    os.link(root / "inline", root / "hard_inline2")
    if fifo:
        os.mkfifo(root / "a_fifo")
    os.setxattr(root / "dir" / "text", "user.note", b"kept")
    os.setxattr(root / "dir", "user.dir_note", b"dir")
    os.setxattr(root / "multi_block", "user.bin", bytes(range(256)))
    os.chmod(root / "dir" / "text", 0o604)
    os.chmod(root / "dir" / "deeper", 0o711)
    os.chmod(root / "setuid", 0o4755)
    os.chmod(root / "empty_dir", 0o1777)
    os.chown(root / "exact_block", 1001, 1002)
    os.chown(root / "dir" / "deeper", 1005, 1006)
    os.chown(root / "link_abs", 1003, 1004, follow_symlinks=False)
    t = 1_600_000_000_000_000_000
    for i, p in enumerate(sorted(root.rglob("*"), key=lambda p: -len(p.parts))):
        os.utime(p, ns=(t, t + i * 1_000_003 + 7), follow_symlinks=False)
    os.utime(root, ns=(t, t - 11))
