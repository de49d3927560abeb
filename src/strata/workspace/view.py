"""Workspace snapshots file by file, for `strata ls/cat/stat/diff/export`.

A workspace snapshot is a block map; its files live in the ext4 inside. To
show them, the snapshot is attached read-only on a private directory for the
length of the command (no lease, nothing published, journal replay kept in
memory), and the command reads the real files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat as statmod
from collections.abc import Iterator

from strata.engine.errors import InvalidInput, StrataError
from strata.engine.interface import Store
from strata.engine.kinds import KIND_OF_IFMT
from strata.engine.objects import K_FILE, K_SYMLINK, Entry

log = logging.getLogger(__name__)


@contextlib.contextmanager
def snapshot_files(store: Store, volume: str, sid: str) -> Iterator[str]:
    """A directory showing snapshot `sid` of workspace `volume`, read-only, while open."""
    import tempfile

    from strata.workspace.attach import attach, detach
    url, token = getattr(store, "url", None), getattr(store, "token", None)
    if not isinstance(url, str):
        raise InvalidInput("reading a workspace's files needs a store server")
    top = tempfile.mkdtemp(prefix="strata-ws-view-")
    where = os.path.join(top, "view")
    os.mkdir(where)
    try:
        attach(url, token, volume, "live", where, snapshot=sid, owner=os.getpid())
        try:
            yield where
        finally:
            detach(where)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(where)  # never a recursive delete: it may still be mounted
            os.rmdir(top)


def inside(root: str, path: str) -> str:
    """`path` (volume-relative) under the view's `root`, refusing to leave it."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidInput(f"{path!r} leaves the workspace")
    full = os.path.join(root, *parts) if parts else root
    real = os.path.realpath(os.path.dirname(full)) if parts else root
    if os.path.commonpath([real, root]) != root:
        raise InvalidInput(f"{path!r} leaves the workspace")  # through a symlinked directory
    return full


def entry_of(path: str) -> Entry:
    """An `Entry` describing what is at `path` (not following a last symlink)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StrataError(f"no such path in the workspace: {path}") from None
    kind = KIND_OF_IFMT[statmod.S_IFMT(st.st_mode)]
    data = os.readlink(os.fsencode(path)) if kind == K_SYMLINK else None
    return Entry(kind=kind, mode=statmod.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid,
                 mtime_ns=st.st_mtime_ns, size=st.st_size if kind == K_FILE else 0, data=data,
                 rdev=st.st_rdev, nlink=st.st_nlink, ino=st.st_ino if st.st_nlink > 1 else 0)


def changed(a: str, b: str, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(path, "added" | "deleted" | "modified") between two views of one workspace.

    Both views are images of one ext4, so a path whose inode number and ctime
    (which every change of content or metadata sets, and nobody can set back)
    are equal on both sides is unchanged: only metadata is read. A path that
    is a directory on both sides is not reported itself; its entries are.
    """
    names_a = set(os.listdir(a)) if os.path.isdir(a) and not os.path.islink(a) else set()
    names_b = set(os.listdir(b)) if os.path.isdir(b) and not os.path.islink(b) else set()
    for name in sorted(names_a | names_b):
        pa, pb = os.path.join(a, name), os.path.join(b, name)
        rel = prefix + name
        if name not in names_b:
            yield rel, "deleted"
            continue
        if name not in names_a:
            yield rel, "added"
            continue
        sa, sb = os.lstat(pa), os.lstat(pb)
        if (sa.st_ino, sa.st_ctime_ns, sa.st_mode) != (sb.st_ino, sb.st_ctime_ns, sb.st_mode):
            if not (statmod.S_ISDIR(sa.st_mode) and statmod.S_ISDIR(sb.st_mode)):
                yield rel, "modified"
        if statmod.S_ISDIR(sa.st_mode) and statmod.S_ISDIR(sb.st_mode):
            # A file changed deep inside leaves its directories' times alone: walk on.
            yield from changed(pa, pb, rel + "/")


def export(root: str, target: str) -> None:
    """Copy the view out: owners, modes, times, links, xattrs (cp -a)."""
    import shutil
    import subprocess
    os.makedirs(target, exist_ok=True)
    p = subprocess.run(["cp", "-a", "--", os.path.join(root, "."), target],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise StrataError(f"export failed: {p.stderr.strip()[-500:]}")
    lost = os.path.join(target, "lost+found")
    if os.path.isdir(lost) and not os.listdir(lost):
        shutil.rmtree(lost)
