"""Stores written by older strata stay readable.

`fixtures/store-v1.tar.gz` is a store made by strata before pack format 2
(40-byte pack headers, frames marked "SR", snapshots of format 1): volumes
proj (branches live and experiment) and data, three packs, the first two
sealed. It must open, read byte-exact, pass fsck, and take new publishes,
which go to a new pack of the current format; the old packs are never
appended to.
"""

from __future__ import annotations

import json
import random
import tarfile
from pathlib import Path

import pytest

from strata.engine import pack as packfmt
from strata.engine.errors import InvalidInput
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import FileNode, packb
from strata.engine.txn import Transaction

FIXTURE = Path(__file__).parent / "fixtures" / "store-v1.tar.gz"
LIVE = "1e234e3ca11c1d598001f3bdf38fac698b5b82bd30f5581638b17ceaaac528fd"
EXPERIMENT = "af704d15a830f5f3db65f5eb77af9bca1ffd3194f05a74189f40b328e50b704d"


def _files(store: LocalStore, volume: str, branch: str = "live") -> dict[str, bytes]:
    t = Transaction(store, volume, branch)
    return {p: t.read(p) for p, e in t.walk() if e.kind == 1}


def test_a_version_1_store_opens_reads_and_takes_new_publishes(tmp_path: Path) -> None:
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    packs = sorted((tmp_path / "packs").glob("*.pack"))
    old = {p.name: p.read_bytes() for p in packs}
    assert [packfmt.read_info(str(p)).version for p in packs] == [1, 1, 1]
    big = random.Random(1).randbytes(200_000)
    with LocalStore(str(tmp_path)) as store:
        assert store.list_volumes() == ["data", "proj"]
        assert store.list_branches("proj") == {"experiment": EXPERIMENT, "live": LIVE}
        assert _files(store, "proj") == {"big.bin": big, "src/main.c": (
            b"int main(void) { return 0; }\n")}
        assert _files(store, "proj", "experiment")["exp.txt"] == b"experiment\n"
        assert _files(store, "proj", "experiment")["text.txt"] == b"hello strata\n" * 5000
        assert _files(store, "data") == {"rows.csv": b"a,b\n1,2\n"}
        assert [i.message for i in store.log(LIVE)][:2] == ["v1 fixture: second",
                                                            "v1 fixture: first"]
        assert store.fsck()["ok"]
        t = Transaction(store, "proj")
        t.write("new.txt", b"written by the current format")
        sid = t.commit("after the upgrade")
    with LocalStore(str(tmp_path)) as store:
        assert store.head("proj", "live") == sid
        assert _files(store, "proj")["new.txt"] == b"written by the current format"
        assert store.fsck()["ok"]
    packs = sorted((tmp_path / "packs").glob("*.pack"))
    assert {p.name: p.read_bytes() for p in packs if p.name in old} == old  # untouched
    assert packfmt.read_info(str(packs[-1])).version == packfmt.PACK_VERSION == 5


def test_policies_from_a_policies_json_move_into_the_journal(tmp_path: Path) -> None:
    """Stores made before policies were journaled kept them in policies.json."""
    init_store(str(tmp_path))
    with LocalStore(str(tmp_path)) as store:
        store.create_volume("v")
        store.fork("v", "side", at=None)
    (tmp_path / "policies.json").write_text(json.dumps({"version": 1, "policies": {
        "v": {"keep_last": 3}, "v@side": {"expire_runs": 60}, "gone": {"keep_last": 1}}}))
    want = {"v": {"keep_last": 3}, "v@side": {"expire_runs": 60}}
    with LocalStore(str(tmp_path)) as store:
        assert store.policies.load() == want
        assert store.policies.get("v", "side").keep_last == 3
        assert store.policies.get("v", "side").expire_runs == 60
    assert not (tmp_path / "policies.json").exists()
    with LocalStore(str(tmp_path)) as store:
        store.rebuild_index()  # replayed from the packs
        assert store.policies.load() == want
    with LocalStore(str(tmp_path)) as store:
        assert store.policies.load() == want
    (tmp_path / "policies.json").write_text(json.dumps({"version": 2, "policies": {}}))
    with pytest.raises(InvalidInput, match="unknown policy file version"):
        LocalStore(str(tmp_path))


def test_version_1_file_nodes_read_and_a_write_turns_them_into_version_2(tmp_path: Path
                                                                         ) -> None:
    """Version 1 nodes (fixed 64 KiB blocks) read as before; a write makes a version 2 tree.

    The tree keeps the old blocks the write did not touch as its chunks
    (none re-read, none stored again).
    """
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    big = random.Random(1).randbytes(200_000)
    with LocalStore(str(tmp_path)) as store:
        t = Transaction(store, "proj")
        e = t.lookup("big.bin")
        assert e is not None and e.ref is not None
        old = FileNode.decode(store.get_object(e.ref))
        assert old.version == 1 and old.block_size == 65536 and len(old.blocks) == 4
        assert t.read("big.bin", 65530, 20) == big[65530:65550]
        t.write_at("big.bin", 70_000, b"new bytes")
        new = t.lookup("big.bin")
        assert new is not None and new.ref is not None
        node = FileNode.decode(t.content.get_object(new.ref))
        assert node.version == 2
        kept = set(old.blocks) & set(node.all_block_ids(t.content.get_object))
        assert kept == {old.blocks[0], old.blocks[2], old.blocks[3]}
        t.commit("a write into a version 1 file")
        want = big[:70_000] + b"new bytes" + big[70_009:]
        assert Transaction(store, "proj").read("big.bin") == want
        assert store.fsck()["ok"]
    with LocalStore(str(tmp_path)) as store:
        assert Transaction(store, "proj").read("big.bin") == want
        assert store.fsck()["ok"]
        # Garbage collection compacts the version 1 packs: their frames carry a 2-byte
        # marker, not the 16 of today's, and their copies must still read.
        report = store.gc(min_age=0)
        assert report["packs_compacted"], report
        assert store.fsck()["ok"]
        assert Transaction(store, "proj").read("big.bin") == want
    with LocalStore(str(tmp_path)) as store:
        assert store.fsck()["ok"]
        assert _files(store, "data") == {"rows.csv": b"a,b\n1,2\n"}


def test_a_file_node_of_an_unknown_version_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="file node format version 3 .* upgrade strata"):
        FileNode.decode(packb([3, 10, 0, [[10, bytes(32)]]]))
