"""Transactions: staged file content, directories, links, renames and attributes.

Every test stages changes, checks the transaction's own view, commits, and
checks the published snapshot through a fresh transaction.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.engine.errors import AlreadyExists, InvalidInput, NotFound
from strata.engine.local import LocalStore
from strata.engine.objects import INLINE_MAX, K_DIR, K_FILE, K_SYMLINK, ZERO_ID, FileNode
from strata.engine.txn import Transaction

BS = 4096  # the block size of the `small_store` fixture


_counter = itertools.count()


def fresh(store: LocalStore, volume: str = "v") -> Transaction:
    return Transaction(store, volume)


def names(t: Transaction, path: str = "") -> list[str]:
    return [n for n, _ in t.listdir(path)]


# -- file content -------------------------------------------------------------

op = st.one_of(
    st.tuples(st.just("write_at"), st.integers(0, 40_000), st.binary(min_size=0, max_size=10_000)),
    st.tuples(st.just("zeros_at"), st.integers(0, 40_000), st.integers(1, 12_000)),
    st.tuples(st.just("truncate"), st.integers(0, 48_000)),
    st.tuples(st.just("write"), st.binary(max_size=20_000)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=20_000), st.lists(op, min_size=1, max_size=8), st.data())
def test_file_content_matches_a_bytearray_model(small_store: LocalStore, initial: bytes,
                                                ops: list[tuple], data: st.DataObject) -> None:
    path = f"f{next(_counter)}"
    t = fresh(small_store)
    t.write(path, initial)
    model = bytearray(initial)
    for o in ops:
        if o[0] == "write_at":
            _, off, chunk = o
            t.write_at(path, off, chunk)
            if chunk:
                if off > len(model):
                    model.extend(bytes(off - len(model)))
                model[off:off + len(chunk)] = chunk
        elif o[0] == "zeros_at":
            _, off, n = o
            t.write_at(path, off, bytes(n))
            if off > len(model):
                model.extend(bytes(off - len(model)))
            model[off:off + n] = bytes(n)
        elif o[0] == "truncate":
            t.truncate(path, o[1])
            del model[o[1]:]
            model.extend(bytes(o[1] - len(model)))
        else:
            t.write(path, o[1])
            model[:] = o[1]
        assert t.read(path) == bytes(model)
        e = t.lookup(path)
        assert e is not None and e.size == len(model)
        assert (e.ref is None) == (len(model) <= INLINE_MAX)
    off = data.draw(st.integers(0, len(model) + 10))
    length = data.draw(st.integers(0, 20_000))
    assert t.read(path, off, length) == bytes(model[off:off + length])
    t.commit()
    after = fresh(small_store)
    assert after.read(path) == bytes(model)
    assert after.read(path, off, length) == bytes(model[off:off + length])


def test_sparse_file_stores_holes_as_one_hole_entry(small_store: LocalStore) -> None:
    t = fresh(small_store)
    t.write("sparse", b"head")
    t.write_at("sparse", 100 * BS + 5, b"tail")
    e = t.lookup("sparse")
    assert e is not None and e.size == 100 * BS + 9 and e.ref is not None
    node = FileNode.decode(t.content.get_object(e.ref))
    assert node.version == 2 and node.level == 0
    assert [n for n, _ in node.entries] == [4, 100 * BS + 1, 4]
    assert node.blocks[1] == ZERO_ID
    assert node.blocks[0] != ZERO_ID and node.blocks[2] != ZERO_ID
    t.commit()
    got = fresh(small_store).read("sparse")
    assert got == b"head" + bytes(100 * BS + 1) + b"tail"


def test_growth_and_shrink_across_block_boundaries(small_store: LocalStore) -> None:
    t = fresh(small_store)
    body = bytes(range(256)) * 160  # 10 blocks
    t.write("g", body)
    t.truncate("g", 2 * BS + 1)     # shrink into the middle of block 2
    t.truncate("g", 6 * BS)         # grow again: the cut-off bytes must not come back
    assert t.read("g") == body[:2 * BS + 1] + bytes(6 * BS - 2 * BS - 1)
    t.truncate("g", 3000)           # shrink back to an inline file
    assert t.lookup("g").ref is None  # type: ignore[union-attr]
    assert t.read("g") == body[:3000]
    t.truncate("g", 0)
    assert t.read("g") == b""
    t.commit()
    assert fresh(small_store).read("g") == b""


def test_equal_content_gives_equal_entries(store: LocalStore) -> None:
    t = fresh(store)
    big = bytes(range(256)) * 1000
    a = t.write("a", big, mtime_ns=1)
    b = t.write("b", big, mtime_ns=1)
    assert a == b and a.ref is not None


def test_write_refusals(store: LocalStore) -> None:
    t = fresh(store)
    t.mkdir("d")
    with pytest.raises(InvalidInput):
        t.write("d", b"x")
    with pytest.raises(NotFound):
        t.write("nodir/x", b"x")
    t.write("f", b"x")
    with pytest.raises(InvalidInput):
        t.write("f/x", b"x")
    with pytest.raises(InvalidInput):
        t.write_at("f", -1, b"x")
    with pytest.raises(InvalidInput):
        t.truncate("f", -1)
    with pytest.raises(NotFound):
        t.write_at("missing", 0, b"x")
    with pytest.raises(InvalidInput):
        t.read("d")
    with pytest.raises(InvalidInput):
        t.truncate("d", 0)


# -- directories, symlinks, hard links ------------------------------------------

def test_mkdir(store: LocalStore) -> None:
    t = fresh(store)
    t.mkdir("a", 0o700)
    t.mkdir("a/b/c", parents=True)
    t.mkdir("a", exist_ok=True)
    with pytest.raises(AlreadyExists):
        t.mkdir("a")
    with pytest.raises(NotFound):
        t.mkdir("x/y")
    t.write("file", b"")
    with pytest.raises(InvalidInput):
        t.mkdir("file/sub")
    with pytest.raises(AlreadyExists):
        t.mkdir("file", exist_ok=True)
    with pytest.raises(AlreadyExists):
        t.mkdir("")
    assert names(t) == ["a", "file"]
    assert names(t, "a/b") == ["c"]
    t.commit()
    u = fresh(store)
    a = u.lookup("a")
    assert a is not None and a.kind == K_DIR and a.mode == 0o700
    assert [p for p, _ in u.walk()] == ["a", "a/b", "a/b/c", "file"]


def test_symlink(store: LocalStore) -> None:
    t = fresh(store)
    t.symlink("ln", "../outside/target")
    with pytest.raises(AlreadyExists):
        t.symlink("ln", "x")
    with pytest.raises(InvalidInput):
        t.symlink("empty", "")
    with pytest.raises(InvalidInput):
        t.symlink("nul", "a\0b")
    with pytest.raises(InvalidInput):
        t.read("ln")
    t.commit()
    e = fresh(store).lookup("ln")
    assert e is not None and e.kind == K_SYMLINK and e.data == b"../outside/target"
    assert e.size == len(b"../outside/target")


def test_hardlinks_share_content_and_count_links(store: LocalStore) -> None:
    t = fresh(store)
    t.write("a", b"one")
    t.commit()
    t = fresh(store)
    t.mkdir("d")
    t.hardlink("a", "d/b")
    t.hardlink("d/b", "c")
    with pytest.raises(AlreadyExists):
        t.hardlink("a", "c")
    with pytest.raises(NotFound):
        t.hardlink("missing", "x")
    t.mkdir("dir")
    with pytest.raises(InvalidInput):
        t.hardlink("dir", "dir2")
    entries = [t.lookup(p) for p in ("a", "d/b", "c")]
    assert all(e is not None and e.nlink == 3 and e.ino for e in entries)
    assert len({e.ino for e in entries if e is not None}) == 1
    # A write through one name is seen through every name.
    t.write_at("c", 3, b"+two")
    t.commit()
    u = fresh(store)
    for p in ("a", "d/b", "c"):
        assert u.read(p) == b"one+two"
        assert u.lookup(p).nlink == 3  # type: ignore[union-attr]
    u.remove("a")
    assert u.lookup("c").nlink == 2  # type: ignore[union-attr]
    u.remove("d/b")
    last = u.lookup("c")
    assert last is not None and last.nlink == 1 and last.ino == 0
    u.commit()
    assert fresh(store).lookup("c").nlink == 1  # type: ignore[union-attr]


# -- rename ------------------------------------------------------------------------


def test_hardlink_of_a_name_that_is_not_utf8(store: LocalStore) -> None:
    """POSIX names are bytes: the new group's number must not need them to be UTF-8."""
    t = fresh(store)
    t.write("caf\udce9", b"latin-1 name")
    t.hardlink("caf\udce9", "other")
    e = t.lookup("other")
    assert e is not None and e.ino and e.nlink == 2
    t.commit()

def test_rename_file_and_over_an_existing_file(store: LocalStore) -> None:
    t = fresh(store)
    t.write("a", b"A")
    t.write("b", b"B")
    t.commit()
    t = fresh(store)
    t.rename("a", "c")
    assert t.lookup("a") is None and t.read("c") == b"A"
    t.rename("c", "b")
    assert names(t) == ["b"] and t.read("b") == b"A"
    t.rename("b", "b")  # same path: nothing happens
    t.commit()
    u = fresh(store)
    assert names(u) == ["b"] and u.read("b") == b"A"


def test_rename_directory_with_staged_changes_beneath(store: LocalStore) -> None:
    t = fresh(store)
    t.mkdir("d/sub", parents=True)
    t.write("d/sub/old", b"old")
    t.write("d/keep", b"keep")
    t.commit()
    t = fresh(store)
    t.write("d/sub/new", b"new")        # staged under a directory from the base
    t.remove("d/keep")
    t.mkdir("n")
    t.write("n/x", b"x")                # staged under a new directory
    t.rename("d", "e")
    t.rename("n", "e/sub/n")
    assert t.lookup("d") is None
    assert names(t, "e") == ["sub"]
    assert names(t, "e/sub") == ["n", "new", "old"]
    assert t.read("e/sub/n/x") == b"x"
    t.commit()
    u = fresh(store)
    assert sorted(p for p, e in u.walk() if e.kind == K_FILE) == [
        "e/sub/n/x", "e/sub/new", "e/sub/old"]
    assert u.read("e/sub/new") == b"new" and u.read("e/sub/old") == b"old"


def test_rename_directory_over_an_empty_directory(store: LocalStore) -> None:
    t = fresh(store)
    t.mkdir("src")
    t.write("src/f", b"f")
    t.mkdir("dst")
    t.commit()
    t = fresh(store)
    t.rename("src", "dst")
    t.commit()
    u = fresh(store)
    assert names(u) == ["dst"] and u.read("dst/f") == b"f"


def test_rename_refusals(store: LocalStore) -> None:
    t = fresh(store)
    t.mkdir("d/inner", parents=True)
    t.write("d/inner/f", b"f")
    t.write("file", b"x")
    t.mkdir("full")
    t.write("full/y", b"y")
    t.commit()
    t = fresh(store)
    with pytest.raises(InvalidInput, match="inside itself"):
        t.rename("d", "d/inner/moved")
    with pytest.raises(InvalidInput):
        t.rename("file", "d")                # non-directory over a directory
    with pytest.raises(InvalidInput):
        t.rename("d", "file")                # directory over a non-directory
    with pytest.raises(InvalidInput, match="not empty"):
        t.rename("d", "full")
    with pytest.raises(AlreadyExists):
        t.rename("file", "full/y", noreplace=True)
    with pytest.raises(NotFound):
        t.rename("missing", "x")
    with pytest.raises(NotFound):
        t.rename("file", "nodir/x")
    with pytest.raises(InvalidInput):
        t.rename("", "x")
    assert t.changes == {}
    t.rename("file", "full/y")
    assert t.read("full/y") == b"x"


# -- remove --------------------------------------------------------------------------

def test_remove(store: LocalStore) -> None:
    t = fresh(store)
    t.mkdir("d/e", parents=True)
    t.write("d/e/f", b"f")
    t.write("g", b"g")
    t.commit()
    t = fresh(store)
    with pytest.raises(InvalidInput, match="not empty"):
        t.remove("d")
    with pytest.raises(InvalidInput):
        t.remove("")
    with pytest.raises(NotFound):
        t.remove("nope")
    t.remove("g")
    t.remove("d", recursive=True)
    assert names(t) == []
    with pytest.raises(NotFound):
        t.read("d/e/f")
    t.commit()
    assert names(fresh(store)) == []


def test_remove_of_a_file_created_in_the_same_transaction_leaves_no_change(
        store: LocalStore) -> None:
    t = fresh(store)
    t.write("tmp", b"x")
    t.remove("tmp")
    assert t.changes == {}
    head = store.head("v", "live")
    assert t.commit() == head


def test_directory_recreated_after_remove_starts_empty(store: LocalStore) -> None:
    t = fresh(store)
    t.mkdir("a")
    t.write("a/old", b"old")
    t.commit()
    t = fresh(store)
    t.remove("a", recursive=True)
    t.mkdir("a")
    t.write("a/new", b"new")
    assert names(t, "a") == ["new"]
    t.commit()
    assert names(fresh(store), "a") == ["new"]


def test_directory_made_where_one_was_renamed_away_starts_empty(store: LocalStore) -> None:
    # mv build build.old && mkdir build
    t = fresh(store)
    t.mkdir("build")
    t.write("build/out.o", b"object")
    t.commit()
    t = fresh(store)
    t.rename("build", "build.old")
    t.mkdir("build")
    t.write("build/new.o", b"new")
    assert names(t, "build") == ["new.o"]
    assert names(t, "build.old") == ["out.o"]
    t.commit()
    u = fresh(store)
    assert names(u, "build") == ["new.o"]
    assert names(u, "build.old") == ["out.o"]


# -- attributes --------------------------------------------------------------------------

def test_chmod_chown_utimes_xattrs(store: LocalStore) -> None:
    t = fresh(store)
    t.mkdir("d")
    t.write("d/f", b"content")
    t.symlink("l", "d/f")
    t.commit()
    t = fresh(store)
    t.chmod("d/f", 0o4750)
    t.chown("d/f", 1000, 2000)
    t.utimes("d/f", 123456789)
    t.setxattr("d/f", b"user.b", b"2")
    t.setxattr("d/f", b"user.a", b"1")
    t.setxattr("d/f", b"user.gone", b"x")
    t.removexattr("d/f", b"user.gone")
    t.chmod("d", 0o711)           # attributes of a directory with content
    t.utimes("d", 42)
    t.setxattr("d", b"user.dir", b"yes")
    t.chown("l", 7, 8)
    with pytest.raises(InvalidInput):
        t.chmod("d/f", 0o10000)
    with pytest.raises(InvalidInput):
        t.chown("d/f", -1, 0)
    with pytest.raises(NotFound):
        t.removexattr("d/f", b"user.never")
    with pytest.raises(InvalidInput):
        t.setxattr("d/f", b"", b"x")
    with pytest.raises(NotFound):
        t.chmod("missing", 0o644)
    t.commit()
    u = fresh(store)
    f = u.lookup("d/f")
    assert f is not None
    assert (f.mode, f.uid, f.gid, f.mtime_ns) == (0o4750, 1000, 2000, 123456789)
    assert f.xattrs == ((b"user.a", b"1"), (b"user.b", b"2"))
    assert u.read("d/f") == b"content"
    d = u.lookup("d")
    assert d is not None and (d.mode, d.mtime_ns) == (0o711, 42)
    assert d.xattrs == ((b"user.dir", b"yes"),)
    assert names(u, "d") == ["f"]  # attributes did not lose the content
    link = u.lookup("l")
    assert link is not None and (link.uid, link.gid) == (7, 8) and link.data == b"d/f"


def test_root_attributes(store: LocalStore) -> None:
    t = fresh(store)
    t.write("x", b"x")
    t.chmod("", 0o700)
    t.commit()
    u = fresh(store)
    assert u.lookup("").mode == 0o700  # type: ignore[union-attr]
    assert names(u) == ["x"]


def test_commit_continues_from_the_new_snapshot(store: LocalStore) -> None:
    t = fresh(store)
    t.write("a", b"1")
    s1 = t.commit("first")
    assert t.base == s1 and t.changes == {}
    t.write("b", b"2")
    s2 = t.commit("second")
    log = store.log(s2)
    assert [i.id for i in log[:2]] == [s2, s1]
    assert [i.message for i in log[:2]] == ["second", "first"]


def test_transaction_on_missing_volume_or_branch(store: LocalStore, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        Transaction(store, "nope")
    with pytest.raises(NotFound):
        Transaction(store, "v", "nobranch")
    with pytest.raises(InvalidInput):
        Transaction(store, "../v")
