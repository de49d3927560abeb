"""What someone who can write to the bucket, but does not hold the store's key, can do.

Each attack is built here with hostile bytes and strata's own framing code
(everything but the key), written straight into the bucket (moto, or a
directory), and then met by the code that reads the bucket back: restore,
a cold read, reopening the owner. Forgeries, rewrites and objects moved to
another name are refused, naming the object; the key never reaches the
bucket; an encrypted store's bucket does not hold what was written in the
clear. A bucket made before keys (tests/fixtures/bucket-v1.tar.gz, written
by strata before bucket format 2) is still restored, but only when asked to
read it unauthenticated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tarfile
import time
import urllib.parse
from pathlib import Path

import pytest

from bucketutil import BUCKET, key_of
from serverutil import cli
from strata.engine import pack as packfmt
from strata.engine.bucket import Bucket, OwnerLog, decode_record, encode_record, log_name
from strata.engine.checkpoint import Checkpoint
from strata.engine.errors import Corrupt, InvalidInput, Unauthentic
from strata.engine.journal import Journal
from strata.engine.kinds import K_FILE
from strata.engine.local import LocalStore, init_store, read_store_meta
from strata.engine.objects import (
    SNAPSHOT,
    TREE,
    Entry,
    FileNode,
    Snapshot,
    TreeNode,
    dir_entry,
    object_id,
    packb,
)
from strata.engine.seal import CHUNK, HEADER, KEY_FILE, TAG, BucketKey, Header
from strata.engine.tier import restore
from strata.engine.tierdrop import Dropping
from strata.engine.txn import Transaction

MiB = 1 << 20
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bucket-v1.tar.gz"


def _owner_store(tmp: Path, url: str, **kw: object) -> tuple[Path, str]:
    """A store kept in `url` with one genuine publish; returns it and the head."""
    store = tmp / "a"
    init_store(str(store), bucket=url, pack_size_limit=MiB, **kw)  # type: ignore[arg-type]
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        t = Transaction(s, "v")
        t.write("genuine.txt", b"written by the owner\n")
        sid = t.commit("genuine")
    return store, sid


def _newest_pack(store: Path) -> int:
    return max(int(p.name[:8], 16) for p in (store / "packs").glob("*.pack"))


def _forged_pack(number: int, store_id: bytes, parent: str, text: bytes) -> bytes:
    """A pack as strata writes one: a tree, a snapshot, and a commit moving v@live to it."""
    sync = packfmt.new_sync()
    planted = Entry(kind=K_FILE, mode=0o644, size=len(text), data=text)
    tree = TreeNode(0, entries=((b"planted.txt", planted),)).encode()
    tree_id = object_id(TREE, tree)
    snap = Snapshot(root=dir_entry(0o755, ref=tree_id), parent=parent, time_ns=time.time_ns(),
                    message="not the owner's").encode()
    sid = object_id(SNAPSHOT, snap).hex()
    out = packfmt.encode_header(number, store_id, sync)
    for kind, oid, raw in ((TREE, tree_id, tree), (SNAPSHOT, bytes.fromhex(sid), snap)):
        out += sync + packfmt.encode_object(kind, oid, raw, compress=False)
    commit = packb({"t": time.time_ns(), "ops": [["ref", "v", "live", parent, sid]]})
    return out + sync + packfmt.encode_frame(packfmt.R_COMMIT, commit)


def _bucket_objects(url: str, request: pytest.FixtureRequest) -> dict[str, bytes]:
    """Every object in the bucket prefix, as stored."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        root = Path(parsed.path)
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    s3 = request.getfixturevalue("moto").s3()
    prefix = parsed.path.lstrip("/") + "/"
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix):]] = s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
    return out


# -- the attacks of the finding -----------------------------------------------------------


def test_a_forged_log_record_is_refused_by_restore(bucket_url: str, tmp_path: Path) -> None:
    """A new pack, tree, snapshot and commit appended to the log: restore refuses it."""
    store, head = _owner_store(tmp_path, bucket_url)
    key = key_of(store)
    meta_id = bytes.fromhex(read_store_meta(str(store))["id"])
    number = _newest_pack(store) + 1
    pack = _forged_pack(number, meta_id, head, b"planted by the attacker\n")
    shutil.rmtree(store)
    raw = Bucket(bucket_url)  # the attacker's: no key
    end = OwnerLog(raw).find_end()
    forged = encode_record({"kind": "segment", "epoch": end - 1, "v": 1,
                            "nonce": os.urandom(16), "chunks": [[number, 0, pack]]})
    assert decode_record(log_name(end), forged)["chunks"]  # well-formed, as strata frames it
    raw.put_new(log_name(end), forged)
    with pytest.raises(Unauthentic, match=log_name(end)):
        restore(bucket_url, str(tmp_path / "b"), key=key)


def test_a_valid_record_moved_to_the_next_name_is_refused(bucket_url: str,
                                                          tmp_path: Path) -> None:
    """Replay under another name: the seal covers the name."""
    store, _head = _owner_store(tmp_path, bucket_url)
    key = key_of(store)
    raw = Bucket(bucket_url)
    end = OwnerLog(raw).find_end()
    raw.put_new(log_name(end), raw.get_stored(log_name(end - 1)))
    with pytest.raises(Unauthentic, match=log_name(end)):
        restore(bucket_url, str(tmp_path / "b"), key=key)


def test_a_rewritten_checkpoint_is_refused(bucket_url: str, tmp_path: Path) -> None:
    """The newest checkpoint rewritten to name an older head: restore refuses it."""
    store = tmp_path / "a"
    init_store(str(store), bucket=bucket_url, pack_size_limit=MiB)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        t = Transaction(s, "v")
        t.write("state", b"before")
        before = t.commit("before")
        assert s._tier is not None
        s._tier.flush()
        t = Transaction(s, "v")
        t.write("state", b"after: the change a rollback would undo")
        t.commit("after")
    key = key_of(store)
    owner = Bucket(bucket_url, BucketKey(key))
    names = [str(b["name"]) for _s, b in OwnerLog(owner).records(0) if b["kind"] == "checkpoint"]
    assert len(names) >= 2
    newest, older = names[-1], names[-2]
    cp = Checkpoint.decode("tier-checkpoint", (store / "tier-checkpoint").read_bytes())
    rolled = dataclasses.replace(cp, refs={**cp.refs, ("v", "live"): before})
    shutil.rmtree(store)
    raw = Bucket(bucket_url)
    raw.delete(newest)
    raw.put_new(newest, rolled.encode())  # framed as strata frames one, without the key
    with pytest.raises(Unauthentic, match=newest):
        restore(bucket_url, str(tmp_path / "b"), key=key)
    # Nor does the owner's own older checkpoint pass under the newest one's name.
    raw.delete(newest)
    raw.put_new(newest, raw.get_stored(older))
    with pytest.raises(Unauthentic, match=newest):
        restore(bucket_url, str(tmp_path / "c"), key=key)


def test_an_altered_pack_is_refused_on_a_cold_read(bucket_url: str, tmp_path: Path) -> None:
    store = tmp_path / "a"
    init_store(str(store), bucket=bucket_url, pack_size_limit=MiB)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        want = {}
        for i in range(6):
            t = Transaction(s, "v")
            want[f"f{i}"] = os.urandom(300_000)
            t.write(f"f{i}", want[f"f{i}"])
            t.commit()
    key = key_of(store)
    shutil.rmtree(store)
    restore(bucket_url, str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as s:
        assert s._tier is not None
        e = Transaction(s, "v").lookup("f0")
        assert e is not None and e.ref is not None
        block = FileNode.decode(s.get_object(e.ref)).all_block_ids(s.get_object)[0]
        loc = s._indexer.locate(block)
        assert loc is not None and loc.pack in s._tier.remote and loc.pack not in s._tier._local
        name = s._tier.remote[loc.pack][0]
    raw = Bucket(bucket_url)
    data = bytearray(raw.get_stored(name))
    at = loc.offset + loc.length // 2
    data[HEADER.size + at // CHUNK * (CHUNK + TAG) + at % CHUNK] ^= 0x01
    raw.delete(name)
    raw.put_new(name, bytes(data))
    with LocalStore(str(tmp_path / "b")) as s:
        with pytest.raises(Unauthentic, match=name):
            Transaction(s, "v").read("f0")
        report = s.fsck()
    assert not report["ok"]
    assert any(d.get("pack") == name for d in report["damaged"]), report["damaged"]


def test_objects_of_packs_rebuilt_from_the_log_are_checked_against_their_ids(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore rebuilds the unsealed pack from the log: its reads are hashed too."""
    url = f"file://{tmp_path}/bucket"
    store = tmp_path / "a"
    init_store(str(store), bucket=url)  # 4 MiB packs: everything stays in pack 1
    want = os.urandom(100_000)
    # As after a crash: the close leaves the active pack unsealed, in the log only.
    monkeypatch.setattr(Journal, "seal_for_close", lambda self: False)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        t = Transaction(s, "v")
        t.write("f", want)
        t.commit()
    key = key_of(store)
    shutil.rmtree(store)
    restore(url, str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as s:
        assert s._tier is not None
        e = Transaction(s, "v").lookup("f")
        assert e is not None and e.ref is not None
        block = FileNode.decode(s.get_object(e.ref)).all_block_ids(s.get_object)[0]
        number, offset, length, _kind = s._indexer.locate(block)  # type: ignore[misc]
        assert number not in s._tier.remote and s._tier.verify_reads(number)
    path = tmp_path / "b" / "packs" / packfmt.pack_name(number)
    data = bytearray(path.read_bytes())
    frame = bytes(data[offset:offset + length])
    sync = frame[:packfmt.SYNC_SIZE]
    kind, oid, raw = packfmt.decode_object(frame, sync, "test", offset)
    forged = bytes(b ^ 0xFF for b in raw)  # a valid frame of the wrong bytes
    data[offset:offset + length] = sync + packfmt.encode_frame(
        packfmt.R_OBJECT, packfmt.OBJ_HEAD.pack(kind, oid, len(forged)) + forged)
    path.chmod(0o600)
    path.write_bytes(bytes(data))
    with LocalStore(str(tmp_path / "b")) as s, \
            pytest.raises(Corrupt, match="does not hash to its id"):
        Transaction(s, "v").read("f")


def test_a_rolled_back_log_is_refused_by_its_owner(tmp_path: Path) -> None:
    """Deleting the newest records: the owner's tier.json knows how far it wrote."""
    url = f"file://{tmp_path}/bucket"
    store, _head = _owner_store(tmp_path, url)
    raw = Bucket(url)
    end = OwnerLog(raw).find_end()
    raw.delete(log_name(end - 1))
    with pytest.raises(Corrupt, match="rolled back"):
        LocalStore(str(store))


# -- the key and encryption ---------------------------------------------------------------


def test_the_key_is_private_and_never_uploaded(bucket_url: str, tmp_path: Path,
                                                request: pytest.FixtureRequest) -> None:
    a = tmp_path / "a"
    p = cli("init", "--bucket", bucket_url, store=a)
    assert p.returncode == 0 and b"bucket.key" in p.stdout, p.stderr
    assert (a / KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert cli("volume", "create", "v", store=a).returncode == 0
    assert cli("put", "v", "x", input=b"some content", store=a).returncode == 0
    assert cli("serve", "--stop", store=a).returncode == 0
    secret = key_of(a)
    objects = _bucket_objects(bucket_url, request)
    assert any(n.startswith("log/") for n in objects) and any(
        n.startswith("checkpoints/") for n in objects), sorted(objects)
    for name, data in objects.items():
        for needle in (secret, secret.hex().encode(), (a / KEY_FILE).read_bytes()):
            assert needle not in data, name
        assert not name.endswith(KEY_FILE)


@pytest.mark.parametrize("encrypt", [True, False])
def test_an_encrypted_bucket_holds_no_plaintext(bucket_url: str, tmp_path: Path,
                                                request: pytest.FixtureRequest,
                                                monkeypatch: pytest.MonkeyPatch,
                                                encrypt: bool) -> None:
    marker = b"PLAINTEXT-MARKER-" + os.urandom(8).hex().encode()
    # Segments stay whole here, so that the scan below reads every byte they carried
    # (a checkpoint's segments are otherwise overwritten by `dropped` records).
    monkeypatch.setattr(Dropping, "_drop_some", lambda self: None)
    store = tmp_path / "a"
    init_store(str(store), bucket=bucket_url, pack_size_limit=MiB, encrypt=encrypt)
    with LocalStore(str(store)) as s:
        s.create_volume("v")
        t = Transaction(s, "v")  # in a block, a name and a message; random: no compression
        t.write(marker.decode(), os.urandom(40_000) + marker + os.urandom(40_000))
        t.write("inline", marker)
        t.commit(marker.decode())
        for i in range(20):  # and in sealed, uploaded packs
            t = Transaction(s, "v")
            t.write(f"f{i}", os.urandom(60_000) + marker + os.urandom(60_000))
            t.commit()
        tier = s.tier_report()
        assert tier is not None and tier["encrypted"] is encrypt
    objects = _bucket_objects(bucket_url, request)
    assert any(n.startswith("packs/") for n in objects), sorted(objects)
    holding = sorted(n for n, data in objects.items() if marker in data)
    if encrypt:
        assert holding == []
    else:  # the control: the marker is there to be found when nothing is encrypted
        assert any(n.startswith("packs/") for n in holding) and any(
            n.startswith("log/") for n in holding), holding
    key = key_of(store)
    shutil.rmtree(store)
    restore(bucket_url, str(tmp_path / "b"), key=key)
    with LocalStore(str(tmp_path / "b")) as s:
        assert Transaction(s, "v").read("inline") == marker
        assert marker in Transaction(s, "v").read("f3")


def test_a_sealed_bucket_needs_its_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"file://{tmp_path}/bucket"
    store, _head = _owner_store(tmp_path, url)
    p = cli("restore", "--bucket", url, store=tmp_path / "b")
    assert p.returncode != 0 and b"--key-file" in p.stderr, p.stderr
    other = tmp_path / "other.key"
    other.write_bytes(b"strata-bucket-key 1\n" + os.urandom(32).hex().encode() + b"\n")
    p = cli("restore", "--bucket", url, "--key-file", str(other), store=tmp_path / "c")
    assert p.returncode != 0 and b"fails authentication" in p.stderr, p.stderr
    monkeypatch.setenv("STRATA_BUCKET_KEY_FILE", str(store / KEY_FILE))
    p = cli("restore", "--bucket", url, store=tmp_path / "d")
    assert p.returncode == 0, p.stderr
    p = cli("cat", "v", "genuine.txt", store=tmp_path / "d")
    assert (p.returncode, p.stdout) == (0, b"written by the owner\n"), p.stderr


# -- formats: sealed objects, versions, and buckets made before keys ---------------------


def test_sealing_round_trips_ranges_and_refuses_every_change() -> None:
    for encrypt in (True, False):
        key = BucketKey(os.urandom(32), encrypt=encrypt)
        for size in (0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17):
            data = os.urandom(size)
            sealed = key.seal("packs/x", data)
            assert key.open("packs/x", sealed) == data
            if size >= 16:
                assert (data[:CHUNK] in sealed) is not encrypt
            header = Header.parse("packs/x", sealed)
            for start, end in ((0, size), (size // 3, size // 2 + 1), (max(size - 5, 0), size)):
                first, at, upto = header.span(start, end)
                got = key.open_chunks("packs/x", header, first, sealed[at:upto])
                skip = start - first * CHUNK
                assert got[skip:skip + end - start] == data[start:end]
            with pytest.raises(Unauthentic, match="packs/y"):
                key.open("packs/y", sealed)  # another name
            with pytest.raises(Unauthentic):
                BucketKey(os.urandom(32)).open("packs/x", sealed)  # another key
            for at in {0, 5, 12, 20, HEADER.size, len(sealed) // 2, len(sealed) - 1}:
                bad = bytearray(sealed)
                bad[at] ^= 0x40
                with pytest.raises(Corrupt, match="packs/x"):
                    key.open("packs/x", bytes(bad))
            if size > CHUNK:  # cut at a chunk boundary: the last chunk is missing
                with pytest.raises(Unauthentic):
                    key.open("packs/x", sealed[:HEADER.size + CHUNK + TAG])
    newer = bytearray(BucketKey(os.urandom(32)).seal("n", b"x"))
    newer[4] = 2
    with pytest.raises(Corrupt, match="sealed object version 2 .*upgrade strata"):
        BucketKey(os.urandom(32)).open("n", bytes(newer))


def test_unknown_versions_are_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    store, _head = _owner_store(tmp_path, url)
    meta = (store / "STRATA").read_text()
    (store / "STRATA").write_text(meta.replace('"bucket_format": 2', '"bucket_format": 3'))
    with pytest.raises(InvalidInput, match="bucket format is 3.*upgrade strata"):
        LocalStore(str(store))
    (store / "STRATA").write_text(meta.replace("strata-store 2", "strata-store 3"))
    with pytest.raises(InvalidInput, match="store format version 3.*upgrade strata"):
        LocalStore(str(store))
    key = BucketKey(key_of(store))
    bucket_file = tmp_path / "bucket" / "strata-bucket"
    body = key.open("strata-bucket", bucket_file.read_bytes())
    bucket_file.write_bytes(key.seal("strata-bucket", body.replace(b'"format": 2',
                                                                     b'"format": 3')))
    with pytest.raises(InvalidInput, match="bucket format 3.*upgrade strata"):
        restore(url, str(tmp_path / "b"), key=key_of(store))


def test_a_bucket_made_before_keys_is_restored_only_when_asked(tmp_path: Path) -> None:
    """tests/fixtures/bucket-v1.tar.gz: a file:// bucket written by strata before format 2."""
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    url = f"file://{tmp_path}/bucket"
    with pytest.raises(InvalidInput, match="unauthenticated.*--unauthenticated"):
        restore(url, str(tmp_path / "a"))
    with pytest.raises(InvalidInput, match="bucket format 1"):
        restore(url, str(tmp_path / "a"), key=os.urandom(32))
    report = restore(url, str(tmp_path / "a"), unauthenticated=True)
    assert report["authenticated"] is False
    assert not (tmp_path / "a" / KEY_FILE).exists()
    with LocalStore(str(tmp_path / "a")) as s:
        t = Transaction(s, "proj")
        assert t.read("README") == b"made by strata before bucket keys\n"
        assert t.read("data.bin") == bytes(range(256)) * 40
        assert t.read("notes.txt") == b"second publish\n"
        tier = s.tier_report()
        assert tier is not None and (tier["bucket_format"], tier["authenticated"]) == (1, False)
        t = Transaction(s, "proj")
        t.write("later.txt", b"written by this strata")
        t.commit("later")
    # It stays a format 1 bucket: its new records are framed as before, unsealed.
    raw = Bucket(url)
    end = OwnerLog(raw).find_end()
    assert decode_record(log_name(end - 1), raw.get_stored(log_name(end - 1)))
    shutil.rmtree(tmp_path / "a")
    restore(url, str(tmp_path / "b"), unauthenticated=True)
    with LocalStore(str(tmp_path / "b")) as s:
        assert Transaction(s, "proj").read("later.txt") == b"written by this strata"


def test_a_bucket_made_before_keys_is_not_taken_for_one_with_a_key(tmp_path: Path) -> None:
    """A sealed store's bucket rewritten to look like format 1 is not read by its owner."""
    url = f"file://{tmp_path}/bucket"
    store, _head = _owner_store(tmp_path, url)
    meta = tmp_path / "bucket" / "strata-bucket"
    meta.write_text(json.dumps({"block_size": 65536, "format": 1,
                                "store_id": read_store_meta(str(store))["id"]}))
    with pytest.raises(InvalidInput, match="not sealed"):
        LocalStore(str(store))
