"""Finding 3 of the hardening issue: uploaded trees are checked, and export cannot escape.

Tree nodes and entries are built here byte by byte, as an attacker would, not
through the client library. Over TCP the server refuses every malformed one.
A store that holds hostile trees anyway (written in-process, below the API's
checks) still cannot make `export` create or follow anything outside its
target: names are checked again, and every entry is created relative to a
directory descriptor with O_NOFOLLOW. Setuid/setgid bits and device nodes are
restored only with --privileged.
"""

from __future__ import annotations

import http.client
import os
import shutil
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from serverutil import served_volume
from strata.engine.errors import InvalidInput
from strata.engine.interface import ChangeSet
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import (
    K_CHR,
    K_DIR,
    K_FILE,
    K_SYMLINK,
    TREE,
    Entry,
    object_id,
    packb,
)
from strata.fsio import export_snapshot
from strata.server.wire import OBJ_HEAD


def entry_list(kind: int = K_FILE, **kw: object) -> list[object]:
    e = {"kind": kind, "mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 0, "size": 1,
         "ref": None, "data": b"x", "rdev": 0, "xattrs": [], "ino": 0, "nlink": 1, **kw}
    return [e["kind"], e["mode"], e["uid"], e["gid"], e["mtime_ns"], e["size"], e["ref"],
            e["data"], e["rdev"], e["xattrs"], e["ino"], e["nlink"]]


def tree(*entries: tuple[bytes, list[object]]) -> bytes:
    return packb([0, [[name, *e] for name, e in entries]])


def upload(port: int, token: str, raw: bytes) -> tuple[int, str]:
    body = OBJ_HEAD.pack(TREE, object_id(TREE, raw), len(raw)) + raw
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/objects", body=body, headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def test_malformed_tree_nodes_are_refused_over_tcp(tmp_path: Path) -> None:
    with served_volume(tmp_path / "s") as (server, tok):
        port = server.tcp_port
        assert port is not None
        hostile = {
            "dot-dot name": tree((b"..", entry_list())),
            "dot name": tree((b".", entry_list())),
            "slash in name": tree((b"a/b", entry_list())),
            "empty name": tree((b"", entry_list())),
            "NUL in name": tree((b"a\0b", entry_list())),
            "name over 255 bytes": tree((b"n" * 256, entry_list())),
            "names out of order": tree((b"b", entry_list()), (b"a", entry_list())),
            "name twice": tree((b"a", entry_list()), (b"a", entry_list())),
            "nlink 0": tree((b"a", entry_list(nlink=0))),
            "negative ino": tree((b"a", entry_list(ino=-1))),
            "empty xattr name": tree((b"a", entry_list(xattrs=[[b"", b"v"]]))),
            "directory with inline data": tree((b"d", entry_list(K_DIR, size=0, data=b"x"))),
            "time out of range": tree((b"a", entry_list(mtime_ns=2**63))),
            "negative rdev": tree((b"a", entry_list(rdev=-5))),
            "symlink with a reference": tree((b"l", entry_list(K_SYMLINK, ref=b"r" * 32))),
            "NUL in a symlink target": tree((b"l", entry_list(K_SYMLINK, data=b"/a\0b"))),
            "a subtree the store lacks": tree((b"d", entry_list(K_DIR, size=0, data=None,
                                                                ref=b"\x01" * 32))),
        }
        for what, raw in hostile.items():
            status, body = upload(port, tok, raw)
            assert status == 400, (what, status, body)
        ok = tree((b"a", entry_list()), (b"b\xff\xfe", entry_list()))  # any bytes but / NUL
        assert upload(port, tok, ok)[0] == 200


def _hostile_store(tmp: Path, entries: list[tuple[bytes, Entry]]) -> tuple[LocalStore, str]:
    """A volume whose root holds `entries` as given, written below the API's checks."""
    init_store(str(tmp / "s"))
    s = LocalStore(str(tmp / "s"))
    s.create_volume("v")
    raw = packb([0, [[name, *e.to_list()] for name, e in sorted(entries)]])
    s.put_objects([(TREE, raw)])
    head = s.head("v", "live")
    root = Entry(kind=K_DIR, mode=0o755, ref=object_id(TREE, raw))
    (sid,) = s.publish([ChangeSet("v", "live", head, {"": root.with_(ref=None)})])
    # Point the root at the hostile node: a merge entry cannot, a subtree entry can.
    inner = Entry(kind=K_DIR, mode=0o755, ref=object_id(TREE, raw))
    (sid,) = s.publish([ChangeSet("v", "live", sid, {"evil": inner})])
    return s, sid


@pytest.mark.parametrize("name", [b"..", b"../escaped", b"a/../../escaped", b"/tmp/escaped"])
def test_export_refuses_names_that_leave_the_directory(tmp_path: Path, name: bytes) -> None:
    s, sid = _hostile_store(tmp_path, [(name, Entry(kind=K_FILE, size=3, data=b"bad"))])
    out = tmp_path / "deep" / "out"
    try:
        with pytest.raises(InvalidInput, match="name"):
            export_snapshot(s, sid, str(out))
    finally:
        s.close()
    outside = sorted(p.name for p in tmp_path.rglob("*") if "escaped" in p.name
                     or (p.parent == tmp_path / "deep" and p.name != "out"))
    assert outside == [] and not Path("/tmp/escaped").exists()


def test_export_never_writes_through_a_symlink_in_the_snapshot(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.mkdir()
    entries = [(b"link", Entry(kind=K_SYMLINK, mode=0o777, size=len(str(target)),
                               data=str(target).encode())),
               (b"link/owned", Entry(kind=K_FILE, size=3, data=b"bad"))]
    s, sid = _hostile_store(tmp_path, entries)
    try:
        with pytest.raises(InvalidInput):
            export_snapshot(s, sid, str(tmp_path / "out"))
    finally:
        s.close()
    assert list(target.iterdir()) == []


def test_setid_bits_and_devices_need_privileged(tmp_path: Path) -> None:
    entries = [(b"suid", Entry(kind=K_FILE, mode=0o4755, size=2, data=b"#!")),
               (b"null", Entry(kind=K_CHR, mode=0o666, rdev=os.makedev(1, 3)))]
    s, sid = _hostile_store(tmp_path, entries)
    try:
        report = export_snapshot(s, sid, str(tmp_path / "plain"))
        plain = tmp_path / "plain" / "evil"
        assert stat.S_IMODE((plain / "suid").stat().st_mode) == 0o755
        assert not (plain / "null").exists()
        assert any("setuid" in r for r in report.skipped)
        assert any("device node" in r for r in report.skipped)
        if os.geteuid() == 0:
            export_snapshot(s, sid, str(tmp_path / "priv"), privileged=True)
            priv = tmp_path / "priv" / "evil"
            assert stat.S_IMODE((priv / "suid").stat().st_mode) == 0o4755
            assert stat.S_ISCHR((priv / "null").lstat().st_mode)
    finally:
        s.close()


def test_references_to_objects_the_store_lacks_are_refused(tmp_path: Path) -> None:
    """No branch may come to reach a hole: tree nodes and file nodes name what exists."""
    from strata.engine.objects import BLOCK, FILENODE, FileNode
    init_store(str(tmp_path / "s"))
    with LocalStore(str(tmp_path / "s")) as s:
        s.create_volume("v")
        ghost = object_id(BLOCK, b"never uploaded")
        with pytest.raises(InvalidInput, match="lacks"):  # as the server checks each batch
            s.check_tree_refs([(TREE, tree((b"d", entry_list(K_DIR, size=0, data=None,
                                                              ref=ghost))))])
        node = FileNode.v1(size=10, block_size=65536, blocks=(ghost,)).encode()
        s.put_objects([(FILENODE, node)])  # blocks may come in a later batch ...
        f = Entry(kind=K_FILE, size=10, ref=object_id(FILENODE, node))
        with pytest.raises(InvalidInput, match="lacks"):  # ... but a publish needs them
            s.publish([ChangeSet("v", "live", s.head("v", "live"), {"f": f})])
        s.put_objects([(BLOCK, b"never uploaded")])
        assert s.publish([ChangeSet("v", "live", s.head("v", "live"), {"f": f})])


# cap_setuid,cap_setgid+ep as the kernel stores it (struct vfs_cap_data, revision 2).
SETUID_CAPS = struct.pack("<IIIII", 0x02000001, (1 << 6) | (1 << 7), 0, 0, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="setting security.capability needs root")
def test_file_capabilities_need_privileged(tmp_path: Path) -> None:
    """Hardening II, finding 3: a snapshot's security.capability gave uid 65534 root."""
    from strata.fsio import import_dir
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy2("/usr/bin/setpriv", src / "setpriv")
    os.setxattr(src / "setpriv", "security.capability", SETUID_CAPS)
    os.setxattr(src / "setpriv", "trusted.note", b"root's")
    init_store(str(tmp_path / "s"))
    with LocalStore(str(tmp_path / "s")) as s:
        s.create_volume("v")
        sid = import_dir(s, "v", "live", str(src))
        report = export_snapshot(s, sid, str(tmp_path / "plain"))
        export_snapshot(s, sid, str(tmp_path / "priv"), privileged=True)
    os.chmod(tmp_path, 0o755)  # let uid 65534 reach the exports

    def as_nobody(binary: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534",
                               "--clear-groups", str(binary), "--reuid", "0", "--regid", "0",
                               "--clear-groups", "id", "-u"], capture_output=True, text=True)

    plain = tmp_path / "plain" / "setpriv"
    assert os.listxattr(plain) == []
    assert any("security.* and trusted.*" in r for r in report.skipped)
    r = as_nobody(plain)
    assert r.returncode != 0 and r.stdout.strip() != "0", (r.stdout, r.stderr)
    # The control: the same file exported with --privileged carries its capabilities.
    assert os.getxattr(tmp_path / "priv" / "setpriv", "security.capability") == SETUID_CAPS
    assert as_nobody(tmp_path / "priv" / "setpriv").stdout.strip() == "0"


def test_inner_tree_nodes_must_describe_their_children_over_tcp(tmp_path: Path) -> None:
    """Hardening II, finding 11: two leaves of one directory both held `x` (`ls`: `x x`)."""
    def inner(*children: tuple[bytes, bytes, int], level: int = 1) -> bytes:
        return packb([level, [[first, oid, count] for first, oid, count in children]])

    with served_volume(tmp_path / "s") as (server, tok):
        port = server.tcp_port
        assert port is not None
        left = tree((b"a", entry_list()), (b"x", entry_list()))
        right = tree((b"x", entry_list()), (b"z", entry_list()))
        for leaf in (left, right):
            assert upload(port, tok, leaf)[0] == 200  # each leaf alone is well formed
        lid, rid = object_id(TREE, left), object_id(TREE, right)
        hostile = {
            "the same name in two leaves": inner((b"a", lid, 2), (b"x", rid, 2)),
            "a count the child does not hold": inner((b"a", lid, 5)),
            "a first name the child does not start with": inner((b"b", lid, 2)),
            "a child two levels down": inner((b"a", lid, 2), level=2),
        }
        for what, raw in hostile.items():
            status, body = upload(port, tok, raw)
            assert status == 400, (what, status, body)
        fine = tree((b"y", entry_list()), (b"z", entry_list()))
        assert upload(port, tok, fine)[0] == 200
        assert upload(port, tok, inner((b"a", lid, 2), (b"y", object_id(TREE, fine), 2)))[0] \
            == 200


def test_a_version_2_tree_whose_parts_disagree_is_refused(tmp_path: Path) -> None:
    """A child sent with a publish must be the level and size its parent's entry says."""
    from strata.engine.objects import BLOCK, FILENODE, FileNode
    init_store(str(tmp_path / "s"))
    with LocalStore(str(tmp_path / "s")) as s:
        s.create_volume("v")
        data = os.urandom(10_000)
        chunk = object_id(BLOCK, data)
        leaf = FileNode(10_000, 0, ((10_000, chunk),)).encode()
        liar = FileNode(20_000, 1, ((20_000, object_id(FILENODE, leaf)),)).encode()
        f = Entry(kind=K_FILE, size=20_000, ref=object_id(FILENODE, liar))
        with pytest.raises(InvalidInput, match="is not the level 0 node of 20000 bytes"):
            s.publish([ChangeSet("v", "live", s.head("v", "live"), {"f": f})],
                      [(BLOCK, data), (FILENODE, leaf), (FILENODE, liar)])
        ghost = FileNode(10_000, 1, ((10_000, object_id(FILENODE, b"absent")),)).encode()
        g = Entry(kind=K_FILE, size=10_000, ref=object_id(FILENODE, ghost))
        with pytest.raises(InvalidInput, match="names child node .* the store lacks"):
            s.publish([ChangeSet("v", "live", s.head("v", "live"), {"g": g})],
                      [(FILENODE, ghost)])
        good = FileNode(10_000, 1, ((10_000, object_id(FILENODE, leaf)),)).encode()
        h = Entry(kind=K_FILE, size=10_000, ref=object_id(FILENODE, good))
        assert s.publish([ChangeSet("v", "live", s.head("v", "live"), {"h": h})],
                         [(BLOCK, data), (FILENODE, leaf), (FILENODE, good)])
        from strata.engine.txn import Transaction
        assert Transaction(s, "v").read("h") == data
