"""The contract every `Store` implementation keeps, written against the interface only.

Content goes in through `Transaction` and raw `ChangeSet`s, which use nothing
but `Store` methods, so the same tests run against the in-process store and
(once listed in conftest.IMPLEMENTATIONS) the remote client.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time

import pytest

from strata.engine.errors import (
    AlreadyExists,
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    Unavailable,
)
from strata.engine.interface import ChangeSet, Store
from strata.engine.objects import (
    BLOCK,
    EMPTY_SNAPSHOT,
    EMPTY_SNAPSHOT_ID,
    FILENODE,
    K_DIR,
    K_FILE,
    SNAPSHOT,
    Entry,
    FileNode,
    Snapshot,
    object_id,
)
from strata.engine.txn import Transaction, commit_all

Files = dict[str, bytes | None]


def put(store: Store, volume: str, files: Files, *, branch: str = "live",
        base: str | None = None, message: str = "", dirs: tuple[str, ...] = (),
        identical: bool = False) -> str:
    """Publish writes (bytes) and removals (None) as one change set; return the new head."""
    t = Transaction(store, volume, branch, base=base)
    t.identical = identical
    for d in dirs:
        t.mkdir(d, parents=True, exist_ok=True)
    for path, data in files.items():
        if data is None:
            t.remove(path, recursive=True)
        else:
            t.write(path, data, mtime_ns=1)
    return t.commit(message)


def tree(store: Store, volume: str, sid: str) -> dict[str, bytes | str]:
    """Every path of a snapshot: file content, or 'dir' for directories."""
    t = Transaction(store, volume, base=sid)
    out: dict[str, bytes | str] = {}
    for path, e in t.walk():
        out[path] = "dir" if e.kind == K_DIR else t.read(path)
    return out


def ids(store: Store, sid: str) -> list[str]:
    return [i.id for i in store.log(sid)]


# -- volumes ---------------------------------------------------------------------

def test_create_list_delete_volumes(store: Store) -> None:
    assert store.list_volumes() == []
    assert store.create_volume("beta") == EMPTY_SNAPSHOT_ID
    assert store.create_volume("alpha") == EMPTY_SNAPSHOT_ID
    assert store.list_volumes() == ["alpha", "beta"]
    assert store.list_branches("alpha") == {"live": EMPTY_SNAPSHOT_ID}
    assert store.head("alpha", "live") == EMPTY_SNAPSHOT_ID
    with pytest.raises(AlreadyExists):
        store.create_volume("alpha")
    put(store, "alpha", {"f": b"x"})
    store.fork("alpha", "other", at=None)
    store.delete_volume("alpha")
    assert store.list_volumes() == ["beta"]
    with pytest.raises(NotFound):
        store.head("alpha", "live")
    with pytest.raises(NotFound):
        store.list_branches("alpha")
    with pytest.raises(NotFound):
        store.delete_volume("alpha")
    # A volume of the same name starts afresh: one empty branch.
    store.create_volume("alpha")
    assert store.list_branches("alpha") == {"live": EMPTY_SNAPSHOT_ID}
    assert store.list_branches("beta") == {"live": EMPTY_SNAPSHOT_ID}


def test_not_found_and_already_exists(store: Store) -> None:
    store.create_volume("v")
    with pytest.raises(NotFound):
        store.head("nope", "live")
    with pytest.raises(NotFound):
        store.head("v", "nope")
    with pytest.raises(NotFound):
        store.fork("nope", "b", at=None)
    with pytest.raises(NotFound):
        store.fork("v", "b", at="ab" * 32)
    with pytest.raises(AlreadyExists):
        store.fork("v", "live", at=None)
    with pytest.raises(NotFound):
        store.delete_branch("v", "nope")
    with pytest.raises(NotFound):
        store.snapshot("cd" * 32)
    with pytest.raises(NotFound):
        store.get_object(bytes(32))
    with pytest.raises(NotFound):
        store.publish([ChangeSet("v", "nope", EMPTY_SNAPSHOT_ID, {})])
    with pytest.raises(NotFound):
        store.publish([ChangeSet("nope", "live", EMPTY_SNAPSHOT_ID, {})])


# -- forks and branches --------------------------------------------------------------

def test_fork_at_a_snapshot_is_independent_of_its_source(store: Store) -> None:
    store.create_volume("v")
    s1 = put(store, "v", {"a": b"1", "d/b": b"2"}, dirs=("d",))
    assert store.fork("v", "exp", at=s1) == s1
    assert store.list_branches("v") == {"live": s1, "exp": s1}
    e1 = put(store, "v", {"a": b"exp", "new": b"n"}, branch="exp")
    l1 = put(store, "v", {"d/b": b"live", "a": None})
    assert tree(store, "v", store.head("v", "exp")) == {
        "a": b"exp", "d": "dir", "d/b": b"2", "new": b"n"}
    assert tree(store, "v", store.head("v", "live")) == {"d": "dir", "d/b": b"live"}
    assert ids(store, e1)[1:] == ids(store, s1)
    assert ids(store, l1)[1:] == ids(store, s1)
    assert store.head("v", "exp") == e1 and store.head("v", "live") == l1


def test_fork_at_an_older_snapshot(store: Store) -> None:
    store.create_volume("v")
    s1 = put(store, "v", {"a": b"1"})
    put(store, "v", {"a": b"2"})
    store.fork("v", "back/then", at=s1)
    assert tree(store, "v", store.head("v", "back/then")) == {"a": b"1"}
    assert ids(store, store.head("v", "back/then")) == [s1, EMPTY_SNAPSHOT_ID]


def test_fork_empty(store: Store) -> None:
    store.create_volume("v")
    put(store, "v", {"a": b"1"})
    assert store.fork("v", "blank", at=None) == EMPTY_SNAPSHOT_ID
    assert tree(store, "v", store.head("v", "blank")) == {}
    s = put(store, "v", {"only": b"here"}, branch="blank")
    assert tree(store, "v", s) == {"only": b"here"}
    assert tree(store, "v", store.head("v", "live")) == {"a": b"1"}


def test_fork_across_volumes(store: Store) -> None:
    store.create_volume("src")
    store.create_volume("dst")
    s = put(store, "src", {"f": b"shared"})
    store.fork("dst", "copy", at=s)
    assert tree(store, "dst", store.head("dst", "copy")) == {"f": b"shared"}


def test_delete_branch(store: Store) -> None:
    store.create_volume("v")
    s1 = put(store, "v", {"a": b"1"})
    store.fork("v", "tmp", at=s1)
    put(store, "v", {"b": b"2"}, branch="tmp")
    store.delete_branch("v", "tmp")
    assert store.list_branches("v") == {"live": s1}
    with pytest.raises(NotFound):
        store.head("v", "tmp")
    with pytest.raises(NotFound):
        store.delete_branch("v", "tmp")
    with pytest.raises(NotFound):
        put(store, "v", {"c": b"3"}, branch="tmp", base=s1)
    # The name can be used again, from anywhere.
    store.fork("v", "tmp", at=None)
    assert store.head("v", "tmp") == EMPTY_SNAPSHOT_ID


# -- head, log, snapshots -------------------------------------------------------------

def test_head_and_log_newest_first_with_parents(store: Store) -> None:
    store.create_volume("v")
    made = [put(store, "v", {f"f{i}": b"%d" % i}, message=f"step {i}") for i in range(4)]
    head = store.head("v", "live")
    assert head == made[-1]
    log = store.log(head)
    assert [i.id for i in log] == made[::-1] + [EMPTY_SNAPSHOT_ID]
    assert [i.message for i in log[:4]] == ["step 3", "step 2", "step 1", "step 0"]
    for newer, older in zip(log, log[1:], strict=False):
        assert newer.parent == older.id
        assert newer.time_ns >= older.time_ns
    assert log[-1].parent is None
    assert [i.id for i in store.log(head, limit=2)] == made[:1:-1]
    info = store.snapshot(made[1])
    assert info.id == made[1] and info.parent == made[0]
    assert info.root.kind == K_DIR
    assert info.to_json()["message"] == "step 1"


def test_publish_meta_is_kept(store: Store) -> None:
    store.create_volume("v")
    t = Transaction(store, "v")
    t.write("f", b"x")
    sid = t.commit("with meta", {"run": "r-17", "exit": 0})
    assert store.snapshot(sid).meta == {"run": "r-17", "exit": 0}


@functools.cache
def colliding_snapshots() -> tuple[bytes, bytes]:
    """Two snapshot records whose ids share their first 8 hex digits."""
    seen: dict[bytes, bytes] = {}
    i = 0
    while True:
        raw = Snapshot(root=EMPTY_SNAPSHOT.root, parent=None, time_ns=0,
                       message=f"collide {i}").encode()
        key = object_id(SNAPSHOT, raw)[:4]
        if key in seen:
            return seen[key], raw
        seen[key] = raw
        i += 1


def test_find_snapshot_by_prefix(store: Store) -> None:
    store.create_volume("v")
    sid = put(store, "v", {"a": b"1"})
    assert store.find_snapshot(sid) == sid
    assert store.find_snapshot(sid[:8]) == sid or sid[:8] == EMPTY_SNAPSHOT_ID[:8]
    assert store.find_snapshot(sid[:13]) == sid
    assert store.find_snapshot(EMPTY_SNAPSHOT_ID[:10]) == EMPTY_SNAPSHOT_ID

    # Ambiguous: two snapshots share an 8-digit prefix.
    raw_a, raw_b = colliding_snapshots()
    a, b = (object_id(SNAPSHOT, r).hex() for r in (raw_a, raw_b))
    store.put_objects([(SNAPSHOT, raw_a), (SNAPSHOT, raw_b)])
    put(store, "v", {"durable": b"now"})  # stored objects are durable after a publish
    common = os.path.commonprefix([a, b])
    assert len(common) >= 8
    with pytest.raises(InvalidInput, match="ambiguous"):
        store.find_snapshot(common)
    assert store.find_snapshot(a[:len(common) + 1]) == a
    assert store.find_snapshot(b[:len(common) + 1]) == b

    # Missing: a prefix no snapshot has (flip the first digit of a known one).
    known = [sid, a, b, EMPTY_SNAPSHOT_ID, store.head("v", "live")]
    missing = next(p for p in (f"{d}{sid[1:12]}" for d in "0123456789abcdef")
                   if not any(k.startswith(p) for k in known))
    with pytest.raises(NotFound):
        store.find_snapshot(missing)
    # A block whose id matches is not a snapshot.
    (block,) = store.put_objects([(BLOCK, b"not a snapshot")])
    put(store, "v", {"durable2": b"now"})
    with pytest.raises(NotFound):
        store.find_snapshot(block.hex()[:16])


# -- objects ---------------------------------------------------------------------------

def test_objects_round_trip_and_are_stored_once(store: Store) -> None:
    raw = os.urandom(1000)
    oid = object_id(BLOCK, raw)
    assert store.missing([oid]) == [oid]
    other = object_id(BLOCK, b"other")
    assert store.missing([other, oid]) == [other, oid]
    assert store.put_objects([(BLOCK, raw), (BLOCK, raw)]) == [oid, oid]
    assert store.put_objects([(BLOCK, raw)]) == [oid]
    assert store.missing([other, oid]) == [other]
    assert store.get_object(oid) == raw
    assert store.get_range(oid, 10, 20) == raw[10:30]
    assert store.get_range(oid, 990, 100) == raw[990:]
    node = FileNode.v1(size=1000, block_size=store.block_size, blocks=(oid,)).encode()
    (nid,) = store.put_objects([(FILENODE, node)])
    assert nid == object_id(FILENODE, node) and store.get_object(nid) == node


def test_compressible_objects_read_back_exactly(store: Store) -> None:
    raw = b"0123456789abcdef" * 5000
    (oid,) = store.put_objects([(BLOCK, raw)])
    assert store.get_object(oid) == raw


# -- publish -------------------------------------------------------------------------------

def test_publish_fast_path(store: Store) -> None:
    store.create_volume("v")
    base = store.head("v", "live")
    t = Transaction(store, "v")
    t.mkdir("src")
    t.write("src/main.py", b"print('hi')\n")
    t.write("big.bin", os.urandom(300_000))
    (sid,) = store.publish([t.changeset("first")])
    assert store.head("v", "live") == sid
    info = store.snapshot(sid)
    assert info.parent == base and info.message == "first"
    got = tree(store, "v", sid)
    assert got["src/main.py"] == b"print('hi')\n"
    assert len(got["big.bin"]) == 300_000


def test_replay_of_disjoint_changes_onto_a_moved_head(store: Store) -> None:
    store.create_volume("v")
    base = put(store, "v", {"shared/keep": b"k", "x": b"x0"}, dirs=("shared",))
    mine = Transaction(store, "v")          # pinned at base
    theirs = put(store, "v", {"x": b"x1", "shared/theirs": b"t"})
    mine.write("shared/mine", b"m")
    mine.write("y", b"y")
    mine.remove("shared/keep")
    sid = mine.commit()
    assert store.snapshot(sid).parent == theirs  # replayed onto the new head
    assert tree(store, "v", sid) == {"shared": "dir", "shared/mine": b"m",
                                     "shared/theirs": b"t", "x": b"x1", "y": b"y"}
    assert ids(store, sid)[1:3] == [theirs, base]


def test_same_change_on_both_sides_conflicts_first_committer_wins(store: Store) -> None:
    """Two read-modify-writes with equal results are two updates: the second conflicts."""
    store.create_volume("v")
    base = put(store, "v", {"a": b"0", "gone": b"g", "other": b"o"})
    head = put(store, "v", {"a": b"same", "gone": None})
    with pytest.raises(Conflict) as info:
        put(store, "v", {"a": b"same", "gone": None, "other": b"mine"}, base=base)
    assert info.value.paths == ["a", "gone"]
    assert store.head("v", "live") == head
    # Disjoint changes from the same stale base still replay.
    sid = put(store, "v", {"other": b"mine"}, base=base)
    assert tree(store, "v", sid) == {"a": b"same", "other": b"mine"}


def test_identical_results_are_accepted_only_by_opt_in(store: Store) -> None:
    store.create_volume("v")
    base = put(store, "v", {"a": b"0", "gone": b"g", "b": b"0"})
    head = put(store, "v", {"a": b"same", "gone": None, "b": b"theirs"})
    sid = put(store, "v", {"a": b"same", "gone": None, "new": b"n"}, base=base, identical=True)
    assert tree(store, "v", sid) == {"a": b"same", "b": b"theirs", "new": b"n"}
    assert store.snapshot(sid).parent == head
    # The opt-in accepts equal results only: a different value still conflicts.
    with pytest.raises(Conflict) as info:
        put(store, "v", {"a": b"same", "b": b"mine"}, base=base, identical=True)
    assert info.value.paths == ["b"]


def test_a_retried_publish_that_landed_answers_its_own_snapshots(store: Store) -> None:
    """The same publish id sent again (a lost answer) finds its work instead of conflicting."""
    store.create_volume("a")
    store.create_volume("b")
    base_a, base_b = store.head("a", "live"), store.head("b", "live")
    f = Entry(kind=K_FILE, mode=0o644, size=1, data=b"1", mtime_ns=5)
    sets = [ChangeSet("a", "live", base_a, {"n": f}), ChangeSet("b", "live", base_b, {"n": f})]
    txid = os.urandom(16)
    first = store.publish(sets, txid=txid)
    later = put(store, "a", {"other": b"x"})  # someone publishes in between
    assert store.publish(sets, txid=txid) == first
    assert store.head("a", "live") == later and store.head("b", "live") == first[1]
    assert store.snapshot(first[0]).tx == txid
    # Another publish of the same change is a second writer of `n`: a conflict.
    with pytest.raises(Conflict) as info:
        store.publish(sets, txid=os.urandom(16))
    assert info.value.paths == ["a:n", "b:n"]
    with pytest.raises(Conflict):
        store.publish(sets)
    with pytest.raises(InvalidInput):
        store.publish(sets, txid=b"short")


def test_conflict_lists_every_path_and_publishes_nothing(store: Store) -> None:
    store.create_volume("v")
    base = put(store, "v", {"a": b"0", "b": b"0", "d/c": b"0", "ok": b"0"}, dirs=("d",))
    head = put(store, "v", {"a": b"theirs", "b": None, "d/c": b"theirs", "new": b"theirs"})
    log_before = ids(store, head)
    with pytest.raises(Conflict) as info:
        put(store, "v", {"a": b"mine", "b": b"mine", "d/c": None, "new": b"mine",
                         "ok": b"fine"}, base=base)
    assert info.value.paths == ["a", "b", "d/c", "new"]
    for p in info.value.paths:
        assert p in str(info.value)
    assert store.head("v", "live") == head
    assert ids(store, store.head("v", "live")) == log_before
    assert tree(store, "v", head)["ok"] == b"0"


def test_deleting_a_directory_the_other_side_changed_conflicts(store: Store) -> None:
    store.create_volume("v")
    base = put(store, "v", {"d/x": b"0", "d/y": b"0"}, dirs=("d",))
    head = put(store, "v", {"d/x": b"theirs"})
    with pytest.raises(Conflict) as info:
        put(store, "v", {"d": None}, base=base)
    assert info.value.paths == ["d"]
    assert store.head("v", "live") == head


def test_changing_a_file_under_a_deleted_directory_conflicts(store: Store) -> None:
    store.create_volume("v")
    base = put(store, "v", {"d/x": b"0", "d/sub/y": b"0"}, dirs=("d/sub",))
    head = put(store, "v", {"d": None})
    with pytest.raises(Conflict) as info:
        put(store, "v", {"d/x": b"mine", "d/sub/z": b"new"}, base=base)
    assert "d" in info.value.paths
    assert {"d/x", "d/sub/z"} <= set(info.value.paths)
    assert store.head("v", "live") == head


def test_both_sides_creating_the_same_directory_merge(store: Store) -> None:
    store.create_volume("v")
    base = put(store, "v", {"top": b"t"})
    put(store, "v", {"new/deep/theirs": b"t"}, dirs=("new/deep",))
    sid = put(store, "v", {"new/deep/mine": b"m", "new/mine2": b"m"}, base=base,
              dirs=("new/deep",))
    assert tree(store, "v", sid) == {"new": "dir", "new/deep": "dir", "new/deep/mine": b"m",
                                     "new/deep/theirs": b"t", "new/mine2": b"m", "top": b"t"}


def test_multi_branch_publish_across_volumes_is_atomic(store: Store) -> None:
    store.create_volume("code")
    store.create_volume("data")
    t1, t2 = Transaction(store, "code"), Transaction(store, "data")
    t1.write("main.c", b"int main;")
    t2.write("db.sqlite", b"rows")
    s1, s2 = commit_all([t1, t2], "run 1")
    assert store.head("code", "live") == s1 and store.head("data", "live") == s2
    assert tree(store, "data", s2) == {"db.sqlite": b"rows"}

    # Now one side conflicts: neither branch may move.
    t1, t2 = Transaction(store, "code"), Transaction(store, "data")
    other = put(store, "data", {"db.sqlite": b"someone else"})
    t1.write("main.c", b"int main() {}")
    t2.write("db.sqlite", b"mine")
    with pytest.raises(Conflict) as info:
        commit_all([t1, t2], "run 2")
    assert info.value.paths == ["data:db.sqlite"]  # several volumes: paths name theirs
    assert store.head("code", "live") == s1
    assert store.head("data", "live") == other
    assert tree(store, "code", s1) == {"main.c": b"int main;"}


def test_multi_branch_publish_with_one_branch_unchanged(store: Store) -> None:
    store.create_volume("a")
    store.create_volume("b")
    ta, tb = Transaction(store, "a"), Transaction(store, "b")
    ta.write("f", b"1")
    sa, sb = commit_all([ta, tb])
    assert sb == EMPTY_SNAPSHOT_ID and store.head("b", "live") == EMPTY_SNAPSHOT_ID
    assert store.head("a", "live") == sa != EMPTY_SNAPSHOT_ID


def test_readers_of_an_old_snapshot_keep_reading_while_publishes_go_on(store: Store) -> None:
    store.create_volume("v")
    original = os.urandom(200_000)
    old = put(store, "v", {"data.bin": original, "small": b"v0"})
    stop = threading.Event()
    errors: list[BaseException] = []
    reads = [0, 0]  # total, while the writer was running

    def reader() -> None:
        try:
            while not stop.is_set():
                t = Transaction(store, "v", base=old)
                assert t.read("data.bin") == original
                assert t.read("small") == b"v0"
                assert t.read("data.bin", 150_000, 10) == original[150_000:150_010]
                reads[0] += 1
                if writing.is_set():
                    reads[1] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    writing = threading.Event()
    threads = [threading.Thread(target=reader) for _ in range(2)]
    for th in threads:
        th.start()
    writing.set()
    heads = []
    for i in range(40):
        heads.append(put(store, "v", {"data.bin": os.urandom(70_000), "small": b"v%d" % (i + 1)}))
    writing.clear()
    time.sleep(0.05)
    stop.set()
    for th in threads:
        th.join()
    assert not errors, errors
    assert reads[1] > 0
    assert tree(store, "v", old)["small"] == b"v0"
    assert ids(store, store.head("v", "live"))[:40] == heads[::-1]


def test_publish_referring_to_a_missing_object_is_refused(store: Store) -> None:
    store.create_volume("v")
    head = put(store, "v", {"a": b"1"})
    ghost = object_id(FILENODE, b"never stored")
    bad = Entry(kind=K_FILE, size=100_000, ref=ghost)
    with pytest.raises(InvalidInput, match=ghost.hex()):
        store.publish([ChangeSet("v", "live", head, {"b": bad, "c": Entry(
            kind=K_FILE, size=1, data=b"c")})])
    ghost_dir = Entry(kind=K_DIR, ref=object_id(3, b"no such tree"))
    with pytest.raises(InvalidInput):
        store.publish([ChangeSet("v", "live", head, {"d": ghost_dir})])
    # A reference to an object of the wrong kind is refused too.
    (blk,) = store.put_objects([(BLOCK, b"a block, not a file node")])
    with pytest.raises(InvalidInput):
        store.publish([ChangeSet("v", "live", head, {"e": Entry(kind=K_FILE, size=5,
                                                                ref=blk)})])
    assert store.head("v", "live") == head
    assert tree(store, "v", head) == {"a": b"1"}


def test_empty_change_set_publishes_nothing_new(store: Store) -> None:
    store.create_volume("v")
    head = put(store, "v", {"a": b"1"})
    assert store.publish([ChangeSet("v", "live", head, {})]) == [head]
    # A change set whose values equal the head's is empty too.
    t = Transaction(store, "v")
    entry = t.lookup("a")
    assert entry is not None
    assert store.publish([ChangeSet("v", "live", head, {"a": entry})]) == [head]
    assert ids(store, store.head("v", "live")) == ids(store, head)


def test_concurrent_publishers_on_one_branch_all_land(store: Store) -> None:
    store.create_volume("v")
    put(store, "v", {}, dirs=tuple(f"w{i}" for i in range(4)))
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for j in range(15):
                put(store, "v", {f"w{i}/f{j}": b"%d-%d" % (i, j)})
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    files = {p: c for p, c in tree(store, "v", store.head("v", "live")).items() if c != "dir"}
    assert files == {f"w{i}/f{j}": b"%d-%d" % (i, j) for i in range(4) for j in range(15)}
    assert len(store.log(store.head("v", "live"))) == 4 * 15 + 2


def test_publishes_racing_a_volume_delete_land_or_fail_with_not_found(store: Store) -> None:
    # Rounds of: a thread publishing in a loop while the volume is deleted under it.
    unexpected: list[BaseException] = []

    def publisher(base: str, started: threading.Event) -> None:
        try:
            for i in range(1000):
                store.publish([ChangeSet("x", "live", base, {
                    f"f{i}": Entry(kind=K_FILE, size=1, data=b"a")})])
                started.set()
        except NotFound:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            unexpected.append(exc)
        finally:
            started.set()

    for _ in range(60):
        store.create_volume("x")
        started = threading.Event()
        th = threading.Thread(target=publisher, args=(store.head("x", "live"), started))
        th.start()
        started.wait(10)
        store.delete_volume("x")
        th.join()
        assert "x" not in store.list_volumes()
    assert not unexpected, unexpected


# -- leases ----------------------------------------------------------------------------------

def test_leases_fence_publishers(store: Store) -> None:
    store.create_volume("v")
    lease = store.acquire_lease("v", "live", ttl=30, holder="runner-1")
    assert lease.fencing >= 1 and lease.holder == "runner-1"
    assert lease.id.startswith(f"{lease.fencing}.") and len(lease.id.split(".")[1]) == 32
    with pytest.raises(Unavailable):
        store.acquire_lease("v", "live", ttl=30)
    head = store.head("v", "live")
    with pytest.raises(Unavailable):
        put(store, "v", {"a": b"no token"})
    with pytest.raises(Forbidden):
        store.publish([ChangeSet("v", "live", head, {}, lease=f"{lease.fencing + 1}.{'0' * 32}")])
    t = Transaction(store, "v")
    t.write("a", b"with token")
    (sid,) = store.publish([ChangeSet("v", "live", head, t.changeset().changes,
                                      lease=lease.id)])
    renewed = store.renew_lease("v", "live", lease.id, ttl=30)
    assert renewed.fencing == lease.fencing and renewed.expires_ns >= lease.expires_ns
    with pytest.raises(Forbidden):
        store.renew_lease("v", "live", f"{lease.fencing + 1}.{'0' * 32}", ttl=30)
    store.release_lease("v", "live", lease.id)
    store.release_lease("v", "live", lease.id)  # releasing twice is harmless
    assert put(store, "v", {"b": b"free again"}) != sid
    again = store.acquire_lease("v", "live", ttl=30)
    assert again.fencing > lease.fencing
    store.release_lease("v", "live", again.id)


def test_a_lease_is_usable_only_with_its_secret_id(store: Store) -> None:
    """Fencing numbers are small and sequential: knowing one gives nothing."""
    store.create_volume("v")
    lease = store.acquire_lease("v", "live", ttl=30, holder="the holder")
    head = store.head("v", "live")
    secret = lease.id.split(".")[1]
    near = secret[:-1] + ("1" if secret[-1] == "0" else "0")  # one digit off
    guesses = [str(lease.fencing), f"{lease.fencing}.", f"{lease.fencing}.{'0' * 32}",
               f"{lease.fencing}.{near}",
               f"{lease.fencing + 1}{lease.id[len(str(lease.fencing)):]}", "x" * 40]
    for guess in guesses:
        with pytest.raises(Forbidden):
            store.publish([ChangeSet("v", "live", head, {}, lease=guess)])
        with pytest.raises(Forbidden):
            store.renew_lease("v", "live", guess, ttl=30)
        with contextlib.suppress(Forbidden):  # refused, or a no-op for an older number
            store.release_lease("v", "live", guess)
        with pytest.raises(Unavailable):  # still held by its holder
            store.acquire_lease("v", "live", ttl=30)
    store.release_lease("v", "live", lease.id)
    store.acquire_lease("v", "live", ttl=30)


def test_an_expired_lease_no_longer_admits_its_holder(store: Store) -> None:
    store.create_volume("v")
    lease = store.acquire_lease("v", "live", ttl=0.2)
    time.sleep(0.3)
    with pytest.raises(Forbidden):
        store.publish([ChangeSet("v", "live", store.head("v", "live"), {},
                                 lease=lease.id)])
    taken = store.acquire_lease("v", "live", ttl=30)
    assert taken.fencing > lease.fencing
    with pytest.raises(Forbidden):
        store.renew_lease("v", "live", lease.id, ttl=30)
    store.release_lease("v", "live", lease.id)  # the old holder cannot end the new lease
    with pytest.raises(Unavailable):
        store.acquire_lease("v", "live", ttl=30)
    with pytest.raises(NotFound):
        store.acquire_lease("v", "nope", ttl=30)
