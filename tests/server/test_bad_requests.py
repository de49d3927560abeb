"""Hostile and broken requests against a live `strata serve`: refused with a 4xx, change nothing.

Raw HTTP over the owner's unix socket (the most privileged way in), so only
input validation stands between a request and the store. Every refusal must
be a 4xx with a JSON `{"error", "message"}`; afterwards the branch heads are
the same, refused objects are still missing, fsck is clean and the server
logged no unhandled exception. Where a refusal could pass for "nothing
happens anyway", the same request made whole is sent too and must land.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from serverutil import Server
from strata.engine.local import init_store
from strata.engine.objects import (
    BLOCK,
    FILENODE,
    K_DIR,
    K_FILE,
    SNAPSHOT,
    TREE,
    Entry,
    FileNode,
    TreeNode,
    object_id,
    packb,
)
from strata.engine.txn import Transaction
from strata.server import wire
from strata.server.client import RemoteStore, http_connection

MAX_BODY = wire.MAX_BODY


class Env:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.store: RemoteStore = server.remote(retry_for=5.0)

    def raw(self, method: str, path: str, body: bytes | None = None,
            ctype: str = "application/json", headers: dict[str, str] | None = None,
            ) -> tuple[int, Any]:
        """One request on a fresh connection: (status, JSON body or raw bytes)."""
        conn = http_connection("unix", self.server.sock, 0, 30.0)
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Type": ctype, **(headers or {})})
            resp = conn.getresponse()
            data = resp.read()
            is_json = (resp.getheader("Content-Type") or "").startswith("application/json")
        finally:
            conn.close()
        return resp.status, json.loads(data) if is_json else data

    def refused(self, method: str, path: str, body: bytes | None = None,
                ctype: str = "application/json", *, status: int = 400,
                match: str = "") -> str:
        """Send a request that must be refused with `status` and a JSON message."""
        got, reply = self.raw(method, path, body, ctype)
        assert got == status, (method, path, (body or b"")[:80], got, reply)
        assert isinstance(reply, dict) and reply.get("error") and reply.get("message"), reply
        assert match.lower() in reply["message"].lower(), (match, reply)
        return str(reply["message"])

    def publish_body(self, changes: list[list[Any]], *, base: str | None = None,
                     objects: bytes | None = None, volume: str = "v") -> bytes:
        return packb({"changesets": [{
            "volume": volume, "branch": "live", "base": base or self.store.head(volume, "live"),
            "changes": changes, "message": "", "meta": {}, "lease": None}],
            "objects": objects})

    def state(self) -> dict[str, dict[str, str]]:
        return {v: self.store.list_branches(v) for v in self.store.list_volumes()}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    store = tmp_path_factory.mktemp("bad") / "store"
    init_store(str(store))
    server = Server(store).start()
    e = Env(server)
    try:
        e.store.create_volume("v")
        t = Transaction(e.store, "v")
        t.mkdir("d")
        t.write("d/f", b"content")
        t.commit("seed")
        e.store.fork("v", "other", at=None)
        yield e
        # Nothing refused left a trace, and nothing crashed.
        report = e.store.admin("POST", "fsck", {})
        assert report["ok"], report
        log = server.log.read_text(errors="replace")
        assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]
    finally:
        e.store.close()
        server.stop()


@pytest.fixture
def unchanged(env: Env) -> Iterator[None]:
    """The test may refuse as much as it likes, but must leave every branch where it was."""
    before = env.state()
    yield
    assert env.state() == before


def file_entry(data: bytes = b"x") -> list[Any]:
    return Entry(kind=K_FILE, size=len(data), data=data).to_list()


# -- ids ---------------------------------------------------------------------------------------

BAD_IDS = ["zz", "ab" * 31, "ab" * 33, "AB" * 32, "g" * 64, "ab" * 31 + "a%20", "%00" * 4]


@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("bad", BAD_IDS)
def test_malformed_ids_are_refused(env: Env, bad: str) -> None:
    env.refused("GET", f"/v1/objects/{bad}", match="invalid")
    if not re.fullmatch("[0-9a-f]{8,64}", bad):  # else a well-formed prefix, of nothing
        env.refused("GET", f"/v1/snapshots/{bad}", match="invalid")
    env.refused("POST", "/v1/volumes/v/branches",
                json.dumps({"name": "x", "at": bad}).encode(), match="invalid")
    env.refused("POST", "/v1/publish", env.publish_body([["f", file_entry()]], base=bad),
                "application/msgpack", match="invalid")


@pytest.mark.usefixtures("unchanged")
def test_malformed_id_lists_are_refused(env: Env) -> None:
    env.refused("POST", "/v1/objects/missing", b"x" * 33, "application/octet-stream",
                match="multiple of 32")
    env.refused("GET", "/v1/snapshots/abc", match="8 to 64")  # a prefix too short
    env.refused("POST", "/v1/volumes/v/branches", b'{"name": "x", "at": 5}',
                match="'at'")


# -- hostile paths -------------------------------------------------------------------------------

HOSTILE_PATHS = ["..", "../escape", "a/../../b", "d/..", ".", "./f", "a\0b", "/abs", "/",
                 "a//b", "d/", "x" * 256, "d/" + "y" * 256, "é" * 128 + "x"]


@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("path", HOSTILE_PATHS, ids=lambda p: repr(p)[:24])
def test_hostile_paths_in_a_publish_are_refused(env: Env, path: str) -> None:
    for value in (file_entry(), None, Entry(kind=K_DIR).to_list()):
        env.refused("POST", "/v1/publish", env.publish_body([["ok", file_entry()],
                                                             [path, value]]),
                    "application/msgpack")


def test_a_hostile_path_refuses_the_whole_multi_branch_publish(env: Env) -> None:
    before = env.state()

    def body(path: str) -> bytes:
        return packb({"changesets": [
            {"volume": "v", "branch": "other", "base": before["v"]["other"],
             "changes": [["fine", file_entry()]]},
            {"volume": "v", "branch": "live", "base": before["v"]["live"],
             "changes": [["ok", file_entry()], [path, file_entry()]]}], "objects": None})

    env.refused("POST", "/v1/publish", body("../x"), "application/msgpack", match="'..'")
    assert env.state() == before
    # A 255-byte name is allowed: the same publish with it lands on both branches.
    status, reply = env.raw("POST", "/v1/publish", body("n" * 255), "application/msgpack")
    assert status == 200, reply
    after = env.state()
    assert after["v"]["other"] != before["v"]["other"]
    assert after["v"]["live"] != before["v"]["live"]
    assert Transaction(env.store, "v").read("n" * 255) == b"x"


# -- oversized and truncated bodies ----------------------------------------------------------------

def _exchange(env: Env, head: bytes, body: bytes = b"", *, chunks: Iterator[bytes] | None = None,
              close_early: bool = False) -> bytes:
    """Write a hand-made request to the socket; return what came back (maybe nothing)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(env.server.sock)
    out = b""
    try:
        s.sendall(head + body)
        try:
            for c in chunks or ():
                s.sendall(c)
        except OSError:
            pass  # the server may answer and close before it has read everything
        if close_early:
            s.shutdown(socket.SHUT_WR)
        while True:
            d = s.recv(65536)
            if not d:
                break
            out += d
            if b"\r\n\r\n" in out and not close_early:
                hdr, _, rest = out.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in hdr.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                if length is not None and len(rest) >= length:
                    break
    except OSError:
        pass  # a reset after a refusal is as good as a close
    finally:
        s.close()
    return out


def _parse(reply: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert b"application/json" in head, reply[:300]
    return status, json.loads(body)


BODY_ENDPOINTS = [("/v1/objects", "application/octet-stream"),
                  ("/v1/objects/missing", "application/octet-stream"),
                  ("/v1/publish", "application/msgpack"),
                  ("/v1/volumes", "application/json"),
                  ("/v1/volumes/v/branches", "application/json")]


@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("path,ctype", BODY_ENDPOINTS)
def test_a_body_claimed_over_the_limit_is_refused_before_it_is_read(
        env: Env, path: str, ctype: str) -> None:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {MAX_BODY + 1}\r\n\r\n").encode()
    status, reply = _parse(_exchange(env, head, b"{}"))
    assert status == 413 and str(MAX_BODY) in reply["message"], reply


@pytest.mark.usefixtures("unchanged")
def test_a_streamed_body_over_the_limit_is_refused(env: Env) -> None:
    # Chunked, so the server only learns the size while reading; 1 MiB at a time here.
    chunk = b"\0" * (1 << 20)
    frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    n = MAX_BODY // len(chunk) + 8
    head = (b"POST /v1/objects HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream"
            b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    status, reply = _parse(_exchange(env, head, chunks=iter([frame] * n + [b"0\r\n\r\n"])))
    assert status == 413 and "body over" in reply["message"], reply


def test_truncated_uploads_store_and_publish_nothing(env: Env) -> None:
    before = env.state()
    blocks = [(BLOCK, os.urandom(50_000)) for _ in range(3)]
    node = FileNode.v1(size=150_000, block_size=65536,
                    blocks=tuple(object_id(k, r) for k, r in blocks)).encode()
    objs = [*blocks, (FILENODE, node)]
    ids = [object_id(k, r) for k, r in objs]
    batch = wire.encode_objects(objs)
    entry = Entry(kind=K_FILE, size=150_000, ref=object_id(FILENODE, node)).to_list()
    pub = env.publish_body([["big.bin", entry]], objects=batch)
    for path, body, ctype in (("/v1/objects", batch, "application/octet-stream"),
                              ("/v1/publish", pub, "application/msgpack")):
        for cut in (10, len(body) // 2, len(body) - 1):
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            reply = _exchange(env, head, body[:cut], close_early=True)
            if reply:  # the server may see the close first and not answer at all
                assert 400 <= _parse(reply)[0] < 500, reply[:300]
            assert env.store.missing(ids) == ids, (path, cut)
            assert env.state() == before
    # The same publish sent whole lands: the truncated ones were refused, not no-ops.
    status, reply = env.raw("POST", "/v1/publish", pub, "application/msgpack")
    assert status == 200, reply
    assert env.store.missing(ids) == []
    assert env.store.head("v", "live") == reply["heads"][0] != before["v"]["live"]


# -- objects that are not what they claim ----------------------------------------------------------

def _batch(objs: list[tuple[int, bytes, bytes]]) -> bytes:
    """An object batch with the given (kind, id, raw) records, ids as given."""
    return b"".join(wire.OBJ_HEAD.pack(k, oid, len(raw)) + raw for k, oid, raw in objs)


@pytest.mark.usefixtures("unchanged")
def test_objects_that_do_not_match_their_ids_are_refused(env: Env) -> None:
    good = (BLOCK, os.urandom(100))
    good_id = object_id(*good)
    liar = os.urandom(100)
    liar_id = object_id(BLOCK, b"something else")
    wrong_kind_id = object_id(FILENODE, liar)  # right bytes, id of another kind
    cases = [
        (_batch([(BLOCK, good_id, good[1]), (BLOCK, liar_id, liar)]), "does not match"),
        (_batch([(BLOCK, wrong_kind_id, liar)]), "does not match"),
        (_batch([(9, object_id(BLOCK, liar), liar)]), "unknown object kind"),
        (_batch([(BLOCK, good_id, good[1])])[:-1], "truncated"),
        (_batch([(BLOCK, good_id, good[1])]) + b"\x01\x02", "truncated"),
        (wire.OBJ_HEAD.pack(BLOCK, good_id, 2**32 - 1), "truncated"),
    ]
    for body, match in cases:
        env.refused("POST", "/v1/objects", body, "application/octet-stream", match=match)
        # The same junk carried inside a publish.
        env.refused("POST", "/v1/publish", env.publish_body([["j", file_entry()]], objects=body),
                    "application/msgpack", match=match)
    # The whole batch was refused: even the good object in it was not stored.
    assert env.store.missing([good_id, liar_id, wrong_kind_id]) == [good_id, liar_id,
                                                                    wrong_kind_id]
    status, _ = env.raw("POST", "/v1/objects", _batch([(BLOCK, good_id, good[1])]),
                        "application/octet-stream")
    assert status == 200 and env.store.missing([good_id]) == []


@pytest.mark.usefixtures("unchanged")
def test_nodes_and_snapshots_that_do_not_decode_are_refused(env: Env) -> None:
    # Their ids are right, but no reader could use them: a branch must never point at them.
    for kind, raw in ((TREE, b"not msgpack \xc1"), (TREE, packb([0, [[b"n", 1, 2]]])),
                      (TREE, packb([1, [[b"n", 5, 1]]])),
                      (FILENODE, packb([1, 10, 65536, [2**40]])),
                      (FILENODE, packb({"size": 1})),
                      (SNAPSHOT, packb({"v": 1, "root": [1]})), (SNAPSHOT, b"\x00")):
        oid = object_id(kind, raw)
        body = _batch([(kind, oid, raw)])
        env.refused("POST", "/v1/objects", body, "application/octet-stream",
                    match="is not a valid")
        ref = Entry(kind=K_DIR if kind == TREE else K_FILE, size=10, ref=oid).to_list()
        env.refused("POST", "/v1/publish", env.publish_body([["j", ref]], objects=body),
                    "application/msgpack", match="is not a valid")
        assert env.store.missing([oid]) == [oid]
        env.refused("POST", "/v1/volumes/v/branches",
                    json.dumps({"name": "junk", "at": oid.hex()}).encode(), status=404)


@pytest.mark.usefixtures("unchanged")
def test_an_entry_whose_size_differs_from_its_file_node_is_refused(env: Env) -> None:
    """Finding 7: readers trust the file node's size, so an entry may not claim another.

    An entry claiming 1,000 bytes over a 256 MiB node (all holes: 128 KiB of
    ids) once passed the web view's 64 MiB limit for SQLite files. Refused in
    a change set and in an uploaded tree node alike; the honest entry lands.
    """
    block = os.urandom(64)
    bid = object_id(BLOCK, block)
    node = FileNode.v1(size=256 << 20, block_size=65536,
                    blocks=(bid,) + (b"\0" * 32,) * 4095).encode()
    nid = object_id(FILENODE, node)
    objects = wire.encode_objects([(BLOCK, block), (FILENODE, node)])
    liar = Entry(kind=K_FILE, size=1000, ref=nid)
    env.refused("POST", "/v1/publish", env.publish_body([["fake.db", liar.to_list()]],
                                                        objects=objects),
                "application/msgpack", match="says 1000 bytes, its file node holds 268435456")
    tree = TreeNode(0, entries=((b"fake.db", liar),)).encode()
    env.refused("POST", "/v1/objects", wire.encode_objects([(BLOCK, block), (FILENODE, node),
                                                            (TREE, tree)]),
                "application/octet-stream", match="says 1000 bytes")
    assert env.store.missing([object_id(TREE, tree)]) == [object_id(TREE, tree)]
    # The same publish with the node's own size lands (on a branch of its own).
    env.store.fork("v", "sized", at=None)
    honest = Entry(kind=K_FILE, size=256 << 20, ref=nid).to_list()
    body = packb({"changesets": [{"volume": "v", "branch": "sized",
                                  "base": env.store.head("v", "sized"),
                                  "changes": [["fake.db", honest]], "message": "",
                                  "meta": {}, "lease": None}], "objects": objects})
    status, reply = env.raw("POST", "/v1/publish", body, "application/msgpack")
    assert status == 200, reply
    env.store.delete_branch("v", "sized")


# -- malformed encodings and types -----------------------------------------------------------------

@pytest.mark.usefixtures("unchanged")
def test_garbage_and_misshapen_msgpack_is_refused(env: Env) -> None:
    head = env.store.head("v", "live")
    cs = {"volume": "v", "branch": "live", "base": head, "changes": []}
    for body in (b"\xc1garbage", b"", os.urandom(64), b"\x91" * 100_000 + b"\xc0",
                 packb([1, 2]), packb({"objects": None}), packb({"changesets": []}),
                 packb({"changesets": {"a": 1}}), packb({"changesets": [5]}),
                 packb({"changesets": [{**cs, "volume": 5}]}),
                 packb({"changesets": [{**cs, "changes": 5}]}),
                 packb({"changesets": [{**cs, "changes": [["f"]]}]}),
                 packb({"changesets": [{**cs, "changes": [[5, None]]}]}),
                 packb({"changesets": [{**cs, "changes": [["f", [1, 2]]]}]}),
                 packb({"changesets": [{**cs, "changes": [["f", ["x"] * 12]]}]}),
                 packb({"changesets": [{**cs, "changes": [["f", None], ["f", None]]}]}),
                 packb({"changesets": [{**cs, "meta": [1]}]}),
                 packb({"changesets": [{**cs, "lease": 7}]}),
                 packb({"changesets": [cs], "objects": "not bytes"})):
        env.refused("POST", "/v1/publish", body, "application/msgpack")


@pytest.mark.usefixtures("unchanged")
def test_wrong_json_types_are_refused(env: Env) -> None:
    tokens_before = env.store.admin("GET", "tokens")
    huge = b"1" + b"0" * 400
    cases: list[tuple[str, bytes, str]] = [
        ("/v1/volumes", b'{"name": 5}', "'name'"),
        ("/v1/volumes", b"[]", "JSON object"),
        ("/v1/volumes", b"nope", "not JSON"),
        ("/v1/volumes", b'{"name": "\xff\xfe"}', "not JSON"),
        ("/v1/volumes", b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        ("/v1/volumes", b'{"name": "../x"}', "invalid volume name"),
        ("/v1/volumes/v/branches", b'{"name": ["x"]}', "'name'"),
        ("/v1/volumes/v/branches", b'{"name": "a//b"}', "invalid branch name"),
        ("/v1/volumes/v/lease/acquire", b'{"branch": "live", "ttl": "abc"}', "'ttl'"),
        ("/v1/volumes/v/lease/acquire", b'{"branch": "live", "ttl": ' + huge + b"}", ""),
        ("/v1/volumes/v/lease/acquire", b'{"branch": "live", "ttl": NaN}', "ttl"),
        ("/v1/volumes/v/lease/acquire", b'{"branch": "live", "ttl": -1}', "ttl"),
        ("/v1/volumes/v/lease/acquire", b'{"branch": "live", "ttl": 5, "holder": {}}',
         "'holder'"),
        ("/v1/volumes/v/lease/release", b'{"branch": "live", "lease": 1.5}', "'lease'"),
        ("/v1/volumes/v/lease/release", b'{"branch": "live", "fencing": 1}', "'lease'"),
        ("/v1/volumes/v/lease/renew", b'{"branch": 7, "ttl": 5, "lease": "1.x"}', "'branch'"),
        ("/v1/admin/tokens", b'{"volume": "v", "writable": "yes"}', "'writable'"),
        ("/v1/admin/tokens", b'{"volume": "v", "writable": true, "ttl": NaN}', "ttl"),
        ("/v1/admin/tokens", b'{"volume": "v", "writable": true, "ttl": ' + huge + b"}", ""),
        ("/v1/admin/tokens", b'{"volume": "v", "writable": true, "ttl": 0}', "ttl"),
        ("/v1/admin/fsck", b"[1]", "JSON object"),
    ]
    for path, body, match in cases:
        env.refused("POST", path, body, match=match)
    assert env.store.admin("GET", "tokens") == tokens_before
    # No refused acquire took the lease: it is free to take now.
    lease = env.store.acquire_lease("v", "live", ttl=5)
    env.store.release_lease("v", "live", lease.id)


@pytest.mark.usefixtures("unchanged")
def test_bad_ranges_are_refused(env: Env) -> None:
    oid = env.store.head("v", "live")
    for rng, status in (("bytes=abc", 400), ("bytes=5-2", 400), ("bytes=0-1,4-5", 400),
                        ("items=0-1", 400), ("bytes=99999999-", 416)):
        got, reply = env.raw("GET", f"/v1/objects/{oid}", headers={"Range": rng})
        assert got == status and reply["message"], (rng, got, reply)


@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("body, why", [
    ([2, 5, 0, [[4, b"x" * 32]]], "add up"),
    ([2, 4, 1, [[4, bytes(32)]]], "hole as a child"),
    ([2, 1, 0, [[1, b"x" * 32]] + [[0, b"x" * 32]] * 511], "length > 0"),
    ([3, 4, 0, [[4, b"x" * 32]]], "upgrade strata"),
])
def test_hostile_version_2_file_nodes_are_refused_on_upload(env: Env, body: list[object],
                                                            why: str) -> None:
    raw = packb(body)
    env.refused("POST", "/v1/objects", wire.encode_objects([(FILENODE, raw)]),
                "application/octet-stream", match=why)
    big = b"\x94\x02" + bytes(70_000)  # refused by its length, never unpacked
    env.refused("POST", "/v1/objects", wire.encode_objects([(FILENODE, big)]),
                "application/octet-stream", match="larger than a version 2 node")
