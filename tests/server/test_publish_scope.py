"""Hardening II, finding 1: a writer of volume A cannot publish its way to volume B's blocks.

The attack, over TCP with A's read-write token: upload one batch holding a
file node F that names B's block X and a tree T whose entry points at F, then
publish a directory entry with ref=T. Every object the publish makes
reachable is now checked, however it arrived; before, F's blocks were never
looked at, and A's tokens (the web view's included) could then read all of X.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serverutil import Server, cli, free_port
from strata.engine.errors import InvalidInput
from strata.engine.interface import ChangeSet
from strata.engine.local import init_store
from strata.engine.objects import (
    FILENODE,
    K_DIR,
    K_FILE,
    TREE,
    Entry,
    FileNode,
    TreeNode,
    object_id,
)
from strata.server.client import RemoteStore

SECRET = b"volume b's secret, never volume a's\n" * 4096  # one block of 144 KiB and more


def _blocks_of(owner: RemoteStore, volume: str, path: bytes) -> tuple[list[bytes], int, int]:
    root = owner.snapshot(owner.head(volume, "live")).root
    assert root.ref is not None
    node = TreeNode.decode(owner.get_object(root.ref))
    entry = dict(node.entries)[path]
    assert entry.ref is not None
    fn = FileNode.decode(owner.get_object(entry.ref))
    return list(fn.blocks), fn.size, fn.block_size


@pytest.mark.parametrize("how", ["one batch, then a publish", "all in the publish"])
def test_a_writer_cannot_reach_another_volumes_blocks(tmp_path: Path, how: str) -> None:
    store = tmp_path / "s"
    init_store(str(store))
    server = Server(store, tcp_port=free_port()).start()
    try:
        for v in ("a", "b"):
            assert cli("volume", "create", v, store=store).returncode == 0
        assert cli("put", "b", "secret", "-m", "b's", store=store, input=SECRET).returncode == 0
        p = cli("token", "create", "a", "--rw", "--json", store=store)
        token = json.loads(p.stdout)["token"]
        owner = RemoteStore(server.unix_url)
        blocks, size, block_size = _blocks_of(owner, "b", b"secret")
        owner.close()

        attacker = RemoteStore(server.tcp_url, token)
        f = FileNode.v1(size=size, block_size=block_size, blocks=tuple(blocks)).encode()
        leaf = Entry(kind=K_FILE, mode=0o644, size=size, ref=object_id(FILENODE, f))
        t = TreeNode(0, entries=((b"leak", leaf),)).encode()
        batch = [(FILENODE, f), (TREE, t)]
        d = Entry(kind=K_DIR, mode=0o755, ref=object_id(TREE, t))
        head = attacker.head("a", "live")
        with pytest.raises(InvalidInput):
            if how == "one batch, then a publish":
                attacker.put_objects(batch)
                attacker.publish([ChangeSet("a", "live", head, {"d": d})])
            else:
                attacker.publish([ChangeSet("a", "live", head, {"d": d})], batch)
        assert attacker.head("a", "live") == head  # nothing was published
        r = cli("cat", "a", "d/leak", server=server.tcp_url, token=token)
        assert r.returncode != 0 and SECRET[:32] not in r.stdout
        attacker.close()
        fsck = json.loads(cli("fsck", "--json", store=store).stdout)
        assert fsck["ok"], fsck
    finally:
        server.stop()


def test_a_writer_still_publishes_trees_of_its_own_blocks(tmp_path: Path) -> None:
    """The control: the same shape over blocks the writer uploaded itself is accepted."""
    from strata.engine.objects import BLOCK
    store = tmp_path / "s"
    init_store(str(store))
    server = Server(store, tcp_port=free_port()).start()
    try:
        assert cli("volume", "create", "a", store=store).returncode == 0
        token = json.loads(cli("token", "create", "a", "--rw", "--json",
                               store=store).stdout)["token"]
        w = RemoteStore(server.tcp_url, token)
        data = b"a's own bytes\n" * 10
        f = FileNode.v1(size=len(data), block_size=65536, blocks=(object_id(BLOCK, data),)).encode()
        leaf = Entry(kind=K_FILE, mode=0o644, size=len(data), ref=object_id(FILENODE, f))
        t = TreeNode(0, entries=((b"mine", leaf),)).encode()
        w.put_objects([(BLOCK, data), (FILENODE, f), (TREE, t)])
        d = Entry(kind=K_DIR, mode=0o755, ref=object_id(TREE, t))
        w.publish([ChangeSet("a", "live", w.head("a", "live"), {"d": d})])
        w.close()
        r = cli("cat", "a", "d/mine", server=server.tcp_url, token=token)
        assert r.returncode == 0 and r.stdout == data
    finally:
        server.stop()
