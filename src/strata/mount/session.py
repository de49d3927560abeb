"""A mount's life: overlays over the FUSE view, scan, status, commit, unmount.

This module owns what is done to a mount: putting overlayfs over the FUSE
lower view, scanning the upper directories into change sets, publishing
them, and tearing the mount down (and sweeping what dead steps left). What a
mount is, its scratch directory and `state.json`, belongs to
mount/state.py. The mount process only serves the read-only lower view;
commit, status and unmount run in the caller's process against the same
store.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import blake3

from strata.engine.interface import ChangeSet, Store
from strata.engine.objects import K_DIR, Entry, FileNode, packb
from strata.engine.tree import Trees, encode_name
from strata.mount import statcache
from strata.mount.overlay import (
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_RDONLY,
    MS_REMOUNT,
    MountError,
    ObjectSet,
    Scan,
    UpperScanner,
    is_mountpoint,
    mount_overlay,
    mount_points,
    sys_mount,
    unmount,
    unmount_under,
)
from strata.mount.state import MountState, VolumeState, scratch_root
from strata.procs import alive

MAX_INLINE_UPLOAD = 4 * 1024 * 1024


def mount_overlays(state: MountState) -> None:
    """Put overlayfs over the FUSE view for every writable volume (FUSE must be up)."""
    done: list[str] = []
    step = state.is_step
    guarded = state.guarded
    secure = MS_NOSUID | MS_NODEV if guarded else 0
    try:
        if not state.single:
            # Volumes appear as DIR/NAME on a small private tmpfs, gone with the mount.
            sys_mount("strata-root", state.mountpoint, "tmpfs", secure, "size=1m,mode=0755",
                      "mounting the volume directory")
            done.append(state.mountpoint)
        for v in state.volumes:
            target = state.target(v)
            if not state.single:
                os.makedirs(target, exist_ok=True)
            if v.readonly:
                bind_readonly(state.lower_of(v), target, secure)
            else:
                # A step's scratch goes whenever its runner dies: no sync of it helps.
                mount_overlay(state.lower_of(v), state.upper(v), state.work(v), target,
                              volatile=step, secure=guarded)
            done.append(target)
    except BaseException:
        for t in reversed(done):
            with contextlib.suppress(MountError):
                unmount(t, lazy=True)
        raise


def bind_readonly(src: str, target: str, flags: int = 0) -> None:
    """Bind `src` on `target` read-only, with `flags` (nosuid, nodev) kept by the remount.

    A bind remount replaces the mount's flags: without them here it would drop
    the nosuid and nodev the view below has.
    """
    sys_mount(src, target, None, MS_BIND | flags, None, "read-only bind mount")
    with contextlib.suppress(MountError):  # the FUSE view below is read-only anyway
        sys_mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None,
                  "read-only remount")


def scan_volume(store: Store, state: MountState, v: VolumeState, *,
                cache: bool = True) -> Scan:
    """The volume's upper directory as a change set against its pinned snapshot.

    With `cache`, files unchanged since the last commit take their entries
    from the stat cache instead of being read again, and the scan notes the
    upper filesystem's time at its start (`stamp_ns`) for the next save.
    """
    trees = Trees(store)
    lower_root = store.snapshot(v.pinned).root
    upper = state.upper(v)
    known: statcache.StatCache | None = None
    stamp_ns = None
    if cache:
        index = state.statcache_path(v)
        os.makedirs(os.path.dirname(index), mode=0o700, exist_ok=True)
        now, dev = statcache.fs_now(os.path.dirname(index))
        if dev == os.lstat(upper).st_dev:  # else its clock is not the upper files' clock
            stamp_ns = now
            known = statcache.load(index, volume=v.volume, pinned=v.pinned, base=v.base)
    scan = UpperScanner(trees, lower_root, store.block_size, known,
                        state.id_shift).scan(upper)
    scan.stamp_ns = stamp_ns
    scan.known = known
    scan.cache_ignored = known.ignored if known is not None else ""
    return scan


def entry_digest(e: Entry | None) -> str:
    return blake3.blake3(packb(None if e is None else e.to_list())).hexdigest()[:24]


def uncommitted_changes(store: Store, state: MountState, v: VolumeState, *,
                        cache: bool = True) -> tuple[dict[str, Entry | None], Scan]:
    """What this volume's next commit publishes: changes since its last commit.

    The upper directory describes the mount against the pinned snapshot; what
    was already published is left out, so a later commit never re-asserts
    paths it did not touch again (and cannot conflict on them). A path that
    was published but is back to its pinned state is set back.
    """
    scan = scan_volume(store, state, v, cache=cache)
    changes: dict[str, Entry | None] = {}
    scan.digests = _digests(scan)
    for path, d in scan.digests.items():
        if v.published.get(path) != d:
            changes[path] = scan.changes[path]
    # A directory replaced whole (opaque, or renamed from elsewhere) is sent again
    # whenever its attributes change, e.g. its mtime when a file is added. It then
    # replaces what the head holds there, so everything the mount has beneath it
    # goes with it again, published before or not.
    replaced = {p for p, e in changes.items()
                if e is not None and e.kind == K_DIR and e.ref is not None}
    if replaced:
        for path, e in scan.changes.items():
            parts = path.split("/")
            if path not in changes and any("/".join(parts[:i]) in replaced
                                           for i in range(1, len(parts))):
                changes[path] = e
    gone = [p for p in v.published if p not in scan.changes]
    if gone:
        trees = Trees(store)
        root = store.snapshot(v.pinned).root
        view = dict(scan.changes)
        for path in sorted(gone, key=lambda p: p.split("/")):  # parents first
            seen, e = _seen_without_change(trees, root, view, path)
            if not seen:
                continue  # below a path now deleted or made a file: gone with it
            view[path] = e
            if e is not None and e.kind == K_DIR:
                e = e.with_(ref=None)  # back to those attributes, contents untouched
            changes[path] = e
    # An entry from the stat cache names objects a commit published; if one is to
    # be published again (below a replaced directory) and the store has lost
    # them since (its snapshots expired), read the files again.
    again = [e.ref for p, e in changes.items()
             if p in scan.cached and e is not None and e.ref is not None]
    if again and store.missing(again):
        return uncommitted_changes(store, state, v, cache=False)
    return changes, scan


def _digests(scan: Scan) -> dict[str, str]:
    """entry_digest of every change; the stat cache has those of files it gave back."""
    out = {}
    for path, e in scan.changes.items():
        d = scan.cached.get(path)
        out[path] = d if d is not None and scan.seen[path][1] is e else entry_digest(e)
    return out


def _seen_without_change(trees: Trees, root: Entry, changes: dict[str, Entry | None],
                         path: str) -> tuple[bool, Entry | None]:
    """What the mount shows at `path` when the scan has no change for it.

    (False, None) when its parent is no directory in that view (deleted, or
    made a file): a change set may not name such a path. Below a directory
    the scan replaced (opaque, or redirected from elsewhere), what that
    directory's tree holds; otherwise what the pinned snapshot holds.
    """
    if not path:
        return True, root
    parts = path.split("/")
    parent = trees.resolve_changed(root, changes, parts[:-1])
    if parent is None or parent.kind != K_DIR:
        return False, None
    return True, trees.child(parent, encode_name(parts[-1]))




@dataclass
class CommitResult:
    published: dict[str, str]   # volume name -> new head
    changed_paths: int
    uploaded_bytes: int         # objects sent: only those the store lacked
    seconds: float
    read_files: int = 0         # files the scans read and hashed (not from the stat cache)
    read_bytes: int = 0


def commit(store: Store, state: MountState, *, message: str = "",
           meta: dict[str, Any] | None = None, names: list[str] | None = None,
           leases: dict[str, str] | None = None, identical: bool = False,
           remember: bool = True) -> CommitResult:
    """Publish the mount's volumes (all, or `names`) in one atomic commit.

    `identical` accepts paths the head already holds exactly as the mount
    has them (see ChangeSet.identical); off, any path changed since the
    mount's snapshot that the mount also changed conflicts. `remember`
    keeps a stat cache of what was published for the next scan (a step's
    mount, committed once and dropped, has no use for it).
    """
    t0 = time.monotonic()
    todo = [v for v in state.committed if names is None or v.name in names]
    work = [(v, *uncommitted_changes(store, state, v, cache=remember)) for v in todo]
    changesets = []
    objects: dict[bytes, ObjectSet] = {}  # id -> the scan that can read it
    for v, changes, scan in work:
        if not changes:
            continue
        changesets.append(ChangeSet(v.volume, v.branch, v.base, changes, message,
                                    dict(meta or {}), (leases or {}).get(v.name), identical))
        _needed(changes, scan, objects)
    uploaded, sent = _upload(store, objects)
    heads = store.publish(changesets, uploaded) if changesets else []
    published = {}
    moved = iter(heads)
    for v, changes, scan in work:
        if changes:
            v.base = next(moved)
        v.published = scan.digests
        published[v.name or v.volume] = v.base
        if scan.stamp_ns is not None:
            # Before state.json: a crash in between leaves a cache made for a base
            # the state does not name yet, which the next scan ignores.
            statcache.save(state.statcache_path(v), volume=v.volume, pinned=v.pinned,
                           base=v.base, stamp_ns=scan.stamp_ns, files=_cache_rows(scan))
    if remember:
        state.save()  # a step's state is dropped with its scratch right after
    return CommitResult(published, sum(len(c) for _v, c, _s in work), sent,
                        time.monotonic() - t0, sum(s.files_hashed for _v, _c, s in work),
                        sum(s.bytes_hashed for _v, _c, s in work))


def _cache_rows(scan: Scan) -> list[list[Any]]:
    """The stat cache's rows for what this scan saw (rows it gave back are kept as read)."""
    known = scan.known.records if scan.known is not None else {}
    rows = []
    for path, (key, e) in scan.seen.items():
        row = known[path] if path in scan.cached else None
        if row is None:
            digest = scan.digests[path] if scan.changes.get(path) is e else entry_digest(e)
            row = statcache.record(path, key, e, digest, scan.stamp_ns or 0)
        if row is not None:
            rows.append(row)
    return rows


def upload_changes(store: Store, changes: dict[str, Entry | None], scan: Scan
                   ) -> list[tuple[int, bytes]]:
    """Upload what `changes` needs and the store lacks; return what rides with the publish."""
    objects: dict[bytes, ObjectSet] = {}
    _needed(changes, scan, objects)
    return _upload(store, objects)[0]


def _needed(changes: dict[str, Entry | None], scan: Scan, out: dict[bytes, ObjectSet]) -> None:
    for e in changes.values():
        if e is not None and e.ref is not None and e.ref in scan.objects:
            _collect(scan, e.ref, out)


def _collect(scan: Scan, ref: bytes, out: dict[bytes, ObjectSet]) -> None:
    """A file's new nodes and the new chunks they name (chunks read only when uploaded)."""
    out[ref] = scan.objects
    _kind, raw = scan.objects[ref]  # file nodes are always held
    node = FileNode.decode(raw)
    for _n, b in node.entries:
        if b in scan.objects and b not in out:
            if node.level:
                _collect(scan, b, out)
            else:
                out[b] = scan.objects


def _upload(store: Store, objects: dict[bytes, ObjectSet]
            ) -> tuple[list[tuple[int, bytes]], int]:
    """Upload what the store lacks; small sets ride with the publish instead.

    Returns the objects to send with the publish and the bytes sent in all:
    only what the store lacked, so a copy of data it has costs nothing.
    Blocks are read one upload batch at a time.
    """
    if not objects:
        return [], 0
    lacking = set(store.missing(list(objects)))
    todo = [o for o in objects if o in lacking]
    sent = sum(objects[o].size(o) for o in todo)
    if sent <= MAX_INLINE_UPLOAD:
        return [objects[o][o] for o in todo], sent
    batch: list[tuple[int, bytes]] = []
    size = 0
    for oid in todo:
        obj = objects[oid][oid]
        batch.append(obj)
        size += len(obj[1])
        if size >= 16 * 1024 * 1024:
            store.put_objects(batch)
            batch, size = [], 0
    if batch:
        store.put_objects(batch)
    return [], sent


def status(store: Store, state: MountState) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in state.volumes:
        if v.readonly:
            out[v.name or v.volume] = {"readonly": True, "changes": [], "uncommitted": []}
            continue
        changes, scan = uncommitted_changes(store, state, v)
        out[v.name or v.volume] = {
            "volume": v.volume, "branch": v.branch, "pinned": v.pinned, "base": v.base,
            "changes": scan.summary(), "uncommitted": sorted(changes),
            "read": {"files": scan.files_hashed, "bytes": scan.bytes_hashed,
                     "from_stat_cache": len(scan.cached),
                     "stat_cache_ignored": scan.cache_ignored}}
    return out


def has_uncommitted(store: Store, state: MountState) -> bool:
    return any(uncommitted_changes(store, state, v)[0] for v in state.committed)


def teardown(state: MountState, *, lazy: bool = False) -> None:
    """Unmount overlays and the FUSE view, stop the mount process, drop scratch."""
    errors = []
    targets = [state.target(v) for v in state.volumes]
    for t in targets:
        if is_mountpoint(t):
            try:
                unmount(t, lazy=lazy)
            except MountError as exc:
                errors.append(str(exc))
    if errors:
        raise MountError("; ".join(errors) + " (is a process still using it?)")
    if is_mountpoint(state.lower):
        unmount(state.lower, lazy=True)
    if state.pid and state.pid != os.getpid():
        _wait_exit(state.pid, 5.0)
        if alive(state.pid):
            with contextlib.suppress(OSError):
                os.kill(state.pid, signal.SIGTERM)
    if not state.single and is_mountpoint(state.mountpoint):
        unmount(state.mountpoint, lazy=True)  # the tmpfs holding DIR/NAME
    if state.stage:
        remove_stage(state.stage)
    _unmount_rw(state)
    shutil.rmtree(state.scratch, ignore_errors=True)


def limit_writes(state: MountState, size: int) -> None:
    """Put the mount's upper and work directories on an ext4 filesystem of `size` bytes.

    A sparse image in the scratch directory, mounted nosuid,nodev on
    scratch/rw: a step that fills it gets ENOSPC and fails; the disk around
    it keeps its free space.
    """
    image = os.path.join(state.scratch, "rw.img")
    rw = os.path.join(state.scratch, "rw")
    os.mkdir(rw, 0o700)
    with open(os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.truncate(size)
    for argv in (["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", "-E",
                  "nodiscard,lazy_itable_init=1", image],
                 ["mount", "-o", "loop,nosuid,nodev,noatime", image, rw]):
        p = subprocess.run(argv, capture_output=True, text=True)
        if p.returncode != 0:
            raise MountError(f"making the step's {size}-byte disk: {argv[0]}: "
                             f"{p.stderr.strip()}")
    os.chmod(rw, 0o700)
    state.rw = "rw"
    for v in state.volumes:
        os.makedirs(state.upper(v), mode=0o755)
        os.makedirs(state.work(v), mode=0o700)


def _unmount_rw(state: MountState) -> None:
    if state.rw:
        rw = os.path.join(state.scratch, "rw")
        if is_mountpoint(rw):
            with contextlib.suppress(MountError):
                unmount(rw, lazy=True)  # the loop device goes with it (autoclear)


def remove_stage(stage: str) -> None:
    """Remove a step's staging directory (what its sandbox is built from), unmounting first.

    Nothing is removed while anything is still mounted beneath it: a removal
    must never reach into a workspace or a volume.
    """
    unmount_under(stage)
    real = os.path.realpath(stage)
    if any(mp == real or mp.startswith(real + "/") for mp in mount_points()):
        return
    shutil.rmtree(stage, ignore_errors=True)


SWEEP_AFTER = 5.0  # seconds a step scratch must have been left alone before a sweep


def sweep_abandoned_steps(root: str | None = None) -> list[str]:
    """Remove step scratch directories whose runner and mount process are both gone.

    A runner killed after its mount process stopped (during teardown) or
    before that process started leaves its scratch directory with nobody to
    remove it. Only step scratch (state with a run id) is swept, and only when
    neither process is alive and nothing is mounted beneath it. Returns what
    was removed. A scratch whose state changed in the last SWEEP_AFTER
    seconds is left alone: its mount process may be starting.
    """
    root = root or scratch_root()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for mid in names:
        scratch = os.path.join(root, mid)
        try:
            st = MountState.load(scratch)
            if time.time() - os.stat(os.path.join(scratch, "state.json")).st_mtime < SWEEP_AFTER:
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not st.is_step or not st.runner:
            continue
        if alive(st.runner) or (st.pid and alive(st.pid)):
            continue
        _unmount_rw(st)  # a --disk filesystem: nobody else can be using it now
        if any(mp == scratch or mp.startswith(scratch + "/") for mp in mount_points()):
            continue
        if st.stage:
            remove_stage(st.stage)
        shutil.rmtree(scratch, ignore_errors=True)
        removed.append(scratch)
    return removed


def _wait_exit(pid: int, timeout: float) -> None:
    """Wait up to `timeout` for `pid` (not our child) to exit: woken by its pidfd."""
    deadline = time.monotonic() + timeout
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        fd = -1  # gone already, or no pidfds here: poll
    try:
        while alive(pid) and (left := deadline - time.monotonic()) > 0:
            if fd >= 0:
                select.select([fd], [], [], min(left, 0.1))
            else:
                time.sleep(0.005)
    finally:
        if fd >= 0:
            os.close(fd)
