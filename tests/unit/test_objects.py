"""Object encodings: round trips, canonical bytes and stable ids.

The golden ids at the top pin the on-disk format: if one changes, every
existing store's objects change id, which needs a format version bump and a
kept fixture of the old format, not an edit of this file.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.engine.errors import InvalidInput
from strata.engine.objects import (
    BLOCK,
    EMPTY_SNAPSHOT_ID,
    EMPTY_SNAPSHOT_RAW,
    EMPTY_TREE,
    EMPTY_TREE_ID,
    ENTRY_KIND_NAMES,
    FILENODE,
    ID_LEN,
    K_DIR,
    K_FILE,
    K_SYMLINK,
    KIND_NAMES,
    SNAPSHOT,
    TREE,
    ZERO_ID,
    Entry,
    FileNode,
    Snapshot,
    TreeNode,
    check_entry,
    object_id,
    packb,
    unpackb,
)

GOLDEN_EMPTY_TREE_ID = "b6fb4e05fba3f08096cb530fba967b184c72ab7952eb51844e9f966fe529bb98"
GOLDEN_EMPTY_SNAPSHOT_ID = "73b50a72838ad3c33d1a471e42b85f0f3f8e9e54555b746158bf9e5e587e5171"

u32 = st.integers(0, 2**32 - 1)
ids = st.binary(min_size=ID_LEN, max_size=ID_LEN)
xattrs = st.lists(st.tuples(st.binary(min_size=1, max_size=20), st.binary(max_size=40)),
                  max_size=4).map(lambda xs: tuple(sorted(dict(xs).items())))
entries = st.builds(
    Entry,
    kind=st.sampled_from(sorted(ENTRY_KIND_NAMES)),
    mode=st.integers(0, 0o7777),
    uid=u32,
    gid=u32,
    mtime_ns=st.integers(0, 2**63 - 1),
    size=st.integers(0, 2**48),
    ref=st.none() | ids,
    data=st.none() | st.binary(max_size=64),
    rdev=u32,
    xattrs=xattrs,
    ino=st.integers(0, 2**48),
    nlink=st.integers(1, 1000),
)
names = st.binary(min_size=1, max_size=40)


def test_golden_ids_of_the_empty_tree_and_snapshot() -> None:
    assert EMPTY_TREE_ID.hex() == GOLDEN_EMPTY_TREE_ID
    assert EMPTY_SNAPSHOT_ID == GOLDEN_EMPTY_SNAPSHOT_ID
    assert object_id(TREE, EMPTY_TREE) == EMPTY_TREE_ID
    assert object_id(SNAPSHOT, EMPTY_SNAPSHOT_RAW).hex() == EMPTY_SNAPSHOT_ID


def test_id_depends_on_kind_and_content() -> None:
    raw = b"the same bytes"
    found = {object_id(kind, raw) for kind in KIND_NAMES}
    assert len(found) == len(KIND_NAMES)
    assert object_id(BLOCK, raw) != object_id(BLOCK, raw + b"\0")
    assert object_id(BLOCK, raw) == object_id(BLOCK, bytes(bytearray(raw)))
    assert all(len(i) == ID_LEN for i in found)


@given(entries)
def test_entry_round_trips_through_msgpack(e: Entry) -> None:
    raw = packb(e.to_list())
    back = Entry.from_list(unpackb(raw))
    assert back == e
    assert packb(back.to_list()) == raw  # canonical: re-encoding gives the same bytes


@given(st.sampled_from([4096, 65536]), st.lists(ids, max_size=20), st.integers(0, 4095))
def test_file_node_round_trip_and_stable_id(bs: int, blocks: list[bytes], short: int) -> None:
    size = max(0, len(blocks) * bs - short) if blocks else 0
    if blocks and size <= (len(blocks) - 1) * bs:
        size = (len(blocks) - 1) * bs + 1
    node = FileNode.v1(size=size, block_size=bs, blocks=tuple(blocks))
    raw = node.encode()
    assert FileNode.decode(raw) == node
    assert FileNode.decode(raw).encode() == raw
    assert object_id(FILENODE, raw) == object_id(FILENODE, FileNode.decode(raw).encode())


@given(st.dictionaries(names, entries, max_size=12))
def test_leaf_tree_node_round_trip(items: dict[bytes, Entry]) -> None:
    node = TreeNode(0, entries=tuple(sorted(items.items())))
    raw = node.encode()
    back = TreeNode.decode(raw)
    assert back == node
    assert back.count == len(items)
    assert back.first == (min(items) if items else b"")
    assert back.encode() == raw


@given(st.integers(1, 6), st.lists(st.tuples(names, ids, st.integers(1, 10**6)), min_size=1,
                                   max_size=12))
def test_inner_tree_node_round_trip(level: int, kids: list[tuple[bytes, bytes, int]]) -> None:
    node = TreeNode(level, children=tuple(sorted(kids)))
    back = TreeNode.decode(node.encode())
    assert back == node
    assert back.count == sum(k[2] for k in kids)


@given(entries, st.none() | ids.map(bytes.hex), st.integers(0, 2**63 - 1), st.text(max_size=40),
       st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8),
                       max_size=4))
def test_snapshot_round_trip(root: Entry, parent: str | None, t: int, msg: str,
                             meta: dict[str, object]) -> None:
    snap = Snapshot(root=root, parent=parent, time_ns=t, message=msg, meta=meta)
    raw = snap.encode()
    assert Snapshot.decode(raw) == snap
    assert Snapshot.decode(raw).encode() == raw


def test_snapshot_id_changes_with_every_field() -> None:
    base = Snapshot(root=Entry(kind=K_DIR, ref=EMPTY_TREE_ID), parent=None, time_ns=1)
    variants = [
        base,
        Snapshot(root=base.root.with_(mode=0o700), parent=None, time_ns=1),
        Snapshot(root=base.root, parent=EMPTY_SNAPSHOT_ID, time_ns=1),
        Snapshot(root=base.root, parent=None, time_ns=2),
        Snapshot(root=base.root, parent=None, time_ns=1, message="m"),
        Snapshot(root=base.root, parent=None, time_ns=1, meta={"k": 1}),
    ]
    assert len({object_id(SNAPSHOT, s.encode()) for s in variants}) == len(variants)


@pytest.mark.parametrize("raw", [b"", b"\xc1", packb([1, 2]), packb({"v": 2}), b"\x92\x00"])
def test_malformed_encodings_raise_value_error(raw: bytes) -> None:
    for decode in (FileNode.decode, TreeNode.decode, Snapshot.decode):
        with pytest.raises((ValueError, KeyError, TypeError)):
            decode(raw)


def test_entry_from_list_refuses_short_lists_and_unknown_kinds() -> None:
    with pytest.raises(ValueError):
        Entry.from_list([K_FILE, 0o644])
    bad = Entry(kind=K_FILE).to_list()
    bad[0] = 99
    with pytest.raises(ValueError, match="unknown entry kind"):
        Entry.from_list(bad)


def test_st_mode_combines_type_and_permission_bits() -> None:
    assert Entry(kind=K_FILE, mode=0o644).st_mode == 0o100644
    assert Entry(kind=K_DIR, mode=0o1777).st_mode == 0o041777
    assert Entry(kind=K_SYMLINK, mode=0o777).st_mode == 0o120777


@pytest.mark.parametrize("e", [
    Entry(kind=42),
    Entry(kind=K_FILE, size=-1),
    Entry(kind=K_FILE, mode=0o17777),
    Entry(kind=K_FILE, uid=-1),
    Entry(kind=K_FILE, gid=-5),
    Entry(kind=K_FILE, size=10, ref=b"short"),
    Entry(kind=K_FILE, size=3, data=b"ab"),
    Entry(kind=K_SYMLINK, data=b""),
])
def test_check_entry_refuses_impossible_entries(e: Entry) -> None:
    with pytest.raises(InvalidInput):
        check_entry(e)


def test_check_entry_accepts_ordinary_entries() -> None:
    check_entry(Entry(kind=K_FILE, size=3, data=b"abc"))
    check_entry(Entry(kind=K_FILE, size=10**6, ref=ZERO_ID))
    check_entry(Entry(kind=K_DIR, ref=EMPTY_TREE_ID))
    check_entry(Entry(kind=K_SYMLINK, size=3, data=b"a/b"))


def test_file_node_reads_ranges_with_holes_and_short_blocks() -> None:
    """The one range read behind transactions, the mount, export and cat."""
    blocks = {b"A" * 32: b"aaa", b"C" * 32: b"cc"}  # a stored block may be short: zeros follow
    node = FileNode.v1(size=10, block_size=4, blocks=(b"A" * 32, ZERO_ID, b"C" * 32))
    fetched: list[bytes] = []

    def fetch(oid: bytes) -> bytes:
        fetched.append(oid)
        return blocks[oid]

    assert node.read(0, 10, fetch) == b"aaa\0\0\0\0\0cc"
    assert node.read(2, 9, fetch) == b"a\0\0\0\0\0c"
    assert list(node.pieces(1, 10, fetch)) == [(3, b"aa\0"), (4, None), (2, b"cc")]
    assert ZERO_ID not in fetched


@given(st.dictionaries(names, entries, min_size=1, max_size=12), st.integers(0, 2**40))
def test_version_2_leaf_round_trips_with_its_link_counts(items: dict[bytes, Entry],
                                                         below: int) -> None:
    rows = tuple(sorted(items.items()))
    links = tuple(below if e.kind == K_DIR else int(e.kind == K_FILE and e.ino != 0)
                  for _n, e in rows)
    node = TreeNode(0, entries=rows, links=links)
    raw = node.encode()
    back = TreeNode.decode(raw)
    assert back == node and back.version == 2 and back.encode() == raw
    assert back.linked == sum(links)
    v1 = TreeNode.decode(TreeNode(0, entries=rows).encode())  # before counts: dirs unknown
    assert v1.version == 1
    assert v1.item_links == tuple(None if e.kind == K_DIR else n
                                  for (_n, e), n in zip(rows, links, strict=True))


def test_the_empty_directory_keeps_its_id_in_version_2() -> None:
    assert TreeNode(0, links=()).encode() == EMPTY_TREE
    assert TreeNode.decode(EMPTY_TREE).linked == 0


def test_a_version_2_leaf_whose_file_counts_lie_is_refused() -> None:
    linked = Entry(kind=K_FILE, size=1, data=b"x", ino=5, nlink=2)
    with pytest.raises(ValueError, match="counts 0 linked files"):
        TreeNode.decode(packb([2, 0, [[b"a", *linked.to_list()]], [0]]))
    for links in ([1, 1], [True], [-1], [2**63], ["1"]):
        with pytest.raises(ValueError, match="link counts do not match"):
            TreeNode.decode(packb([2, 0, [[b"a", *linked.to_list()]], links]))
