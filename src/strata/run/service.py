"""The step service: one resident process per store that runs `strata run` steps.

Started on demand by `strata run` (run/client.py) as `python -m
strata.run.service STORE`, it imports the mount stack (pyfuse3, trio), the
store client and the runner once, listens on `STORE/steps.sock` (mode 0600),
and keeps workers forked ahead of their clients, each with its step's mount
process forked already (no imports, no fork on the step's path). A worker
takes one connection, reads and checks the request, takes the client's
stdin, stdout and stderr as its own, and runs the step exactly as an
in-process `strata run` would (`runner.run_step`). The client learns the
result, or the error, as frames on the same connection (docs/api.md, "The
step service"). This module owns the processes (the service, its pool of
workers, what a worker does with its connection); what goes over the
connection, and the checks of every request field, are run/protocol.py's.

Dying stays safe, as it was with the runner in the CLI's own process:

- The client dies: the kernel ends the worker (SIGIO on its connection,
  `_die_with_client`); its mount process notices, kills the step's processes and
  discards everything, as it did when a runner died.
- The worker dies: the same.
- The service dies: every worker dies with it (PR_SET_PDEATHSIG), so the
  same again; its client sees the connection end and reports the step failed.
  The next `strata run` starts a fresh service.

The service itself never reads a byte a client sends: the worker does, after
the fork, with a deadline and size limits, and checks every field before it
touches anything. It exits when it has been idle for STRATA_SERVER_IDLE_EXIT
seconds (300 by default), or when no worker runs and the store's server is
gone (`strata serve --stop`).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import TYPE_CHECKING, Any

from strata.engine.errors import InvalidInput, StrataError
from strata.procs import idle_exit, keepalive_every
from strata.run.protocol import (
    LOCK_NAME,
    LOG_NAME,
    MAX_ANSWER,
    SERVER_SOCKET,
    check,
    frame,
    read_request,
    socket_path,
)

if TYPE_CHECKING:
    from strata.mount.process import Prepared

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0  # seconds a client has to send its whole request
CHECK_SERVER_EVERY = 1.0
IDLE_WORKERS = 2  # forked ahead, waiting for clients
PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m strata.run.service STORE", file=sys.stderr)
        return 2
    store = os.path.abspath(argv[0])
    os.chdir("/")
    lock = _lock(store)
    if lock is None:
        return 0  # another service has the store
    _preload()
    from strata.logs import setup
    setup(os.path.join(store, LOG_NAME))
    from strata.engine.storedir import read_store_meta
    try:  # fixed when the store was made: spares every step a request for it
        block = int(read_store_meta(store)["block_size"])
    except (StrataError, KeyError, ValueError, TypeError):
        block = 0  # asked of the server, as any client does
    listener = _listen(socket_path(store))
    log.info("step service %d listening on %s", os.getpid(), socket_path(store))
    try:
        _serve(listener, store, lock, max(1.0, idle_exit()), block)
    finally:
        listener.close()
        os.close(lock)
    return 0


def _lock(store: str) -> int | None:
    """The store's service lock, or None when another live service holds it.

    A service that is leaving holds it for a moment after its socket is gone,
    so a holder that does not answer is waited for (up to 5 s) rather than
    left to a client that would wait for a socket nobody binds.
    """
    fd = os.open(os.path.join(store, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + 5.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())  # who serves (for people and tests)
            return fd
        except BlockingIOError:
            pass
        if _answers(socket_path(store)) or time.monotonic() > deadline:
            os.close(fd)
            return None
        time.sleep(0.01)


def _answers(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _preload() -> None:
    """Import everything a step and its mount process use, once for all workers."""
    import ctypes  # noqa: F401  (sandbox._prctl)
    import subprocess  # noqa: F401

    import strata.mount.cache
    import strata.mount.fuse
    import strata.mount.process
    import strata.mount.session
    import strata.mount.vfs
    import strata.run.runner
    import strata.run.sandbox
    import strata.server.client  # noqa: F401
    strata.run.sandbox.pdeathsig_wrapper()  # asked once here, not by every worker
    # What is loaded now is never freed: keep the collector off those pages, so a
    # forked worker does not copy them by touching their headers.
    gc.collect()
    gc.freeze()


def _listen(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a dead service's: we hold the lock
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # owner only from the first instant
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    listener.listen(128)
    return listener


class _Pool:
    """Workers forked ahead of their clients, each blocked in accept().

    A worker that takes a connection writes its pid to `took` and the service
    forks a fresh one, so a step never waits for a fork of the service, nor
    for the worker's mount process, which the worker forks before it accepts.
    """

    def __init__(self, listener: socket.socket, lock: int, store: str, block: int) -> None:
        self.listener, self.lock, self.store, self.block = listener, lock, store, block
        self.took_r, self.took_w = os.pipe()
        self.idle: set[int] = set()
        self.busy: set[int] = set()

    def fill(self) -> None:
        while len(self.idle) < IDLE_WORKERS:
            self.idle.add(self._fork())

    def taken(self) -> None:
        """Move the workers that said they took a connection from idle to busy."""
        data = os.read(self.took_r, 4096)
        for (pid,) in struct.iter_unpack("i", data[:len(data) - len(data) % 4]):
            self.idle.discard(pid)
            self.busy.add(pid)

    def reap(self) -> None:
        for group in (self.idle, self.busy):
            for pid in list(group):
                with contextlib.suppress(ChildProcessError):
                    done, _status = os.waitpid(pid, os.WNOHANG)
                    if not done:
                        continue
                group.discard(pid)

    def stop_idle(self) -> None:
        for pid in self.idle:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in self.idle:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.idle.clear()

    def _fork(self) -> int:
        service = os.getpid()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            os.close(self.lock)  # a fresh service may start the moment this one is gone
            os.close(self.took_r)
            code = _worker(self.listener, self.took_w, service, self.store, self.block)
        except BaseException:
            with contextlib.suppress(Exception):  # the log itself may be what failed
                log.exception("step worker %d failed", os.getpid())
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def _serve(listener: socket.socket, store: str, lock: int, idle: float, block: int) -> None:
    pool = _Pool(listener, lock, store, block)
    last = time.monotonic()
    next_check = last + CHECK_SERVER_EVERY
    try:
        while True:
            pool.fill()
            ready, _w, _x = select.select([pool.took_r], [], [], 0.25)
            now = time.monotonic()
            if ready:
                pool.taken()
                last = now
            pool.reap()
            if pool.busy:
                last = now
                continue
            if now - last > idle:
                return
            if now >= next_check:
                next_check = now + CHECK_SERVER_EVERY
                # A connection only: a request would keep the server from ever idling.
                if not _answers(os.path.join(store, SERVER_SOCKET)):
                    return  # the store's server stopped: so do we (a client starts both)
    finally:
        # No new connection from here on; a worker that took one just now says so
        # in `took` and finishes its step; the idle ones go.
        with contextlib.suppress(OSError):
            os.unlink(socket_path(store))  # ours: no other service binds without the lock
        readable, _w, _x = select.select([pool.took_r], [], [], 0)
        if readable:
            pool.taken()
        pool.stop_idle()
        for pid in pool.busy:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _die_with_parent(parent: int) -> bool:
    import ctypes
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent  # else it died before the prctl took hold


def _send(conn: socket.socket, doc: dict[str, Any]) -> bool:
    try:
        conn.sendall(frame(doc))
        return True
    except OSError:
        return False  # the client is gone (SIGIO ends this worker, see _die_with_client)


def _worker(listener: socket.socket, took: int, service: int, store: str, block: int) -> int:
    """A pre-forked worker: fork the mount process, take one connection, run its step."""
    from strata.mount.process import Prepared
    if not _die_with_parent(service):
        return 1
    # Forked now, while this process has no client: the mount process never holds
    # a client's terminal, pipes or connection, nor the service's socket.
    mounter = Prepared(watch_pid=os.getpid(), close=(listener.fileno(), took))
    try:
        conn, _addr = listener.accept()
    except OSError:
        return 1
    finally:
        listener.close()
    try:
        os.write(took, struct.pack("i", os.getpid()))
    finally:
        os.close(took)
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        return 1  # the socket is 0600; this is a second line
    fds: list[int] = []
    try:
        conn.settimeout(REQUEST_TIMEOUT)
        try:
            raw, fds = read_request(conn)
            step = check(raw)
        except StrataError as exc:  # refused: the client learns which field, and why
            _send(conn, {"event": "error", "code": exc.exit_code, "message": str(exc)})
            return 1
        except (OSError, ValueError) as exc:
            _send(conn, {"event": "error", "code": 2, "message": f"bad request: {exc}"})
            return 1
        conn.settimeout(None)
        if step["op"] == "mount":
            return _mount(conn, step, store, mounter)
        return _run(conn, step, fds, store, mounter, block)
    finally:
        mounter.cancel()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _adopt_common(req: dict[str, Any]) -> None:
    """Take on the client's umask, environment and working directory.

    Each was checked by `protocol.check`. The worker then acts as if the
    request ran in the client's own process.
    """
    os.umask(req["umask"])
    os.environ.clear()
    os.environ.update(req["env"])
    with contextlib.suppress(OSError):
        os.chdir(req["cwd"])


def _run(conn: socket.socket, step: dict[str, Any], fds: list[int], store_dir: str,
         mounter: Prepared, block: int) -> int:
    """Run the checked step with the client's stdio; answer on `conn`."""
    from strata.run.runner import StepResult, run_step
    from strata.server.client import RemoteStore, default_socket
    if not _send(conn, {"event": "accepted"}):
        return 1
    _adopt_common(step)  # the command's environment, the scratch and cache directories
    log_fd = os.dup(2)  # the service's log, for what the worker says after its answer
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    fds.clear()
    answered: list[bool] = []  # non-empty once the answer is on its way
    _die_with_client(conn)

    def publishing() -> None:
        _send(conn, {"event": "publishing"})

    def done(result: StepResult) -> None:
        _release_stdio(log_fd)
        answered.append(True)
        _stop_dying_with_client(conn)
        doc: dict[str, Any] = {"event": "result", "result": result.to_json()}
        if len(frame(doc)) - 4 > MAX_ANSWER:
            doc = {"event": "error", "code": 1, "message": "the step's result is too large"}
        _send(conn, doc)

    store = RemoteStore("unix:" + default_socket(store_dir))
    if block:
        store.block_size = block
    try:
        run_step(store, step["specs"], step["argv"], sandbox=step["sandbox"],
                 timeout=step["timeout"], memory=step["memory"], network=step["network"],
                 pids=step["pids"], disk=step["disk"], image=step["image"],
                 entrypoint=step.get("entrypoint"),
                 message=step["message"], identical=step["identical"], mounter=mounter,
                 mounter_env=True, on_publish=publishing, on_done=done)
    except Exception as exc:
        if answered:  # after the answer: only the teardown failed
            log.exception("step %s on %s: teardown failed after the answer", step["argv"][:1],
                          [s.volume for s in step["specs"]])
            return 1
        _release_stdio(log_fd)
        answered.append(True)
        _stop_dying_with_client(conn)
        code = exc.exit_code if isinstance(exc, StrataError) else 1
        # The service's log keeps every step strata itself failed, and why.
        if not isinstance(exc, StrataError):
            log.exception("step %s on %s failed", step["argv"][:1],
                          [s.volume for s in step["specs"]])
        else:
            log.warning("step %s on %s failed: %s", step["argv"][:1],
                        [s.volume for s in step["specs"]], exc)
        _send(conn, {"event": "error", "code": code, "message": str(exc) or type(exc).__name__})
        return 1
    finally:
        try:
            store.close()
        except Exception:
            log.debug("closing the store client failed", exc_info=True)
    return 0


def _mount(conn: socket.socket, req: dict[str, Any], store_dir: str, mounter: Prepared) -> int:
    """Make a background mount with the pre-forked mount process; answer its mount point.

    Unlike a step, the mount outlives this worker, the client and the
    service (its process watches nobody), as a `strata mount --background`
    made in the CLI's own process does; so this worker finishes what it
    began even if its client goes away.
    """
    from strata.mount.state import mount_volumes, new_state
    from strata.server.client import RemoteStore, default_socket
    if not _send(conn, {"event": "accepted"}):
        return 1
    _adopt_common(req)
    url = "unix:" + default_socket(store_dir)
    try:
        if os.listdir(req["target"]):
            raise InvalidInput(f"{req['target']} is not empty")
        store = RemoteStore(url)
        try:
            vols = mount_volumes(store, req["refs"], ro=req["ro"], single=req["single"])
        finally:
            store.close()
        state = new_state(req["target"], url, vols, single=req["single"])
        state.privileged = bool(req["privileged"])
        # As cmd_mount: the mount keeps the store's server from idling, and commit,
        # status and unmount start it again if it is gone.
        state.store = store_dir
        state.keepalive = keepalive_every()
        state.save()
        error = mounter.start_mount(state, dict(os.environ), watch=False)
    except (StrataError, OSError, ValueError) as exc:
        code = exc.exit_code if isinstance(exc, StrataError) else 1
        _send(conn, {"event": "error", "code": code, "message": str(exc)})
        return 1
    if error is not None:
        _send(conn, {"event": "error", "code": 1, "message": error})
        return 1
    _send(conn, {"event": "result", "result": {"mountpoint": state.mountpoint}})
    return 0


def _release_stdio(log_fd: int) -> None:
    """Give the client's stdio back, so its pipes end when the client exits.

    What the worker still says goes to the service's log.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)


def _die_with_client(conn: socket.socket) -> None:
    """Let the kernel end this worker the moment its client goes away.

    The client sends nothing after its request, so the connection becoming
    readable (its end, or bytes it should not send) means the step is
    abandoned. With O_ASYNC the kernel then sends SIGIO, whose default
    action ends the process at once, wherever it is (no thread, no Python
    handler); this worker's death is what discards the step (its mount
    process kills the step's processes and removes everything).
    `_stop_dying_with_client` undoes it before the answer goes out.
    """
    signal.signal(signal.SIGIO, signal.SIG_DFL)
    fd = conn.fileno()
    fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    if select.select([fd], [], [], 0)[0]:
        os.kill(os.getpid(), signal.SIGKILL)  # gone before there was anyone to tell


def _stop_dying_with_client(conn: socket.socket) -> None:
    signal.signal(signal.SIGIO, signal.SIG_IGN)
    fd = conn.fileno()
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_ASYNC)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
