"""Hostile input is refused with `InvalidInput` and changes nothing.

Covers change sets sent straight to `publish` (what a remote client could
send), transactions, malformed ids, and invalid volume and branch names.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from strata.engine.errors import InvalidInput
from strata.engine.interface import ChangeSet
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import (
    BLOCK,
    EMPTY_SNAPSHOT_ID,
    EMPTY_TREE_ID,
    K_DIR,
    K_FILE,
    K_SYMLINK,
    Entry,
)
from strata.engine.txn import Transaction

HOSTILE_PATHS = [
    "..", "../escape", "a/../../escape", "a/..", ".", "./a", "a/./b", "/etc/passwd", "/",
    "a//b", "a/", "a\0b", "\0", "n" * 256, "a/" + "é" * 128, "/".join(["d" * 250] * 17),
    "\ud800", "a/\udfff",
]
FILE = Entry(kind=K_FILE, size=4, data=b"evil")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    init_store(str(tmp_path / "store"))
    s = LocalStore(str(tmp_path / "store"))
    s.create_volume("v")
    t = Transaction(s, "v")
    t.mkdir("a")
    t.write("a/file", b"keep")
    t.commit()
    yield s
    s.close()


def unchanged(store: LocalStore, head: str) -> None:
    assert store.head("v", "live") == head
    assert store.list_branches("v") == {"live": head}
    t = Transaction(store, "v")
    assert [p for p, _ in t.walk()] == ["a", "a/file"]
    assert t.read("a/file") == b"keep"


def refused(store: LocalStore, changes: dict[Any, Any], **kw: Any) -> None:
    head = store.head("v", "live")
    with pytest.raises(InvalidInput):
        store.publish([ChangeSet("v", "live", kw.pop("base", head), changes, **kw)])
    unchanged(store, head)


@pytest.mark.parametrize("path", HOSTILE_PATHS)
@pytest.mark.parametrize("value", [FILE, None, Entry(kind=K_DIR)])
def test_hostile_paths_in_change_sets(store: LocalStore, path: str, value: Entry | None) -> None:
    refused(store, {path: value})
    # One bad path spoils the whole change set, good paths included.
    refused(store, {"fine": FILE, path: value})


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_hostile_paths_in_transactions(store: LocalStore, path: str) -> None:
    head = store.head("v", "live")
    t = Transaction(store, "v")
    calls = [
        lambda: t.write(path, b"x"),
        lambda: t.mkdir(path),
        lambda: t.mkdir(path, parents=True),
        lambda: t.symlink(path, "target"),
        lambda: t.hardlink("a/file", path),
        lambda: t.rename("a/file", path),
        lambda: t.rename(path, "b"),
        lambda: t.remove(path),
        lambda: t.lookup(path),
        lambda: t.listdir(path),
        lambda: t.read(path),
        lambda: t.write_at(path, 0, b"x"),
        lambda: t.truncate(path, 0),
        lambda: t.chmod(path, 0o644),
        lambda: t.setxattr(path, b"user.x", b"1"),
        lambda: t.set_entry(path, FILE),
    ]
    for call in calls:
        with pytest.raises(InvalidInput):
            call()
    assert t.changes == {}
    assert t.commit() == head
    unchanged(store, head)


@pytest.mark.parametrize("changes", [
    {"x": Entry(kind=99)},
    {"x": Entry(kind=K_FILE, size=-1, data=b"")},
    {"x": Entry(kind=K_FILE, mode=0o100644, size=0, data=b"")},
    {"x": Entry(kind=K_FILE, uid=-1, size=0, data=b"")},
    {"x": Entry(kind=K_FILE, size=5, data=b"abc")},
    {"x": Entry(kind=K_FILE, size=100, ref=b"\x01" * 31)},
    {"x": Entry(kind=K_SYMLINK, data=b"")},
    {"x": Entry(kind=K_SYMLINK, size=1, data=b"t", ref=EMPTY_TREE_ID)},
    {"x": "not an entry"},
    {"x": {"kind": K_FILE, "data": b"dict"}},
    {"": None},                                   # deleting the root
    {"": FILE},                                   # the root must stay a directory
    {"a": None, "a/file": FILE},                  # delete and change beneath
    {"a/file": None, "a/file/under": FILE},
    {1: FILE},
    {b"bytes-path": FILE},
])
def test_malformed_change_sets(store: LocalStore, changes: dict[Any, Any]) -> None:
    refused(store, changes)


def test_changes_that_are_not_a_mapping(store: LocalStore) -> None:
    refused(store, [("x", FILE)])  # type: ignore[arg-type]


def test_reference_to_an_object_of_the_wrong_kind(store: LocalStore) -> None:
    (blk,) = store.put_objects([(BLOCK, b"a block")])
    refused(store, {"x": Entry(kind=K_FILE, size=7, ref=blk)})
    refused(store, {"x": Entry(kind=K_DIR, ref=blk)})


def test_message_and_meta_that_cannot_be_stored(store: LocalStore) -> None:
    refused(store, {"x": FILE}, meta={"huge": 2**70})
    refused(store, {"x": FILE}, meta={"obj": object()})
    refused(store, {"x": FILE}, meta=[("not", "a mapping")])
    refused(store, {"x": FILE}, message=b"bytes")
    refused(store, {"x": FILE}, message=None)


@pytest.mark.parametrize("base", ["", "abc", "zz" * 32, "AB" * 32, "ab" * 31, "ab" * 33,
                                  EMPTY_SNAPSHOT_ID[:8], None, 7])
def test_malformed_base_ids(store: LocalStore, base: Any) -> None:
    refused(store, {"x": FILE}, base=base)


def test_publish_request_shape(store: LocalStore) -> None:
    head = store.head("v", "live")
    with pytest.raises(InvalidInput):
        store.publish([])
    with pytest.raises(InvalidInput, match="twice"):
        store.publish([ChangeSet("v", "live", head, {"x": FILE}),
                       ChangeSet("v", "live", head, {"y": FILE})])
    unchanged(store, head)


@pytest.mark.parametrize("prefix", ["", "abc", "abcdefg", "ABCDEF01", "ghijklmn", "ab" * 33,
                                    " abcdef01", "abcdef01\n"])
def test_malformed_snapshot_prefixes(store: LocalStore, prefix: str) -> None:
    with pytest.raises(InvalidInput):
        store.find_snapshot(prefix)


@pytest.mark.parametrize("at", ["", "abc", "zz" * 32, "AB" * 32, EMPTY_SNAPSHOT_ID[:20]])
def test_malformed_fork_points(store: LocalStore, at: str) -> None:
    with pytest.raises(InvalidInput):
        store.fork("v", "new", at=at)
    assert store.list_branches("v") == {"live": store.head("v", "live")}


def test_malformed_object_ids(store: LocalStore) -> None:
    for bad in [b"", b"short", bytes(33)]:
        with pytest.raises(InvalidInput):
            store.missing([bad])
    with pytest.raises(InvalidInput):
        store.missing(["ab" * 32])  # type: ignore[list-item]
    with pytest.raises(InvalidInput):
        store.put_objects([(99, b"unknown kind")])
    with pytest.raises(InvalidInput):
        store.snapshot("not hex")


BAD_VOLUMES = ["", ".", "..", ".hidden", "-dash", "a/b", "a b", "x" * 129, "tab\t", "ü",
               "nul\0"]
BAD_BRANCHES = ["", "/", "/abs", "trailing/", "a//b", "..", "a/../b", ".dot", "a b",
                "x" * 256, "nul\0"]


@pytest.mark.parametrize("name", BAD_VOLUMES)
def test_invalid_volume_names(store: LocalStore, name: str) -> None:
    with pytest.raises(InvalidInput):
        store.create_volume(name)
    with pytest.raises(InvalidInput):
        store.delete_volume(name)
    with pytest.raises(InvalidInput):
        store.list_branches(name)
    with pytest.raises(InvalidInput):
        store.publish([ChangeSet(name, "live", EMPTY_SNAPSHOT_ID, {"x": FILE})])
    with pytest.raises(InvalidInput):
        Transaction(store, name)
    assert store.list_volumes() == ["v"]


@pytest.mark.parametrize("name", BAD_BRANCHES)
def test_invalid_branch_names(store: LocalStore, name: str) -> None:
    head = store.head("v", "live")
    with pytest.raises(InvalidInput):
        store.fork("v", name, at=None)
    with pytest.raises(InvalidInput):
        store.delete_branch("v", name)
    with pytest.raises(InvalidInput):
        store.head("v", name)
    with pytest.raises(InvalidInput):
        store.publish([ChangeSet("v", name, head, {"x": FILE})])
    with pytest.raises(InvalidInput):
        store.acquire_lease("v", name, ttl=10)
    unchanged(store, head)


def test_invalid_attribute_values_in_transactions(store: LocalStore) -> None:
    head = store.head("v", "live")
    t = Transaction(store, "v")
    for call in [
        lambda: t.chmod("a/file", -1),
        lambda: t.chmod("a/file", 0o10000),
        lambda: t.chown("a/file", -1, 0),
        lambda: t.setxattr("a/file", b"", b"v"),
        lambda: t.setxattr("a/file", b"bad\0name", b"v"),
        lambda: t.setxattr("a/file", b"n" * 256, b"v"),
        lambda: t.write_at("a/file", -5, b"x"),
        lambda: t.truncate("a/file", -1),
        lambda: t.symlink("link", ""),
        lambda: t.symlink("link", "nul\0target"),
    ]:
        with pytest.raises(InvalidInput):
            call()
    assert t.changes == {}
    unchanged(store, head)
