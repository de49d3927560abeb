"""Directory trees: build, lookup, update and diff against a plain dict model.

Trees read through a real `LocalStore`; new nodes stay in `Trees.new` until a
test stores them, which is also how the bytes a change writes are counted.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.engine.errors import InvalidInput, NotFound
from strata.engine.local import LocalStore
from strata.engine.objects import EMPTY_TREE_ID, K_DIR, K_FILE, TREE, Entry, TreeNode
from strata.engine.tree import MAX_FANOUT, Trees, decode_name, encode_name

Model = dict[bytes, Entry]


def name(i: int) -> bytes:
    return f"entry-{i:06d}".encode()


def fentry(i: int, size: int = 1) -> Entry:
    return Entry(kind=K_FILE, size=size, data=bytes([i % 251]) * size, mtime_ns=i)


def dentry(ref: bytes = EMPTY_TREE_ID, mode: int = 0o755) -> Entry:
    return Entry(kind=K_DIR, mode=mode, ref=ref)


def store_new(store: LocalStore, trees: Trees) -> None:
    store.put_objects([(TREE, raw) for raw in trees.new.values()])
    trees.new.clear()


def check_against(trees: Trees, root: bytes, model: Model, absent: list[bytes]) -> None:
    assert list(trees.iter_dir(root)) == sorted(model.items())
    assert trees.count(root) == len(model)
    for n, e in model.items():
        assert trees.lookup(root, n) == e
    for n in absent:
        if n not in model:
            assert trees.lookup(root, n) is None
    check_shape(trees, root)


def check_shape(trees: Trees, oid: bytes) -> tuple[bytes, bytes] | None:
    """Every node sorted, within fan-out, counts and first names right; (min, max) names."""
    node = trees.node(oid)
    if node.level == 0:
        names = [n for n, _ in node.entries]
        assert names == sorted(set(names))
        assert len(names) <= MAX_FANOUT
        return (names[0], names[-1]) if names else None
    assert 0 < len(node.children) <= MAX_FANOUT
    prev_max = None
    for first, child, count in node.children:
        sub = trees.node(child)
        assert sub.level == node.level - 1
        assert sub.count == count
        rng = check_shape(trees, child)
        assert rng is not None and rng[0] == first
        if prev_max is not None:
            assert prev_max < rng[0]
        prev_max = rng[1]
    return node.children[0][0], prev_max  # type: ignore[return-value]


def model_diff(a: Model, b: Model) -> list[tuple[str, Entry | None, Entry | None]]:
    return [(decode_name(n), a.get(n), b.get(n)) for n in sorted(a.keys() | b.keys())
            if a.get(n) != b.get(n)]


def test_empty_directory(shared_store: LocalStore) -> None:
    trees = Trees(shared_store)
    assert trees.build([]) == EMPTY_TREE_ID
    assert list(trees.iter_dir(EMPTY_TREE_ID)) == []
    assert trees.lookup(EMPTY_TREE_ID, b"x") is None
    root = trees.update(EMPTY_TREE_ID, {b"a": fentry(1)})
    assert trees.update(root, {b"a": None}) == EMPTY_TREE_ID
    assert trees.update(root, {}) == root


def test_build_is_deterministic_and_content_addressed(shared_store: LocalStore) -> None:
    items = [(name(i), fentry(i)) for i in range(3000)]
    a, b = Trees(shared_store), Trees(shared_store)
    assert a.build(items) == b.build(items)
    assert a.new == b.new
    assert a.build(items[:-1]) != a.build(items)
    assert TreeNode.decode(a.new[a.build(items)]).level >= 1  # 3000 entries: split


edit_value = st.none() | st.integers(0, 10_000).map(fentry)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2500), st.lists(
    st.dictionaries(st.integers(0, 3000).map(name), edit_value, min_size=1, max_size=40),
    min_size=1, max_size=6))
def test_updates_match_a_dict_model(shared_store: LocalStore, n: int,
                                    batches: list[dict[bytes, Entry | None]]) -> None:
    trees = Trees(shared_store)
    model: Model = {name(i): fentry(i) for i in range(0, 2 * n, 2)}
    root = trees.build(sorted(model.items()))
    check_against(trees, root, model, [name(i) for i in range(1, 40, 3)])
    probes = [name(i) for i in range(0, 3001, 97)]
    for batch in batches:
        old_model, old_root = dict(model), root
        root = trees.update(root, batch)
        for k, v in batch.items():
            if v is None:
                model.pop(k, None)
            else:
                model[k] = v
        check_against(trees, root, model, probes + list(batch))
        old = dentry(old_root)
        new = dentry(root)
        assert list(trees.diff(old, new)) == model_diff(old_model, model)
        assert list(trees.diff(new, old)) == model_diff(model, old_model)
        # An update that lands on the same content gives back the same tree.
        assert trees.update(root, {k: model.get(k) for k in batch}) == root


def test_large_directory_change_rewrites_few_small_nodes(shared_store: LocalStore) -> None:
    rng = random.Random(1)
    n = 100_000
    items = [(name(i), Entry(kind=K_FILE, size=10_000, ref=rng.randbytes(32), mtime_ns=i))
             for i in range(n)]
    builder = Trees(shared_store)
    root = builder.build(items)
    store_new(shared_store, builder)
    depth = builder.node(root).level + 1
    assert depth >= 3
    old_leaves = set(builder.leaves(root))
    model = dict(items)
    for edit in [
        {name(50_000): fentry(7)},                  # modify
        {b"entry-050000.5": fentry(8)},             # insert in the middle
        {name(77_777): None},                       # delete
        {b"zzz-after-everything": fentry(9)},       # insert after the last
        {b"aaa-before-everything": fentry(10)},     # insert before the first
    ]:
        trees = Trees(shared_store)  # fresh: `new` holds exactly what this change writes
        new_root = trees.update(root, edit)
        written = sum(len(raw) for raw in trees.new.values())
        assert written <= 64 * 1024, f"{written} bytes of tree nodes for a one-entry change"
        assert len(trees.new) <= 2 * depth
        assert len(set(trees.leaves(new_root)) - old_leaves) <= 2
        for k, v in edit.items():
            assert trees.lookup(new_root, k) == v
        expected = dict(model)
        for k, v in edit.items():
            if v is None:
                del expected[k]
            else:
                expected[k] = v
        assert trees.count(new_root) == len(expected)
        for k in random.Random(2).sample(sorted(expected), 500):
            assert trees.lookup(new_root, k) == expected[k]
        assert list(trees.diff(dentry(root), dentry(new_root))) == model_diff(model, expected)
        assert trees.lookup(root, name(50_000)) == model[name(50_000)]  # the old tree is intact
    assert [n for n, _ in builder.iter_dir(root)] == [n for n, _ in items]


def tree_of(trees: Trees, files: dict[str, bytes]) -> Entry:
    """A root directory entry holding `files` (path -> content), made through apply()."""
    root = dentry()
    changes: list[tuple[tuple[str, ...], Entry | None]] = []
    dirs = sorted({tuple(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
    for d in dirs:
        changes.append((d, Entry(kind=K_DIR, mode=0o755)))
    for p, data in files.items():
        changes.append((tuple(p.split("/")), Entry(kind=K_FILE, size=len(data), data=data)))
    changes.sort(key=lambda c: c[0])
    return trees.apply(root, changes) if changes else root


def files_of(trees: Trees, root: Entry) -> dict[str, bytes]:
    return {p: e.data or b"" for p, e in trees.walk(root) if e.kind == K_FILE}


def test_apply_nested_changes(shared_store: LocalStore) -> None:
    trees = Trees(shared_store)
    root = tree_of(trees, {"a/b/c.txt": b"c", "a/d.txt": b"d", "top": b"t", "e/f/g/h": b"h"})
    assert files_of(trees, root) == {"a/b/c.txt": b"c", "a/d.txt": b"d", "top": b"t",
                                     "e/f/g/h": b"h"}
    assert [p for p, _ in trees.walk(root)] == [
        "a", "a/b", "a/b/c.txt", "a/d.txt", "e", "e/f", "e/f/g", "e/f/g/h", "top"]
    assert trees.resolve(root, ("a", "b", "c.txt")) == Entry(kind=K_FILE, size=1, data=b"c")
    assert trees.resolve(root, ("a", "nope", "c.txt")) is None
    assert trees.resolve(root, ("top", "below-a-file")) is None

    # A merge entry (ref None) keeps the directory's content and takes its attributes.
    merged = trees.apply(root, [(("a",), Entry(kind=K_DIR, mode=0o700, mtime_ns=5)),
                                (("a", "new"), Entry(kind=K_FILE, size=1, data=b"n"))])
    a = trees.resolve(merged, ("a",))
    assert a is not None and a.mode == 0o700 and a.mtime_ns == 5
    assert files_of(trees, merged)["a/d.txt"] == b"d"
    assert files_of(trees, merged)["a/new"] == b"n"

    # A merge entry over a file makes an empty directory.
    over = trees.apply(root, [(("top",), Entry(kind=K_DIR, mode=0o755))])
    assert trees.resolve(over, ("top",)) == dentry()

    # Deleting a directory deletes its subtree.
    gone = trees.apply(root, [(("e",), None)])
    assert files_of(trees, gone) == {"a/b/c.txt": b"c", "a/d.txt": b"d", "top": b"t"}

    with pytest.raises(NotFound):
        trees.apply(root, [(("missing", "x"), fentry(1))])
    with pytest.raises(NotFound):
        trees.apply(root, [(("top", "x"), fentry(1))])
    with pytest.raises(InvalidInput):
        trees.apply(fentry(1), [(("x",), fentry(1))])
    with pytest.raises(InvalidInput):
        trees.apply(root, [((), fentry(1))])


def test_nested_diff(shared_store: LocalStore) -> None:
    trees = Trees(shared_store)
    a = tree_of(trees, {"d/x": b"1", "d/y": b"2", "k/z": b"3", "same/s": b"s"})
    b = tree_of(trees, {"d/x": b"1", "d/y": b"22", "n/w": b"4", "same/s": b"s"})
    got = [(p, o is not None, n is not None) for p, o, n in trees.diff(a, b)]
    assert sorted(got) == sorted([
        ("d/y", True, True),
        ("k/z", True, False), ("k", True, False),
        ("n", False, True), ("n/w", False, True),
    ])
    assert list(trees.diff(a, a)) == []
    # Directory attribute changes show up on the directory's own line.
    c = trees.apply(a, [(("same",), Entry(kind=K_DIR, mode=0o700))])
    assert [p for p, _, _ in trees.diff(a, c)] == ["same"]


def test_names_round_trip_bytes_that_are_not_utf8() -> None:
    raw = b"caf\xe9"
    assert encode_name(decode_name(raw)) == raw
    assert encode_name("é") == "é".encode()


def test_resolve_changed_sees_what_apply_makes(shared_store: LocalStore) -> None:
    """A transaction's and a mount's view before publishing equals the published tree."""
    trees = Trees(shared_store)
    root = tree_of(trees, {"a/b/c.txt": b"c", "a/d.txt": b"d", "top": b"t", "e/f/g/h": b"h"})
    changes: dict[str, Entry | None] = {
        "a": Entry(kind=K_DIR, mode=0o700, mtime_ns=5),  # merge: keeps b/ and d.txt
        "a/new": fentry(1),
        "e": dentry(),  # replaced by an empty directory
        "e/x": fentry(2),
        "top": Entry(kind=K_DIR, mode=0o750),  # a merge entry over a file: empty
        "top/y": fentry(3),
        "a/b": None,
    }
    parsed = [(tuple(p.split("/")), e) for p, e in sorted(changes.items())]
    applied = trees.apply(root, parsed, merge_time=lambda _theirs, ours: ours)
    paths = {p for p, _ in trees.walk(root)} | {p for p, _ in trees.walk(applied)}

    def shown(e: Entry | None) -> Entry | None:  # a directory's ref holds no pending change
        return e.with_(ref=None) if e is not None and e.kind == K_DIR else e

    for p in sorted(paths | {"a/b/c.txt/below", "nope/x"}):
        parts = p.split("/")
        seen = trees.resolve_changed(root, changes, parts)
        assert shown(seen) == shown(trees.resolve(applied, parts)), p
    assert trees.resolve_changed(root, changes, ["a", "b"], skip_last=True) == trees.resolve(
        root, ["a", "b"])
    top = trees.resolve_changed(root, {"": dentry(mode=0o711)}, [])
    assert top == root.with_(mode=0o711)


def true_links(trees: Trees, oid: bytes) -> int:
    """Hard-linked files under tree `oid`, counted by hand; every written count must agree."""
    node = trees.node(oid)
    if node.level:
        got = [true_links(trees, c[1]) for c in node.children]
    else:
        got = [true_links(trees, e.ref) if e.kind == K_DIR and e.ref is not None
               else int(e.kind == K_FILE and e.ino != 0) for _n, e in node.entries]
    assert list(node.item_links) == got
    return sum(got)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 400), st.integers(0, 3)),
                min_size=1, max_size=60))
def test_link_counts_follow_every_update(shared_store: LocalStore,
                                         ops: list[tuple[int, int, int]]) -> None:
    """Counts of hard-linked files stay exact through nested sets, deletes and splits."""
    trees = Trees(shared_store)
    root = Entry(kind=K_DIR, mode=0o755, ref=EMPTY_TREE_ID)
    for d, i, what in ops:
        parts = (f"dir{d}", f"sub{i % 3}", f"f{i:04d}")
        e = None if what == 0 else fentry(i).with_(ino=i + 1 if what == 1 else 0,
                                                     nlink=2 if what == 1 else 1)
        change = [(parts[:1], Entry(kind=K_DIR, mode=0o755)),
                  (parts[:2], Entry(kind=K_DIR, mode=0o755)), (parts, e)]
        root = trees.apply(root, change)
        assert root.ref is not None
        linked = true_links(trees, root.ref)
        want = sum(1 for _p, e in trees.walk(root) if e.kind == K_FILE and e.ino)
        assert linked == want
        assert sorted(p for p, _e in trees.link_group(root, i + 1)) == sorted(
            p for p, e in trees.walk(root) if e.kind == K_FILE and e.ino == i + 1)


def test_the_node_cache_is_bounded_by_decoded_size_not_only_by_count() -> None:
    """256 entries with inline data cost far more than one small entry: both count."""
    from strata.engine.tree import NodeCache
    cache = NodeCache(capacity=1000, max_bytes=2 << 20)
    big = TreeNode(0, entries=tuple((name(i), fentry(i, 2000)) for i in range(MAX_FANOUT)))
    raw = big.encode()
    for i in range(100):
        cache.put(i.to_bytes(32, "big"), big, len(raw))
        assert cache.bytes <= 2 << 20
    kept = [i for i in range(100) if cache.get(i.to_bytes(32, "big")) is not None]
    assert kept == list(range(100 - len(kept), 100)) and 1 <= len(kept) < 10  # the newest
    small = TreeNode(0, entries=((name(0), fentry(0)),))
    for i in range(1000, 3000):
        cache.put(i.to_bytes(32, "big"), small, len(small.encode()))
    assert all(cache.get(i.to_bytes(32, "big")) is None for i in range(100))  # pushed out
    kept_small = sum(cache.get(i.to_bytes(32, "big")) is not None for i in range(1000, 3000))
    assert kept_small == 1000  # the count's bound, before the bytes' (~1.1 MiB of 2)
    before = cache.bytes
    cache.put((2999).to_bytes(32, "big"), small, len(small.encode()))  # a put again
    assert cache.bytes == before  # counted once
    cache.clear()
    assert cache.bytes == 0 and cache.get((1000).to_bytes(32, "big")) is None
