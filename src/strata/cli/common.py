"""Shared pieces of the CLI: REF parsing, opening the store, and output helpers.

Every `strata` command imports this module before it runs, so it imports
only what parsing arguments needs: the store, the client and the tree code
are imported by the functions that use them (tests/test_cli_imports.py holds
the budget).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from strata.cli import show
from strata.cli.show import fmt_time as fmt_time
from strata.cli.show import print_json as print_json
from strata.cli.show import quote_path as quote_path
from strata.cli.show import show_path as show_path
from strata.cli.show import unquote_path as unquote_path
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


def bucket_key(args: argparse.Namespace) -> bytes | None:
    """The key in --key-file, else in $STRATA_BUCKET_KEY_FILE, else None."""
    path = getattr(args, "key_file", None) or os.environ.get("STRATA_BUCKET_KEY_FILE")
    if not path:
        return None
    from strata.engine.seal import read_key_file
    return read_key_file(path)


def add_key_options(p: argparse.ArgumentParser) -> None:
    """--key-file and --unauthenticated, for commands that read a bucket's store."""
    p.add_argument("--key-file", metavar="PATH",
                   help="the store's bucket key (STORE/bucket.key of the store that made "
                        "the bucket; default: $STRATA_BUCKET_KEY_FILE)")
    p.add_argument("--unauthenticated", action="store_true",
                   help="read a bucket made before bucket keys (format 1), which nothing "
                        "protects from whoever can write to the bucket")


def server_url(args: argparse.Namespace) -> str | None:
    """--server, else $STRATA_SERVER, else None (use the local store's own server)."""
    return getattr(args, "server", None) or os.environ.get("STRATA_SERVER") or None


def fleet_members(args: argparse.Namespace) -> str | None:
    """--fleet, else $STRATA_FLEET: the members' addresses, comma-separated; None: no fleet."""
    return getattr(args, "fleet", None) or os.environ.get("STRATA_FLEET") or None


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
    members = fleet_members(args)
    if url is None and members:
        from strata.fleet.client import FleetStore
        # No store named: the fleet's catalog places each volume (fleet/front.py).
        name = getattr(args, "fleet_store", None) or os.environ.get("STRATA_FLEET_STORE")
        fleet = FleetStore([m for m in members.split(",") if m], name or None,
                           token=os.environ.get("STRATA_FLEET_TOKEN") or None,
                           bearer=token)
        try:
            yield fleet
        finally:
            fleet.close()
        return
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

    from strata.procs import idle_exit
    idle = repr(idle_exit())
    # Owner only, like every store file (requests and errors name volumes and paths).
    log_path = os.path.join(path, "serve.log")
    with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
        os.fchmod(log.fileno(), 0o600)  # one an older strata made 0644
        start = log.seek(0, os.SEEK_END)
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata", "serve", "--store", path, "--idle-exit", idle],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            close_fds=True)
    deadline = time.monotonic() + timeout
    exited: float | None = None
    while time.monotonic() < deadline:
        if is_serving(sock):
            return sock
        if exited is None and proc.poll() is not None:
            exited = time.monotonic()  # another command's server may be starting instead
        if exited is not None and time.monotonic() - exited > 2.0:
            # It gave up (a bucket that holds another store, a fenced owner...): its
            # own words, at once, not a time-out's.
            raise Unavailable(f"the store's server could not start: "
                              f"{_last_error(log_path, start)} (see {log_path})")
        time.sleep(0.02)
    raise Unavailable(f"the store's server did not start within {timeout:g}s "
                      f"(see {log_path})")


def _last_error(log_path: str, start: int) -> str:
    """The reason a server gave in its log since `start`: its last error line."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            lines = f.read(64 * 1024).decode(errors="replace").splitlines()
    except OSError:
        return "it exited"
    errors = [ln for ln in lines if ln.startswith("strata: error: ")]
    if errors:
        return errors[-1].removeprefix("strata: error: ")
    return lines[-1].strip() if lines else "it exited"


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
        try:
            return store.head(self.volume, self.branch)
        except NotFound:
            if "@" not in self.text and hasattr(store, "whoami"):
                # A branch-scoped token sees only its branch: say which, not "no 'live'".
                scope = store.whoami()
                if scope.get("volume") == self.volume and scope.get("branch"):
                    raise InvalidInput(f"this token is for {self.volume}@{scope['branch']}: "
                                       f"name it ({self.volume}@{scope['branch']})") from None
            raise

    def need_branch(self) -> str:
        if self.branch is None:
            raise InvalidInput(f"{self.text!r} names a snapshot; this command needs a branch "
                               "(VOLUME or VOLUME@BRANCH)")
        return self.branch


REF_HELP = ("VOLUME, VOLUME@BRANCH (the branch defaults to live) or VOLUME#SNAPSHOT "
            "(a snapshot id or a unique prefix of 8+ hex digits)")


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


@contextmanager
def progress_bar(what: str, enabled: bool | None = None
                 ) -> Iterator[Callable[..., None] | None]:
    """A rich progress bar on stderr when it is a terminal; otherwise nothing (None).

    The callback takes (done, total) and optionally the phase under way, shown in
    place of `what`; a total of 0 is not known ahead (a count, or none while 0).
    The bar animates on its own, so work that reports nothing still shows it goes on.
    """
    if not (sys.stderr.isatty() if enabled is None else enabled):
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.fields[count]}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=None, count="")

        def update(done: int, total: int, phase: str | None = None) -> None:
            count = f"{done}/{total}" if total else (str(done) if done else "")
            bar.update(task, completed=done, total=total or None, count=count,
                       description=phase or what)

        yield update


def short(sid: str | None) -> str:
    return sid[:12] if sid else "-"


def entry_json(path: str, e: Entry) -> dict[str, Any]:
    return show.entry_info(path, e.to_list())


def long_line(name: str, e: Entry) -> str:
    return show.long_line(name, e.to_list())
