"""The mount process: serve the FUSE view and put the overlays on top.

`start` runs in the foreground until the view is unmounted, or (background)
forks a detached process and returns once the mount is ready or has failed.
With `watch_pid`, the mount process tears itself down, discarding the upper
directories, as soon as that process is gone (first killing the process group
the owner recorded as the state's `pgid`, the processes using the
mount): a step runner that dies publishes nothing and leaves no scratch behind.
`Prepared` is a mount process forked before its mount exists (a runner's or
a step service worker's), which `start_mount` starts once it does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from strata.engine.errors import StrataError
from strata.mount.overlay import MountError, unmount
from strata.mount.session import mount_overlays, teardown
from strata.mount.state import MountState
from strata.procs import alive
from strata.server.client import RemoteStore

if TYPE_CHECKING:
    from strata.mount.boottrace import ImageBoot
    from strata.mount.vfs import SnapshotFS

log = logging.getLogger(__name__)

# Set by the watcher when it starts discarding, and when it is done: unmounting the
# FUSE view ends the main loop, which must not exit the process half-way through.
_discarding = threading.Event()
_discarded = threading.Event()


def start(state: MountState, *, background: bool, watch_pid: int | None = None,
          announce: bool = True) -> str | None:
    """Mount; in the background, return None once ready or the error message."""
    rfd, wfd = os.pipe()
    if background:
        pid = os.fork()
        if pid:
            os.close(wfd)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # the intermediate child exits at once
            return _ready(rfd)
        os.close(rfd)
        os.setsid()
        if os.fork():  # detach fully: the caller never has to reap us
            os._exit(0)
        _log_to(state)
    else:
        os.close(rfd)
    return _serve(state, wfd, background=background, watch_pid=watch_pid, announce=announce)


class Prepared:
    """A mount process forked before its mount exists, loading the FUSE stack meanwhile.

    A step's runner forks it first and pins, forks branches and writes the
    state while the child imports pyfuse3 and trio (~70 ms) on the other
    core; `start_mount` hands it the scratch directory and waits until the
    mount is ready, as `start` does. Until then the child waits on a pipe, and exits
    when the runner closes it or dies (`cancel`, or the kernel closing it).
    """

    def __init__(self, watch_pid: int, close: tuple[int, ...] = ()) -> None:
        # `close`: descriptors of the caller's that the mount process must not keep
        # open (the step service's connection to its client: its end tells the
        # client the step is over).
        cmd_r, self._cmd = os.pipe()
        self._ready, wfd = os.pipe()
        pid = os.fork()
        if pid:
            os.close(cmd_r)
            os.close(wfd)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # the intermediate child exits at once
            return
        code = 1
        try:
            os.close(self._cmd)
            os.close(self._ready)
            for fd in close:
                with contextlib.suppress(OSError):
                    os.close(fd)
            os.setsid()
            if os.fork():
                code = 0
                return
            _load_fuse_stack()
            message = _read_all(cmd_r)
            if not message:
                code = 0  # the runner gave up, or died
                return
            scratch, _, extra = message.partition(b"\0")
            how = json.loads(extra) if extra else {}
            if how.get("env") is not None:
                os.environ.clear()
                os.environ.update(how["env"])
            state = MountState.load(os.fsdecode(scratch))
            _log_to(state)
            _serve(state, wfd, background=True, announce=False,
                   watch_pid=watch_pid if how.get("watch", True) else None)
        finally:
            os._exit(code)

    def start_mount(self, state: MountState, env: dict[str, str] | None = None, *,
           watch: bool = True) -> str | None:
        """Mount `state`; None once ready, else the error message.

        `env` replaces the mount process's environment first (the step
        service forks it before it knows its client's, which names the
        content cache). Without `watch` the mount outlives the process that
        forked it (`strata mount --background` made by the step service).
        """
        message = os.fsencode(state.scratch)
        if env is not None or not watch:
            message += b"\0" + json.dumps({"env": env, "watch": watch}).encode()
        _write_all(self._cmd, message)
        os.close(self._cmd)
        self._cmd = -1
        rfd, self._ready = self._ready, -1
        return _ready(rfd)

    def cancel(self) -> None:
        for fd in (self._cmd, self._ready):
            if fd >= 0:
                os.close(fd)
        self._cmd = self._ready = -1


def _load_fuse_stack() -> None:
    from strata.mount import boottrace, fuse, vfs  # noqa: F401


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_all(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 4096):
        out += chunk
    os.close(fd)
    return out


def _ready(rfd: int) -> str | None:
    """None once the mount process says "ok", else its error (or that it died).

    "ok" is enough: waiting for the pipe to close as well (the mount process's
    thread closes it right after writing) once took 0.24 s on a busy machine.
    """
    msg = b""
    try:
        while not msg.startswith(b"ok") and (chunk := os.read(rfd, 4096)):
            msg += chunk
    finally:
        os.close(rfd)
    return None if msg.startswith(b"ok") else (
        msg.decode(errors="replace") or "the mount process died")


def _log_to(state: MountState) -> None:
    log = os.open(os.path.join(state.scratch, "mount.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    from strata.logs import setup
    setup(os.path.join(state.scratch, "mount.log"))


def _serve(state: MountState, wfd: int, *, background: bool, watch_pid: int | None,
           announce: bool) -> str | None:
    """The mount process itself: pin, serve the FUSE view, put the overlays on top."""
    from strata.mount import fuse
    from strata.mount.cache import ContentCache
    from strata.mount.vfs import SnapshotFS, Volume
    state.pid = os.getpid()
    state.save()
    store = RemoteStore(state.server or "", state.token)
    pins = _Pins(store, [(v.volume, v.pinned) for v in state.volumes])
    # A step's runner pins the step's snapshots itself, renews and releases them:
    # a second set here would only add a request to every step. It also measures
    # the content cache now and then (cache.trim_if_due), not every step's mount.
    own_pins = not state.is_step
    try:
        if own_pins:
            pins.pin()  # garbage collection keeps what the lower view shows while mounted
        # A server on this machine keeps the bytes on this disk already: streamed reads
        # of large files skip the content cache (see mount/readahead.py).
        fs = SnapshotFS([Volume(v.name or v.volume, store, v.pinned) for v in state.volumes],
                        ContentCache(measure=own_pins), single=state.single,
                        cache_streams=store.kind != "unix")
    except StrataError as exc:
        with contextlib.suppress(OSError):  # the asker may be gone: tear down all the same
            os.write(wfd, str(exc).encode())
        with contextlib.suppress(OSError):
            os.close(wfd)
        teardown(state)
        if background:
            os._exit(1)
        return str(exc)
    boot = _image_boot(state, store, fs)
    if own_pins:
        threading.Thread(target=pins.renew, daemon=True).start()
    if state.keepalive:
        threading.Thread(target=_keep_alive, args=(store, float(state.keepalive)),
                         daemon=True).start()

    def tell(msg: bytes) -> None:
        # The one waiting for this answer may be gone already (a runner killed while
        # the mount came up): that must not stop what follows, least of all the watch
        # that tears the mount down once it notices.
        with contextlib.suppress(OSError):
            os.write(wfd, msg)
        with contextlib.suppress(OSError):
            os.close(wfd)

    def overlay_up() -> None:
        try:
            mount_overlays(state)
        except Exception as exc:
            log.warning("overlays on %s failed: %s", state.mountpoint, exc,
                        exc_info=not isinstance(exc, StrataError))
            tell(str(exc).encode())
            with contextlib.suppress(MountError):
                unmount(state.lower, lazy=True)
            return
        tell(b"ok")
        if not background and announce:
            print(f"mounted {state.mountpoint} (Ctrl-C or 'strata unmount' to stop)",
                  file=sys.stderr, flush=True)
        if watch_pid is not None:
            _watch(watch_pid, state)

    def ready() -> None:
        threading.Thread(target=overlay_up, daemon=True).start()

    try:
        fuse.run(fs, state.lower, fsname=f"strata:{state.volumes[0].volume}", on_ready=ready,
                 id_shift=state.id_shift,
                 privileged=state.privileged and not state.is_step)
    except KeyboardInterrupt:
        pass
    if boot is not None:
        try:
            boot.finish()  # the first boot's trace is published now, if not before
        except Exception:
            log.warning("finishing the boot trace failed", exc_info=True)
    if _discarding.is_set():
        _discarded.wait(30)
    pins.release()
    if background:
        os._exit(0)
    return None


def _image_boot(state: MountState, store: RemoteStore, fs: SnapshotFS) -> ImageBoot | None:
    """A step's image (its throwaway volume): record its boot trace, or prefetch from it."""
    from strata.mount.boottrace import ImageBoot
    index = next((i for i, v in enumerate(state.volumes) if v.throwaway), None)
    if index is None:
        return None
    v = state.volumes[index]
    trace_file = os.path.join(state.scratch, "boot-trace.json")

    def note(what: str, detail: dict[str, object]) -> None:
        # For whoever watches the step (tests, benchmarks): what the trace did, one line each.
        with open(trace_file, "a") as f:
            f.write(json.dumps({"event": what, **detail}) + "\n")

    boot = ImageBoot(store, v.volume, v.pinned, fs.root_of(index), fs.cache, on_event=note)
    assert boot.recorder is not None
    fs.trace(index, boot.recorder)
    boot.begin()
    return boot


PIN_TTL = 60.0


class _Pins:
    """The mount's snapshots, pinned through the server and renewed while it runs."""

    def __init__(self, store: RemoteStore, snaps: list[tuple[str, str]]) -> None:
        self.store = store
        self.snaps = snaps
        self.ids: dict[str, list[str]] = {}

    def pin(self) -> None:
        for volume, sid in self.snaps:
            self.ids.setdefault(volume, []).extend(self.store.pin(volume, [sid], PIN_TTL))

    def renew(self) -> None:
        while True:
            time.sleep(PIN_TTL / 3)
            try:
                for volume, ids in list(self.ids.items()):
                    self.store.renew_pins(volume, ids, PIN_TTL)
            except StrataError:
                # Lost (a server restart forgets pins): pin again; a restarted server
                # deletes nothing for one pin lifetime, which leaves time for this.
                with contextlib.suppress(StrataError):
                    self.ids.clear()
                    self.pin()

    def release(self) -> None:
        for volume, ids in self.ids.items():
            with contextlib.suppress(StrataError):
                self.store.release_pins(volume, ids)


def _keep_alive(store: RemoteStore, every: float) -> None:
    """Keep a server that exits when idle serving while this mount may read through it."""
    while True:
        time.sleep(every)
        with contextlib.suppress(StrataError):
            store.whoami()


def _watch(pid: int, state: MountState) -> None:
    while True:
        time.sleep(0.2)
        if not alive(pid):
            break  # exited (perhaps not reaped yet by its parent)
        if not os.path.isdir(state.scratch):
            # Torn down by its owner, or swept: nothing of ours may stay mounted.
            try:
                teardown(state, lazy=True)
            except Exception:
                log.warning("teardown of %s failed", state.mountpoint, exc_info=True)
            return
    # Our owner died without tearing us down: stop the processes it said use the
    # mount (state.json "pgid", a process group), then discard everything.
    _discarding.set()
    try:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            pgid = MountState.load(state.scratch).pgid
            if pgid > 1:
                os.killpg(pgid, signal.SIGKILL)
        try:
            teardown(state, lazy=True)
        except Exception:
            log.warning("discarding %s failed", state.mountpoint, exc_info=True)
    finally:
        _discarded.set()

