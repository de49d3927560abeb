"""Shared pieces of the CLI: REF parsing, opening the store, and output helpers."""

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
from typing import Any

from strata.engine.errors import InvalidInput, NotFound
from strata.engine.interface import Store
from strata.engine.local import LocalStore
from strata.engine.names import check_branch, check_volume, split_path
from strata.engine.objects import ENTRY_KIND_NAMES, K_DIR, K_SYMLINK, Entry
from strata.engine.tree import Trees

DEFAULT_BRANCH = "live"
Handler = Callable[[argparse.Namespace], int]


def store_path(args: argparse.Namespace) -> str:
    """--store, else $STRATA_STORE, else ~/.local/share/strata."""
    path = getattr(args, "store", None) or os.environ.get("STRATA_STORE")
    return path or os.path.join(os.path.expanduser("~"), ".local", "share", "strata")


@contextmanager
def open_store(args: argparse.Namespace) -> Iterator[LocalStore]:
    # LocalStore waits (bounded) for another process holding the store lock.
    with LocalStore(store_path(args)) as store:
        yield store  # type: ignore[misc]


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
    parts = split_path(path)
    e = Trees(store).resolve(store.snapshot(sid).root, parts)
    if e is None:
        raise NotFound(f"no such file or directory: {path!r}")
    return e


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def short(sid: str | None) -> str:
    return sid[:12] if sid else "-"


def fmt_time(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def entry_json(path: str, e: Entry) -> dict[str, Any]:
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
    size = f"{os.major(e.rdev)}, {os.minor(e.rdev)}" if e.rdev else str(e.size)
    line = (f"{statmod.filemode(e.st_mode)} {e.nlink:>2} {e.uid:>5} {e.gid:>5} {size:>10} "
            f"{fmt_time(e.mtime_ns)} {name}")
    if e.kind == K_SYMLINK:
        line += f" -> {os.fsdecode(e.data or b'')}"
    elif e.kind == K_DIR:
        line += "/"
    return line
