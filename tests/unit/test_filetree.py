"""Version 2 file nodes: the tree of content-defined chunks, its checks and its edits.

What a file node tree must do: read any range through the nodes covering it,
refuse a hostile node before it costs memory, rewrite O(depth) small nodes
for a small change however large the file, and share chunks between files
that share runs of bytes (where fixed-size blocks share nothing once bytes
shift).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.engine import filetree
from strata.engine.local import LocalStore
from strata.engine.objects import (
    BLOCK,
    FILE_FANOUT_MAX,
    FILE_NODE_V2_MAX,
    FILENODE,
    K_FILE,
    ZERO_ID,
    Entry,
    FileNode,
    object_id,
    packb,
    references,
)
from strata.engine.txn import Transaction

GIB = 1 << 30


class Objects:
    """A plain dict store that counts what is put into it."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.put_bytes = 0
        self.put_nodes = 0

    def put(self, kind: int, raw: bytes) -> bytes:
        oid = object_id(kind, raw)
        if oid not in self.data:
            self.data[oid] = raw
            self.put_bytes += len(raw)
            self.put_nodes += kind == FILENODE
        return oid

    def block(self, raw: bytes) -> bytes:
        return self.put(BLOCK, raw)

    def get(self, oid: bytes) -> bytes:
        return self.data[oid]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tiny chunks and nodes, so that a few hundred KiB make a tree several levels deep."""
    monkeypatch.setattr(filetree, "CDC_MIN", 256)
    monkeypatch.setattr(filetree, "CDC_AVG", 1024)
    monkeypatch.setattr(filetree, "CDC_MAX", 4096)
    monkeypatch.setattr(filetree, "FILE_FANOUT_MAX", 8)
    monkeypatch.setattr(filetree, "NODE_MASK", 3)
    monkeypatch.setattr(filetree._local, "cdc", None, raising=False)
    yield
    filetree._local.cdc = None


# -- the node format -----------------------------------------------------------


def test_a_version_2_node_round_trips_and_names_its_children() -> None:
    a, b = object_id(BLOCK, b"a"), object_id(BLOCK, b"b")
    leaf = FileNode(10, 0, ((4, a), (3, ZERO_ID), (3, b)))
    raw = leaf.encode()
    assert raw[:2] == b"\x94\x02"
    assert FileNode.decode(raw) == leaf
    assert references(FILENODE, raw) == [(BLOCK, a), (BLOCK, b)]
    leaf_id = object_id(FILENODE, raw)
    inner = FileNode(20, 1, ((10, leaf_id), (10, leaf_id)))
    assert references(FILENODE, inner.encode()) == [(FILENODE, leaf_id)]


@pytest.mark.parametrize("body, why", [
    ([2, 5, 0, [[4, b"x" * 32]]], "add up"),
    ([2, 4, 0, [[0, b"x" * 32], [4, b"x" * 32]]], "length > 0"),
    ([2, 4, 0, [[-1, b"x" * 32], [5, b"x" * 32]]], "length > 0"),
    ([2, 4, 0, [[True, b"x" * 32], [3, b"x" * 32]]], "length > 0"),
    ([2, 4, 0, [[4, b"x" * 31]]], "32-byte id"),
    ([2, 4, 0, [[4, "x" * 32]]], "32-byte id"),
    ([2, 4, 0, [[4, b"x" * 32, 1]]], "32-byte id"),
    ([2, 4, 1, [[4, bytes(32)]]], "hole as a child"),
    ([2, 4, 9, [[4, b"x" * 32]]], "out of range"),
    ([2, 4, -1, [[4, b"x" * 32]]], "out of range"),
    ([2, 4, 0, []], "out of range"),
    ([2, -4, 0, [[4, b"x" * 32]]], "bad size"),
    ([2, 2**63, 0, [[4, b"x" * 32]]], "bad size"),
    ([2, 513, 0, [[1, b"x" * 32]] * 513], "out of range"),
    ([3, 4, 0, [[4, b"x" * 32]]], "version 3"),
    ([1, 8192, 4096, [b"x" * 32]], "disagree"),
    ([2, 4, 0, {"a": 1}], "bad size or entry list"),
])
def test_hostile_nodes_are_refused_naming_the_fault(body: list[object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        FileNode.decode(packb(body))


def test_a_version_2_node_too_long_is_refused_before_it_is_unpacked() -> None:
    raw = b"\x94\x02" + bytes(FILE_NODE_V2_MAX)
    with pytest.raises(ValueError, match="larger than a version 2 node"):
        FileNode.decode(raw)
    assert FILE_FANOUT_MAX * len(packb([2**40, bytes(32)])) < FILE_NODE_V2_MAX


def test_an_unknown_version_asks_for_an_upgrade() -> None:
    with pytest.raises(ValueError, match="upgrade strata"):
        FileNode.decode(packb([7, 0, 0, []]))


def test_a_child_that_disagrees_with_its_parent_is_refused() -> None:
    objs = Objects()
    leaf = FileNode(10, 0, ((10, objs.block(b"x" * 10)),))
    leaf_id = objs.put(FILENODE, leaf.encode())
    liar = FileNode(11, 1, ((11, leaf_id),))
    with pytest.raises(ValueError, match="is not the level 0 node of 11 bytes"):
        liar.read(0, 11, objs.get)


# -- trees: building, reading, editing ---------------------------------------------


def test_a_tree_reads_every_range_and_fetches_only_what_covers_it(small_chunks: None) -> None:
    objs = Objects()
    data = random.Random(3).randbytes(300_000)
    root, _rid = filetree.build(filetree.chunk_entries(data, objs.block), objs.put)
    assert root.level >= 2
    assert root.read(0, len(data), objs.get) == data
    fetched: list[bytes] = []

    def get(oid: bytes) -> bytes:
        fetched.append(oid)
        return objs.get(oid)

    assert root.read(150_000, 150_100, get) == data[150_000:150_100]
    assert len(fetched) <= root.level + 2  # one node a level, then a chunk or two


ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 60_000), st.binary(min_size=1, max_size=9000)),
    st.tuples(st.just("zeros"), st.integers(0, 60_000), st.integers(1, 20_000)),
    st.tuples(st.just("truncate"), st.integers(0, 70_000)),
), max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(initial=st.binary(max_size=40_000), ops=ops)
def test_splices_on_a_deep_tree_match_a_bytearray(small_chunks: None, store: LocalStore,
                                                   initial: bytes,
                                                   ops: list[tuple[object, ...]]) -> None:
    t = Transaction(store, "v")
    t.write("f", initial)
    model = bytearray(initial)
    for op in ops:
        if op[0] == "truncate":
            size = int(op[1])  # type: ignore[call-overload]
            t.truncate("f", size)
            model = model[:size] + bytearray(max(0, size - len(model)))
            continue
        offset = int(op[1])  # type: ignore[call-overload]
        data = op[2] if op[0] == "write" else bytes(int(op[2]))  # type: ignore[call-overload]
        assert isinstance(data, bytes)
        t.write_at("f", offset, data)
        if offset > len(model):
            model.extend(bytes(offset - len(model)))
        model[offset:offset + len(data)] = data
    assert t.read("f") == bytes(model)
    e = t.lookup("f")
    assert e is not None and e.size == len(model)
    if e.ref is not None:
        root = FileNode.decode(t.content.get_object(e.ref))
        assert root.version == 2 and root.size == len(model)


def test_a_100_gib_sparse_file_changed_at_one_offset_writes_a_few_kib(store: LocalStore
                                                                     ) -> None:
    t = Transaction(store, "v")
    t.write("disk.img", b"")
    t.truncate("disk.img", 100 * GIB)
    t.commit("a 100 GiB hole")
    t = Transaction(store, "v")
    t.write_at("disk.img", 37 * GIB + 12345, b"\xab" * 4096)
    pending = list(t.content.pending.values())
    nodes = sum(len(raw) for kind, raw in pending if kind == FILENODE)
    chunks = sum(len(raw) for kind, raw in pending if kind == BLOCK)
    assert chunks == 4096 and nodes < 1024, (nodes, chunks)
    packs = Path(store.path) / "packs"
    before = sum(p.stat().st_size for p in packs.iterdir())
    t.commit("one 4 KiB write")
    # Everything the publish put in the store: chunk, file node, tree path, snapshot.
    assert sum(p.stat().st_size for p in packs.iterdir()) - before < 16 * 1024
    got = Transaction(store, "v").read("disk.img", 37 * GIB + 12000, 5000)
    assert got == bytes(345) + b"\xab" * 4096 + bytes(5000 - 345 - 4096)


def test_one_chunk_changed_in_a_dense_100_gib_file_rewrites_o_log_n_nodes() -> None:
    """1.6 million chunks (named, not stored: an edit never reads the chunks it keeps)."""
    objs = Objects()
    rng = random.Random(5)
    chunk = 64 * 1024
    count = 100 * GIB // chunk
    builder = filetree.TreeBuilder(objs.put)
    for _ in range(count):
        builder.add(chunk, rng.randbytes(32))
    root, _rid = builder.finish()
    assert root.size == 100 * GIB and root.level >= 2
    before_bytes, before_nodes = objs.put_bytes, objs.put_nodes
    at = 41 * GIB + 7 * chunk
    new = [(chunk, objs.block(os.urandom(chunk)))]
    root2, _ = filetree.replace_range(root, at, at + chunk, new, objs.get, objs.put)
    node_bytes = objs.put_bytes - before_bytes - chunk
    assert objs.put_nodes - before_nodes <= root.level + 2
    assert node_bytes < 64 * 1024, node_bytes  # v1: a 50 MiB node rewritten whole
    assert [oid for _s, _n, oid in root2.spans(at, at + 1, objs.get)] == [new[0][1]]


# -- dedup ------------------------------------------------------------------------


def test_bytes_inserted_at_the_front_keep_most_chunks_unlike_fixed_blocks() -> None:
    data = random.Random(9).randbytes(4 << 20)
    shifted = b"a few new bytes at the front" + data

    def cdc(b: bytes) -> set[bytes]:
        return {object_id(BLOCK, b[o:o + n]) for o, n in filetree.cut(b)}

    def fixed(b: bytes) -> set[bytes]:
        return {object_id(BLOCK, b[i:i + 65536]) for i in range(0, len(b), 65536)}

    a, b = cdc(data), cdc(shifted)
    assert len(a & b) >= 0.9 * len(a)
    assert not fixed(data) & fixed(shifted)


def test_the_same_bytes_give_the_same_tree_whatever_wrote_them(store: LocalStore,
                                                              tmp_path: object) -> None:
    data = random.Random(11).randbytes(3 << 20)
    t = Transaction(store, "v")
    whole = t.write("a", data)
    t.write("b", data[:1 << 20])
    t.write_at("b", 1 << 20, data[1 << 20:])
    spliced = t.lookup("b")
    assert spliced is not None and whole.ref is not None
    assert t.read("b") == data
    # A write at the end re-cuts from the last chunk on: the chunks all agree.
    ours = FileNode.decode(t.content.get_object(whole.ref))
    theirs = FileNode.decode(t.content.get_object(spliced.ref))  # type: ignore[arg-type]
    get = t.content.get_object
    same = set(ours.all_block_ids(get)) & set(theirs.all_block_ids(get))
    assert len(same) >= len(ours.all_block_ids(get)) - 2


@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_value_error(raw: bytes) -> None:
    for prefix in (b"", b"\x94", b"\x94\x02", b"\x94\x01"):
        try:
            FileNode.decode(prefix + raw)
        except ValueError:
            pass


def test_appends_make_the_chunks_of_the_whole_written_at_once(store: LocalStore) -> None:
    data = random.Random(13).randbytes(1 << 20)
    t = Transaction(store, "v")
    whole = t.write("whole", data)
    t.write("appended", b"")
    for i in range(0, len(data), 16 * 1024):
        t.write_at("appended", i, data[i:i + 16 * 1024])
    appended = t.lookup("appended")
    assert appended is not None and t.read("appended") == data
    assert appended.ref == whole.ref  # the same chunks, so the same tree


def test_a_file_built_in_pieces_is_the_file_written_whole(store: LocalStore) -> None:
    t = Transaction(store, "v")
    rng = random.Random(17)
    for size in (0, 100, 4096, 4097, 70_000, 3 << 20):
        data = rng.randbytes(size)
        whole = t.content.file_entry(data, Entry(kind=K_FILE))
        b = t.content.builder()
        pos = 0
        while pos < size:
            n = rng.choice((1, 7, 4096, 100_000))
            b.write(data[pos:pos + n])
            pos += n
        assert b.entry(Entry(kind=K_FILE)) == whole, size


def test_fixed_blocks_from_an_older_writer_still_make_a_readable_tree(store: LocalStore
                                                                      ) -> None:
    t = Transaction(store, "v")
    data = random.Random(19).randbytes(200_000)
    bs = t.content.block_size
    ids = [t.content.block(data[i:i + bs]) for i in range(0, len(data), bs)]
    e = t.content.node_entry(ids, len(data), Entry(kind=K_FILE))
    assert e.ref is not None and t.content.read(e) == data


def test_import_reads_a_window_at_a_time_and_cuts_as_the_whole(
        store: LocalStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from strata import localfile
    monkeypatch.setattr(localfile, "READ_WINDOW", 100_000)
    data = random.Random(23).randbytes(2 << 20)
    path = tmp_path / "f"
    path.write_bytes(data)
    t = Transaction(store, "v")
    got = localfile.file_content(str(path), len(data), lambda _o, d: t.content.block(d),
                                 t.content.add)
    assert isinstance(got, tuple)
    assert got[1] == t.content.file_entry(data, Entry(kind=K_FILE)).ref


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200_000), st.booleans()), min_size=1, max_size=8),
       st.sampled_from([5_000, 70_000, 1 << 20]))
def test_zero_runs_are_holes_and_pieces_cut_as_the_whole(parts: list[tuple[int, bool]],
                                                          window: int) -> None:
    rng = random.Random(len(parts))
    data = b"".join(bytes(n) if zero else rng.randbytes(n) for n, zero in parts)
    whole = list(filetree.cut(data))
    assert sum(n for _o, n in whole) == len(data)
    for o, n in whole:  # a zero run of ZERO_RUN or more is never inside a data chunk
        piece = data[o:o + n]
        assert filetree.is_zero(piece) or bytes(filetree.ZERO_RUN) not in piece
    c = filetree.Chunker()
    pieces = [p for i in range(0, len(data), window) for p in c.feed(data[i:i + window])]
    pieces += c.finish()
    assert b"".join(pieces) == data
    objs = Objects()
    fed: filetree.Entries = []
    for p in pieces:
        filetree.append_entry(fed, len(p), ZERO_ID if filetree.is_zero(p) else objs.block(p))
    assert fed == filetree.chunk_entries(data, objs.block)
