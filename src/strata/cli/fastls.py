"""`strata ls` in one request on the lean stream, before argparse and the engine are imported.

`strata ls` is what scripts and agents call most, and a Python CLI pays for
every module it imports. When the command line is a plain `ls` (REF, an
optional PATH, `-l`, `--json`, `--debug`, `--store DIR`) and the store's own
server answers on its lean stream, one `list` request (docs/api.md, "The
lean stream") brings the entries and this module prints them exactly as
`read.cmd_ls` does; it imports only `_socket`, msgpack and `show`.

Everything else returns None and the command runs the ordinary way: another
server (`--server`, `STRATA_SERVER`, a token), `STRATA_IN_PROCESS`, options
this module does not know, no server answering (the ordinary path starts
one), an older server that has no `list`, any error (the ordinary path
reports it with its own message and exit code), and workspace volumes (which
list files inside a block device).
"""

from __future__ import annotations

import _socket  # the C module: `socket` would add enum and selectors, ~8 ms here
import os
import struct
import sys

import msgpack

from strata.cli import show

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

FRAME = struct.Struct(">I")
SOCKET = "serve.sock.lean"  # client.SOCKET_NAME + wire.LEAN_SUFFIX (a test holds them equal)
WORKSPACE_LAYOUT = "workspace.json"  # strata.workspace.LAYOUT_PATH (likewise)
TIMEOUT = 30.0
MAX_ANSWER = 128 * 1024 * 1024  # wire.MAX_BODY


def run(argv: list[str]) -> int | None:
    """The exit code of `strata ls` done here, or None to run it the ordinary way."""
    env = os.environ
    if env.get("STRATA_SERVER") or env.get("STRATA_TOKEN") or env.get("STRATA_FLEET") or \
            env.get("STRATA_IN_PROCESS") == "1":
        return None
    parsed = _parse(argv)
    if parsed is None:
        return None
    store, words, flags = parsed
    if len(words) not in (2, 3) or words[0] != "ls":
        return None
    ref = words[1]
    path = show.unquote_path(words[2]) if len(words) == 3 else ""
    if "#" in ref:
        volume, _, prefix = ref.partition("#")
        branch: str | None = None
    else:
        volume, sep, branch = ref.partition("@")
        branch = branch if sep else "live"
        prefix = None
    store = store or env.get("STRATA_STORE") or os.path.join(
        os.path.expanduser("~"), ".local", "share", "strata")
    request = ["list", volume, branch, prefix,
               [WORKSPACE_LAYOUT.encode(), path.encode("utf-8", "surrogateescape")]]
    result = _call(os.path.join(store, SOCKET), request)
    if not isinstance(result, dict):
        return None
    found = result.get("found")
    if not isinstance(found, list) or len(found) != 2 or found[0] is not None \
            or not isinstance(found[1], list) or len(found[1]) != 2:
        return None  # a workspace, a missing path, or an answer this client does not know
    entry, children = found[1]
    try:
        if children is not None:
            prefix_path = f"{path}/" if path else ""
            items = [(name.decode("utf-8", "surrogateescape"), v) for name, v in children]
        else:
            prefix_path = ""
            items = [(path, entry)]
        return _print(items, prefix_path, flags)
    except BrokenPipeError:
        # The reader went away (`strata ls ... | head`): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _parse(argv: list[str]) -> tuple[str | None, list[str], set[str]] | None:
    """(--store, words, flags), or None for anything this module leaves to argparse."""
    store: str | None = None
    words: list[str] = []
    flags: set[str] = set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--store" and i + 1 < len(argv):
            store = argv[i + 1]
            i += 1
        elif arg.startswith("--store="):
            store = arg[len("--store="):]
        elif arg in ("-l", "--json", "--debug"):
            flags.add(arg)
        elif arg.startswith("-"):
            return None
        else:
            words.append(arg)
        i += 1
    return store, words, flags


def _call(path: str, request: list[Any]) -> Any:
    """The result of one lean request, or None (no server, a refusal, a broken answer)."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(TIMEOUT)
        sock.connect(path)
        body = msgpack.packb(request, use_bin_type=True)
        sock.sendall(FRAME.pack(len(body)) + body)
        (length,) = FRAME.unpack(_recv(sock, FRAME.size))
        if length > MAX_ANSWER:
            return None
        answer = msgpack.unpackb(_recv(sock, length), raw=False)
    except (OSError, EOFError, ValueError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError):
        return None
    finally:
        sock.close()
    if not isinstance(answer, list) or len(answer) != 2 or answer[0] != 0:
        return None
    return answer[1]


def _recv(sock: _socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k
    return bytes(buf)


def _print(items: list[tuple[str, list[Any]]], prefix: str, flags: set[str]) -> int:
    # Names that are not UTF-8 come back out as the bytes they were, as `ls` does.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape")
    if "--json" in flags:
        show.print_json([show.entry_info(prefix + name, v) | {"name": name}
                         for name, v in items])
    elif "-l" in flags:
        for name, v in items:
            print(show.long_line(show.show_path(name), v))
    else:
        for name, _v in items:
            print(show.show_path(name))
    sys.stdout.flush()
    return 0
