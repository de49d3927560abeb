"""Workspaces: create, attach, detach, snapshot; the attach daemon.

`attach` forks a daemon that steals the workspace branch's lease (fencing
any earlier holder), serves the device file over FUSE in a private
directory, puts a loop device on it and mounts the filesystem on the
caller's directory. The daemon renews the lease while it runs, writes dirty
blocks back in the background, and answers the snapshot requests of
`strata workspace snapshot` on a unix socket in its state directory. An
attach made for a process (`owner`, a step's runner) detaches itself once
that process is gone, so a runner that dies leaves nothing attached.

State lives in /run/strata/workspaces/<hash of the directory>/ (`state.json`,
`dev/` the FUSE directory, `ctl` the socket, `daemon.log`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from strata.engine.errors import Forbidden, InvalidInput, NotFound, StrataError
from strata.engine.interface import ChangeSet, Store
from strata.engine.objects import K_FILE, Entry, FileNode
from strata.engine.tree import Trees
from strata.procs import alive
from strata.workspace import LAYOUT_PATH
from strata.workspace.device import (
    SNAPSHOT_PATH,
    Device,
    DeviceError,
    Layout,
    snapshot_entry,
    written_extents,
)

STATE_ROOT = os.environ.get("STRATA_WORKSPACE_STATE", "/run/strata/workspaces")
LEASE_TTL = 30.0
TRIM_WAIT = 10.0           # how long a trim waits for the filesystem to be gone everywhere
OWNER_GRACE = 30.0         # an owner's processes get this long to leave the mount
FLUSH_DIRTY = 64 << 20     # write back in the background once this much is dirty
FLUSH_AGE = 5.0            # ... or once something has been dirty this long
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
FENCED = "fenced"  # in an attach's state directory, once another holder took it over


class WritesDropped(StrataError):
    """A detach found the attach fenced: what was written after that is not in the store."""
MOUNT_OPTIONS = "noatime,nosuid,nodev"  # what a workspace holds never raises privilege


@dataclass
class Attached:
    """What `detach` and `snapshot` need to find an attached workspace's daemon."""

    volume: str
    branch: str
    dir: str
    server: str
    token: str | None = None
    pid: int = 0
    loop: str = ""
    snapshot: str = ""   # set for a read-only attach of one snapshot
    owner: int = 0       # detach once this process is gone (0: stay until detached)

    @property
    def state_dir(self) -> str:
        return state_dir_for(self.dir)

    def save(self) -> None:
        path = os.path.join(self.state_dir, "state.json")
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(self), f)
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, directory: str) -> Attached:
        try:
            with open(os.path.join(state_dir_for(directory), "state.json")) as f:
                return cls(**json.load(f))
        except FileNotFoundError:
            raise NotFound(f"no workspace is attached at {directory}") from None
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"the attach state of {directory} is damaged: {exc}") from None


def state_dir_for(directory: str) -> str:
    real = os.path.realpath(directory)
    return os.path.join(STATE_ROOT, hashlib.sha256(os.fsencode(real)).hexdigest()[:16])


def attached() -> list[Attached]:
    """Every workspace attached on this machine (in this mount namespace's view)."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(STATE_ROOT)):
            with contextlib.suppress(OSError, ValueError, TypeError):
                with open(os.path.join(STATE_ROOT, name, "state.json")) as f:
                    out.append(Attached(**json.load(f)))
    return out


# -- the workspace in the store --------------------------------------------------------

def create(store: Store, volume: str, layout: Layout) -> str:
    """A new volume holding an empty (never written) device; returns its head."""
    store.create_volume(volume)
    head = store.head(volume, "live")
    raw = layout.encode()
    return store.publish([ChangeSet(volume, "live", head, {
        LAYOUT_PATH: Entry(kind=K_FILE, mode=0o644, size=len(raw), data=raw)},
        "create workspace", {"workspace": "create"})])[0]


def read_layout(store: Store, sid: str) -> Layout:
    e = Trees(store).resolve(store.snapshot(sid).root, [LAYOUT_PATH])
    if e is None or e.kind != K_FILE:
        raise InvalidInput("this volume is not a workspace (it has no workspace.json)")
    if e.data is not None:
        raw = e.data
    elif e.ref is not None and e.size <= 4096:
        raw = FileNode.decode(store.get_object(e.ref)).read(0, e.size, store.get_object)
    else:
        raise InvalidInput("workspace.json is not a workspace layout")
    return Layout.decode(raw)


# -- the daemon --------------------------------------------------------------------------

class Daemon:
    def __init__(self, store: Store, att: Attached) -> None:
        self.store = store
        self.att = att
        self.devdir = os.path.join(att.state_dir, "dev")
        self.stopping = threading.Event()
        self.device: Device | None = None
        self.lease = ""

    def open(self) -> bool:
        """Take the lease (fencing any earlier holder) and map the head; True if fresh.

        A snapshot is attached read-only: no lease, and what the filesystem
        writes (its journal replay) stays in memory and is dropped at detach.
        """
        a = self.att
        if a.snapshot:
            head = a.snapshot
        else:
            holder = f"{socket.gethostname()} pid {os.getpid()}"
            self.lease = self.store.acquire_lease(a.volume, a.branch, LEASE_TTL, holder,
                                                  steal=True).id
            head = self.store.head(a.volume, a.branch)
        layout = read_layout(self.store, head)
        self.device = Device(self.store, a.volume, a.branch, head, layout,
                             lease=self.lease or None, scratch=bool(a.snapshot))
        self.device.on_fenced = self.note_fenced
        root = self.store.snapshot(head).root
        fresh = next(iter(written_extents(Trees(self.store), root)), None) is None
        if fresh and a.snapshot:
            raise InvalidInput(f"snapshot {head[:12]} of {a.volume} was never formatted: "
                               "there is nothing to mount")
        return fresh

    def renew(self) -> None:
        dev = self.device
        assert dev is not None
        while not self.stopping.wait(LEASE_TTL / 4):
            try:
                self.store.renew_lease(self.att.volume, self.att.branch, self.lease, LEASE_TTL)
            except Forbidden as exc:
                dev.fenced = f"this host no longer holds the workspace's lease: {exc}"
                print(f"strata workspace: fenced: {exc}", flush=True)
                self.note_fenced()
                return
            except StrataError as exc:
                print(f"strata workspace: lease renewal failed, retrying: {exc}", flush=True)

    def note_fenced(self) -> None:
        """Record, beside the attach, that it was fenced and what it could not publish.

        `workspace list` shows it; `workspace detach` reports it and fails.
        """
        dev = self.device
        if dev is None or not dev.fenced:
            return
        doc = {"reason": dev.fenced, "dropped_bytes": dev.dirty_bytes + dev.refused_bytes}
        tmp = os.path.join(self.att.state_dir, FENCED + ".tmp")
        with contextlib.suppress(OSError):
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.rename(tmp, os.path.join(self.att.state_dir, FENCED))

    def write_back(self) -> None:
        dev = self.device
        assert dev is not None
        since: float | None = None
        while not self.stopping.wait(0.25):
            if dev.fenced:
                self.note_fenced()
                continue  # keep the count of what is refused up to date
            if dev.dirty_bytes == 0:
                since = None
                continue
            since = since or time.monotonic()
            if dev.dirty_bytes >= FLUSH_DIRTY or time.monotonic() - since >= FLUSH_AGE:
                try:
                    dev.flush()
                    since = None
                except StrataError as exc:
                    print(f"strata workspace: background write-back failed: {exc}", flush=True)

    def control(self, sock: socket.socket) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as f:
            try:
                req = json.loads(f.readline(65536))
                op = req.get("op") if isinstance(req, dict) else None
                if op == "snapshot":
                    head = self.snapshot(str(req.get("message") or "snapshot"))
                    reply: dict[str, Any] = {"ok": True, "head": head}
                elif op == "trim":
                    reply = {"ok": True, "trimmed": self.trim()}
                else:
                    raise InvalidInput("unknown request")
            except (StrataError, OSError, ValueError) as exc:
                reply = {"ok": False, "error": str(exc)}
            f.write(json.dumps(reply).encode() + b"\n")

    def follow(self, owner: int | None, up: threading.Event) -> None:
        """Once the owner's pidfd reads ready (it exited), detach this attach.

        `owner` is None when the owner was gone before the daemon could watch it.
        """
        if owner is not None:
            select.select([owner], [], [])
            os.close(owner)
        up.wait()
        if self.stopping.is_set():
            return
        print(f"strata workspace: its owner (pid {self.att.owner}) is gone: detaching",
              flush=True)
        deadline = time.monotonic() + OWNER_GRACE
        _unmount_views(self.att.dir)
        while True:  # the owner's processes die with it (PDEATHSIG); wait for them to leave
            if subprocess.run(["umount", self.att.dir], capture_output=True).returncode == 0 \
                    or not os.path.ismount(self.att.dir):
                with contextlib.suppress(StrataError, OSError):
                    self.trim()
                break
            if time.monotonic() > deadline:
                print("strata workspace: still busy: unmounting lazily", flush=True)
                subprocess.run(["umount", "-l", self.att.dir], capture_output=True)
                break
            time.sleep(0.2)
        # Once the filesystem is gone (lazily: when its last user is) the loop
        # device lets go of the FUSE file; unmounting it ends the daemon's loop.
        _release_device(self.devdir, deadline=None, every=0.5)

    def trim(self) -> int:
        """Punch what the unmounted filesystem has free; return the bytes punched.

        ext4 cannot discard through this device (pyfuse3 has no FUSE fallocate),
        so detach reads the free-block bitmaps once the filesystem is unmounted
        (clean, nothing writing) and makes those blocks holes.
        """
        dev = self.device
        assert dev is not None
        if dev.scratch or dev.fenced:
            return 0
        if not dev.wait_unused(TRIM_WAIT):
            # Unmounted here but alive elsewhere: its bitmaps are not final, and a
            # punch could land after a block's last write. Keeping blocks is safe.
            print("strata workspace: not trimmed: the filesystem is still in use "
                  "(another mount namespace holds it)", flush=True)
            return 0
        p = subprocess.run(["dumpe2fs", os.path.join(self.devdir, "disk")],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise DeviceError(f"dumpe2fs failed: {p.stderr.strip()[-300:]}")
        ranges = free_ranges(p.stdout)
        for start, length in ranges:
            dev.punch(start, length)
        dev.flush()
        return sum(n for _s, n in ranges)

    def snapshot(self, message: str) -> str:
        """Freeze the filesystem (clean on the device), publish a named snapshot, thaw."""
        dev = self.device
        assert dev is not None
        fd = os.open(self.att.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, FIFREEZE, 0)
            try:
                return dev.flush(message)
            finally:
                fcntl.ioctl(fd, FITHAW, 0)
        finally:
            os.close(fd)


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


def _ask(att: Attached, request: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(os.path.join(att.state_dir, "ctl"))
        s.sendall(json.dumps(request).encode() + b"\n")
        reply = json.loads(s.makefile("rb").readline(65536))
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise InvalidInput(f"{request.get('op')} failed: "
                           f"{reply.get('error') if isinstance(reply, dict) else reply}")
    return reply


def _mount_fs(daemon: Daemon, fresh: bool) -> None:
    from strata.workspace import loop
    dev, lfd = loop.attach(os.path.join(daemon.devdir, "disk"))
    device = daemon.device
    assert device is not None
    try:
        daemon.att.loop = dev
        daemon.att.save()
        # mkfs and a journal replay flush after every step; none of it is visible to
        # anyone until `mount` returns, and a publish is all-or-nothing over every
        # write before it, so one publish after is as safe: a crash before it leaves
        # the old image, whose journal the next attach replays again.
        device.deferring = True
        try:
            if fresh:
                subprocess.run([*MKFS, dev], check=True, capture_output=True)
            options = MOUNT_OPTIONS + (",ro" if daemon.att.snapshot else "")
            p = subprocess.run(["mount", "-t", "ext4", "-o", options, dev, daemon.att.dir],
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise DeviceError(f"mount failed: {p.stderr.strip()}")
        finally:
            device.deferring = False
        try:
            device.flush()
        except BaseException:
            subprocess.run(["umount", daemon.att.dir], capture_output=True)
            raise
    finally:
        os.close(lfd)  # the mount holds the loop device now; autoclear ends it with it


def run_daemon(att: Attached, report: int | None) -> int:
    """Serve the workspace until detached; write "ok" or an error to `report`."""
    from strata.server.client import RemoteStore
    from strata.workspace import fuse

    def tell(msg: bytes) -> None:
        nonlocal report
        if report is not None:
            try:
                os.write(report, msg)
            except OSError:
                pass  # the attaching process is gone (an owner: `follow` detaches)
            finally:
                os.close(report)
                report = None

    store = RemoteStore(att.server, att.token, prefetch=False)  # its device keeps its own map
    daemon = Daemon(store, att)
    os.makedirs(daemon.devdir, exist_ok=True)
    try:
        t0 = time.monotonic()
        fresh = daemon.open()
        t_open = time.monotonic() - t0
    except StrataError as exc:
        tell(str(exc).encode())
        return 1
    att.pid = os.getpid()
    att.save()
    ctl_path = os.path.join(att.state_dir, "ctl")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(ctl_path)
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ctl.bind(ctl_path)
    ctl.listen(8)
    threads: list[tuple[Any, tuple[Any, ...]]] = [(daemon.control, (ctl,))]
    if not att.snapshot:
        threads += [(daemon.renew, ()), (daemon.write_back, ())]
    up_done = threading.Event()
    if att.owner:
        try:  # the owner waits on our report, so it is alive now unless it was killed
            owner: int | None = os.pidfd_open(att.owner)
        except ProcessLookupError:
            owner = None
        threads.append((daemon.follow, (owner, up_done)))
    for target, args in threads:
        threading.Thread(target=target, args=args, daemon=True).start()

    def up() -> None:
        try:
            t1 = time.monotonic()
            _mount_fs(daemon, fresh)
            print(f"attached {att.volume}@{att.branch} at {att.dir}: lease and head "
                  f"{t_open * 1e3:.0f} ms, {'mkfs and ' if fresh else ''}mount "
                  f"{(time.monotonic() - t1) * 1e3:.0f} ms", flush=True)
        except (OSError, subprocess.CalledProcessError, StrataError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            tell(f"{exc} {detail.decode(errors='replace') if isinstance(detail, bytes) else detail}"
                 .strip().encode())
            subprocess.run(["fusermount3", "-uz", daemon.devdir], capture_output=True)
            return
        tell(b"ok")
        up_done.set()

    assert daemon.device is not None
    try:
        fuse.serve(daemon.device, daemon.devdir,
                   on_ready=lambda: threading.Thread(target=up, daemon=True).start())
    finally:
        daemon.stopping.set()
        ctl.close()
        dev = daemon.device
        with contextlib.suppress(StrataError):
            if not dev.fenced and not att.snapshot:
                dev.flush()
                store.release_lease(att.volume, att.branch, daemon.lease)
        daemon.note_fenced()  # the final count, after the unmount's own writes
        if att.owner and not alive(att.owner):
            shutil.rmtree(att.state_dir, ignore_errors=True)  # nobody is left to detach
    return 0


def attach(server: str, token: str | None, volume: str, branch: str, directory: str, *,
           snapshot: str = "", owner: int = 0) -> Attached:
    """Attach in a detached daemon; return once mounted (or raise its error).

    With `snapshot`, that snapshot, read-only (the branch is only a label).
    With `owner`, the daemon detaches by itself once that process is gone.
    """
    directory = os.path.realpath(directory)
    if not os.path.isdir(directory):
        raise InvalidInput(f"{directory} is not a directory")
    if os.path.ismount(directory):
        raise InvalidInput(f"something is mounted on {directory} already")
    att = Attached(volume, branch, directory, server, token, snapshot=snapshot, owner=owner)
    with contextlib.suppress(NotFound):
        old = Attached.load(directory)
        if old.pid and alive(old.pid):
            raise InvalidInput(f"{directory} has a workspace attached (pid {old.pid})")
    shutil.rmtree(att.state_dir, ignore_errors=True)
    os.makedirs(att.state_dir, mode=0o700)
    att.save()
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        msg = b""
        while chunk := os.read(rfd, 4096):
            msg += chunk
        os.close(rfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        if msg != b"ok":
            shutil.rmtree(att.state_dir, ignore_errors=True)
            why = msg.decode(errors="replace") or "the daemon died"
            raise InvalidInput(f"attach failed: {why}")
        return Attached.load(directory)
    os.close(rfd)
    code = 1
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        log = os.open(os.path.join(att.state_dir, "daemon.log"),
                      os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        from strata.logs import setup
        setup(os.path.join(att.state_dir, "daemon.log"))
        code = run_daemon(att, wfd)
    except BaseException as exc:  # noqa: BLE001 - report anything, then go
        with contextlib.suppress(OSError):
            os.write(wfd, f"{type(exc).__name__}: {exc}".encode())
    finally:
        os._exit(code)


def fuse_connections(mountinfo: str, fstype: str = "fuse.strata") -> list[int]:
    """The FUSE connection numbers of the `fstype` mounts a mountinfo text lists."""
    out = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " in line and line.split(" - ", 1)[1].split()[0] == fstype:
            major, _, minor = fields[2].partition(":")
            if major == "0" and minor.isdigit():
                out.append(int(minor))
    return out


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


def _gone(att: Attached) -> None:
    """Clean up after a daemon that died (its host's processes were killed)."""
    devdir = os.path.join(att.state_dir, "dev")
    with open("/proc/self/mountinfo") as f:
        mine = [ln for ln in f.read().splitlines() if ln.split()[4] == devdir]
    subprocess.run(["umount", "-l", att.dir], capture_output=True)
    abort_fuse(fuse_connections("\n".join(mine)))
    subprocess.run(["umount", "-l", devdir], capture_output=True)
    shutil.rmtree(att.state_dir, ignore_errors=True)


def _unmount_views(directory: str) -> None:
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
    with open("/proc/self/mountinfo") as f:
        views = [fields[4].encode().decode("unicode_escape") for fields in
                 (line.split() for line in f) if fields[2] == want]
    for mp in reversed(views):
        if mp != real:
            subprocess.run(["umount", "-l", mp], capture_output=True)


def _release_device(devdir: str, deadline: float | None, every: float = 0.05) -> bool:
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


def detach(directory: str, *, timeout: float = 60.0) -> None:
    """Unmount (which flushes), let the daemon publish and release the lease, wait.

    If the daemon is dead (the attach was lost with its processes), clean up
    what it left instead: nothing more reaches the workspace from here anyway.
    """
    att = Attached.load(directory)
    if not att.pid or not alive(att.pid):
        _gone(att)
        return
    p = subprocess.run(["umount", att.dir], capture_output=True, text=True)
    if p.returncode != 0 and os.path.ismount(att.dir):
        raise InvalidInput(f"cannot detach {att.dir}: {p.stderr.strip()}")
    if not att.snapshot and alive(att.pid):
        with contextlib.suppress(StrataError, OSError, ValueError):
            _ask(att, {"op": "trim"})  # free blocks become holes; keeping them is safe too
    deadline = time.monotonic() + timeout
    if not _release_device(os.path.join(att.state_dir, "dev"), deadline):
        raise InvalidInput(f"the device of {att.dir} stays busy")
    while att.pid and alive(att.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    fenced = fenced_note(att)
    shutil.rmtree(att.state_dir, ignore_errors=True)
    if fenced is not None:
        raise WritesDropped(f"{att.dir} was fenced ({fenced['reason']}): another holder took "
                     f"{att.volume}@{att.branch} over, and {fenced['dropped_bytes']} byte(s) "
                     "written here after that were dropped; the workspace holds what the "
                     "other holder wrote")


def fenced_note(att: Attached) -> dict[str, Any] | None:
    """What the daemon recorded when it was fenced, or None if it never was."""
    try:
        with open(os.path.join(att.state_dir, FENCED)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def snapshot(store: Store, volume: str, branch: str, message: str) -> str:
    """A named snapshot: through the daemon when attached here, else of the head."""
    for att in attached():
        if (att.volume, att.branch) == (volume, branch) and not att.snapshot \
                and alive(att.pid):
            return str(_ask(att, {"op": "snapshot", "message": message})["head"])
    head = store.head(volume, branch)
    read_layout(store, head)
    return store.publish([ChangeSet(volume, branch, head, {SNAPSHOT_PATH: snapshot_entry(message)},
                                    message, {"workspace": "snapshot"})])[0]
