"""Hard-link groups are found by the counts in tree nodes, not by walking the volume.

Every tree node written since tree node version 2 counts the hard-linked
files under each of its items (docs/format.md "Tree node"), and a
transaction's group search descends only where that count is not zero
(docs/design.md "Hard links"). These tests check that groups stay in step
through nested directories, through a transaction's own renames, and in a
store written before the counts existed (`fixtures/store-links-v1.tar.gz`,
made by the strata before version 2); that hostile counts are refused over
TCP and, if they are in a store anyway, cost time and never a group member;
and that a hard-link operation reads a number of tree nodes that does not
grow with the volume.
"""

from __future__ import annotations

import http.client
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from serverutil import served_volume
from strata.engine.interface import ChangeSet
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import K_DIR, K_FILE, TREE, Entry, TreeNode, object_id, packb
from strata.engine.tree import NodeCache
from strata.engine.txn import Transaction
from strata.server.wire import OBJ_HEAD

FIXTURE = Path(__file__).parent / "fixtures" / "store-links-v1.tar.gz"
FIXTURE_HEAD = "bf6d5622b94600d1213f74077a8e979178e87a9d7db8cca287141ed86186fe99"


def groups(t: Transaction) -> dict[int, list[tuple[str, Entry]]]:
    """Every link group in the view, found the slow way (a walk of everything)."""
    out: dict[int, list[tuple[str, Entry]]] = {}
    for p, e in t.walk():
        if e.kind == K_FILE and e.ino:
            out.setdefault(e.ino, []).append((p, e))
    return out


def assert_in_step(t: Transaction) -> None:
    """Each group's members agree in content and metadata, and nlink is the group's size."""
    for members in groups(t).values():
        first = members[0][1]
        for p, e in members:
            assert e == first, p
            assert e.nlink == len(members), (p, e.nlink, len(members))
        want = t.read(members[0][0])
        assert all(t.read(p) == want for p, _e in members)


def test_groups_stay_in_step_across_nested_directories_and_renames(tmp_path: Path) -> None:
    init_store(str(tmp_path))
    with LocalStore(str(tmp_path)) as store:
        store.create_volume("v")
        t = Transaction(store, "v")
        for d in range(8):
            t.mkdir(f"plain/d{d}/deeper", parents=True)
            t.write(f"plain/d{d}/deeper/f", b"plain")
        t.mkdir("a/b/c", parents=True)
        t.mkdir("x/y", parents=True)
        t.write("a/b/c/one", b"1" * 10_000)
        t.hardlink("a/b/c/one", "x/y/two")
        t.hardlink("x/y/two", "three")
        assert_in_step(t)
        t.write_at("three", 5, b"written through three")  # uncommitted members
        assert t.read("a/b/c/one")[5:26] == b"written through three"
        assert_in_step(t)
        t.commit("a group of three")

        t.write_at("x/y/two", 0, b"TWO")  # committed members, in the base tree
        assert t.read("a/b/c/one")[:3] == b"TWO"
        t.chmod("a/b/c/one", 0o600)
        t.setxattr("three", b"user.k", b"v")
        assert_in_step(t)
        # A directory renamed in this transaction carries a member in a tree of its
        # own (the change's ref): the next write must still reach it.
        t.rename("x", "moved")
        t.truncate("three", 2)
        assert t.read("moved/y/two") == b"TW"
        assert t.lookup("x/y/two") is None
        assert_in_step(t)
        t.hardlink("moved/y/two", "plain/d3/deeper/four")
        assert {p for p, _e in groups(t)[t.lookup("three").ino]} == {  # type: ignore[union-attr]
            "a/b/c/one", "moved/y/two", "three", "plain/d3/deeper/four"}
        assert_in_step(t)
        t.commit("renamed and linked again")

        t.remove("a/b/c/one")
        t.rename("plain/d0/deeper/f", "three")  # over a member: it leaves the group
        assert_in_step(t)
        assert t.read("three") == b"plain"
        g = groups(t)
        assert [[p for p, _e in m] for m in g.values()] == [
            ["moved/y/two", "plain/d3/deeper/four"]]
        t.commit("two left")
        t.remove("moved/y/two")
        assert groups(t) == {}  # the last one is an ordinary file again
        assert t.lookup("plain/d3/deeper/four").nlink == 1  # type: ignore[union-attr]
        t.commit("none left")

        # Every node the commits wrote is version 2, and its counts are right.
        root = store.snapshot(store.head("v", "live")).root
        assert root.ref is not None
        assert_counts(lambda oid: TreeNode.decode(store.get_object(oid)), root.ref)


def assert_counts(node_of: Callable[[bytes], TreeNode], oid: bytes) -> int:
    """The hard-linked files under tree `oid`, checking every count on the way."""
    node = node_of(oid)
    got = []
    if node.level:
        got = [assert_counts(node_of, c[1]) for c in node.children]
    else:
        for _n, e in node.entries:
            if e.kind == K_DIR:
                assert e.ref is not None
                got.append(assert_counts(node_of, e.ref))
            else:
                got.append(1 if e.kind == K_FILE and e.ino else 0)
    if node.count:
        assert node.version == 2
    assert list(node.item_links) == got
    return sum(got)


def test_a_store_written_before_counts_keeps_its_groups(tmp_path: Path) -> None:
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    with LocalStore(str(tmp_path)) as store:
        assert store.head("links", "live") == FIXTURE_HEAD
        root = store.snapshot(FIXTURE_HEAD).root
        assert root.ref is not None
        assert TreeNode.decode(store.get_object(root.ref)).version == 1
        t = Transaction(store, "links")
        assert_in_step(t)
        assert sorted(len(m) for m in groups(t).values()) == [2, 3]
        t.write_at("three", 0, b"through three")
        assert t.read("a/b/c/one").startswith(b"through three")
        t.hardlink("p/s", "many/d07/linked")
        t.write("p/q/r", b"group two, again\n")
        assert t.read("many/d07/linked") == b"group two, again\n"
        assert_in_step(t)
        t.commit("after the upgrade")
        new_root = store.snapshot(store.head("links", "live")).root
        assert new_root.ref is not None
        top = TreeNode.decode(store.get_object(new_root.ref))
        assert top.version == 2
        # Directories the commit did not touch stay version 1 and count as unknown.
        assert top.linked is None
        t.remove("x/y/two")
        t.write_at("a/b/c/one", 0, b"THROUGH")
        assert_in_step(t)
        t.commit("a member less")
        assert store.fsck()["ok"]
    with LocalStore(str(tmp_path)) as store:
        t = Transaction(store, "links")
        assert t.read("three").startswith(b"THROUGH")
        assert t.lookup("three").nlink == 2  # type: ignore[union-attr]
        assert_in_step(t)


def _entry(kind: int = K_FILE, **kw: object) -> list[object]:
    e: dict[str, object] = {"mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 0, "size": 1,
                            "ref": None, "data": b"x", "rdev": 0, "xattrs": None, "ino": 0,
                            "nlink": 1, **kw}
    return [kind, e["mode"], e["uid"], e["gid"], e["mtime_ns"], e["size"], e["ref"],
            e["data"], e["rdev"], e["xattrs"], e["ino"], e["nlink"]]


def _leaf(items: list[tuple[bytes, list[object]]], links: list[int | None]) -> bytes:
    return packb([2, 0, [[name, *e] for name, e in items], links])


def _upload(port: int, token: str, raw: bytes) -> tuple[int, str]:
    body = OBJ_HEAD.pack(TREE, object_id(TREE, raw), len(raw)) + raw
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/objects", body=body, headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def test_hostile_link_counts_are_refused_over_tcp(tmp_path: Path) -> None:
    member = _entry(ino=77, nlink=2)
    child = _leaf([(b"m", member)], [1])
    with served_volume(tmp_path / "s") as (server, tok):
        port = server.tcp_port
        assert port is not None
        assert _upload(port, tok, child)[0] == 200
        sub = _entry(K_DIR, size=0, data=None, ref=object_id(TREE, child))
        inner_ok = packb([2, 1, [[b"m", object_id(TREE, child), 1]], [1]])
        hostile = {
            "a subdirectory counted 0": (_leaf([(b"d", sub)], [0]), "holds 1"),
            "a subdirectory counted 5": (_leaf([(b"d", sub)], [5]), "holds 1"),
            "a linked file counted 0": (_leaf([(b"m", member)], [0]), "counts 0"),
            "a plain file counted 1": (_leaf([(b"p", _entry())], [1]), "counts 1"),
            "a child counted 0": (packb([2, 1, [[b"m", object_id(TREE, child), 1]], [0]]),
                                  "holds 1"),
            "counts missing": (packb([2, 0, [[b"m", *member]], []]), "link counts"),
            "a negative count": (_leaf([(b"d", sub)], [-1]), "link counts"),
            "version 3": (packb([3, 0, [], []]), "version 3"),
        }
        for what, (raw, why) in hostile.items():
            status, body = _upload(port, tok, raw)
            assert status == 400 and why in body, (what, status, body)
        assert _upload(port, tok, _leaf([(b"d", sub)], [1]))[0] == 200
        # Unknown is never wrong, only slower: the search descends into it.
        assert _upload(port, tok, _leaf([(b"d", sub)], [None]))[0] == 200
        assert _upload(port, tok, inner_ok)[0] == 200


def test_hostile_counts_already_stored_cost_time_not_a_member(tmp_path: Path) -> None:
    """Nodes written below the API's checks (in-process) that hide a member.

    The search finds fewer members than the group's nlink says, so it walks
    the whole view instead, and the write still reaches the hidden name.
    """
    init_store(str(tmp_path))
    with LocalStore(str(tmp_path)) as store:
        store.create_volume("v")
        member = Entry(kind=K_FILE, size=3, data=b"old", ino=99, nlink=2)
        child = TreeNode(0, entries=((b"hidden", member),), links=(1,)).encode()
        sub = Entry(kind=K_DIR, mode=0o755, ref=object_id(TREE, child))
        lying = TreeNode(0, entries=((b"d", sub),), links=(0,)).encode()  # says: nothing below
        store.put_objects([(TREE, child), (TREE, lying)])
        head = store.head("v", "live")
        (sid,) = store.publish([ChangeSet("v", "live", head, {
            "top": Entry(kind=K_DIR, mode=0o755, ref=object_id(TREE, lying)),
            "visible": member})])
        t = Transaction(store, "v", base=sid)
        t.write("visible", b"new content")
        assert t.read("top/d/hidden") == b"new content"
        assert_in_step(t)


def _volume(store: LocalStore, name: str, files: int) -> None:
    """`files` small files in directories of 100, and one link group in two of them."""
    store.create_volume(name)
    t = Transaction(store, name)
    for d in range(files // 100):
        t.mkdir(f"d{d:04}")
        for f in range(100):
            t.write(f"d{d:04}/f{f:03}", b"%d" % f)
    t.hardlink("d0001/f001", "d0002/linked")
    t.commit("built")


def _reads_of_a_link_and_a_write(store: LocalStore, volume: str) -> int:
    """Objects read (from a cold node cache) by a hard link plus a write through it."""
    reads = 0
    real = store.get_object

    def counting(oid: bytes) -> bytes:
        nonlocal reads
        reads += 1
        return real(oid)

    store.get_object = counting  # type: ignore[method-assign]
    try:
        t = Transaction(store, volume, cache=NodeCache())
        t.hardlink("d0002/linked", "d0003/third")
        t.write_at("d0003/third", 0, b"through the third name")
        assert t.read("d0001/f001") == b"through the third name"
        assert t.lookup("d0001/f001").nlink == 3  # type: ignore[union-attr]
    finally:
        del store.get_object
    return reads


def test_a_hard_link_reads_tree_nodes_by_path_not_by_volume(tmp_path: Path) -> None:
    init_store(str(tmp_path))
    with LocalStore(str(tmp_path)) as store:
        _volume(store, "small", 1_000)
        _volume(store, "large", 10_000)
        small = _reads_of_a_link_and_a_write(store, "small")
        large = _reads_of_a_link_and_a_write(store, "large")
    # The root (one or two levels at 100 directories), four directories and the
    # snapshot; the walk this replaces read every one of the 100 directories.
    assert small <= 16, small
    assert large <= small + 4, (small, large)


@pytest.mark.parametrize("raw", [packb([3, 0, [], []]), packb([9, 1, [], [], None])])
def test_unknown_tree_node_versions_are_refused_by_name(raw: bytes) -> None:
    with pytest.raises(ValueError, match="version (3|9) is not one this strata reads"):
        TreeNode.decode(raw)
