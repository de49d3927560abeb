"""Shared pieces of the CLI: REF parsing, opening the store, and output helpers.

Every `strata` command imports this module before it runs, so it imports
only what parsing arguments needs: the store, the client and the tree code
are imported by the functions that use them (tests/test_cli_imports.py holds
the budget).
"""

from __future__ import annotations

import argparse
import json
import os
import stat as statmod
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from strata.engine.errors import InvalidInput, NotFound, Unavailable
from strata.engine.names import check_branch, check_volume, split_path

if TYPE_CHECKING:
    from strata.engine.interface import Store
    from strata.engine.objects import Entry
    from strata.server.client import RemoteStore

DEFAULT_BRANCH = "live"
Handler = Callable[[argparse.Namespace], int]


def store_path(args: argparse.Namespace) -> str:
    """--store, else $STRATA_STORE, else ~/.local/share/strata."""
    path = getattr(args, "store", None) or os.environ.get("STRATA_STORE")
    return path or os.path.join(os.path.expanduser("~"), ".local", "share", "strata")


def server_url(args: argparse.Namespace) -> str | None:
    """--server, else $STRATA_SERVER, else None (use the local store's own server)."""
    return getattr(args, "server", None) or os.environ.get("STRATA_SERVER") or None


@contextmanager
def open_store(args: argparse.Namespace) -> Iterator[Store]:
    """The store the command works on, always through a server.

    With --server, that server. Otherwise the local store's own server on its
    unix socket, started in the background when none is running, so that any
    number of concurrent `strata` processes share one owner (and one group
    commit). STRATA_IN_PROCESS=1 opens the store in this process instead.
    """
    if os.environ.get("STRATA_IN_PROCESS") == "1" and server_url(args) is None:
        from strata.engine.local import LocalStore
        with LocalStore(store_path(args)) as local:
            yield local
        return
    with open_remote(args) as store:
        yield store


@contextmanager
def open_remote(args: argparse.Namespace) -> Iterator[RemoteStore]:
    from strata.server.client import RemoteStore
    url = server_url(args)
    token = getattr(args, "token", None) or os.environ.get("STRATA_TOKEN") or None
    if url is None:
        url = "unix:" + ensure_server(store_path(args))
    store = RemoteStore(url, token)
    try:
        yield store
    finally:
        store.close()


def ensure_server(path: str, timeout: float = 15.0) -> str:
    """The unix socket of the store's server, starting one if none answers."""
    from strata.engine.storedir import read_store_meta
    from strata.server.client import default_socket, is_serving
    read_store_meta(path)  # "no strata store at ... (run 'strata init')"
    sock = default_socket(path)
    if is_serving(sock):
        return sock
    import subprocess
    idle = os.environ.get("STRATA_SERVER_IDLE_EXIT", "300")
    with open(os.path.join(path, "serve.log"), "ab") as log:
        subprocess.Popen(
            [sys.executable, "-m", "strata", "serve", "--store", path, "--idle-exit", idle],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            close_fds=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_serving(sock):
            return sock
        time.sleep(0.02)
    raise Unavailable(f"the store's server did not start within {timeout:g}s "
                      f"(see {os.path.join(path, 'serve.log')})")


@dataclass(frozen=True, slots=True)
class Ref:
    """A parsed REF: VOLUME, VOLUME@BRANCH or VOLUME#SNAPSHOT."""

    volume: str
    branch: str | None
    snapshot: str | None
    text: str

    def resolve(self, store: Store) -> str:
        """The full snapshot id this REF names now."""
        if self.snapshot is not None:
            store.list_branches(self.volume)  # the volume must exist
            return store.find_snapshot(self.snapshot)
        assert self.branch is not None
        return store.head(self.volume, self.branch)

    def need_branch(self) -> str:
        if self.branch is None:
            raise InvalidInput(f"{self.text!r} names a snapshot; this command needs a branch "
                               "(VOLUME or VOLUME@BRANCH)")
        return self.branch


def parse_ref(text: str) -> Ref:
    if "#" in text:
        vol, _, snap = text.partition("#")
        check_volume(vol)
        if len(snap) < 8 or any(c not in "0123456789abcdef" for c in snap):
            raise InvalidInput(f"invalid snapshot in {text!r} (at least 8 lowercase hex digits)")
        return Ref(vol, None, snap, text)
    vol, sep, branch = text.partition("@")
    check_volume(vol)
    if sep:
        check_branch(branch)
        return Ref(vol, branch, None, text)
    return Ref(vol, DEFAULT_BRANCH, None, text)


def resolve_base(store: Store, text: str | None) -> str | None:
    """A --base SNAPSHOT argument (full id or unique prefix) as a full id."""
    if text is None:
        return None
    return store.find_snapshot(text)


def lookup(store: Store, sid: str, path: str) -> Entry:
    """The entry at `path` in snapshot `sid`; `NotFound` if it is missing."""
    from strata.engine.tree import Trees
    parts = split_path(path)
    e = Trees(store).resolve(store.snapshot(sid).root, parts)
    if e is None:
        raise NotFound(f"no such file or directory: {path!r}")
    return e


_C_ESCAPES = {"\a": "a", "\b": "b", "\t": "t", "\n": "n", "\v": "v", "\f": "f", "\r": "r",
              '"': '"', "\\": "\\"}


def quote_path(path: str) -> str:
    r"""A name as git shows it, quoted only when it must be.

    Printable UTF-8 stays as is; anything else goes in double quotes with C
    escapes, and the bytes that are not UTF-8 in octal ("caf\351.txt").
    Names hold any bytes but / and NUL; in strata's strings a byte that is not
    UTF-8 is a lone surrogate (Python's surrogateescape). `unquote_path` reads
    the quoted form back, so a name shown can be typed as shown.
    """
    if path.isprintable() and '"' not in path and "\\" not in path:
        return path
    out = []
    for ch in path:
        if ch in _C_ESCAPES:
            out.append("\\" + _C_ESCAPES[ch])
        elif 0xDC80 <= ord(ch) <= 0xDCFF:  # a byte that was not UTF-8
            out.append(f"\\{ord(ch) - 0xDC00:03o}")
        elif not ch.isprintable():
            out.extend(f"\\{b:03o}" for b in ch.encode("utf-8", "surrogateescape"))
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def unquote_path(arg: str) -> str:
    """A path argument as the user meant it: a git-style quoted name is unescaped."""
    if len(arg) < 2 or not (arg.startswith('"') and arg.endswith('"')):
        return arg
    body = arg[1:-1]
    raw = bytearray()
    i = 0
    reverse = {v: k for k, v in _C_ESCAPES.items()}
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt in "01234567" and i + 3 < len(body) + 1 and all(
                    c in "01234567" for c in body[i + 1:i + 4]) and len(body[i + 1:i + 4]) == 3:
                raw.append(int(body[i + 1:i + 4], 8) & 0xFF)
                i += 4
                continue
            if nxt in reverse:
                raw.extend(reverse[nxt].encode())
                i += 2
                continue
        raw.extend(ch.encode("utf-8", "surrogateescape"))
        i += 1
    return raw.decode("utf-8", "surrogateescape")


def show_path(path: str) -> str:
    """How the CLI prints a name: quoted on a terminal, the raw bytes into a pipe (as ls)."""
    return quote_path(path) if sys.stdout.isatty() else path


def parse_size(text: str) -> int:
    """A byte count as typed: 512, 64K, 1.5G."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:].upper(), 1)
    try:
        value = int(float(text[:-1] if mult > 1 else text) * mult)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return value


class Progress:
    """A restore's progress on stderr: a line redrawn on a terminal, a line every 2 s in a log."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.tty = sys.stderr.isatty()
        self.every = 0.25 if self.tty else 2.0
        self.started = self.shown = time.monotonic()
        self.drawn = False

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        now = time.monotonic()
        if now - self.shown < self.every or now - self.started < 1.0:
            return  # quick work shows nothing
        self.shown = now
        line = f"strata: {self.what}: {done}/{total} log records, {nbytes / 2**20:.1f} MiB"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)
        self.drawn = True

    def close(self) -> None:
        if self.drawn and self.tty:
            print(file=sys.stderr)


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def short(sid: str | None) -> str:
    return sid[:12] if sid else "-"


def fmt_time(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def entry_json(path: str, e: Entry) -> dict[str, Any]:
    from strata.engine.objects import ENTRY_KIND_NAMES, K_SYMLINK
    out: dict[str, Any] = {
        "path": path, "type": ENTRY_KIND_NAMES[e.kind], "mode": f"{e.mode:04o}",
        "uid": e.uid, "gid": e.gid, "size": e.size, "mtime_ns": e.mtime_ns,
        "nlink": e.nlink,
    }
    if e.ino:
        out["ino"] = e.ino
    if e.kind == K_SYMLINK:
        out["target"] = os.fsdecode(e.data or b"")
    if e.rdev:
        out["rdev"] = [os.major(e.rdev), os.minor(e.rdev)]
    if e.xattrs:
        out["xattrs"] = {os.fsdecode(k): v.decode("utf-8", "backslashreplace")
                         for k, v in e.xattrs}
    return out


def long_line(name: str, e: Entry) -> str:
    from strata.engine.objects import K_DIR, K_SYMLINK
    size = f"{os.major(e.rdev)}, {os.minor(e.rdev)}" if e.rdev else str(e.size)
    line = (f"{statmod.filemode(e.st_mode)} {e.nlink:>2} {e.uid:>5} {e.gid:>5} {size:>10} "
            f"{fmt_time(e.mtime_ns)} {name}")
    if e.kind == K_SYMLINK:
        line += f" -> {os.fsdecode(e.data or b'')}"
    elif e.kind == K_DIR:
        line += "/"
    return line
