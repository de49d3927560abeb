"""The thin side of `strata run`: hand the step to the store's step service.

`strata run` would otherwise start an interpreter that imports the mount
stack (pyfuse3, trio), the client and the runner for every step. Instead it
sends one request over the step service's unix socket (`STORE/steps.sock`,
mode 0600; `run/service.py` is the other side) together with its own stdin,
stdout and stderr (SCM_RIGHTS), so the command writes to the caller's
terminal or pipes directly, and waits for the answer. The service is started
here when none answers, as the store's server is.

This module is on the path of every `strata run`, so it imports only the
interpreter's own `_socket` (the `socket` module around it costs 6 ms of
imports), the error classes and the protocol's names and frames
(run/protocol.py; tests/test_cli_imports.py holds the budget). It never decides anything
about the step: if this process dies, the service's worker sees its
connection end and discards the step, as a runner's death always did.

The wire format is in docs/api.md, "The step service".
"""

from __future__ import annotations

import _socket
import contextlib
import os
import sys
import time
from typing import Any

from strata.engine.errors import StrataError, Unavailable
from strata.run.protocol import (
    LOG_NAME,
    MAX_ANSWER,
    MAX_REQUEST,
    MOUNT_KEYS,
    PROTOCOL,
    RESULT_KEYS,
    SERVER_SOCKET,
    frame,
    read_frame,
    socket_path,
)

START_TIMEOUT = 15.0
ACCEPT_TIMEOUT = 10.0


class ServiceDied(StrataError):
    """The service's worker went away before answering (exit code 1)."""


def server_answers(store: str) -> bool:
    """True if the store's own server answers a request (GET /v1/info).

    A request, not only a connection: it starts the server's idle time
    again (STRATA_SERVER_IDLE_EXIT), so a server about to leave stays for
    the requests the step service makes a moment later on this step's
    behalf. Without importing the HTTP client (server/client.py).
    """
    sock = _try_connect(os.path.join(store, SERVER_SOCKET))
    if sock is None:
        return False
    try:
        sock.settimeout(10.0)
        sock.sendall(b"GET /v1/info HTTP/1.1\r\nHost: strata\r\nConnection: close\r\n\r\n")
        return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False
    finally:
        sock.close()


def call(store: str, request: dict[str, Any], *, kind: str = "step") -> dict[str, Any]:
    """Run the step (or, with kind "mount", make the mount) through the service.

    Returns the result document: StepResult.to_json for a step,
    {"mountpoint"} for a mount.

    Raises the service's error as a StrataError with its exit code, and
    ServiceDied when the worker went away after accepting the step. A worker
    that never accepted it (the service was exiting, or died before reading)
    did nothing, so the request is sent again to a fresh service.
    """
    store = os.path.abspath(store)
    if not os.path.exists(os.path.join(store, "STRATA")):
        from strata.engine.errors import NotFound
        raise NotFound(f"no strata store at {store} (run 'strata init')")
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "/"  # removed under us; the command runs in the volumes' directory anyway
    request = {"v": PROTOCOL, "cwd": cwd, "umask": _umask(),
               "env": dict(os.environ), **request}
    data = frame(request)
    if len(data) - 4 > MAX_REQUEST:
        raise StrataError(f"the step's command line and environment exceed "
                          f"{MAX_REQUEST >> 10} KiB")
    fds, opened = _stdio()
    try:
        for _attempt in range(3):
            sock = _connect(store)
            try:
                # Never shut the writing side: its end is how the worker learns
                # that this process died.
                with contextlib.suppress(OSError):  # a refusal may close it early: read it
                    sent = sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                                                  b"".join(fd.to_bytes(4, sys.byteorder,
                                                                       signed=True)
                                                           for fd in fds))])
                    if sent < len(data):
                        sock.sendall(data[sent:])
                answer = _answer(sock, kind)
            finally:
                sock.close()
            if answer is not None:
                return answer
        raise Unavailable(f"the step service did not take the step (see "
                          f"{os.path.join(store, LOG_NAME)})")
    finally:
        for fd in opened:
            os.close(fd)


def _answer(sock: _socket.socket, kind: str) -> dict[str, Any] | None:
    """The step's result; None if the service never accepted the request."""
    keys = RESULT_KEYS if kind == "step" else MOUNT_KEYS
    accepted = publishing = False
    sock.settimeout(ACCEPT_TIMEOUT)  # a service that never answers did nothing yet
    while True:
        try:
            doc = read_frame(sock, MAX_ANSWER)
        except (OSError, ValueError):
            doc = None
        if doc is None:
            if not accepted:
                return None
            if kind == "mount":
                raise ServiceDied("the step service died while making the mount: it may "
                                  "or may not be there (see 'strata status DIR')")
            if publishing:
                raise ServiceDied("the step service died while publishing the step: it may "
                                  "or may not have been published (see 'strata log')")
            raise ServiceDied("the step service died before the step finished; nothing was "
                              "published")
        event = doc.get("event")
        if event == "accepted":
            accepted = True
            sock.settimeout(None)  # the step takes as long as it takes
        elif event == "publishing":
            publishing = True
        elif event == "result":
            result = doc.get("result")
            if not isinstance(result, dict) or not keys <= set(result):
                raise ServiceDied("the step service sent a malformed result")
            return result
        elif event == "error":
            exc = StrataError(str(doc.get("message", "the step failed")))
            code = doc.get("code")
            exc.exit_code = code if isinstance(code, int) and 0 < code < 126 else 1
            raise exc


def _connect(store: str) -> _socket.socket:
    """A connection to the store's step service, starting one if none answers."""
    path = socket_path(store)
    sock = _try_connect(path)
    if sock is not None:
        return sock
    _spawn(store)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        time.sleep(0.005)
        sock = _try_connect(path)
        if sock is not None:
            return sock
    raise Unavailable(f"the step service did not start within {START_TIMEOUT:g}s "
                      f"(see {os.path.join(store, LOG_NAME)})")


def _try_connect(path: str) -> _socket.socket | None:
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _spawn(store: str) -> None:
    """Start `python -m strata.run.service STORE` in a session of its own.

    posix_spawn, not subprocess: this runs on the step's path, and the
    service's own start (the imports) is the cost that matters.
    """
    log = os.path.join(store, LOG_NAME)
    os.posix_spawn(sys.executable, [sys.executable, "-m", "strata.run.service", store],
                   dict(os.environ), setsid=True, file_actions=[
                       (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                       (os.POSIX_SPAWN_OPEN, 1, log,
                        os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
                       (os.POSIX_SPAWN_DUP2, 1, 2)])
    # The service outlives this process; init adopts and reaps it.


def _stdio() -> tuple[list[int], list[int]]:
    """Our stdin, stdout and stderr to pass on; /dev/null for any that is closed."""
    fds, opened = [], []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            opened.append(null)
            fds.append(null)
    return fds, opened


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask

