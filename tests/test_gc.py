"""Garbage collection: what retention lets go is freed; what it keeps reads back whole.

Real stores on disk. The state machine at the end drives publishes, forks,
tags, policy changes, GC passes, mounts that pin and release, reopenings and
crashes (no flush, unsynced bytes lost) against a model, and after every step
reads back every snapshot that a head, a tag, a policy or a mount keeps. A
mount's pin outlives a crash of the store's owner only in the mount: the new
owner must delete nothing until the mount can pin again.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from strata.engine import gc
from strata.engine.errors import Corrupt, Expired, InvalidInput, NotFound, StrataError
from strata.engine.gc import PIN_LIFETIME
from strata.engine.index import COUNT
from strata.engine.interface import ChangeSet
from strata.engine.local import LocalStore, StoreConfig, init_store
from strata.engine.objects import BLOCK, FILENODE, K_FILE, Entry, FileNode, references
from strata.engine.pack import pack_name
from strata.engine.txn import Transaction

MiB = 1 << 20


def _packs_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "packs").glob("*.pack"))


def _write(s: LocalStore, vol: str, files: dict[str, bytes], branch: str = "live") -> str:
    t = Transaction(s, vol, branch)
    for path, data in files.items():
        if data is None:
            t.remove(path)
        else:
            t.write(path, data)
    return t.commit()


def test_a_deleted_file_gives_its_space_back_at_once(tmp_path: Path) -> None:
    """Delete a big file, let its snapshots go, `gc --min-age 0`: the space comes back.

    Even though the bytes were written seconds ago and sat in the pack being written.
    """
    init_store(str(tmp_path), pack_size_limit=4 * MiB)
    big = os.urandom(20 * MiB)
    with LocalStore(str(tmp_path)) as s:
        s.create_volume("v")
        _write(s, "v", {"small": b"stays", "big": big})
        old = s.head("v", "live")
        t = Transaction(s, "v")
        t.remove("big")
        t.commit()
        assert _packs_bytes(tmp_path) > 20 * MiB
        dry = s.gc(min_age=0, dry_run=True)
        assert dry["bytes_freed"] == 0  # the default policy keeps all history
        s.policies.set("v", None, keep_last=1)
        first = s.gc(min_age=0)
        assert first["snapshots_expired"] >= 1 and first["bytes_freed"] > 20 * MiB
        second = s.gc(min_age=0)  # packs found empty are deleted one pass later
        assert second["packs_deleted"] and second["bytes_reclaimed"] > 20 * MiB
        assert _packs_bytes(tmp_path) < 2 * MiB
        assert Transaction(s, "v").read("small") == b"stays"
        with pytest.raises(Expired):
            s.snapshot(old)
        assert s.fsck()["ok"]
        s.rebuild_index()  # the packs left still hold every ref (the state record)
        assert s.list_branches("v") == {"live": s.head("v", "live")}
        assert s.fsck()["ok"]
        with pytest.raises(Expired):
            s.snapshot(old)
    with LocalStore(str(tmp_path)) as s:
        assert Transaction(s, "v").read("small") == b"stays"
        assert s.fsck()["ok"]


def test_nothing_goes_before_the_age_cutoff(tmp_path: Path) -> None:
    init_store(str(tmp_path))
    with LocalStore(str(tmp_path)) as s:
        s.create_volume("v")
        _write(s, "v", {"a": os.urandom(200_000)})
        _write(s, "v", {"a": os.urandom(200_000)})
        s.policies.set("v", None, keep_last=1)
        r = s.gc(min_age=3600)
        assert r["objects_unreachable"] > 0 and r["objects_deleted"] == 0
        assert len(s.log(s.head("v", "live"))) == 3  # still readable (and the empty one)
        r = s.gc(min_age=0)  # unreachable since the last pass: now it goes
        assert r["objects_deleted"] > 0 and len(s.log(s.head("v", "live"))) == 1


def test_tags_forks_and_other_branches_keep_what_they_reach(tmp_path: Path) -> None:
    init_store(str(tmp_path))
    with LocalStore(str(tmp_path)) as s:
        s.create_volume("v")
        first = _write(s, "v", {"a": b"one" * 5000, "b": b"shared" * 5000})
        s.fork("v", "tags/release", at=first)
        s.fork("v", "side", at=first)
        _write(s, "v", {"a": b"two" * 5000})
        mid = s.head("v", "live")
        _write(s, "v", {"a": b"three" * 5000})
        s.policies.set("v", None, keep_last=1)
        s.gc(min_age=0)
        s.gc(min_age=0)
        assert Transaction(s, "v", "tags/release").read("a") == b"one" * 5000
        assert Transaction(s, "v", "side").read("b") == b"shared" * 5000
        assert Transaction(s, "v").read("a") == b"three" * 5000
        with pytest.raises(Expired):
            s.snapshot(mid)
        with pytest.raises(InvalidInput, match="tag"):
            _write(s, "v", {"a": b"moved"}, branch="tags/release")
        assert s.fsck()["ok"]


def test_run_and_rejected_branches_expire(tmp_path: Path) -> None:
    init_store(str(tmp_path))
    with LocalStore(str(tmp_path)) as s:
        s.create_volume("v")
        head = _write(s, "v", {"a": b"x"})
        s.fork("v", "run/abc", at=head)
        _write(s, "v", {"r": os.urandom(100_000)}, branch="run/abc")
        s.fork("v", "rejected/abc", at=head)
        assert s.gc(min_age=0)["branches_expired"] == []  # younger than a day
        s.policies.set("v", None, expire_runs=0)
        r = s.gc(min_age=0)
        assert sorted(r["branches_expired"]) == ["v@rejected/abc", "v@run/abc"]
        assert set(s.list_branches("v")) == {"live"}
        assert r["objects_deleted"] > 0


def test_objects_uploaded_ahead_of_their_publish_are_pinned(tmp_path: Path) -> None:
    init_store(str(tmp_path))
    with LocalStore(str(tmp_path)) as s:
        s.create_volume("v")
        data = os.urandom(70_000)
        block = s.put_objects([(BLOCK, data)])[0]
        node = FileNode.v1(size=len(data), block_size=1 << 20, blocks=(block,)).encode()
        ref = s.put_objects([(FILENODE, node)])[0]
        r = s.gc(min_age=0)
        assert r["objects_deleted"] == 0
        base = s.head("v", "live")
        s.publish([ChangeSet("v", "live", base,
                             {"f": Entry(kind=K_FILE, size=len(data), ref=ref)})])
        assert Transaction(s, "v").read("f") == data


def test_gc_in_a_loop_while_publishes_race_it(tmp_path: Path) -> None:
    """Publishes that rewrite and dedup against old content never fail or read wrong."""
    init_store(str(tmp_path), pack_size_limit=MiB)
    contents = [os.urandom(100_000) for _ in range(4)]
    errors: list[BaseException] = []
    stop = threading.Event()
    with LocalStore(str(tmp_path)) as s:
        for v in ("a", "b"):
            s.create_volume(v)
            s.policies.set(v, None, keep_last=1)

        def writer(vol: str, seed: int) -> None:
            i = seed
            try:
                while not stop.is_set():
                    want = {f"w{seed}-{k}": contents[(i + k) % 4] for k in range(3)}
                    _write(s, vol, want)  # old content comes back: dedup against garbage
                    t = Transaction(s, vol)  # the head: this writer's or another's
                    for path in want:
                        if t.read(path) not in contents:
                            raise AssertionError(f"{vol}/{path} read wrong bytes")
                    i += 1
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(v, k))
                   for k, v in enumerate(["a", "b", "a", "b"])]
        for th in threads:
            th.start()
        passes = 0
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and not errors:
            s.gc(min_age=0)
            passes += 1
        stop.set()
        for th in threads:
            th.join(30)
        assert not errors, errors[0]
        assert passes >= 3
        report = s.fsck()
        assert report["ok"], report


def test_a_pass_reads_only_snapshots_new_since_the_last(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept history is walked through the index's memo: a pass reads only what is new.

    With the default policy (all history kept), 40 snapshots: the first pass
    reads each; after 5 more publishes, the next reads those 5 (and the head's
    parent chain through the memo). A rebuilt index has no memo and reads all
    again. A wrong memo entry is what `gc --full` finds and clears.
    """
    init_store(str(tmp_path))
    with LocalStore(str(tmp_path)) as s:
        s.create_volume("v")
        for i in range(40):
            _write(s, "v", {"f": b"%d" % i})
        read: list[str] = []
        snapshot = s.snapshot

        def counting(sid: str) -> Any:
            read.append(sid)
            return snapshot(sid)

        monkeypatch.setattr(s, "snapshot", counting)
        assert s.gc(min_age=0)["snapshots_retained"] == 41
        assert len(read) >= 41
        for i in range(5):
            _write(s, "v", {"f": b"new %d" % i})
        read.clear()
        assert s.gc(min_age=0)["snapshots_retained"] == 46
        assert len(read) == 5, read
        # A fact the memo got wrong (a snapshot made older than it is): with keep_newer,
        # walking through the memo would end early. The full pass reads, compares, clears.
        s.policies.set("v", None, keep_newer=3600)
        head = bytes.fromhex(s.head("v", "live"))
        parent = bytes.fromhex(snapshot(s.head("v", "live")).parent or "")
        grand = snapshot(parent.hex()).parent
        s.index.note_history([(parent, bytes.fromhex(grand or ""), 0)])
        assert parent not in gc._kept(s, time.time(), set(), noted=True)
        dry = s.gc(min_age=0, full=True, dry_run=True)
        # 45: the volume's first snapshot (empty, time 0) is past keep_newer
        assert dry["checked"]["history_roots_wrong"] > 0 and dry["snapshots_retained"] == 45
        full = s.gc(min_age=0, full=True)
        assert full["checked"]["history_roots_wrong"] > 0 and full["objects_deleted"] == 0
        assert parent in gc._kept(s, time.time(), set(), noted=True)
        again = s.gc(min_age=0, full=True)
        assert again["checked"]["history_roots_wrong"] == 0, again
        assert head in gc._kept(s, time.time(), set(), noted=True)
    with LocalStore(str(tmp_path)) as s:
        s.rebuild_index()
    with LocalStore(str(tmp_path)) as s:
        read.clear()
        monkeypatch.setattr(s, "snapshot", counting)
        assert s.gc(min_age=0)["snapshots_retained"] == 45
        assert len(read) >= 45  # the memo went with the old index


# -- the state machine -------------------------------------------------------------------


class GcMachine(RuleBasedStateMachine):
    """Branches of one volume, their histories as the model keeps them, and GC."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="strata-gc-")
        init_store(self.dir, pack_size_limit=MiB)
        self.s = LocalStore(self.dir, StoreConfig(pack_size_limit=MiB))
        self.s.create_volume("v")
        # branch -> [(sid, files)] oldest first; what is still kept is checked
        self.hist: dict[str, list[tuple[str, dict[str, bytes]]]] = {
            "live": [(self.s.head("v", "live"), {})]}
        self.tags: dict[str, tuple[str, dict[str, bytes]]] = {}
        self.keep_last: int | None = None
        self.branch_keep: dict[str, int] = {}  # a branch's own keep_last (outlives the branch)
        # Mounts: pin id -> (snapshot, files). A reopen loses the store's pins, not
        # the mounts: theirs are "orphans" until they renew, find the pin gone and
        # pin again (mount/process.py), as a mount does after a server restart.
        self.pins: dict[str, tuple[str, dict[str, bytes]]] = {}
        self.orphans: list[tuple[str, dict[str, bytes]]] = []
        self.pinned_until = 0.0  # wall clock: a pin granted so far may last until then
        self.grace_until = 0.0   # after a reopen: nothing may be deleted before this

    def teardown(self) -> None:
        self.s.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @initialize()
    def start(self) -> None:
        pass

    @rule(branch=st.sampled_from(["live", "b1", "b2"]), path=st.sampled_from("abcd"),
          size=st.sampled_from([10, 5000, 70_000]), seed=st.integers(0, 5), delete=st.booleans())
    def publish(self, branch: str, path: str, size: int, seed: int, delete: bool) -> None:
        if branch not in self.hist:
            return
        files = dict(self.hist[branch][-1][1])
        t = Transaction(self.s, "v", branch)
        if delete and path in files:
            t.remove(path)
            del files[path]
        else:
            data = bytes([seed]) * size  # repeats: new publishes dedup against old bytes
            t.write(path, data)
            files[path] = data
        sid = t.commit()
        if sid != self.hist[branch][-1][0]:
            self.hist[branch].append((sid, files))

    @rule(seed=st.integers(0, 5))
    def upload_ahead(self, seed: int) -> None:
        """Objects sent ahead of a publish that never comes: not synced, garbage later."""
        self.s.put_objects([(BLOCK, bytes([seed, 1]) * 30_000)])

    @rule(src=st.sampled_from(["live", "b1", "b2"]), new=st.sampled_from(["b1", "b2"]))
    def fork(self, src: str, new: str) -> None:
        if src not in self.hist or new in self.hist:
            return
        sid, files = self.hist[src][-1]
        self.s.fork("v", new, at=sid)
        self.hist[new] = [(sid, files)]

    @rule(branch=st.sampled_from(["b1", "b2"]))
    def delete_branch(self, branch: str) -> None:
        if branch in self.hist:
            self.s.delete_branch("v", branch)
            del self.hist[branch]

    @rule(branch=st.sampled_from(["live", "b1", "b2"]), back=st.integers(0, 3),
          name=st.sampled_from(["t1", "t2"]))
    def tag(self, branch: str, back: int, name: str) -> None:
        if branch not in self.hist or name in self.tags:
            return
        kept = self._kept(branch)
        sid, files = kept[max(0, len(kept) - 1 - back)]
        self.s.fork("v", f"tags/{name}", at=sid)
        self.tags[name] = (sid, files)

    @rule(name=st.sampled_from(["t1", "t2"]))
    def untag(self, name: str) -> None:
        if name in self.tags:
            self.s.delete_branch("v", f"tags/{name}")
            del self.tags[name]

    @rule(n=st.sampled_from([None, 1, 2, 3]))
    def policy(self, n: int | None) -> None:
        self.keep_last = n
        self.s.policies.set("v", None, keep_last=n)

    @rule(branch=st.sampled_from(["live", "b1", "b2"]), n=st.sampled_from([None, 1, 2]))
    def branch_policy(self, branch: str, n: int | None) -> None:
        """A branch's own policy overrides the volume's; unset, the volume's applies."""
        if branch not in self.hist and branch != "live":
            return
        self.s.policies.set("v", branch, keep_last=n)
        if n is None:
            self.branch_keep.pop(branch, None)
        else:
            self.branch_keep[branch] = n

    @rule(dry=st.booleans(), full=st.booleans())
    def gc(self, dry: bool, full: bool) -> None:
        in_grace = time.time() < self.grace_until
        counted = self.s.index.counted()
        report = self.s.gc(min_age=0, dry_run=dry, full=full)
        # The accounting never goes wrong here: passes stay incremental, and a full
        # mark finds exactly the garbage the accounting found. Accounting lost (as a
        # restore leaves it) is recounted first by a pass that may write the index.
        if counted or dry:
            assert report["recount"] is None, report
        else:
            assert report["recount"]["exact"], report
            assert_accounting_exact(self.s)
        assert report["mode"] == ("full" if full or not (counted or not dry)
                                  else "incremental"), report
        assert report["fallback"] is None, report
        if full:
            c = report["checked"]
            if counted or not dry:
                assert c["live_in_full_mark"] == c["missed_by_accounting"] == 0, c
            assert c["history_roots_wrong"] == 0, c
        if in_grace and not dry:  # pins from before the reopen may still be held
            assert report["objects_deleted"] == 0, report
            assert report["waiting"] or not report["objects_unreachable"], report
        if not dry:  # the model forgets what the policy let go
            for br in self.hist:
                self.hist[br] = self._kept(br)

    def _readable(self) -> list[tuple[str, dict[str, bytes]]]:
        return ([x for br in sorted(self.hist) for x in self._kept(br)]
                + [self.tags[t] for t in sorted(self.tags)]
                + [self.pins[p] for p in sorted(self.pins)] + self.orphans)

    @rule(pick=st.integers(0, 1 << 16))
    def mount_pins(self, pick: int) -> None:
        """A mount starts on a snapshot that is kept and pins it through the store."""
        choices = self._readable()
        sid, files = choices[pick % len(choices)]
        ttl = PIN_LIFETIME  # what a mount may ask for at most; renewed long before it ends
        (pid,) = self.s.pin("v", [sid], ttl)
        self.pinned_until = max(self.pinned_until, time.time() + ttl)
        self.pins[pid] = (sid, files)

    @rule(pick=st.integers(0, 1 << 16))
    def mount_releases(self, pick: int) -> None:
        """A mount ends: its pin goes (an orphan's mount just exits)."""
        held = sorted(self.pins)
        if pick % 2 and self.orphans:
            self.orphans.pop(pick % len(self.orphans))
        elif held:
            pid = held[pick % len(held)]
            self.s.release_pins("v", [pid])
            del self.pins[pid]

    @rule()
    def mounts_renew(self) -> None:
        """Every mount renews; one whose pin a reopen lost pins its snapshot again."""
        for pid in sorted(self.pins):
            self.s.renew_pins("v", [pid], PIN_LIFETIME)
        for sid, files in self.orphans:
            (pid,) = self.s.pin("v", [sid], PIN_LIFETIME)  # still there: GC waited
            self.pins[pid] = (sid, files)
        self.orphans = []
        if self.pins:
            self.pinned_until = max(self.pinned_until, time.time() + PIN_LIFETIME)

    def _lose_pins(self) -> None:
        for pid in sorted(self.pins):
            with pytest.raises(NotFound):  # the new owner never granted it
                self.s.renew_pins("v", [pid], PIN_LIFETIME)
        if self.pins:  # held by mounts that live on: the new owner must wait for them
            self.grace_until = max(self.grace_until, self.pinned_until)
        self.orphans += [self.pins[p] for p in sorted(self.pins)]
        self.pins = {}

    @rule()
    def reopen(self) -> None:
        self.s.close()
        self.s = LocalStore(self.dir, StoreConfig(pack_size_limit=MiB))
        self._lose_pins()

    @rule()
    def rebuild_index(self) -> None:
        """The index from the packs GC left: refs and policies come from its state commit."""
        self.s.rebuild_index()
        self.reopen()  # what is served next comes from the rebuilt index
        for br in ("live", "b1", "b2"):
            assert self.s.policies.get("v", br).keep_last == self.branch_keep.get(
                br, self.keep_last)

    @rule(cut=st.floats(0, 1))
    def crash(self, cut: float) -> None:
        """The owner dies: nothing is flushed or closed, and what was not synced is lost."""
        _crash(self.s, cut)
        self.s = LocalStore(self.dir, StoreConfig(pack_size_limit=MiB))
        self._lose_pins()

    def _kept(self, branch: str) -> list[tuple[str, dict[str, bytes]]]:
        h = self.hist[branch]
        n = self.branch_keep.get(branch, self.keep_last)
        return h if n is None else h[-n:]

    @invariant()
    def kept_snapshots_read_back(self) -> None:
        for sid, files in self._readable():
            t = Transaction(self.s, "v", base=sid)
            got = {name: t.read(name) for name, _e in t.listdir("")}
            assert got == files, sid

    @rule()
    def history_memo_agrees(self) -> None:
        """The roots found through the history memo are those reading every snapshot finds.

        Under the model's policy, then under keep_newer policies set for the check
        and unset after it (0: heads only; 1e9 s: all history, so every memo entry's
        time is used): the memo's facts serve any policy. The first walk notes
        what the memo lacked, so the later ones read it.
        """
        self.s.sync_index()
        try:
            for age in (None, 1e9, 0.0):
                if age is not None:
                    self.s.policies.set("v", None, keep_newer=age)
                now = time.time()
                noted = gc._kept(self.s, now, set(), noted=True)
                assert noted == gc._kept(self.s, now, set(), noted=False), age
        finally:
            self.s.policies.set("v", None, keep_newer=None)

    @rule(seed=st.integers(0, 1 << 16))
    def lose_accounting(self, seed: int) -> None:
        """The accounting as a restored index has it: not trusted, counts missing or wrong.

        The next pass that may write recounts it in place (engine/recount.py).
        """
        rnd = random.Random(seed)
        ix = self.s.index
        self.s.sync_index()
        ix.uncount()
        with ix.env.begin(write=True) as txn:
            for db in (ix.counts, ix.zero, ix.packbytes):
                for k, v in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]:
                    r = rnd.random()
                    if r < 0.3:
                        txn.delete(k, db=db)
                    elif r < 0.45 and db != ix.zero:
                        txn.put(k, COUNT.pack(COUNT.unpack(v)[0] + rnd.randint(1, 3)), db=db)

    @rule()
    def accounting_is_exact(self) -> None:
        """The counts, the unnamed objects and the bytes per pack, recomputed from scratch."""
        if self.s.index.counted():
            assert_accounting_exact(self.s)

    @invariant()
    def heads_match(self) -> None:
        heads = self.s.list_branches("v")
        assert {b: h for b, h in heads.items() if not b.startswith("tags/")} == {
            b: h[-1][0] for b, h in self.hist.items()}


def assert_accounting_exact(s: LocalStore) -> None:
    s.sync_index()
    ix = s.index
    assert ix.counted()
    objects = dict(ix.iter_objects())
    want: Counter[bytes] = Counter()
    per_pack: Counter[int] = Counter()
    for oid, loc in objects.items():
        per_pack[loc.pack] += loc.length
        if loc.kind != BLOCK:
            want.update(list(dict.fromkeys(o for _k, o in references(loc.kind, s.get_object(oid)))))
    with ix.env.begin() as txn:
        counts = {bytes(k): COUNT.unpack(v)[0] for k, v in txn.cursor(db=ix.counts)}
        zero = {bytes(k) for k in txn.cursor(db=ix.zero).iternext(values=False)}
    assert counts == dict(want)
    assert zero == {o for o in objects if o not in want}
    assert ix.pack_bytes() == dict(per_pack)


def _crash(s: LocalStore, cut: float) -> None:
    """Leave `s` as SIGKILL and a lost page cache would: no flush, no seal, no close.

    The indexer stops where it is, descriptors are closed without a sync, the lock
    goes (the process holding it is dead), and the active pack loses a `cut`
    fraction of what it holds beyond its last fsync (a torn tail, cut anywhere).
    """
    s._indexer.stop()  # stops its thread; no flush
    journal = s._journal
    with journal.append_lock:
        writer, number, end, _born = journal.tail
        durable = journal.durable
        journal.closed = True
        writer.close()
    s._packs.close()
    s.index.close()
    s._lock.release()
    keep = durable[1] if durable[0] == number else 0
    path = Path(s.packs_dir) / pack_name(number)
    if path.exists() and end > keep:
        os.truncate(path, keep + int((end - keep) * (1 - cut)))


def _two_snapshots_pinning_the_old(path: Path, keep_pin: bool) -> tuple[LocalStore, str]:
    init_store(str(path))
    s = LocalStore(str(path))
    s.create_volume("v")
    _write(s, "v", {"a": os.urandom(100_000)})
    old = s.head("v", "live")
    _write(s, "v", {"a": os.urandom(100_000)})
    s.policies.set("v", None, keep_last=1)
    (pid,) = s.pin("v", [old], 30)
    if not keep_pin:
        s.release_pins("v", [pid])
    return s, old


def test_gc_waits_out_the_pins_an_earlier_owner_granted(tmp_path: Path) -> None:
    """After a crash, even `gc --min-age 0` deletes nothing while a lost pin may be held."""
    s, old = _two_snapshots_pinning_the_old(tmp_path / "crashed", keep_pin=True)
    _crash(s, 1.0)
    for _ in range(2):  # a clean close within the wait passes it on
        with LocalStore(str(tmp_path / "crashed")) as s:
            r = s.gc(min_age=0)
            assert r["objects_deleted"] == 0 and r["objects_unreachable"] > 0, r
            assert "pins granted before" in (r["waiting"] or ""), r
            assert s.snapshot(old).id == old  # the mount pins it again in time
            s.pin("v", [old], 30)
    # A clean close with no pin held leaves nothing to wait for.
    s, old = _two_snapshots_pinning_the_old(tmp_path / "closed", keep_pin=False)
    s.close()
    with LocalStore(str(tmp_path / "closed")) as s:
        r = s.gc(min_age=0)
        assert r["objects_deleted"] > 0 and not r["waiting"], r
        with pytest.raises(Expired):
            s.snapshot(old)


def test_a_recount_cut_short_or_overtaken_leaves_the_accounting_inexact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recount cut short, or overtaken by a loss of exactness, declares nothing exact.

    The next pass recounts from the start and finishes.
    """
    from strata.engine import recount as recountmod
    from strata.engine.index import Index

    init_store(str(tmp_path / "s"))
    with LocalStore(str(tmp_path / "s")) as s:
        s.create_volume("v")
        s.policies.set("v", None, keep_last=1)
        for i in range(5):
            _write(s, "v", {f"f{j}": b"%d %d" % (i, j) if j <= i else b"same" for j in range(8)})
        s.sync_index()
        s.index.uncount()
        with s.index.env.begin(write=True) as txn:
            txn.drop(s.index.counts, delete=False)  # as a restored index has them
        real = Index.adjust_counts
        calls = []

        def dies(self: Index, deltas: Any) -> None:
            calls.append(1)
            if len(calls) == 2:
                raise OSError("the process dies here")
            real(self, deltas)

        monkeypatch.setattr(recountmod, "ADJUST_BATCH", 2)
        monkeypatch.setattr(Index, "adjust_counts", dies)
        with pytest.raises(OSError):
            s.gc(min_age=0)
        assert not s.index.counted()  # half the counts set: not trusted

        monkeypatch.setattr(Index, "adjust_counts", real)
        real_zero = Index.rederive_zero

        def overtaken(self: Index, batch: int = 4096) -> None:
            self.uncount()  # as an object indexed without its frame read would
            real_zero(self, batch)

        monkeypatch.setattr(Index, "rederive_zero", overtaken)
        r = s.gc(min_age=0)
        assert r["recount"]["exact"] is False and "meanwhile" in r["recount"]["why"], r
        assert r["mode"] == "full" and not s.index.counted(), r

        monkeypatch.setattr(Index, "rederive_zero", real_zero)
        _write(s, "v", {"f0": b"last"})
        r = s.gc(min_age=0)
        assert r["recount"]["exact"] and r["mode"] == "incremental", r
        assert r["objects_deleted"] > 0, r
        assert_accounting_exact(s)

        # A node that cannot be read: noted, and later passes mark in full without
        # reading everything again for the same end (until the index is rebuilt).
        def unreadable(*_args: Any) -> list[bytes]:
            raise Corrupt("pack", 0, "a damaged frame")

        monkeypatch.setattr(recountmod, "frame_refs", lambda _packs: unreadable)
        s.index.uncount()
        r = s.gc(min_age=0)
        assert "damaged frame" in r["recount"]["why"] and r["mode"] == "full", r
        r = s.gc(min_age=0)
        assert r["recount"] is None and r["mode"] == "full", r


def test_gc_state_machine() -> None:
    n = int(os.environ.get("STRATA_STATEFUL_EXAMPLES", "60"))  # about 3 s
    machine = settings(max_examples=n, stateful_step_count=40, deadline=None,
                       suppress_health_check=list(HealthCheck))(GcMachine)
    try:
        machine.TestCase().runTest()
    except StrataError:
        raise
