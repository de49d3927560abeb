"""Crash and corruption: SIGKILLed writers, torn tails, flipped bits, lost indexes, full disks.

Also a second process waiting for (and giving up on) the store lock.
The writer is tests/crash_writer.py, run with this interpreter; it prints a
line for every publish the store acknowledged. Whatever it printed must be
in the store after the kill.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from crash_writer import content_of, path_of
from strata.engine import pack as packfmt
from strata.engine.errors import Corrupt, NotFound, StrataError, Unavailable
from strata.engine.filetree import cut
from strata.engine.local import LocalStore, StoreConfig, init_store
from strata.engine.objects import BLOCK, K_FILE, object_id
from strata.engine.txn import Transaction

HERE = Path(__file__).resolve().parent

KILLS = 32
KILL_BUDGET_S = 45.0  # stop killing early on a slow machine, but never below 30 kills


def new_store(path: Path, volumes: tuple[str, ...] = ("v",)) -> LocalStore:
    init_store(str(path))
    s = LocalStore(str(path))
    for v in volumes:
        s.create_volume(v)
    return s


def files(store: LocalStore, volume: str, sid: str | None = None) -> dict[str, bytes]:
    t = Transaction(store, volume, base=sid)
    return {p: t.read(p) for p, e in t.walk() if e.kind == K_FILE}


def packs(store_dir: Path) -> list[Path]:
    return sorted((store_dir / "packs").glob("*.pack"))


# -- SIGKILL in a publish loop -----------------------------------------------------------

def test_acknowledged_publishes_survive_sigkill(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    with new_store(store_dir) as s:
        t = Transaction(s, "v")
        t.mkdir("t0")
        t.mkdir("t1")
        t.commit()
    rng = random.Random(20260530)
    acked: dict[str, str] = {}  # path -> the snapshot that acknowledged it
    runs_with_acks = 0
    started = time.monotonic()
    kills = 0
    while kills < KILLS and (kills < 30 or time.monotonic() - started < KILL_BUDGET_S):
        out = tmp_path / f"acks-{kills}.txt"
        with open(out, "wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "crash_writer.py"), str(store_dir), str(kills), "2"],
                stdout=sink, stderr=subprocess.PIPE)
            if rng.random() < 0.3:
                # Early: in start-up, recovery, or the first publishes.
                time.sleep(rng.uniform(0.02, 0.4))
            else:
                # Mid-publish: some time after the first acknowledgement.
                deadline = time.monotonic() + 20
                while out.stat().st_size == 0 and proc.poll() is None:
                    assert time.monotonic() < deadline, "writer never acknowledged a publish"
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, 0.35))
            proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, f"writer died by itself: {err.decode()}"
        kills += 1
        # Only whole lines count: a line cut by the kill was never fully acknowledged.
        lines = out.read_bytes().split(b"\n")[:-1]
        fresh: dict[str, str] = {}
        for line in lines:
            tag, thread, run, n, sid, path = line.decode().split()
            assert tag == "ack" and int(run) == kills - 1
            assert path == path_of(int(thread), int(run), int(n))
            fresh[path] = sid
        runs_with_acks += bool(fresh)
        acked.update(fresh)

        with LocalStore(str(store_dir)) as s:
            assert s.recovery["damaged"] == [], s.recovery
            head = s.head("v", "live")
            # Every acknowledged snapshot is in the branch's history ...
            wanted = set(fresh.values())
            for info in s.log(head):
                wanted.discard(info.id)
                if not wanted:
                    break
            assert not wanted, f"acknowledged snapshots missing from the history: {wanted}"
            # ... and holds what was written, as does the head.
            now = Transaction(s, "v")
            for path, sid in fresh.items():
                assert Transaction(s, "v", base=sid).read(path) == content_of(path)
                assert now.read(path) == content_of(path)
            report = s.fsck()
            assert report["ok"], report

    assert kills >= 30
    assert runs_with_acks >= kills // 2, "too few runs got as far as publishing"
    assert len(acked) >= 100
    with LocalStore(str(store_dir)) as s:
        got = files(s, "v")
        # Every acknowledged file is there; every file there (acknowledged or not:
        # the kill may come between the publish and its line) has the right bytes.
        assert acked.keys() <= got.keys()
        for path, data in got.items():
            assert data == content_of(path), path
        # Each publish added one file, so the history has one snapshot per file.
        assert len(s.log(s.head("v", "live"))) == len(got) + 2
        assert s.fsck()["ok"]


# -- a torn tail ------------------------------------------------------------------------------

@pytest.mark.parametrize("tail", ["partial-frame", "frame-header-only", "garbage"])
def test_torn_tail_is_truncated_on_open(tmp_path: Path, tail: str) -> None:
    store_dir = tmp_path / "store"
    with new_store(store_dir) as s:
        t = Transaction(s, "v")
        t.write("a", os.urandom(100_000))
        t.write("b", b"small")
        head = t.commit()
        before = files(s, "v")
    last = packs(store_dir)[-1]
    size = last.stat().st_size
    raw = os.urandom(3000)
    frame = packfmt.encode_object(BLOCK, object_id(BLOCK, raw), raw, False)
    junk = {"partial-frame": frame[:1700], "frame-header-only": frame[:packfmt.FRAME_SIZE],
            "garbage": b"SR" + os.urandom(500)}[tail]
    with open(last, "ab") as f:
        f.write(junk)

    with LocalStore(str(store_dir)) as s:
        assert s.recovery["truncated"] == [
            {"pack": last.name, "offset": size, "bytes": len(junk)}]
        assert s.recovery["damaged"] == []
        assert last.stat().st_size == size
        assert s.head("v", "live") == head
        assert files(s, "v") == before
        assert s.fsck()["ok"]
        t = Transaction(s, "v")
        t.write("c", b"after the repair")
        t.commit()
    with LocalStore(str(store_dir)) as s:
        assert s.recovery["truncated"] == []
        assert files(s, "v") == {**before, "c": b"after the repair"}


@pytest.mark.parametrize("length", [0, 17])
def test_new_pack_without_its_header_is_dropped_on_open(tmp_path: Path, length: int) -> None:
    # A crash between creating the next pack and writing its header leaves a
    # file shorter than a header; it holds nothing and must not stop the store.
    store_dir = tmp_path / "store"
    with new_store(store_dir) as s:
        t = Transaction(s, "v")
        t.write("a", b"before")
        head = t.commit()
    last = packs(store_dir)[-1]
    stub = last.with_name(packfmt.pack_name(int(last.stem, 16) + 1))
    header = bytes(packfmt.HEADER_SIZE)
    stub.write_bytes(header[:length])
    with LocalStore(str(store_dir)) as s:
        assert {"pack": stub.name, "offset": 0, "bytes": length} in s.recovery["truncated"]
        assert s.head("v", "live") == head
        t = Transaction(s, "v")
        t.write("b", b"after")
        t.commit()
        assert s.fsck()["ok"]
    with LocalStore(str(store_dir)) as s:
        assert files(s, "v") == {"a": b"before", "b": b"after"}


# -- a flipped bit -----------------------------------------------------------------------------

def _chunks(data: bytes) -> list[bytes]:
    """The content-defined chunks a file of `data` is stored as."""
    return [data[o:o + n] for o, n in cut(data)]


def _flip_block_of(store_dir: Path, block: bytes) -> tuple[str, int]:
    """Flip one bit inside the stored record of `block`; return (pack name, offset)."""
    return flip_record_of(store_dir, object_id(BLOCK, block))


def flip_record_of(store_dir: Path, oid: bytes) -> tuple[str, int]:
    """Flip one bit inside the stored record of object `oid`; return (pack name, offset)."""
    for path in packs(store_dir):
        for rec in packfmt.scan(str(path)).records:
            if rec.rtype == packfmt.R_OBJECT and rec.payload[1:33] == oid:
                at = rec.offset + packfmt.FRAME_SIZE + packfmt.OBJ_HEAD_SIZE + 1000
                with open(path, "r+b") as f:
                    f.seek(at)
                    byte = f.read(1)[0]
                    f.seek(at)
                    f.write(bytes([byte ^ 0x10]))
                return path.name, rec.offset
    raise AssertionError("record not found")


def test_flipped_bit_is_reported_naming_pack_and_offset(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    victim = os.urandom(600_000)  # at least three chunks: the second is 16 KiB or more
    with new_store(store_dir) as s:
        t = Transaction(s, "v")
        t.write("victim", victim)
        t.commit()
        t = Transaction(s, "v")
        t.write("later", b"written after the damaged record")
        t.commit()
    second = _chunks(victim)[1]
    pack, offset = _flip_block_of(store_dir, second)
    with LocalStore(str(store_dir)) as s:
        report = s.fsck()
        assert not report["ok"]
        assert {"pack": pack, "offset": offset} in [
            {k: d.get(k) for k in ("pack", "offset")} for d in report["damaged"]]
        t = Transaction(s, "v")
        assert t.read("later") == b"written after the damaged record"
        assert t.read("victim", 0, 100) == victim[:100]  # the first block is fine
        with pytest.raises(Corrupt) as info:
            t.read("victim")
        assert (info.value.pack, info.value.offset) == (pack, offset)
        assert pack in str(info.value) and str(offset) in str(info.value)
        with pytest.raises(Corrupt):
            s.get_object(object_id(BLOCK, second))


def test_flipped_bit_found_while_rebuilding_the_index(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    victim = os.urandom(200_000)
    with new_store(store_dir) as s:
        t = Transaction(s, "v")
        t.write("victim", victim)
        t.write("other", b"fine")
        t.commit()
    pack, offset = _flip_block_of(store_dir, _chunks(victim)[0])
    shutil.rmtree(store_dir / "index")
    with LocalStore(str(store_dir)) as s:
        assert [(d["pack"], d["offset"]) for d in s.recovery["damaged"]] == [(pack, offset)]
        t = Transaction(s, "v")
        assert t.read("other") == b"fine"
        with pytest.raises((Corrupt, NotFound)):
            t.read("victim")
        report = s.fsck()
        assert not report["ok"]
        assert (pack, offset) in [(d.get("pack"), d.get("offset")) for d in report["damaged"]]
        assert report["missing"]  # the block the file needs is gone


# -- a deleted index ---------------------------------------------------------------------------

def _index_state(s: LocalStore) -> tuple[list[str], dict[str, dict[str, str]], list[object]]:
    s.sync_index()
    vols = s.list_volumes()
    return vols, {v: s.list_branches(v) for v in vols}, sorted(s.index.iter_objects())


def test_deleted_index_is_rebuilt(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    with new_store(store_dir, ("a", "b", "gone")) as s:
        for i in range(5):
            t = Transaction(s, "a")
            t.write(f"f{i}", os.urandom(20_000 * i))
            t.commit()
        s.fork("a", "exp", at=s.head("a", "live"))
        s.fork("a", "old", at=s.log(s.head("a", "live"))[3].id)
        s.fork("b", "tmp", at=None)
        s.delete_branch("b", "tmp")
        s.delete_volume("gone")
        t = Transaction(s, "b")
        t.write("x", b"x")
        t.commit()
        lease = s.acquire_lease("b", "live", ttl=600)
        before = _index_state(s)
        content = {v: files(s, v) for v in ("a", "b")}
    assert before[0] == ["a", "b"]
    shutil.rmtree(store_dir / "index")

    with LocalStore(str(store_dir)) as s:
        assert s.recovery["replayed"] > 0
        assert _index_state(s) == before
        assert {v: files(s, v) for v in ("a", "b")} == content
        assert s.fsck()["ok"]
        with pytest.raises(Unavailable):  # the lease was journaled too
            s.acquire_lease("b", "live", ttl=10)
        s.release_lease("b", "live", lease.id)
        # And a rebuild from scratch while open gives the same again.
        state = _index_state(s)
        summary = s.rebuild_index()
        assert summary["volumes"] == 2 and summary["branches"] == 4
        assert _index_state(s) == state
        assert s.fsck()["ok"]


def test_damaged_index_is_rebuilt(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    with new_store(store_dir) as s:
        t = Transaction(s, "v")
        t.write("f", b"data")
        head = t.commit()
    data = store_dir / "index" / "data.mdb"
    data.write_bytes(os.urandom(data.stat().st_size))
    with LocalStore(str(store_dir)) as s:
        assert s.recovery.get("index_rebuilt")
        assert s.head("v", "live") == head
        assert files(s, "v") == {"f": b"data"}


# -- one owner at a time ----------------------------------------------------------------------

HOLDER = """
import sys
from strata.engine.local import LocalStore
s = LocalStore(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()   # hold the store until the test closes our stdin
s.close()
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    store_dir = tmp_path / "store"
    new_store(store_dir).close()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(store_dir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"
    try:
        yield store_dir, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_second_process_gives_up_after_the_lock_timeout(
        holder: tuple[Path, subprocess.Popen[bytes]]) -> None:
    store_dir, proc = holder
    start = time.monotonic()
    with pytest.raises(Unavailable) as info:
        LocalStore(str(store_dir), StoreConfig(lock_timeout=0.5))
    waited = time.monotonic() - start
    assert 0.5 <= waited < 5
    assert f"process {proc.pid}" in str(info.value)
    assert "waited" in str(info.value)


def test_second_process_waits_for_the_lock(
        holder: tuple[Path, subprocess.Popen[bytes]]) -> None:
    store_dir, proc = holder
    assert proc.stdin is not None
    # The owner lets go 0.4 s from now, while we are already waiting for it.
    release = threading.Timer(0.4, proc.stdin.close)
    start = time.monotonic()
    release.start()
    try:
        with LocalStore(str(store_dir), StoreConfig(lock_timeout=20)) as s:
            assert time.monotonic() - start >= 0.3
            assert s.list_volumes() == ["v"]
    finally:
        release.join()
    assert proc.wait(10) == 0


def test_a_killed_owner_releases_the_lock(
        holder: tuple[Path, subprocess.Popen[bytes]]) -> None:
    store_dir, proc = holder
    proc.kill()
    proc.wait()
    with LocalStore(str(store_dir), StoreConfig(lock_timeout=2)) as s:
        assert s.list_volumes() == ["v"]


# -- a full disk ------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (needs root); unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(path: Path, leave: int = 0) -> None:
    """Write `path` until the disk is full, then give `leave` bytes back."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        if leave:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
        os.close(fd)


def test_full_disk_fails_clearly_and_keeps_the_store_consistent(small_disk: Path) -> None:
    store_dir = small_disk / "store"
    config = StoreConfig(lock_timeout=2, index_interval=0.01)
    init_store(str(store_dir))
    acked: dict[str, dict[str, bytes]] = {}
    s = LocalStore(str(store_dir), config)
    try:
        s.create_volume("v")
        s.create_volume("w")
        t = Transaction(s, "v")
        t.write("kept", os.urandom(300_000))
        t.commit()
        acked["v"] = files(s, "v")

        # Too big for the disk: a clear error, nothing published, nothing left behind.
        head = s.head("v", "live")
        t = Transaction(s, "v")
        t.write("huge", os.urandom(3_000_000))
        with pytest.raises(Unavailable, match="full"):
            t.commit()
        assert s.head("v", "live") == head

        # A disk that is full but for a page or two: small publishes come and go
        # while the pack and the index compete for the last bytes.
        failures = 0
        for round_ in range(3):
            _fill(small_disk / f"filler{round_}", leave=4096)
            for i in range(30):
                t = Transaction(s, "w")
                t.write(f"r{round_}-{i}", b"%d" % i)
                try:
                    t.commit()
                except StrataError as exc:
                    assert isinstance(exc, Unavailable) and "full" in str(exc)
                    failures += 1
                    break
            time.sleep(0.05)  # let the indexer try (and maybe fail) to catch up
        assert failures >= 1
        acked["w"] = files(s, "w")
        assert acked["w"], "nothing could be published on a nearly full disk"
        assert files(s, "v") == acked["v"]
        for filler in small_disk.glob("filler*"):
            filler.unlink()
        # With space again the store carries on.
        t = Transaction(s, "w")
        t.write("after", b"space again")
        t.commit()
        acked["w"]["after"] = b"space again"
    finally:
        s.close()
    with LocalStore(str(store_dir), config) as s:
        assert {v: files(s, v) for v in ("v", "w")} == acked
        report = s.fsck()
        assert report["ok"], report


def test_close_on_a_full_disk_releases_the_store(small_disk: Path) -> None:
    store_dir = small_disk / "store"
    init_store(str(store_dir))
    config = StoreConfig(lock_timeout=1, index_interval=3600)  # the index waits for close
    s = LocalStore(str(store_dir), config)
    s.create_volume("v")
    written: dict[str, bytes] = {}
    _fill(small_disk / "filler", leave=8192)
    try:
        for i in range(40):
            t = Transaction(s, "v")
            t.write(f"f{i}", b"x" * i)
            try:
                t.commit()
            except Unavailable:
                break
            written[f"f{i}"] = b"x" * i
    finally:
        s.close()  # its index flush may hit ENOSPC; the lock must be released anyway
    (small_disk / "filler").unlink()
    with LocalStore(str(store_dir), config) as s:
        assert files(s, "v") == written
        assert s.fsck()["ok"]
