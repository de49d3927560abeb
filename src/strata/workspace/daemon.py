"""The attach daemon: serves one attached workspace until it is detached.

Forked by `attach` (workspace/attach.py), it steals the workspace branch's
lease (fencing any earlier holder), serves the device file over FUSE in a
private directory, puts a loop device on it and mounts the filesystem on the
caller's directory. While it runs it renews the lease, writes dirty blocks
back in the background, and answers the snapshot and trim requests of
`strata workspace snapshot` and `detach` on a unix socket in its state
directory. An attach made for a process (`owner`, a step's runner) detaches
itself once that process is gone, so a runner that dies leaves nothing
attached. It never prints for a person: what it has to say goes to its log.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import threading
import time
from typing import Any

from strata.engine.errors import Forbidden, InvalidInput, StrataError
from strata.engine.interface import Store
from strata.engine.tree import Trees
from strata.procs import alive
from strata.workspace.device import Device, DeviceError, read_layout, written_extents
from strata.workspace.ext4 import (
    FIFREEZE,
    FITHAW,
    MKFS,
    MOUNT_OPTIONS,
    free_ranges,
    release_device,
    unmount_views,
)
from strata.workspace.state import FENCED, Attached

log = logging.getLogger(__name__)

LEASE_TTL = 30.0
TRIM_WAIT = 10.0           # how long a trim waits for the filesystem to be gone everywhere
OWNER_GRACE = 30.0         # an owner's processes get this long to leave the mount
FLUSH_DIRTY = 64 << 20     # write back in the background once this much is dirty
FLUSH_AGE = 5.0            # ... or once something has been dirty this long


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
                log.warning("fenced: %s", exc)
                self.note_fenced()
                return
            except StrataError as exc:
                log.warning("lease renewal failed, retrying: %s", exc)

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
                    log.warning("background write-back failed: %s", exc)

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
        log.info("its owner (pid %d) is gone: detaching", self.att.owner)
        deadline = time.monotonic() + OWNER_GRACE
        unmount_views(self.att.dir)
        while True:  # the owner's processes die with it (PDEATHSIG); wait for them to leave
            if subprocess.run(["umount", self.att.dir], capture_output=True).returncode == 0 \
                    or not os.path.ismount(self.att.dir):
                with contextlib.suppress(StrataError, OSError):
                    self.trim()
                break
            if time.monotonic() > deadline:
                log.warning("still busy: unmounting lazily")
                subprocess.run(["umount", "-l", self.att.dir], capture_output=True)
                break
            time.sleep(0.2)
        # Once the filesystem is gone (lazily: when its last user is) the loop
        # device lets go of the FUSE file; unmounting it ends the daemon's loop.
        release_device(self.devdir, deadline=None, every=0.5)

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
            log.warning("not trimmed: the filesystem is still in use "
                        "(another mount namespace holds it)")
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


def mount_fs(daemon: Daemon, fresh: bool) -> None:
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

    store: RemoteStore
    if att.fleet:  # through any live member; the store follows this host's work there
        from strata.fleet.client import FleetStore
        fleet = FleetStore(att.fleet.split(","), att.fleet_store or None, bearer=att.token,
                           prefetch=False)
        fleet.volume = att.volume  # requests that name no volume go to its store
        store = fleet
    else:
        store = RemoteStore(att.server, att.token, prefetch=False)  # the device keeps its map
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
            mount_fs(daemon, fresh)
            log.info("attached %s@%s at %s: lease and head %.0f ms, %smount %.0f ms",
                     att.volume, att.branch, att.dir, t_open * 1e3,
                     "mkfs and " if fresh else "", (time.monotonic() - t1) * 1e3)
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
