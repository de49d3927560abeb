"""The step service's wire protocol: names, limits, frames and request checks.

Both sides import this module: `run/client.py` (on the path of every
`strata run`) to frame a request and read the answer, `run/service.py`'s
workers to read a request and check every field before anything runs. It
owns what the two sides must agree on, and nothing else: it never starts,
forks or runs anything. It imports only the interpreter's own `_socket` and
`json` at load time (tests/test_cli_imports.py holds the client's budget);
the checks import what they need when they run, in the worker.

Every byte a request carries comes from a client and is untrusted: the
checks name the first bad field (InvalidInput, exit code 2) and accept
nothing they do not know. The wire format is in docs/api.md, "The step
service".
"""

from __future__ import annotations

import _socket
import contextlib
import json
import os
import sys
from typing import Any

from strata.engine.errors import InvalidInput, Unavailable

PROTOCOL = 2  # 2: steps carry a process limit ("pids")
SOCKET_NAME = "steps.sock"
SERVER_SOCKET = "serve.sock"  # the store's server (server/client.py's SOCKET_NAME)
LOCK_NAME = "steps.lock"
LOG_NAME = "steps.log"
MAX_REQUEST = 1 << 20   # bytes of one request body (argv, environment, specs)
MAX_ANSWER = 64 << 20   # bytes of one answer body (a conflict names every path)
MAX_ARGS = 4096
MAX_SPECS = 256
MAX_ENV = 4096
MOUNT_KEYS = {"mountpoint"}
RESULT_KEYS = {"run", "status", "published", "conflicts", "rejected", "timed_out", "oom",
               "timings"}


def socket_path(store: str) -> str:
    return os.path.join(store, SOCKET_NAME)


def frame(doc: dict[str, Any]) -> bytes:
    # ensure_ascii: argv and names may hold surrogate-escaped bytes, which UTF-8
    # cannot encode; \\udcXX escapes carry them and json.loads gives them back.
    body = json.dumps(doc, separators=(",", ":")).encode()
    return len(body).to_bytes(4, "big") + body


def read_frame(sock: _socket.socket, limit: int) -> dict[str, Any] | None:
    """The next frame's JSON object, or None at a clean end of the stream."""
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > limit:
        raise ValueError(f"frame of {size} bytes is over the limit of {limit}")
    body = _recv_exact(sock, size)
    if body is None:
        raise ValueError("frame cut short")
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("a frame is a JSON object")
    return doc


def _recv_exact(sock: _socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if buf:
                raise ValueError("frame cut short")
            return None
        buf += chunk
    return bytes(buf)


def read_request(conn: _socket.socket) -> tuple[Any, list[int]]:
    """The request's JSON document and the three descriptors sent with it.

    ValueError or OSError for anything that is not one frame of at most
    MAX_REQUEST bytes with exactly three descriptors; the descriptors
    received are closed then.
    """
    fds: list[int] = []
    try:
        data, anc, flags, _addr = conn.recvmsg(65536, _socket.CMSG_SPACE(3 * 4))
        for level, kind, payload in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                fds.extend(int.from_bytes(payload[i:i + 4], sys.byteorder, signed=True)
                           for i in range(0, usable, 4))
        if flags & _socket.MSG_CTRUNC:
            raise ValueError("too many descriptors")
        if len(fds) != 3:
            raise ValueError(f"expected 3 descriptors (stdin, stdout, stderr), got {len(fds)}")
        if len(data) < 4:
            data += _exact(conn, 4 - len(data))
        size = int.from_bytes(data[:4], "big")
        if size > MAX_REQUEST:
            raise ValueError(f"request of {size} bytes is over {MAX_REQUEST}")
        body = data[4:]
        if len(body) > size:
            raise ValueError("bytes after the request")
        body += _exact(conn, size - len(body))
        return json.loads(body), fds
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def _exact(conn: _socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ValueError("request cut short")
        buf += chunk
    return bytes(buf)


def check(raw: Any) -> dict[str, Any]:
    """The request's fields, each checked; InvalidInput names the first bad one.

    A request in another protocol version is Unavailable (exit code 1): the
    service running is older or newer than this strata, and stopping it
    lets the next client start the right one.
    """
    import math

    from strata.run.sandbox import SANDBOXES
    from strata.run.spec import parse_image, parse_spec
    if not isinstance(raw, dict):
        raise InvalidInput("a request is a JSON object")
    if raw.get("v") != PROTOCOL:
        raise Unavailable(f"protocol version {raw.get('v')!r}; this service speaks {PROTOCOL} "
                          "(stop it with 'strata serve --stop' after an upgrade)")
    op = raw.get("op", "step")
    if op == "mount":
        return _check_mount(raw)
    if op != "step":
        raise InvalidInput(f"op must be 'step' or 'mount', not {op!r}")
    known = {"v", "op", "argv", "specs", "sandbox", "timeout", "memory", "network", "message",
             "identical", "env", "cwd", "umask", "pids", "disk", "image", "entrypoint"}
    extra = set(raw) - known
    if extra:
        raise InvalidInput(f"unknown request fields {sorted(extra)}")
    _check_common(raw)
    argv = raw.get("argv")
    least = 0 if raw.get("image") is not None else 1  # an image may name its own command
    if (not isinstance(argv, list) or not least <= len(argv) <= MAX_ARGS
            or not all(isinstance(a, str) and "\0" not in a for a in argv)):
        raise InvalidInput(f"argv must be {least} to {MAX_ARGS} strings without NUL")
    texts = raw.get("specs")
    if (not isinstance(texts, list) or len(texts) > MAX_SPECS
            or not all(isinstance(t, str) for t in texts)):
        raise InvalidInput(f"specs must be at most {MAX_SPECS} strings")
    specs = [parse_spec(t) for t in texts]  # InvalidInput names the bad one
    if len({s.volume for s in specs}) != len(specs):
        raise InvalidInput("a volume appears twice")
    if raw.get("sandbox") not in SANDBOXES:
        raise InvalidInput(f"sandbox must be one of {', '.join(SANDBOXES)}")
    timeout = raw.get("timeout")
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        raise InvalidInput("timeout must be a positive number of seconds or null")
    memory = raw.get("memory")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int)
                               or memory <= 0):
        raise InvalidInput("memory must be a positive number of bytes or null")
    pids = raw.get("pids")
    if isinstance(pids, bool) or not isinstance(pids, int) or not 0 < pids <= 1 << 22:
        raise InvalidInput("pids must be a whole number from 1 to 4194304")
    disk = raw.get("disk")
    if disk is not None and (isinstance(disk, bool) or not isinstance(disk, int)
                             or not 1 << 20 <= disk <= 1 << 50):
        raise InvalidInput("disk must be a number of bytes from 1 MiB to 1 PiB, or null")
    image = raw.get("image")
    if image is not None:
        if not isinstance(image, str):
            raise InvalidInput("image must be VOLUME[@BRANCH], NAME:TAG or null")
        image = parse_image(image)
    entrypoint = raw.get("entrypoint")
    if entrypoint is not None and (image is None or not isinstance(entrypoint, str)
                                   or "\0" in entrypoint):
        raise InvalidInput("entrypoint must be a string without NUL, with an image, or null")
    for name in ("network", "identical"):
        if not isinstance(raw.get(name), bool):
            raise InvalidInput(f"{name} must be true or false")
    message = raw.get("message")
    if message is not None and not isinstance(message, str):
        raise InvalidInput("message must be a string or null")
    return {**raw, "op": "step", "specs": specs, "image": image}


def _check_common(raw: dict[str, Any]) -> None:
    """The fields every request has: the client's environment, directory and umask."""
    env = raw.get("env")
    if (not isinstance(env, dict) or len(env) > MAX_ENV
            or not all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k
                       and "\0" not in k and "\0" not in v for k, v in env.items())):
        raise InvalidInput(f"env must map at most {MAX_ENV} names (no '=', no NUL) to strings")
    cwd = raw.get("cwd")
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd:
        raise InvalidInput("cwd must be an absolute path")
    umask = raw.get("umask")
    if isinstance(umask, bool) or not isinstance(umask, int) or not 0 <= umask <= 0o777:
        raise InvalidInput("umask must be an integer from 0 to 0o777")


def _check_mount(raw: dict[str, Any]) -> dict[str, Any]:
    """A `mount --background` request: REFs as [name, volume, branch, snapshot, ro]."""
    from strata.engine.names import check_branch, check_hex_id, check_volume
    from strata.mount.state import MountRef
    known = {"v", "op", "refs", "target", "ro", "single", "privileged", "env", "cwd", "umask"}
    extra = set(raw) - known
    if extra:
        raise InvalidInput(f"unknown request fields {sorted(extra)}")
    _check_common(raw)
    raw.setdefault("privileged", False)
    for name in ("ro", "single", "privileged"):
        if not isinstance(raw.get(name), bool):
            raise InvalidInput(f"{name} must be true or false")
    target = raw.get("target")
    if (not isinstance(target, str) or not target.startswith("/") or "\0" in target
            or not os.path.isdir(target)):
        raise InvalidInput("target must be the absolute path of a directory")
    items = raw.get("refs")
    if not isinstance(items, list) or not 0 < len(items) <= MAX_SPECS:
        raise InvalidInput(f"refs must list 1 to {MAX_SPECS} refs")
    if raw["single"] and len(items) != 1:
        raise InvalidInput("a single-volume mount has one ref")
    refs = []
    for item in items:
        if (not isinstance(item, list) or len(item) != 5 or not isinstance(item[0], str)
                or not isinstance(item[1], str) or not isinstance(item[4], bool)
                or not all(x is None or isinstance(x, str) for x in item[2:4])
                or (item[2] is None) == (item[3] is None)):
            raise InvalidInput("a ref is [name, volume, branch or null, snapshot or null, ro], "
                               "with a branch or a snapshot")
        name, volume, branch, snapshot, ro = item
        if name:
            check_volume(name)  # a directory name in the mount: the same rules
        check_volume(volume)
        if branch is not None:
            check_branch(branch)
        if snapshot is not None:
            check_hex_id(snapshot, min_len=8)
        refs.append(MountRef(name, volume, branch, snapshot, ro))
    return {**raw, "op": "mount", "refs": refs}
