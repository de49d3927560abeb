"""The bucket tier end to end: a server on a store kept in a bucket, the disk lost, a restore.

Real parts: `strata serve` processes publishing over their socket, moto on
loopback (and file:// for the same contract), SIGKILL, and the store
directory deleted as a lost disk is. Nothing is downloaded at restore: the
old files are read back through ranged reads of the bucket's packs.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from bucketutil import Publisher, content, key_of, survivors
from serverutil import Server, cli
from strata.engine.checkpoint import Checkpoint
from strata.engine.errors import StoreFailed, StrataError, Unavailable
from strata.engine.local import LocalStore, init_store
from strata.engine.tier import restore
from strata.engine.txn import Transaction


def _lose_the_host(server: Server, store: Path) -> float:
    """SIGKILL the server and delete its disk; returns when."""
    assert server.proc is not None
    server.proc.kill()
    at = time.monotonic()
    server.proc.wait()
    shutil.rmtree(store)
    return at


def _start(tmp: Path, url: str, sync: str) -> tuple[Server, Path]:
    store = tmp / "host-a"
    init_store(str(store), bucket=url, sync=sync, pack_size_limit=1 << 20)
    server = Server(store).start()
    with server.remote(retry_for=5.0) as owner:
        owner.create_volume("v")
    return server, store


@pytest.mark.parametrize("sync", ["local", "bucket"])
def test_a_lost_disk_loses_at_most_the_loss_window(bucket_url: str, tmp_path: Path,
                                                   sync: str) -> None:
    server, store = _start(tmp_path, bucket_url, sync)
    key = key_of(store)
    pubs = [Publisher(server, f"c{k}-") for k in range(3)]  # three clients at once
    try:
        for pub in pubs:
            pub.thread.start()
        time.sleep(3.0)  # small packs: several are sealed and uploaded meanwhile
        killed = _lose_the_host(server, store)
    finally:
        for pub in pubs:
            pub.stop()
        server.kill()
    per_client = [[(p, t) for p, t in pub.acked if t <= killed] for pub in pubs]
    acked = sorted((a for c in per_client for a in c), key=lambda a: a[1])
    assert all(len(c) > 5 for c in per_client), [pub.error for pub in pubs]
    report = restore(bucket_url, str(tmp_path / "host-b"), key=key)
    assert report["packs_in_bucket"] >= 1, report  # read back lazily, not downloaded
    survived = set(survivors(tmp_path / "host-b", acked))
    lost = [p for p, t in acked if (p, t) not in survived]
    newest = max((t for _p, t in survived), default=0.0)
    window = killed - min((t for p, t in acked if p in lost), default=killed)
    print(f"sync={sync}: {len(acked)} acknowledged by 3 clients, {len(lost)} lost; loss "
          f"window {window * 1000:.0f} ms; restore {report['seconds'] * 1000:.0f} ms")
    if sync == "bucket":
        assert lost == [], lost[:5]
    else:
        # Each client's publishes land in order, so what it lost is a suffix, and short.
        for c in per_client:
            mine = [p for p, t in c if (p, t) not in survived]
            assert [p for p, _t in c[len(c) - len(mine):]] == mine
        assert window <= 5.0, window
        assert newest >= killed - 5.0


def test_a_takeover_fences_the_old_owner(bucket_url: str, tmp_path: Path) -> None:
    """In strict mode the old owner's next publish is refused, and nothing is lost."""
    server, store = _start(tmp_path, bucket_url, "bucket")
    try:
        with server.remote(retry_for=5.0) as owner:
            for i in range(5):
                t = Transaction(owner, "v")
                t.write(f"a{i}", content(f"a{i}"))
                t.commit()
            restore(bucket_url, str(tmp_path / "host-b"), key=key_of(store), sync="bucket")
            # Refused at the commit, or sooner: the old owner's fence watcher may have
            # seen the takeover and stopped its server before the transaction begins.
            with pytest.raises(StrataError):
                t = Transaction(owner, "v")
                t.write("after-takeover", b"must not land")
                t.commit()
        survived = survivors(tmp_path / "host-b", [(f"a{i}", 0.0) for i in range(5)])
        assert len(survived) == 5
        with LocalStore(str(tmp_path / "host-b")) as s:
            assert Transaction(s, "v").lookup("after-takeover") is None
        # The old store cannot be opened again as an owner: it was taken over.
        server.kill()
        with pytest.raises(StrataError, match="taken over"):
            LocalStore(str(store))
    finally:
        server.kill()


def test_an_idle_old_owner_notices_the_takeover_and_stops(bucket_url: str,
                                                           tmp_path: Path) -> None:
    """No write of its own is needed: an idle owner looks for a successor's claim."""
    server, store = _start(tmp_path, bucket_url, "local")
    try:
        with server.remote(retry_for=5.0) as owner:
            t = Transaction(owner, "v")
            t.write("a", b"before")
            t.commit()
        time.sleep(3.0)  # shipped and checkpointed: the old owner goes idle
        restore(bucket_url, str(tmp_path / "host-b"), key=key_of(store))
        assert server.proc is not None
        assert server.proc.wait(15) == 1  # Fenced: the Unavailable family's code
        assert "taken over" in server.log.read_text(errors="replace")
        with LocalStore(str(tmp_path / "host-b")) as s:
            assert Transaction(s, "v").read("a") == b"before"
    finally:
        server.kill()


def test_a_restored_store_restored_again_keeps_everything(bucket_url: str,
                                                          tmp_path: Path) -> None:
    """Host A, then B restored from it, then C from B.

    B's checkpoints must carry the object index B inherited (it reads that index
    lazily), not only the blocks it touched.
    """
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    init_store(str(a), bucket=bucket_url, pack_size_limit=1 << 20)
    with LocalStore(str(a)) as s:
        s.create_volume("v")
        t = Transaction(s, "v")
        for i in range(3000):  # objects enough for several blocks of the index run
            t.write(f"a{i}", content(f"a{i}", 5000))
        t.commit()
        s.sync_index()
        a_objects = s.index.count_objects()
        assert a_objects > 3000
    key = key_of(a)
    shutil.rmtree(a)
    restore(bucket_url, str(b), key=key)
    with LocalStore(str(b)) as s:
        assert Transaction(s, "v").read("a0") == content("a0", 5000)  # one index block
        s.create_volume("w")  # a publish beside v's tree, not through it
        t = Transaction(s, "w")
        t.write("b0", content("b0", 5000))
        t.commit()
        deadline = time.monotonic() + 20
        # A checkpoint may come before the copy-in ends (it names A's runs as they are).
        assert s._tier is not None
        while time.monotonic() < deadline and not (
                (s.tier_report() or {}).get("checkpoints") and s._tier.index_complete()):
            time.sleep(0.1)
        report = s.tier_report()
        assert report and report["checkpoints"], report
        assert s._tier.index_complete(), report
        s.sync_index()
        assert s.index.count_objects() >= a_objects  # the runs, and the log past them
    # B's last checkpoint indexes every object, not only those B happened to look up.
    cp = Checkpoint.decode("tier-checkpoint", (b / "tier-checkpoint").read_bytes())
    indexed = sum(p.entries for p in cp.parts)  # its runs: A's, and B's own changes
    assert indexed > a_objects, (indexed, a_objects)
    shutil.rmtree(b)
    restore(bucket_url, str(c), key=key)
    got = survivors(c, [(f"a{i}", 0.0) for i in range(3000)], 5000)
    assert len(got) == 3000
    with LocalStore(str(c)) as s:
        assert Transaction(s, "w").read("b0") == content("b0", 5000)


def test_a_damaged_pack_in_the_bucket_is_an_error_naming_it(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    store = tmp_path / "a"
    init_store(str(store), bucket=url, pack_size_limit=1 << 20)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        for i in range(40):
            t = Transaction(s, "v")
            t.write(f"f{i}", os.urandom(60_000))
            t.commit()
    key = key_of(store)
    shutil.rmtree(store)
    restore(url, str(tmp_path / "b"), key=key)
    packs = sorted((tmp_path / "bucket" / "packs").iterdir())
    assert packs
    victim = packs[0]
    data = bytearray(victim.read_bytes())
    for i in range(100, len(data), 997):
        data[i] ^= 0x55
    victim.write_bytes(bytes(data))
    with LocalStore(str(tmp_path / "b")) as s:
        report = s.fsck()
    assert not report["ok"]
    assert any("00000001" in str(d) for d in report["damaged"]), report["damaged"][:3]


def test_the_cli_inits_restores_and_reports(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli("init", "--bucket", url, store=a).returncode == 0
    assert cli("volume", "create", "v", store=a).returncode == 0
    assert cli("put", "v", "hello", input=b"hi there", store=a).returncode == 0
    p = cli("stats", "--json", store=a)
    assert p.returncode == 0 and b'"bucket": "file://' in p.stdout, p.stderr
    assert cli("serve", "--stop", store=a).returncode == 0
    (tmp_path / "bucket.key").write_bytes((a / "bucket.key").read_bytes())
    shutil.rmtree(a)
    p = cli("restore", "--bucket", url, store=b)
    assert p.returncode != 0 and b"--key-file" in p.stderr, p.stderr
    p = cli("restore", "--bucket", url, "--key-file", str(tmp_path / "bucket.key"), store=b)
    assert p.returncode == 0 and b"restored" in p.stdout, p.stderr
    p = cli("cat", "v", "hello", store=b)
    assert (p.returncode, p.stdout) == (0, b"hi there"), p.stderr


def test_publishes_waiting_on_a_failed_sync_fail_too_and_the_store_closes(
        tmp_path: Path) -> None:
    """A sync that fails with the store's failure wakes the publishes waiting on it.

    A fenced tier makes the sync leader's datasync raise `StoreFailed` (its
    `_check`, or here the acknowledgement gate, which the tier asks in the
    same place). The publishes waiting for that sync were never woken: a
    server's drain then waited for them forever, and a fleet member kept
    the given-up store's threads (its indexer retrying every 50 ms) for the
    rest of its life, which is what stalled the 100-round fault run.
    """
    store = tmp_path / "host-a"
    init_store(str(store), bucket=f"file://{tmp_path}/bucket", sync="local")
    s = LocalStore(str(store))
    s.create_volume("v")
    first = threading.Event()

    def gate() -> None:
        # The first sync takes a moment (the others queue behind it), then meets the
        # failure, as a datasync does once a successor's claim fenced the tier.
        if not first.is_set():
            first.set()
            time.sleep(0.5)
        raise StoreFailed("the bucket tier stopped: taken over (test)")

    s.set_ack_gate(gate)
    failed: list[StrataError] = []

    def publish(i: int) -> None:
        try:
            t = Transaction(s, "v")
            t.write(f"f{i}", b"x" * 1000)
            t.commit()
        except StrataError as exc:
            failed.append(exc)

    threads = [threading.Thread(target=publish, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    assert [t for t in threads if t.is_alive()] == [], "publishes still wait on a failed sync"
    assert len(failed) == 8
    s.close()


@pytest.mark.parametrize("sync", ["local", "bucket"])
def test_a_refused_acknowledgement_never_tears_a_seal(tmp_path: Path, sync: str) -> None:
    """The acknowledgement gate (the fleet's lease and ship lag) refuses while packs seal.

    A seal's sync used to ask the gate too: refused, it left the journal's tail
    before the seal it had written, the next record landed past the seal, and
    the index pointed at the wrong bytes ("bad frame marker"), which a 100-round
    fault run found shipped to the bucket. Every publish here is refused,
    several packs fill and seal meanwhile, and then the gate lets go.
    """
    store = tmp_path / "host-a"
    init_store(str(store), bucket=f"file://{tmp_path}/bucket", sync=sync,
               pack_size_limit=1 << 20)
    s = LocalStore(str(store))
    s.create_volume("v")
    refusing = threading.Event()
    refusing.set()

    def gate() -> None:
        if refusing.is_set():
            raise Unavailable("not now (test)")

    s.set_ack_gate(gate)
    for i in range(12):  # 12 x 256 KiB of random bytes: packs of 1 MiB seal while refused
        t = Transaction(s, "v")
        t.write(f"f{i}", os.urandom(256 << 10))
        with pytest.raises(Unavailable):
            t.commit()
    refusing.clear()
    t = Transaction(s, "v")
    t.write("after", b"after")
    t.commit()
    report = s.fsck()
    assert report["ok"], report
    assert Transaction(s, "v").read("after") == b"after"
    s.close()
    key = key_of(store)
    shutil.rmtree(store)
    restore(f"file://{tmp_path}/bucket", str(tmp_path / "again"), key=key)
    with LocalStore(str(tmp_path / "again")) as r:
        assert r.fsck()["ok"]
        assert Transaction(r, "v").read("after") == b"after"


def test_a_clean_close_leaves_the_next_restore_no_log_to_replay(tmp_path: Path) -> None:
    """A planned move: the closing owner seals and uploads its last pack.

    Its last checkpoint then starts the log past every segment, so whoever
    restores next rebuilds no pack from the log (a move's claim replayed a
    second of publishes before). The store reopened appends to a new pack.
    """
    url = f"file://{tmp_path}/bucket"
    a = tmp_path / "a"
    init_store(str(a), bucket=url)  # 4 MiB packs: the publishes stay in pack 1 unsealed
    with LocalStore(str(a)) as s:
        s.create_volume("v")
        for i in range(20):
            t = Transaction(s, "v")
            t.write(f"f{i}", content(f"f{i}", 3000))
            t.commit()
        assert s._tier is not None and not s._tier.remote  # nothing uploaded yet
    report = restore(url, str(tmp_path / "b"), key=key_of(a))
    assert (report["segments"], report["packs"], report["packs_in_bucket"]) == (0, 0, 1), report
    with LocalStore(str(tmp_path / "b")) as s:
        for i in range(20):
            assert Transaction(s, "v").read(f"f{i}") == content(f"f{i}", 3000)
        t = Transaction(s, "v")
        t.write("later", b"after the move")
        t.commit()
        assert s._journal.end()[0] == 2  # pack 1 stays sealed
        assert s.fsck()["ok"]
