"""The POSIX suite: what unmodified programs need from a writable mount.

One store and one writable mount are shared by the whole module (a mount
costs about a second); each test works in its own names. Every check runs on
files that exist only in the overlay's upper directory and on files that come
from the pinned snapshot (the FUSE lower layer, copied up on first change).
Where a property must survive a commit, the test commits and looks at a fresh
mount of the new head, served by a new process.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import random
import shutil
import stat as statmod
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fsutil import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    SharedMount,
    diff_states,
    renameat2,
    run_as,
    tree_state,
    varied_tree,
)

NOBODY = 65534
LOWER_TEXT = b"lower content\n" * 1000  # > 4 KiB: a file node, not inline data
HL_TEXT = b"hard linked\n" * 2000
COLD = [os.urandom(200_000), os.urandom(200_000)]  # never read before the idle test
SPARSE_LOWER = 32 << 20


def _seed(root: Path) -> None:
    """The pinned snapshot's content: everything the lower layer serves."""
    root.mkdir()
    (root / "lower.txt").write_bytes(LOWER_TEXT)
    for name in ("ren_src", "ren_dst", "ren_dst2", "ex_a", "ex_b", "nr_src", "nr_dst", "append",
                 "excl", "trunc_me", "shrink_me", "unlink_open", "xl", "locked_flock",
                 "locked_lockf", "locked_range", "locked_flock-shared", "locked_lockf-shared",
                 "chmod_me", "link_src"):
        (root / name).write_bytes(name.encode() * 600)
    (root / "ldir" / "sub").mkdir(parents=True)
    (root / "ldir" / "a").write_text("a\n")
    (root / "ldir" / "sub" / "b").write_bytes(os.urandom(100_000))
    (root / "ldir_over").mkdir()
    (root / "exd1").mkdir()
    (root / "exd1" / "one").write_text("1")
    (root / "exd2").mkdir()
    (root / "exd2" / "two").write_text("2")
    (root / "lhl1").write_bytes(HL_TEXT)
    os.link(root / "lhl1", root / "lhl2")
    (root / "hg").mkdir()
    (root / "hg" / "h1").write_bytes(HL_TEXT + b"g")
    os.link(root / "hg" / "h1", root / "hg" / "h2")
    os.link(root / "hg" / "h1", root / "h3")
    (root / "rA" / "x" / "deep").mkdir(parents=True)
    (root / "rA" / "x" / "deep" / "f").write_text("relative redirect")
    (root / "rP" / "Q" / "R").mkdir(parents=True)
    (root / "rP" / "Q" / "R" / "g").write_text("relative below absolute")
    (root / "lhl_x").write_bytes(HL_TEXT + b"x")
    os.link(root / "lhl_x", root / "lhl_y")
    for d in ("opq/sub", "opq2", "dir2file"):
        (root / d).mkdir(parents=True)
    (root / "opq" / "a").write_text("a")
    (root / "opq" / "sub" / "b").write_text("b")
    (root / "opq2" / "c").write_text("c")
    (root / "dir2file" / "x").write_text("x")
    (root / "file2dir").write_text("was a file")
    (root / "rc_lower" / "sub").mkdir(parents=True)
    (root / "rc_lower" / "k").write_text("pinned k")
    (root / "rc_lower" / "sub" / "j").write_text("pinned j")
    (root / "rc_lower2").mkdir()
    (root / "rc_lower2" / "k").write_text("pinned k2")
    (root / "rc_mv").mkdir()
    (root / "rc_mv" / "a").write_text("pinned a")
    (root / "lhl_a").write_bytes(HL_TEXT + b"a")
    os.link(root / "lhl_a", root / "lhl_b")
    os.symlink("lower.txt", root / "lsym")
    (root / "untouched" / "sub").mkdir(parents=True)
    (root / "many").mkdir()
    (root / "many_lower").mkdir()
    for i in range(200):
        (root / "many_lower" / f"f{i:03d}").write_text(str(i))
    for i in range(200):
        (root / "many" / f"f{i:03d}").write_text(str(i))
    (root / "secret").write_text("top secret\n")
    os.chmod(root / "secret", 0o600)
    (root / "public").write_text("everyone\n")
    os.chmod(root / "public", 0o644)
    (root / "mm.bin").write_bytes(bytes(range(256)) * 1024)
    os.mkfifo(root / "lfifo")
    os.setxattr(root / "xl", "user.lower", b"from below")
    with open(root / "sparse_lower", "wb") as f:
        f.write(b"s")
        f.seek(SPARSE_LOWER - 1)
        f.write(b"e")
    (root / "mapped_lower").write_bytes(b"old bytes" * 1000)
    (root / "ino_plain").write_bytes(b"plain" * 1000)
    (root / "ino_linked").write_bytes(b"linked" * 1000)
    os.link(root / "ino_linked", root / "ino_linked2")
    for i, data in enumerate(COLD):
        (root / f"cold{i}").write_bytes(data)


@pytest.fixture(scope="module")
def sm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedMount]:
    root = tmp_path_factory.mktemp("posix")
    _seed(root / "seed")
    s = SharedMount(root, root / "seed")
    try:
        yield s
    finally:
        s.close()


def _errno(fn: object, *args: object, **kw: object) -> int:
    try:
        fn(*args, **kw)  # type: ignore[operator]
    except OSError as exc:
        return exc.errno or 0
    return 0


# -- rename ----------------------------------------------------------------------------


def test_rename_file_over_existing(sm: SharedMount) -> None:
    m = sm.m
    # Lower over lower, upper over upper, upper over lower.
    os.rename(m / "ren_src", m / "ren_dst")
    assert (m / "ren_dst").read_bytes() == b"ren_src" * 600
    assert not (m / "ren_src").exists()
    (m / "u1").write_text("new one")
    (m / "u2").write_text("old two")
    os.rename(m / "u1", m / "u2")
    assert (m / "u2").read_text() == "new one" and not (m / "u1").exists()
    (m / "u3").write_text("over lower")
    os.rename(m / "u3", m / "ren_dst2")
    assert (m / "ren_dst2").read_text() == "over lower"
    with sm.fresh() as f:
        assert (f / "ren_dst").read_bytes() == b"ren_src" * 600
        assert not (f / "ren_src").exists()
        assert (f / "u2").read_text() == "new one" and not (f / "u1").exists()
        assert (f / "ren_dst2").read_text() == "over lower" and not (f / "u3").exists()


def test_rename_is_atomic_for_readers(sm: SharedMount) -> None:
    """A reader never sees the target missing or torn while it is replaced."""
    m = sm.m
    target = m / "atomic"
    target.write_bytes(b"v0" * 5000)
    stop = threading.Event()
    seen: set[bytes] = set()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                with open(target, "rb") as f:
                    seen.add(f.read()[:2])
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(1, 200):
            tmp = m / f"atomic.tmp{i}"
            tmp.write_bytes(b"v%d" % (i % 10) * 5000)
            os.rename(tmp, target)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert len(seen) > 1  # the reader did run alongside the renames
    assert target.read_bytes() == b"v9" * 5000


def test_rename_directories(sm: SharedMount) -> None:
    m = sm.m
    # A lower directory moves (overlayfs redirect_dir), then over an empty directory.
    os.rename(m / "ldir", m / "ldir_moved")
    assert (m / "ldir_moved" / "sub" / "b").stat().st_size == 100_000
    assert not (m / "ldir").exists()
    os.rename(m / "ldir_moved", m / "ldir_over")
    assert sorted(os.listdir(m / "ldir_over")) == ["a", "sub"]
    # Over a non-empty directory is refused.
    (m / "udir" / "x").mkdir(parents=True)
    (m / "udir2").mkdir()
    (m / "udir2" / "keep").write_text("k")
    assert _errno(os.rename, m / "udir", m / "udir2") in (errno.ENOTEMPTY, errno.EEXIST)
    # Directory onto a file and file onto a directory are refused.
    assert _errno(os.rename, m / "udir", m / "lower.txt") == errno.ENOTDIR
    assert _errno(os.rename, m / "lower.txt", m / "udir") == errno.EISDIR
    # A directory renamed inside a renamed directory: its redirect is relative to
    # the parent's source, not to the parent's new name.
    os.rename(m / "rA", m / "rB")
    os.rename(m / "rB" / "x", m / "rB" / "y")
    os.rename(m / "rP" / "Q", m / "rQ2")
    os.rename(m / "rQ2" / "R", m / "rQ2" / "R2")
    assert (m / "rB" / "y" / "deep" / "f").read_text() == "relative redirect"
    # A moved directory keeps working after it is moved again, with new content.
    os.rename(m / "udir", m / "udir2" / "nested")
    (m / "udir2" / "nested" / "x" / "f").write_text("deep")
    with sm.fresh() as f:
        assert not (f / "ldir").exists() and not (f / "ldir_moved").exists()
        assert (f / "ldir_over" / "a").read_text() == "a\n"
        assert (f / "ldir_over" / "sub" / "b").read_bytes() == (
            m / "ldir_over" / "sub" / "b").read_bytes()
        assert (f / "udir2" / "nested" / "x" / "f").read_text() == "deep"
        assert (f / "udir2" / "keep").read_text() == "k"
        assert not (f / "udir").exists()
        assert (f / "rB" / "y" / "deep" / "f").read_text() == "relative redirect"
        assert (f / "rQ2" / "R2" / "g").read_text() == "relative below absolute"
        assert sorted(os.listdir(f / "rB")) == ["y"]
        assert os.listdir(f / "rP") == [] and os.listdir(f / "rQ2") == ["R2"]


def test_rename_noreplace(sm: SharedMount) -> None:
    m = sm.m
    assert _errno(renameat2, m / "nr_src", m / "nr_dst", RENAME_NOREPLACE) == errno.EEXIST
    assert (m / "nr_src").read_bytes() == b"nr_src" * 600
    assert (m / "nr_dst").read_bytes() == b"nr_dst" * 600
    renameat2(m / "nr_src", m / "nr_new", RENAME_NOREPLACE)
    assert not (m / "nr_src").exists()
    assert (m / "nr_new").read_bytes() == b"nr_src" * 600
    (m / "nr_u").write_text("u")
    assert _errno(renameat2, m / "nr_u", m / "nr_dst", RENAME_NOREPLACE) == errno.EEXIST
    assert (m / "nr_u").read_text() == "u"


def test_rename_exchange(sm: SharedMount) -> None:
    """RENAME_EXCHANGE swaps two names atomically, files and directories alike."""
    m = sm.m
    # Two upper files.
    (m / "xa").write_text("A")
    (m / "xb").write_text("B")
    renameat2(m / "xa", m / "xb", RENAME_EXCHANGE)
    assert (m / "xa").read_text() == "B" and (m / "xb").read_text() == "A"
    # Two lower files (both copied up by the exchange).
    renameat2(m / "ex_a", m / "ex_b", RENAME_EXCHANGE)
    assert (m / "ex_a").read_bytes() == b"ex_b" * 600
    assert (m / "ex_b").read_bytes() == b"ex_a" * 600
    # A lower directory with an upper one, then two lower directories.
    (m / "exu").mkdir()
    (m / "exu" / "u").write_text("u")
    renameat2(m / "exd1", m / "exu", RENAME_EXCHANGE)
    assert os.listdir(m / "exu") == ["one"] and os.listdir(m / "exd1") == ["u"]
    renameat2(m / "exu", m / "exd2", RENAME_EXCHANGE)
    assert os.listdir(m / "exu") == ["two"] and os.listdir(m / "exd2") == ["one"]
    # A file with a directory.
    renameat2(m / "xa", m / "exd1", RENAME_EXCHANGE)
    assert (m / "exd1").read_text() == "B" and os.listdir(m / "xa") == ["u"]
    with sm.fresh() as f:
        assert (f / "xb").read_text() == "A"
        assert (f / "ex_a").read_bytes() == b"ex_b" * 600
        assert (f / "ex_b").read_bytes() == b"ex_a" * 600
        assert os.listdir(f / "exu") == ["two"]
        assert os.listdir(f / "exd2") == ["one"]
        assert (f / "exd2" / "one").read_text() == "1"
        assert (f / "exd1").read_text() == "B"
        assert (f / "xa" / "u").read_text() == "u"


# -- links -------------------------------------------------------------------------------


def test_symlinks(sm: SharedMount) -> None:
    m = sm.m
    os.symlink("lower.txt", m / "s_rel")
    os.symlink("/nonexistent/target", m / "s_abs_dangling")
    os.symlink("ldir_over/sub", m / "s_dir")
    os.symlink("s_loop2", m / "s_loop1")
    os.symlink("s_loop1", m / "s_loop2")
    assert os.readlink(m / "s_rel") == "lower.txt"
    assert (m / "s_rel").read_bytes() == LOWER_TEXT
    assert statmod.S_ISLNK(os.lstat(m / "s_abs_dangling").st_mode)
    assert not (m / "s_abs_dangling").exists()
    assert os.listdir(m / "s_dir") == ["b"]
    assert _errno(open, m / "s_loop1") == errno.ELOOP
    assert os.readlink(m / "lsym") == "lower.txt"  # from the lower layer
    os.chown(m / "s_rel", 4321, 8765, follow_symlinks=False)
    os.utime(m / "s_rel", ns=(1_500_000_000_123_456_789,) * 2, follow_symlinks=False)
    # Replace a lower symlink with one pointing elsewhere.
    os.unlink(m / "lsym")
    os.symlink("public", m / "lsym")
    with sm.fresh() as f:
        assert os.readlink(f / "s_rel") == "lower.txt"
        assert (f / "s_rel").read_bytes() == LOWER_TEXT
        assert os.readlink(f / "s_abs_dangling") == "/nonexistent/target"
        assert os.readlink(f / "s_loop1") == "s_loop2"
        assert os.listdir(f / "s_dir") == ["b"]
        st = os.lstat(f / "s_rel")
        assert (st.st_uid, st.st_gid) == (4321, 8765)
        assert st.st_mtime_ns == 1_500_000_000_123_456_789
        assert os.readlink(f / "lsym") == "public"


def _ino_nlink(p: Path) -> tuple[int, int, int]:
    st = os.lstat(p)
    return st.st_dev, st.st_ino, st.st_nlink


def test_hardlinks_made_on_the_mount(sm: SharedMount) -> None:
    m = sm.m
    (m / "hl").mkdir()
    (m / "hl" / "one").write_bytes(b"x" * 10_000)
    os.link(m / "hl" / "one", m / "hl" / "two")
    os.link(m / "hl" / "one", m / "three")
    assert os.stat(m / "hl" / "one").st_nlink == 3
    os.unlink(m / "three")
    d1, i1, n1 = _ino_nlink(m / "hl" / "one")
    d2, i2, n2 = _ino_nlink(m / "hl" / "two")
    assert (d1, i1, n1) == (d2, i2, 2)
    with open(m / "hl" / "two", "ab") as fh:
        fh.write(b"appended")
    assert (m / "hl" / "one").read_bytes().endswith(b"appended")
    # A link to a lower file copies it up first; both names are then one inode.
    os.link(m / "link_src", m / "hl" / "link_dst")
    assert os.stat(m / "link_src").st_nlink == 2
    assert os.stat(m / "link_src").st_ino == os.stat(m / "hl" / "link_dst").st_ino
    # Small (inline) content links too.
    (m / "hl" / "tiny").write_text("t")
    os.link(m / "hl" / "tiny", m / "hl" / "tiny2")
    with sm.fresh() as f:
        d1, i1, n1 = _ino_nlink(f / "hl" / "one")
        d2, i2, n2 = _ino_nlink(f / "hl" / "two")
        assert (d1, i1, n1) == (d2, i2, 2)
        assert not (f / "three").exists()
        assert (f / "hl" / "one").read_bytes() == b"x" * 10_000 + b"appended"
        d1, i1, n1 = _ino_nlink(f / "link_src")
        assert (d1, i1, n1) == _ino_nlink(f / "hl" / "link_dst")
        assert n1 == 2
        assert _ino_nlink(f / "hl" / "tiny")[1:] == _ino_nlink(f / "hl" / "tiny2")[1:]
        assert _ino_nlink(f / "hl" / "tiny")[2] == 2
        # A write through one name of the committed pair is seen through the
        # other only once both are copied up; see test_lower_hardlink_limits.
        assert os.stat(f / "lhl1").st_ino == os.stat(f / "lhl2").st_ino


def test_lower_hardlinks_after_unlink_and_write(sm: SharedMount) -> None:
    """Link groups from the snapshot keep right counts in what a commit publishes.

    overlayfs (index=off) copies up one name of a lower hard-link group on its
    own: the live mount still shows the other name's old count and content
    (the documented limit), but the commit must publish a consistent group.
    """
    m = sm.m
    assert os.stat(m / "lhl1").st_ino == os.stat(m / "lhl2").st_ino
    assert os.stat(m / "lhl1").st_nlink == 2
    os.unlink(m / "lhl2")
    with open(m / "lhl_a", "ab") as fh:  # copy-up of one member
        fh.write(b"+")
    # A new name for one member: it leaves its old group for a new one.
    os.link(m / "lhl_x", m / "lhl_z")
    # A group of three: one name goes, the two left are in a renamed directory.
    os.rename(m / "hg", m / "hg_moved")
    os.unlink(m / "h3")
    with sm.fresh() as f:
        a, b = os.stat(f / "hg_moved" / "h1"), os.stat(f / "hg_moved" / "h2")
        assert (a.st_ino, a.st_nlink) == (b.st_ino, 2)
        assert (f / "hg_moved" / "h2").read_bytes() == HL_TEXT + b"g"
        assert os.stat(f / "lhl1").st_nlink == 1
        assert (f / "lhl1").read_bytes() == HL_TEXT
        assert not (f / "lhl2").exists()
        assert (f / "lhl_a").read_bytes() == HL_TEXT + b"a+"
        # The other name was not changed by the write (copy-up broke the link),
        # and it is published as a file of its own.
        assert (f / "lhl_b").read_bytes() == HL_TEXT + b"a"
        assert os.stat(f / "lhl_a").st_nlink == 1
        assert os.stat(f / "lhl_b").st_nlink == 1
        x, y, z = (os.stat(f / n) for n in ("lhl_x", "lhl_y", "lhl_z"))
        assert (x.st_ino, x.st_nlink) == (z.st_ino, 2)
        assert y.st_ino != x.st_ino and y.st_nlink == 1
        assert (f / "lhl_y").read_bytes() == (f / "lhl_z").read_bytes() == HL_TEXT + b"x"


def test_replace_lower_directories(sm: SharedMount) -> None:
    """A snapshot directory deleted and made again shows only its new contents.

    overlayfs marks such a directory opaque; a directory turned into a file and
    a file turned into a directory are published the same way.
    """
    m = sm.m
    shutil.rmtree(m / "opq")
    (m / "opq").mkdir()
    (m / "opq" / "new").write_text("new")
    os.rename(m / "opq2", m / "opq2_moved")  # moved away, and a new one in its place
    (m / "opq2").mkdir()
    (m / "opq2" / "d").write_text("d")
    shutil.rmtree(m / "dir2file")
    (m / "dir2file").write_text("now a file")
    os.unlink(m / "file2dir")
    (m / "file2dir").mkdir()
    (m / "file2dir" / "inside").write_text("inside")
    with sm.fresh() as f:
        assert os.listdir(f / "opq") == ["new"]
        assert os.listdir(f / "opq2") == ["d"]
        assert os.listdir(f / "opq2_moved") == ["c"]
        assert (f / "opq2_moved" / "c").read_text() == "c"
        assert (f / "dir2file").read_text() == "now a file"
        assert os.listdir(f / "file2dir") == ["inside"]


# -- metadata ----------------------------------------------------------------------------


MTIME = 1_234_567_891_123_456_789
ATIME = 1_111_111_111_222_222_222


def test_modes_owners_and_nanosecond_times(sm: SharedMount) -> None:
    m = sm.m
    (m / "meta").mkdir()
    for mode in (0o600, 0o640, 0o755, 0o4755, 0o2750, 0o1777, 0o000):
        p = m / "meta" / f"m{mode:o}"
        p.write_text(str(mode))
        os.chmod(p, mode)
        assert statmod.S_IMODE(os.stat(p).st_mode) == mode
    (m / "meta" / "d700").mkdir()
    os.chmod(m / "meta" / "d700", 0o700)
    os.chmod(m / "meta" / "m1777", 0o1777)
    os.chown(m / "meta" / "m640", 1234, 5678)
    os.chown(m / "meta" / "d700", 2345, 6789)
    os.chmod(m / "chmod_me", 0o751)  # a lower file: metadata-only copy-up
    os.chown(m / "chmod_me", 3456, 7890)
    os.utime(m / "chmod_me", ns=(ATIME, MTIME))
    os.utime(m / "meta" / "m600", ns=(ATIME, MTIME + 1))
    st = os.stat(m / "meta" / "m600")
    assert (st.st_atime_ns, st.st_mtime_ns) == (ATIME, MTIME + 1)
    os.utime(m / "meta" / "d700", ns=(ATIME, MTIME + 2))
    os.utime(m / "meta", ns=(ATIME, MTIME + 3))  # last: creating entries moves it
    with sm.fresh() as f:
        for mode in (0o600, 0o640, 0o755, 0o4755, 0o2750, 0o1777, 0o000):
            assert statmod.S_IMODE(os.stat(f / "meta" / f"m{mode:o}").st_mode) == mode
        assert statmod.S_IMODE(os.stat(f / "meta" / "d700").st_mode) == 0o700
        st = os.stat(f / "meta" / "m640")
        assert (st.st_uid, st.st_gid) == (1234, 5678)
        st = os.stat(f / "meta" / "d700")
        assert (st.st_uid, st.st_gid, st.st_mtime_ns) == (2345, 6789, MTIME + 2)
        st = os.stat(f / "chmod_me")
        assert (statmod.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) == (
            0o751, 3456, 7890, MTIME)
        assert (f / "chmod_me").read_bytes() == b"chmod_me" * 600
        assert os.stat(f / "meta" / "m600").st_mtime_ns == MTIME + 1
        assert os.stat(f / "meta").st_mtime_ns == MTIME + 3


def test_root_directory_attributes(sm: SharedMount) -> None:
    """The mount's own directory keeps its mode, owner, xattrs and mtime too."""
    m = sm.m
    os.chmod(m, 0o750)
    os.chown(m, 4242, 4343)
    os.setxattr(m, "user.root", b"on the root")
    try:
        with sm.fresh() as f:
            st = os.stat(f)
            assert (statmod.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o750, 4242, 4343)
            assert os.getxattr(f, "user.root") == b"on the root"
            os.utime(m, ns=(ATIME, MTIME + 5))
        with sm.fresh() as f:
            assert os.stat(f).st_mtime_ns == MTIME + 5
    finally:
        os.chmod(m, 0o755)
        os.chown(m, 0, 0)


def test_truncate(sm: SharedMount) -> None:
    m = sm.m
    os.truncate(m / "trunc_me", 100_000)  # lower file, grown with a hole
    data = (m / "trunc_me").read_bytes()
    assert data[:4800] == b"trunc_me" * 600 and data[4800:] == bytes(100_000 - 4800)
    os.truncate(m / "shrink_me", 10)  # lower file, shrunk
    assert (m / "shrink_me").read_bytes() == (b"shrink_me" * 600)[:10]
    with open(m / "tr_up", "wb") as fh:
        fh.write(b"q" * 70_000)
        fh.truncate(65_536)
        fh.truncate(200_000)
        fh.seek(0, os.SEEK_END)
        fh.write(b"tail")
    data = (m / "tr_up").read_bytes()
    assert len(data) == 200_004
    assert data[:65_536] == b"q" * 65_536 and data[65_536:200_000] == bytes(134_464)
    (m / "tr_zero").write_bytes(b"z" * 9000)
    os.truncate(m / "tr_zero", 0)
    with sm.fresh() as f:
        assert (f / "trunc_me").read_bytes() == b"trunc_me" * 600 + bytes(100_000 - 4800)
        assert (f / "shrink_me").read_bytes() == (b"shrink_me" * 600)[:10]
        assert (f / "tr_up").read_bytes() == data
        assert os.stat(f / "tr_zero").st_size == 0


def test_open_flags(sm: SharedMount) -> None:
    m = sm.m
    # O_APPEND: two descriptors both append, whatever their file position.
    a = os.open(m / "append", os.O_WRONLY | os.O_APPEND)  # lower file
    b = os.open(m / "append", os.O_WRONLY | os.O_APPEND)
    os.write(a, b"<A>")
    os.write(b, b"<B>")
    os.lseek(a, 0, os.SEEK_SET)
    os.write(a, b"<C>")
    os.close(a)
    os.close(b)
    assert (m / "append").read_bytes() == b"append" * 600 + b"<A><B><C>"
    # O_EXCL: refused for an existing file (lower and upper), fine for a new one.
    assert _errno(os.open, m / "excl", os.O_CREAT | os.O_EXCL | os.O_WRONLY) == errno.EEXIST
    fd = os.open(m / "excl_new", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
    os.close(fd)
    assert _errno(os.open, m / "excl_new", os.O_CREAT | os.O_EXCL | os.O_WRONLY) == (
        errno.EEXIST)
    assert statmod.S_IMODE(os.stat(m / "excl_new").st_mode) == 0o640
    os.symlink("excl_target", m / "excl_link")  # O_EXCL does not follow a symlink
    assert _errno(os.open, m / "excl_link", os.O_CREAT | os.O_EXCL | os.O_WRONLY) == (
        errno.EEXIST)
    assert not (m / "excl_target").exists()
    # O_TRUNC on a lower file and on an upper one.
    fd = os.open(m / "excl", os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"short")
    os.close(fd)
    assert (m / "excl").read_bytes() == b"short"
    fd = os.open(m / "excl_new", os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert os.stat(m / "excl_new").st_size == 0
    with sm.fresh() as f:
        assert (f / "append").read_bytes() == b"append" * 600 + b"<A><B><C>"
        assert (f / "excl").read_bytes() == b"short"
        assert os.stat(f / "excl_new").st_size == 0


def test_unlink_open_file(sm: SharedMount) -> None:
    m = sm.m
    low = open(m / "unlink_open", "rb")  # a lower file, not copied up
    (m / "uo_up").write_bytes(b"upper data" * 1000)
    up = open(m / "uo_up", "r+b")
    try:
        os.unlink(m / "unlink_open")
        os.unlink(m / "uo_up")
        assert not (m / "unlink_open").exists() and not (m / "uo_up").exists()
        assert low.read() == b"unlink_open" * 600
        assert up.read() == b"upper data" * 1000
        assert os.fstat(up.fileno()).st_nlink == 0
        up.write(b"still writable")
        up.seek(0)
        assert up.read().endswith(b"still writable")
        # The name can be reused while the old file is open.
        (m / "uo_up").write_text("reborn")
        head = sm.commit()
        assert len(head) == 64
    finally:
        low.close()
        up.close()
    with sm.fresh(commit=False) as f:
        assert not (f / "unlink_open").exists()
        assert (f / "uo_up").read_text() == "reborn"


def test_commits_after_removing_committed_trees(sm: SharedMount) -> None:
    """What one commit published can be removed or replaced by the next one.

    The second commit of each pair changes paths whose children the first one
    published: a new tree removed, a snapshot directory with committed changes
    removed or emptied and made again, a file turned into a tree and back.
    """
    m = sm.m
    (m / "rc_new" / "e").mkdir(parents=True)
    (m / "rc_new" / "e" / "f").write_text("f")
    (m / "rc_file").write_text("file")
    (m / "rc_dir" / "v").mkdir(parents=True)
    (m / "rc_dir" / "v" / "u").write_text("u")
    (m / "rc_lower" / "k").write_text("changed k")
    (m / "rc_lower" / "new").write_text("new in lower dir")
    (m / "rc_lower2" / "k").write_text("changed k2")
    os.rename(m / "rc_mv", m / "rc_mv2")
    (m / "rc_mv2" / "a").write_text("changed a")
    sm.commit()
    shutil.rmtree(m / "rc_new")
    os.unlink(m / "rc_file")
    (m / "rc_file" / "y").mkdir(parents=True)
    (m / "rc_file" / "y" / "z").write_text("z")
    shutil.rmtree(m / "rc_dir")
    (m / "rc_dir").write_text("a file now")
    shutil.rmtree(m / "rc_lower")
    shutil.rmtree(m / "rc_lower2")
    (m / "rc_lower2").mkdir()
    (m / "rc_lower2" / "other").write_text("other")
    with sm.fresh() as f:
        assert not (f / "rc_new").exists()
        assert (f / "rc_file" / "y" / "z").read_text() == "z"
        assert (f / "rc_dir").read_text() == "a file now"
        assert not (f / "rc_lower").exists()
        assert os.listdir(f / "rc_lower2") == ["other"]
    # And back again, once more each.
    shutil.rmtree(m / "rc_file")
    (m / "rc_file").write_text("file again")
    os.unlink(m / "rc_dir")
    (m / "rc_lower2" / "k").write_text("k2 again")
    (m / "rc_mv2" / "b").write_text("b")  # the renamed directory's mtime moves
    with sm.fresh() as f:
        assert sorted(os.listdir(f / "rc_mv2")) == ["a", "b"]
        assert (f / "rc_mv2" / "a").read_text() == "changed a"
        assert (f / "rc_file").read_text() == "file again"
        assert not (f / "rc_dir").exists()
        assert sorted(os.listdir(f / "rc_lower2")) == ["k", "other"]
        assert (f / "rc_lower2" / "k").read_text() == "k2 again"
    assert sm.env.run("status", str(m), "--json").stdout.count('"uncommitted": []') == 1


# -- sparse and large files ------------------------------------------------------------------


GIB = 1 << 30


def test_sparse_files(sm: SharedMount) -> None:
    m = sm.m
    with open(m / "sparse_small", "wb") as fh:
        fh.write(b"head")
        fh.seek(3 << 20)
        fh.write(b"tail")
    big = m / "sparse_5g"
    with open(big, "wb") as fh:
        fh.write(b"start")
        fh.seek(5 * GIB)
        fh.write(b"at five gib")
    st = os.stat(big)
    assert st.st_size == 5 * GIB + 11
    assert st.st_blocks * 512 < 1 << 20  # sparse in the upper layer
    with open(big, "rb") as fh:
        fh.seek(4 * GIB)
        assert fh.read(4096) == bytes(4096)
        fh.seek(5 * GIB - 3)
        assert fh.read() == b"\0\0\0at five gib"
    upper_before = _upper_usage(sm)
    # The commit's scan skips holes instead of reading 5 GiB of zeros.
    assert _scan_reads(sm) < 64 << 20
    with sm.fresh() as f:
        st = os.stat(f / "sparse_5g")
        assert st.st_size == 5 * GIB + 11
        with open(f / "sparse_5g", "rb") as fh:
            assert fh.read(5) == b"start"
            fh.seek(3 * GIB + 12345)
            assert fh.read(65536) == bytes(65536)
            fh.seek(5 * GIB)
            assert fh.read() == b"at five gib"
        with open(f / "sparse_small", "rb") as fh:
            data = fh.read()
        assert data == b"head" + bytes((3 << 20) - 4) + b"tail"
    assert _upper_usage(sm) == upper_before  # commit never filled the holes
    os.unlink(big)  # keep later whole-tree walks cheap


# The committer's own peak RSS: VmHWM of its address space. Not ru_maxrss, which
# Linux carries across execve, so it would report the forking test process's peak.
COMMIT_MEASURED = """
import runpy, sys
sys.argv = ["strata", "commit", "--json", sys.argv[1]]
try:
    runpy.run_module("strata", run_name="__main__")
finally:
    hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
    print(hwm[0].split()[1], file=sys.stderr)
"""


def test_commit_of_a_large_file_reads_it_back_in_batches(sm: SharedMount) -> None:
    """Committing a 512 MiB file does not hold the file in the committer's memory."""
    m = sm.m
    block = 64 * 1024
    count = 8192  # random bytes: no chunk repeats, nothing dedupes

    def content(i: int) -> bytes:
        return random.Random(i).randbytes(block)

    with open(m / "large", "wb") as fh:
        for i in range(count):
            fh.write(content(i))
    p = subprocess.run([sys.executable, "-c", COMMIT_MEASURED, str(m)], env=sm.env.env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    max_rss_mib = int(p.stderr.strip().splitlines()[-1]) // 1024
    assert max_rss_mib < 256, max_rss_mib
    assert json.loads(p.stdout)["uploaded_bytes"] >= count * block
    with sm.fresh(commit=False) as f, open(f / "large", "rb") as fh:
        for i in (0, 1, 4097, count - 1):
            fh.seek(i * block)
            assert fh.read(block) == content(i)
    os.unlink(m / "large")


def test_a_block_read_back_must_still_match(tmp_path: Path) -> None:
    """A block kept by reference is checked when read back for the upload."""
    from strata.engine.errors import Unavailable
    from strata.engine.objects import BLOCK, object_id
    from strata.mount.overlay import ObjectSet

    f = tmp_path / "f"
    f.write_bytes(b"a" * 100 + b"b" * 100)
    objs = ObjectSet()
    oid = object_id(BLOCK, b"b" * 100)
    objs.put_block(oid, str(f), 100, 100)
    assert objs[oid] == (BLOCK, b"b" * 100) and objs.size(oid) == 100 and oid in objs
    f.write_bytes(b"a" * 100 + b"c" * 100)  # changed after the scan
    with pytest.raises(Unavailable, match="changed while it was being committed"):
        objs[oid]


def _scan_reads(sm: SharedMount) -> int:
    """Bytes this process reads while scanning the mount's upper directory."""
    from strata.mount.session import scan_volume
    from strata.mount.state import find_mount
    from strata.server.client import RemoteStore

    os.environ["STRATA_SCRATCH"] = sm.env.env["STRATA_SCRATCH"]
    try:
        state = find_mount(str(sm.m))
    finally:
        del os.environ["STRATA_SCRATCH"]
    store = RemoteStore(f"unix:{sm.env.store / 'serve.sock'}")
    try:
        before = _rchar()
        scan_volume(store, state, state.volumes[0], cache=False)  # what a full scan reads
        return _rchar() - before
    finally:
        store.close()


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _upper_usage(sm: SharedMount) -> int:
    # Upper directories only: a commit also rewrites the mount's state and stat cache.
    uppers = [str(p) for p in (sm.root / "scratch").glob("*/upper")]
    out = subprocess.run(["du", "-s", "-c", "--block-size=1", *uppers],
                         capture_output=True, text=True, check=True).stdout
    return int(out.splitlines()[-1].split()[0])


# -- xattrs ------------------------------------------------------------------------------------


def test_xattrs(sm: SharedMount) -> None:
    m = sm.m
    assert os.getxattr(m / "xl", "user.lower") == b"from below"
    assert "user.lower" in os.listxattr(m / "xl")
    assert not [n for n in os.listxattr(m / "xl") if n.startswith("trusted.overlay")]
    os.setxattr(m / "xl", "user.added", b"\x00binary\xff")  # copy-up of a lower file
    os.removexattr(m / "xl", "user.lower")
    (m / "xu").write_text("x")
    os.setxattr(m / "xu", "user.big", b"v" * 3000)
    os.setxattr(m / "xu", "user.empty", b"")
    os.setxattr(m / "xu", "user.gone", b"soon")
    os.removexattr(m / "xu", "user.gone")
    assert _errno(os.getxattr, m / "xu", "user.gone") == errno.ENODATA
    assert _errno(os.setxattr, m / "xu", "user.big", b"x", os.XATTR_CREATE) == errno.EEXIST
    assert _errno(os.setxattr, m / "xu", "user.nope", b"x", os.XATTR_REPLACE) == errno.ENODATA
    (m / "xdir").mkdir()
    os.setxattr(m / "xdir", "user.dir", b"on a dir")
    os.setxattr(m / "many", "user.merged", b"on a lower dir")
    with sm.fresh() as f:
        assert sorted(os.listxattr(f / "xl")) == ["user.added"]
        assert os.getxattr(f / "xl", "user.added") == b"\x00binary\xff"
        assert os.getxattr(f / "xu", "user.big") == b"v" * 3000
        assert os.getxattr(f / "xu", "user.empty") == b""
        assert sorted(os.listxattr(f / "xu")) == ["user.big", "user.empty"]
        assert os.getxattr(f / "xdir", "user.dir") == b"on a dir"
        assert os.getxattr(f / "many", "user.merged") == b"on a lower dir"
        assert (f / "xl").read_bytes() == b"xl" * 600


# -- locks -----------------------------------------------------------------------------------


HOLDER = r"""
import fcntl, os, sys
path, kind = sys.argv[1], sys.argv[2]
shared = kind.endswith("-shared")
fd = os.open(path, os.O_RDONLY if shared else os.O_RDWR)  # read-only: no copy-up
if kind.startswith("flock"):
    fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
elif kind.startswith("lockf"):
    fcntl.lockf(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
else:
    fcntl.lockf(fd, fcntl.LOCK_EX, 10, 0)  # bytes 0..9
print("locked", flush=True)
sys.stdin.readline()
"""


def _try_lock(path: Path, kind: str, length: int = 0, start: int = 0) -> int:
    fd = os.open(path, os.O_RDWR)
    try:
        if kind == "flock":
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
    except OSError as exc:
        return exc.errno or -1
    finally:
        os.close(fd)
    return 0


@pytest.mark.parametrize("kind", ["flock", "lockf", "range", "flock-shared", "lockf-shared"])
def test_locks_between_processes(sm: SharedMount, kind: str) -> None:
    """Locks (flock and fcntl) conflict between processes, on new and snapshot files.

    In the -shared variants the holder opens a snapshot file read-only (it
    stays in the lower layer) and the contender's read-write open copies it
    up: the locks still meet, on the overlay's inode.
    """
    m = sm.m
    targets = [m / f"locked_{kind}"]  # a snapshot file first
    (m / f"locked_up_{kind}").write_text("upper")
    targets.append(m / f"locked_up_{kind}")
    for path in targets:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), kind],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdin is not None
            assert holder.stdout.readline().strip() == "locked"
            busy = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
            if kind == "range":
                assert _try_lock(path, "lockf", 10, 5) in busy  # overlaps 5..14
                assert _try_lock(path, "lockf", 10, 20) == 0  # 20..29 is free
            else:
                assert _try_lock(path, kind.split("-")[0]) in busy
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.wait(timeout=10) == 0
            assert _try_lock(path, "lockf" if kind == "range" else kind.split("-")[0]) == 0
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()


# -- fifos, statfs ------------------------------------------------------------------------------


WRITER = r"""
import sys
with open(sys.argv[1], "wb") as f:
    f.write(b"through the fifo\n" * 1000)
"""


def _through_fifo(path: Path) -> bytes:
    w = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
    try:
        with open(path, "rb") as f:
            data = f.read()
    finally:
        assert w.wait(timeout=10) == 0
    return data


def test_fifos(sm: SharedMount) -> None:
    m = sm.m
    os.mkfifo(m / "fifo")
    os.chmod(m / "fifo", 0o620)
    assert statmod.S_ISFIFO(os.stat(m / "fifo").st_mode)
    assert _through_fifo(m / "fifo") == b"through the fifo\n" * 1000
    assert statmod.S_ISFIFO(os.stat(m / "lfifo").st_mode)  # from the lower layer
    assert _through_fifo(m / "lfifo") == b"through the fifo\n" * 1000
    with sm.fresh() as f:
        st = os.stat(f / "fifo")
        assert statmod.S_ISFIFO(st.st_mode) and statmod.S_IMODE(st.st_mode) == 0o620
        assert _through_fifo(f / "fifo") == b"through the fifo\n" * 1000


def test_statfs(sm: SharedMount) -> None:
    for path in (sm.m, sm.m / "many"):
        s = os.statvfs(path)
        assert s.f_bsize > 0 and s.f_frsize > 0
        assert s.f_blocks > 0 and 0 < s.f_bavail <= s.f_blocks
        assert s.f_namemax >= 255
        assert not s.f_flag & os.ST_RDONLY


# -- readdir -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["many_lower", "many", "fresh_dir"])
def test_readdir_while_the_directory_changes(sm: SharedMount, where: str) -> None:
    """Entries that exist throughout a listing appear exactly once; no crash.

    many_lower is a snapshot directory nothing touched before (the first
    change during the listing copies it up), many one with an xattr set
    (already merged), fresh_dir one made on the mount.
    """
    d = sm.m / where
    if where == "fresh_dir":
        d.mkdir()
        for i in range(200):
            (d / f"f{i:03d}").write_text(str(i))
    before = set(os.listdir(d))
    assert len(before) == 200
    deleted = {f"f{i:03d}" for i in range(0, 200, 3)}
    created: set[str] = set()
    seen: list[str] = []
    with os.scandir(d) as it:
        for n, entry in enumerate(it):
            seen.append(entry.name)
            if n == 20:
                for name in sorted(deleted):
                    os.unlink(d / name)
            if 20 <= n < 120:
                new = f"new{n:03d}"
                (d / new).write_text("n")
                created.add(new)
            if n == 60:  # a rename within the directory as well
                os.rename(d / "f001", d / "f001.renamed")
                created.add("f001.renamed")
    assert len(seen) == len(set(seen)), "a name was listed twice"
    stable = before - deleted - {"f001"}
    assert stable <= set(seen), sorted(stable - set(seen))
    assert set(seen) <= before | created
    assert set(os.listdir(d)) == (before - deleted - {"f001"}) | created
    # A second listing of the final state through a fresh descriptor agrees.
    assert sorted(os.listdir(d)) == sorted(e.name for e in os.scandir(d))


def test_readdir_lists_dot_entries(sm: SharedMount) -> None:
    """"." and ".." are listed by every directory, as on a disk filesystem."""
    m = sm.m
    (m / "dots_up").mkdir()
    (m / "many" / "dots_merged").mkdir()
    for d in ("untouched", "untouched/sub", "dots_up", "many", "."):
        out = subprocess.run(["ls", "-a", "-1", d], cwd=m, capture_output=True, text=True,
                             check=True).stdout.split("\n")
        assert out[:2] == [".", ".."], (d, out[:4])
        assert out.count(".") == 1 and out.count("..") == 1
    assert os.stat(m / "untouched" / "sub" / "..").st_ino == os.stat(m / "untouched").st_ino
    assert subprocess.run(["ls", "-A", "untouched/sub"], cwd=m, capture_output=True,
                          text=True, check=True).stdout == ""


# -- permissions ---------------------------------------------------------------------------


def test_permission_checks(sm: SharedMount) -> None:
    m = sm.m
    (m / "psecret").write_text("upper secret")
    os.chmod(m / "psecret", 0o600)
    (m / "ppublic").write_text("upper public")
    os.chmod(m / "ppublic", 0o644)
    (m / "pdir").mkdir(mode=0o755)
    (m / "popen").mkdir()
    os.chmod(m / "popen", 0o777)

    def probe() -> dict[str, int | str]:
        out: dict[str, int | str] = {}
        for name in ("secret", "psecret"):
            out[name] = _errno(open, name, "rb")
        for name in ("public", "ppublic"):
            with open(name) as f:
                out[name] = f.read()
            out[name + "_write"] = _errno(open, name, "ab")
        out["create_in_root_dir"] = _errno(open, "pdir/x", "wb")
        out["unlink_root_file"] = _errno(os.unlink, "ppublic")
        out["chmod_root_file"] = _errno(os.chmod, "ppublic", 0o777)
        with open("popen/mine", "wb") as f:
            f.write(b"ok")
        out["mine_uid"] = os.stat("popen/mine").st_uid
        return out

    res = run_as(NOBODY, NOBODY, m, probe)
    assert not isinstance(res, BaseException), res
    assert res["secret"] == errno.EACCES and res["psecret"] == errno.EACCES
    assert res["public"] == "everyone\n" and res["ppublic"] == "upper public"
    assert res["public_write"] == errno.EACCES and res["ppublic_write"] == errno.EACCES
    assert res["create_in_root_dir"] == errno.EACCES
    assert res["unlink_root_file"] == errno.EACCES
    assert res["chmod_root_file"] == errno.EPERM
    assert res["mine_uid"] == NOBODY
    assert (m / "popen" / "mine").stat().st_uid == NOBODY
    with sm.fresh() as f:
        assert os.stat(f / "popen" / "mine").st_uid == NOBODY
        res = run_as(NOBODY, NOBODY, f, lambda: _errno(open, "psecret", "rb"))
        assert res == errno.EACCES


# -- mmap ----------------------------------------------------------------------------------------


def test_shared_mmap_writes_are_committed(sm: SharedMount) -> None:
    m = sm.m
    (m / "mm_up").write_bytes(bytes(300_000))
    expect_up = bytearray(300_000)
    with open(m / "mm_up", "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
        mm[1000:1005] = b"hello"
        mm[299_990:300_000] = b"0123456789"
        mm.flush()
    expect_up[1000:1005] = b"hello"
    expect_up[299_990:300_000] = b"0123456789"
    expect_low = bytearray((m / "mm.bin").read_bytes())
    fh = open(m / "mm.bin", "r+b")  # a lower file, mapped and left mapped over the commit
    mm = mmap.mmap(fh.fileno(), 0)
    try:
        mm[70_000:70_008] = b"MMAPPED!"
        expect_low[70_000:70_008] = b"MMAPPED!"
        assert (m / "mm.bin").read_bytes() == bytes(expect_low)  # same page cache
        with sm.fresh() as f:
            assert (f / "mm_up").read_bytes() == bytes(expect_up)
            assert (f / "mm.bin").read_bytes() == bytes(expect_low)
    finally:
        mm.close()
        fh.close()


# -- read-only mount --------------------------------------------------------------------------


def test_readonly_mount_answers_erofs(sm: SharedMount) -> None:
    sm.commit()
    ro = sm.env.mount("v", "ro", "--ro")
    try:
        assert (ro / "lower.txt").read_bytes() == LOWER_TEXT
        assert os.statvfs(ro).f_flag & os.ST_RDONLY
        attempts = {
            "create": lambda: open(ro / "new", "wb"),
            "write": lambda: open(ro / "lower.txt", "r+b"),
            "append": lambda: open(ro / "lower.txt", "ab"),
            "trunc": lambda: os.truncate(ro / "lower.txt", 0),
            "mkdir": lambda: os.mkdir(ro / "d"),
            "rmdir": lambda: os.rmdir(ro / "ldir_over"),
            "unlink": lambda: os.unlink(ro / "lower.txt"),
            "rename": lambda: os.rename(ro / "lower.txt", ro / "x"),
            "symlink": lambda: os.symlink("a", ro / "s"),
            "link": lambda: os.link(ro / "lower.txt", ro / "l"),
            "mkfifo": lambda: os.mkfifo(ro / "f"),
            "chmod": lambda: os.chmod(ro / "lower.txt", 0o777),
            "chown": lambda: os.chown(ro / "lower.txt", 1, 1),
            "utime": lambda: os.utime(ro / "lower.txt", ns=(1, 1)),
            "setxattr": lambda: os.setxattr(ro / "lower.txt", "user.x", b"1"),
            "removexattr": lambda: os.removexattr(ro / "xl", "user.added"),
        }
        got = {k: _errno(fn) for k, fn in attempts.items()}
        assert got == dict.fromkeys(attempts, errno.EROFS)
    finally:
        sm.env.unmount(ro)


# -- the server behind the mount ----------------------------------------------------------


def test_mount_outlives_an_idle_server(sm: SharedMount) -> None:
    """The store's own server exits when idle; a mount reads through it for life.

    The mount process keeps it busy, and commit starts it again when it is gone.
    """
    idle = float(os.environ.get("STRATA_SERVER_IDLE_EXIT", "300"))
    if idle > 10:
        pytest.skip("the auto-started server's idle exit is too long to wait for")
    time.sleep(idle * 1.5 + 1)
    assert (sm.m / "cold0").read_bytes() == COLD[0]  # fetched now, lazily
    sm.env.run("serve", "--stop")
    (sm.m / "after_stop").write_text("x")
    sm.commit()
    assert sm.env.run("cat", "v", "after_stop").stdout == "x"
    assert (sm.m / "cold1").read_bytes() == COLD[1]


# -- known limits of overlayfs over a FUSE view --------------------------------------------------
#
# These pass because the mount behaves as described; each is a limit of the
# design (kernel overlayfs, index=off, over a pyfuse3 view), kept here so that a
# change of behaviour is noticed.


def test_known_limit_readonly_mapping_of_a_snapshot_file(sm: SharedMount) -> None:
    """A read-only shared mapping of a snapshot file misses later writes.

    overlayfs maps the lower file, and another process's write goes to a
    copy-up: the mapping keeps the old bytes, while read() through any
    descriptor, even one opened before the copy-up, sees the new ones.
    """
    m = sm.m
    with open(m / "mapped_lower", "rb") as fh, mmap.mmap(fh.fileno(), 0,
                                                         prot=mmap.PROT_READ) as mm:
        subprocess.run([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'r+b'); "
                        "f.write(b'NEW')", str(m / "mapped_lower")], check=True)
        assert mm[:9] == b"old bytes"  # the limit
        fh.seek(0)
        assert fh.read(9) == b"NEW bytes"


def test_inode_numbers_across_copy_up(sm: SharedMount) -> None:
    """A snapshot file keeps (st_dev, st_ino) through its first write.

    overlayfs records the lower file's handle on the copy-up (the FUSE view
    can encode one) and keeps showing the lower inode number. The limit: a
    file of a snapshot hard-link group (index=off) gets the upper file's
    number and device at its first write.
    """
    m = sm.m
    for name, kept in (("ino_plain", True), ("ino_linked", False)):
        before = os.stat(m / name)
        with open(m / name, "ab") as fh:
            fh.write(b"+")
        after = os.stat(m / name)
        assert ((before.st_dev, before.st_ino) == (after.st_dev, after.st_ino)) is kept, name


def test_known_limit_snapshot_files_report_full_allocation(sm: SharedMount) -> None:
    """A sparse file of the snapshot looks fully allocated and is copied up whole.

    It reports its size as allocated, and its first write copies it up with
    the holes filled (the FUSE view cannot answer SEEK_DATA/SEEK_HOLE: pyfuse3
    has no lseek). The commit still publishes the holes as holes.
    """
    m = sm.m
    st = os.stat(m / "sparse_lower")
    assert st.st_size == SPARSE_LOWER and st.st_blocks * 512 >= SPARSE_LOWER
    with open(m / "sparse_lower", "r+b") as fh:
        fh.write(b"S")
    upper = next((sm.root / "scratch").glob("*/upper/_/sparse_lower"))
    assert os.stat(upper).st_blocks * 512 >= SPARSE_LOWER  # holes filled by copy-up
    result = json.loads(sm.env.run("commit", str(m), "--json").stdout)
    assert result["uploaded_bytes"] < 1 << 20  # one new block, not 32 MiB of zeros
    with sm.fresh(commit=False) as f:
        with open(f / "sparse_lower", "rb") as fh:
            assert fh.read(1) == b"S"
            fh.seek(SPARSE_LOWER - 1)
            assert fh.read() == b"e"


def test_known_limit_times_and_directory_counts(sm: SharedMount) -> None:
    """Snapshots keep mtime only, and snapshot directories count two links.

    After a commit and remount a file's atime and ctime read as its mtime.
    Directories of the snapshot report st_nlink 2 whatever their
    subdirectories (GNU find and fts do not rely on it here).
    """
    m = sm.m
    (m / "times").write_text("t")
    os.utime(m / "times", ns=(ATIME, MTIME))
    with sm.fresh() as f:
        st = os.stat(f / "times")
        assert (st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns) == (MTIME, MTIME, MTIME)
        assert os.stat(f / "untouched").st_nlink == 2  # it has a subdirectory
        found = subprocess.run(["find", "untouched"], cwd=f, capture_output=True, text=True,
                               check=True).stdout.split()
        assert found == ["untouched", "untouched/sub"]


# -- the whole tree ---------------------------------------------------------------------------


def test_whole_tree_survives_commit_and_remount(sm: SharedMount,
                                                tmp_path: Path) -> None:
    """A tree copied in with `cp -a` comes back whole from a fresh mount.

    The fresh mount is compared with the original directory and with the
    mount itself: content, modes, owners, links, xattrs, nanosecond mtimes.
    """
    m = sm.m
    src = tmp_path / "varied"
    varied_tree(src)
    subprocess.run(["cp", "-a", str(src), str(m / "varied")], check=True)
    expected = tree_state(src)
    assert diff_states(expected, tree_state(m / "varied")) == []
    # Link groups from the snapshot that this mount split show stale counts on the
    # live mount (overlayfs reports the lower inode's; see
    # test_lower_hardlinks_after_unlink_and_write): compare those without counts.
    live = tree_state(m)
    stale = {}  # only where test_lower_hardlinks_after_unlink_and_write ran
    if "lhl1" in live and "lhl2" not in live:
        stale |= {"lhl1": (2, 1), "lhl_b": (2, 1), "lhl_y": (2, 1)}
    if "ino_linked" in live and live["ino_linked"]["size"] != live["ino_linked2"]["size"]:
        stale |= {"ino_linked2": (2, 1)}
    if "hg_moved/h1" in live:
        stale |= {"hg_moved/h1": (3, 2), "hg_moved/h2": (3, 2)}
    with sm.fresh() as f:
        assert diff_states(expected, tree_state(f / "varied")) == []
        again = tree_state(f)
        for p, (stale_count, count) in stale.items():
            # Stale until a commit moves the mount onto a new snapshot (mount/move.py).
            assert live[p].pop("nlink") in (stale_count, count), p
            assert again[p].pop("nlink") == count, p
        assert diff_states(live, again) == []
