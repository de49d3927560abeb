"""Moving a mount onto other snapshots, keeping what is uncommitted.

Two callers: a commit moves the mount onto the snapshots it published, so
that its upper directory holds only what is still uncommitted and the next
`status` or `commit` costs what changed since then, not everything written
since the mount; and `strata reload` moves it onto its branches' heads.

overlayfs does not allow its layers to change under it, so a move is a new
mount. It gets a new scratch whose upper directory holds only the
uncommitted entries, renamed there from the old one (same filesystem: no
copy). A new mount process serves the new snapshots. Its overlays are put
beneath the old ones at the same mount points, and then the old ones are
detached. That uses move_mount with MOVE_MOUNT_BENEATH (Linux 6.5), so a path
lookup never finds the mount point empty.

A move is made only when nothing uses the mount. No process may have its
working or root directory, an open file or a mapping there. The old overlays
are then remounted read-only, which fails while a file is open for writing,
so nothing changes while the uncommitted entries move. Otherwise the mount
stays where it is and the caller is told why. A mount whose uncommitted
entries include a renamed directory (an overlay redirect), a hard link, or
the volume root's own attributes also stays: those entries point into the
old lower layer, and only a commit resolves them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import stat as statmod
from dataclasses import dataclass, replace

from strata import localfile
from strata.engine.errors import Conflict, Stayed
from strata.engine.interface import Store
from strata.engine.objects import K_DIR, Entry
from strata.engine.tree import Trees
from strata.mount.overlay import (
    MS_NODEV,
    MS_NOSUID,
    MS_RDONLY,
    MS_REMOUNT,
    OVERLAY_PREFIX,
    REDIRECT,
    MountError,
    _libc,
    is_mountpoint,
    sys_mount,
    unmount,
)
from strata.mount.session import teardown, uncommitted_changes
from strata.mount.state import SETTINGS, MountState, VolumeState, new_state

# A commit moves the mount once its upper directory holds this many published
# paths: below it, a scan of them costs less than starting a new mount process.
MOVE_AFTER = 512

_SYS_MOVE_MOUNT = 429  # x86_64 and arm64 (asm-generic) alike
_MOVE_MOUNT_BENEATH = 0x200
_AT_FDCWD = -100


@dataclass
class _Plan:
    volume: VolumeState
    target: str                  # the snapshot to move onto
    uncommitted: dict[str, Entry | None]


def published_in_upper(state: MountState) -> int:
    """How many paths this mount's upper directories hold that a commit published."""
    return sum(len(v.published) for v in state.committed)


def after_commit(store: Store, state: MountState) -> tuple[MountState, str | None]:
    """Move onto what the last commit published, if it is worth it and nothing uses the mount.

    Returns the mount's state (new if it moved) and why it stayed, if it did
    and a move was due.
    """
    if state.is_step or published_in_upper(state) < MOVE_AFTER:
        return state, None
    try:
        return move(store, state, {v.name: v.base for v in state.committed}), None
    except Stayed as exc:
        return state, str(exc)


def reload(store: Store, state: MountState) -> MountState:
    """Move onto the heads of the mount's branches, keeping uncommitted changes.

    Raises Conflict naming the paths that both the mount (uncommitted) and
    the head (since the mount's last commit) changed, and Stayed when the
    mount is in use.
    """
    heads = {v.name: store.head(v.volume, v.branch) for v in state.volumes if v.branch}
    return move(store, state, heads, check_heads=True)


def move(store: Store, state: MountState, targets: dict[str, str], *,
         check_heads: bool = False) -> MountState:
    """Move the volumes named in `targets` onto those snapshots (see the module's doc)."""
    if state.is_step or state.rw:
        raise Stayed("a step's mount never moves")
    users = using(state)
    if users:
        raise Stayed(f"in use by {', '.join(users[:5])}"
                     + (f" and {len(users) - 5} more" if len(users) > 5 else ""))
    frozen = _freeze(state)
    new: MountState | None = None
    try:
        plans = _plan(store, state, targets, check_heads)
        new = _new_state(state, plans)
        for plan in plans:
            _carry(store, state, new, plan)
        _mount_and_swap(state, new, plans)
    except BaseException:
        if new is not None:
            with contextlib.suppress(Exception):
                teardown(new, lazy=True)
        _thaw(state, frozen)
        raise
    _retire(state)
    return new


def using(state: MountState) -> list[str]:
    """Processes with a directory, file or mapping in the mount's volumes: "PID (comm)"."""
    roots = [state.target(v) for v in state.volumes]
    prefixes = tuple(r.rstrip("/") + "/" for r in roots)

    def inside(path: str) -> bool:
        return path in roots or path.startswith(prefixes)

    me = os.getpid()
    out = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid == me:
            continue
        base = f"/proc/{pid}"
        try:
            links = [os.readlink(f"{base}/cwd"), os.readlink(f"{base}/root")]
            with contextlib.suppress(OSError):
                links += [os.readlink(f"{base}/fd/{fd}") for fd in os.listdir(f"{base}/fd")]
            with open(f"{base}/maps", "rb") as maps:
                links += [line.split(None, 5)[5].rstrip(b"\n").decode("utf-8", "replace")
                          for line in maps if line.count(b" ") >= 5 and b"/" in line]
            if any(inside(p.removesuffix(" (deleted)")) for p in links):
                with open(f"{base}/comm") as comm:
                    out.append(f"{pid} ({comm.read().strip()})")
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return out


def _overlay_flags(state: MountState) -> int:
    return MS_NOSUID | MS_NODEV if state.guarded else 0


def _freeze(state: MountState) -> list[str]:
    """Remount the writable volumes' overlays read-only; fails while a file is open for writing."""
    done: list[str] = []
    for v in state.committed:
        target = state.target(v)
        try:
            sys_mount("none", target, None, MS_REMOUNT | MS_RDONLY | _overlay_flags(state),
                      None, "read-only remount")
        except MountError as exc:
            _thaw(state, done)
            raise Stayed(f"a file is open for writing in {target}") from exc
        done.append(target)
    return done


def _thaw(state: MountState, frozen: list[str]) -> None:
    for target in frozen:
        with contextlib.suppress(MountError):
            sys_mount("none", target, None, MS_REMOUNT | _overlay_flags(state), None,
                      "read-write remount")


def _plan(store: Store, state: MountState, targets: dict[str, str], check_heads: bool
          ) -> list[_Plan]:
    plans = []
    conflicts: list[str] = []
    trees = Trees(store)
    for v in state.volumes:
        if v.name not in targets:
            continue
        uncommitted: dict[str, Entry | None] = {}
        if not v.readonly:
            uncommitted, _scan = uncommitted_changes(store, state, v)
            _check_movable(state, v, uncommitted)
        if check_heads and uncommitted and targets[v.name] != v.base:
            changed = [p for p, _a, _b in trees.diff(store.snapshot(v.base).root,
                                                      store.snapshot(targets[v.name]).root)]
            conflicts += _overlapping(changed, uncommitted)
        plans.append(_Plan(v, targets[v.name], uncommitted))
    if conflicts:
        raise Conflict(conflicts, f"reload: {len(set(conflicts))} uncommitted path(s) also "
                                  "changed on the branch; commit them (which reports the "
                                  "conflict) or discard them first")
    return plans


def _overlapping(changed: list[str], mine: dict[str, Entry | None]) -> list[str]:
    """Paths of `mine` that equal, contain or lie within a path in `changed`."""
    theirs = set(changed)
    out = []
    for path in mine:
        parts = path.split("/")
        if any("/".join(parts[:i]) in theirs for i in range(1, len(parts) + 1)):
            out.append(path)
            continue
        prefix = path + "/"
        if any(c.startswith(prefix) for c in theirs):
            out.append(path)
    return out


def _check_movable(state: MountState, v: VolumeState, uncommitted: dict[str, Entry | None]
                   ) -> None:
    upper = state.upper(v)
    for path, e in uncommitted.items():
        if not path:
            continue  # its attributes are set through the new overlay (_mount_and_swap)
        real = os.path.join(upper, path)
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            continue  # below a directory that moves whole
        if statmod.S_ISDIR(st.st_mode) and localfile.read_xattr(real, REDIRECT) is not None:
            raise Stayed(f"{path}: a renamed directory is uncommitted")
        if statmod.S_ISREG(st.st_mode) and st.st_nlink > 1:
            raise Stayed(f"{path}: a hard-linked file is uncommitted")
        if e is not None and e.kind == K_DIR and e.ref is not None:
            for dirpath, dirs, files in os.walk(real):
                for name in dirs:
                    if localfile.read_xattr(os.path.join(dirpath, name), REDIRECT) is not None:
                        raise Stayed(f"{path}: a renamed directory is uncommitted")
                for name in files:
                    if os.lstat(os.path.join(dirpath, name)).st_nlink > 1:
                        raise Stayed(f"{path}: a hard-linked file is uncommitted")


def _new_state(old: MountState, plans: list[_Plan]) -> MountState:
    moving = {p.volume.name: p.target for p in plans}
    volumes = [replace(v, pinned=moving[v.name], base=moving[v.name], published={})
               if v.name in moving else replace(v, published=dict(v.published))
               for v in old.volumes]
    new = new_state(old.mountpoint, old.server, volumes, old.single, save=False)
    for name in SETTINGS:
        if name != "stage":  # a step's staging directory, removed with the old mount
            setattr(new, name, getattr(old, name))
    new.mountpoint = os.path.join(new.scratch, "stage")  # until the swap
    os.mkdir(new.mountpoint, 0o755)
    return new


def _carry(store: Store, old: MountState, new: MountState, plan: _Plan) -> None:
    """Rename the uncommitted entries from the old upper directory into the new one."""
    v = plan.volume
    if not plan.uncommitted:
        return
    src, dst = old.upper(v), new.upper(_twin(new, v))
    trees = Trees(store)
    root = store.snapshot(plan.target).root
    moved: list[str] = []
    dirs: list[tuple[str, os.stat_result]] = []  # attributes to set once children are in
    for path in sorted(plan.uncommitted, key=lambda p: p.split("/")):
        if not path:
            continue  # the root: see _mount_and_swap
        if any(path.startswith(m + "/") for m in moved):
            continue  # inside a directory that moved whole
        real = os.path.join(src, path)
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            continue
        _parents(trees, root, src, dst, path)
        e = plan.uncommitted[path]
        if statmod.S_ISDIR(st.st_mode) and (e is None or e.ref is None):
            # Attributes only (or a new directory): the directory alone; what it
            # holds comes by its own paths.
            if not os.path.isdir(os.path.join(dst, path)):
                os.mkdir(os.path.join(dst, path))
            dirs.append((path, st))
            continue
        os.rename(real, os.path.join(dst, path))
        _forget_origin(os.path.join(dst, path))
        moved.append(path)
    for path, st in sorted(dirs, key=lambda d: -d[0].count("/")):
        _copy_dir_attrs(os.path.join(src, path), os.path.join(dst, path), st)


# Written by overlayfs on a copy up: a handle of the lower file it came from
# (the old view's, which the new one does not know: opening it gives ESTALE), and
# marks that depend on such handles. Whiteouts and opaque directories keep theirs.
_ORIGIN_MARKS = tuple(OVERLAY_PREFIX + n for n in (b"origin", b"impure", b"nlink"))


def _forget_origin(top: str) -> None:
    def drop(path: str) -> None:
        for name in _ORIGIN_MARKS:
            with contextlib.suppress(OSError):
                os.removexattr(path, name, follow_symlinks=False)

    drop(top)
    if os.path.isdir(top) and not os.path.islink(top):
        for dirpath, dirs, files in os.walk(top):
            for name in dirs + files:
                drop(os.path.join(dirpath, name))


def _parents(trees: Trees, root: Entry, src: str, dst: str, path: str) -> None:
    """Make `path`'s parent directories in `dst`, with the new snapshot's attributes."""
    parts = path.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        rel = "/".join(parts[:i])
        d = os.path.join(dst, rel)
        if os.path.isdir(d):
            continue
        os.mkdir(d)
        e = trees.resolve(root, parts[:i])
        if e is not None and e.kind == K_DIR:
            os.chown(d, e.uid, e.gid)
            os.chmod(d, e.mode & 0o7777)
            for name, value in e.xattrs:
                with contextlib.suppress(OSError):
                    os.setxattr(d, name, value)
            os.utime(d, ns=(e.mtime_ns, e.mtime_ns))
        else:
            _copy_dir_attrs(os.path.join(src, rel), d, os.lstat(os.path.join(src, rel)))


def _copy_dir_attrs(src: str, dst: str, st: os.stat_result) -> None:
    for name in os.listxattr(src, follow_symlinks=False):
        if not name.encode().startswith(OVERLAY_PREFIX):
            with contextlib.suppress(OSError):
                os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False))
    os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, statmod.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def _twin(new: MountState, v: VolumeState) -> VolumeState:
    return next(n for n in new.volumes if n.name == v.name)


def _mount_and_swap(old: MountState, new: MountState, plans: list[_Plan]) -> None:
    """Start the new mount on its stage; put each volume beneath the old, detach the old."""
    from strata.mount.process import start
    error = start(new, background=True)
    if error is not None:
        raise MountError(f"moving the mount: {error}")
    new.pid = MountState.load(new.scratch).pid  # the mount process's, not ours
    for plan in plans:
        if "" in plan.uncommitted:
            # The root's attributes: overlayfs shows the upper root's, which the new
            # mount set to the new snapshot's; uncommitted ones are set through it.
            upper_root = old.upper(plan.volume)
            _copy_dir_attrs(upper_root, new.target(_twin(new, plan.volume)),
                            os.lstat(upper_root))
    libc = _libc()
    for v_new, v_old in zip(new.volumes, old.volumes, strict=True):
        src, dst = new.target(v_new), old.target(v_old)
        if libc.syscall(_SYS_MOVE_MOUNT, _AT_FDCWD, os.fsencode(src), _AT_FDCWD,
                        os.fsencode(dst), _MOVE_MOUNT_BENEATH) != 0:
            err = ctypes.get_errno()
            raise MountError(f"moving the mount beneath {dst}: {os.strerror(err)}")
        unmount(dst, lazy=True)  # the old one: what is beneath now shows
    if not new.single and is_mountpoint(new.mountpoint):
        unmount(new.mountpoint, lazy=True)  # the stage's own tmpfs, now empty
    new.mountpoint = old.mountpoint
    # The old state no longer names the mount point before the new one does: a
    # command looking for the mount finds one of them, never both.
    with contextlib.suppress(OSError):
        os.rename(os.path.join(old.scratch, "state.json"),
                  os.path.join(old.scratch, "state.moved.json"))
    new.save()


def _retire(old: MountState) -> None:
    """Let the old mount process go: its view is detached, and it exits once unused."""
    if is_mountpoint(old.lower):
        with contextlib.suppress(MountError):
            unmount(old.lower, lazy=True)
    shutil.rmtree(old.scratch, ignore_errors=True)
