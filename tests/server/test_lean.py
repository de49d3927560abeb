"""The lean stream (server/lean.py) against a real `strata serve` process.

The client takes it for object reads and publishes and must get exactly what
HTTP gives; the server must treat every byte on it as untrusted (hostile
frames are answered or the connection closed, and the server keeps serving),
and a client must fall back to HTTP when the stream is absent.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from serverutil import Server
from strata.engine.errors import NotFound
from strata.engine.local import init_store
from strata.engine.objects import FileNode
from strata.engine.txn import Transaction
from strata.server.client import RemoteStore
from strata.server.wire import MAX_BODY, lean_path

FRAME = struct.Struct(">I")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    init_store(str(tmp_path / "store"))
    srv = Server(tmp_path / "store").start()
    rs = srv.remote()
    rs.create_volume("v")
    rs.close()
    yield srv
    srv.stop()


def _lean_only(srv: Server) -> RemoteStore:
    rs = srv.remote(retry_for=2.0)
    assert rs._lean == lean_path(srv.sock) and os.path.exists(rs._lean)
    return rs


def _http_only(srv: Server) -> RemoteStore:
    rs = srv.remote(retry_for=2.0)
    rs._lean = None
    return rs


def _raw(srv: Server, payload: bytes, *, length: int | None = None) -> tuple[int, Any] | None:
    """Send one frame built here; the decoded answer, or None if the server hung up."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(lean_path(srv.sock))
        s.sendall(FRAME.pack(len(payload) if length is None else length) + payload)
        f = s.makefile("rb")
        head = f.read(4)
        if len(head) < 4:
            return None
        body = f.read(FRAME.unpack(head)[0])
        status, result = msgpack.unpackb(body, raw=False)
        return int(status), result


def test_lean_and_http_give_the_same_answers(server: Server) -> None:
    lean, http = _lean_only(server), _http_only(server)
    name = "caf\udce9 \n\t\"x\\"  # not UTF-8 (a lone byte 0xE9), control characters
    t = Transaction(lean, "v")
    t.write(name, os.urandom(200_000))
    t.write("small", b"hello")
    head = t.commit()
    assert http.head("v", "live") == head
    for store in (lean, http):
        r = Transaction(store, "v")
        assert r.read("small") == b"hello"
        assert r.read(name) == Transaction(http, "v").read(name)
        assert name in [n for n, _e in r.listdir("")]
    before = int(http.admin("GET", "stats")["objects_served"])
    root = lean.snapshot(head).root.ref
    assert root is not None
    assert lean.get_objects([root, root]) == http.get_objects([root, root])
    assert int(http.admin("GET", "stats")["objects_served"]) > before  # it went to the server
    with pytest.raises(NotFound):
        lean.get_object(bytes(32))
    lean.close()
    http.close()


def test_list_answers_entries_and_children_without_content(server: Server) -> None:
    lean = _lean_only(server)
    t = Transaction(lean, "v")
    t.mkdir("d")
    t.write("d/inside", b"x" * 10)
    t.write("small", b"hello")  # inline content, never sent by `list`
    t.symlink("link", "small")
    head = t.commit()
    answer = _raw(server, msgpack.packb(
        ["list", "v", "live", None, [b"", b"small", b"link", b"nope"]], use_bin_type=True))
    assert answer is not None and answer[0] == 0, answer
    result = answer[1]
    assert result["snapshot"] == head
    root, small, link, nope = result["found"]
    assert [name for name, _v in root[1]] == [b"d", b"link", b"small"]
    assert small[1] is None and small[0][5] == 5 and small[0][6] is None and small[0][7] is None
    assert link[0][7] == b"small"  # a symlink's target is what `ls -l` shows
    assert nope is None
    # The same by snapshot prefix; a prefix names a snapshot of that volume only.
    by_prefix = _raw(server, msgpack.packb(["list", "v", None, head[:12], [b"d"]],
                                           use_bin_type=True))
    assert by_prefix is not None and by_prefix[0] == 0
    assert [n for n, _v in by_prefix[1]["found"][0][1]] == [b"inside"]
    lean.close()


def test_a_retried_publish_on_the_lean_stream_is_not_a_conflict(server: Server) -> None:
    from strata.engine.interface import ChangeSet
    from strata.engine.objects import K_FILE, Entry
    from strata.server import wire
    lean = _lean_only(server)
    cs = ChangeSet("v", "live", lean.head("v", "live"),
                   {"a": Entry(K_FILE, 0o644, size=1, data=b"1")})
    body = wire.encode_publish([cs], [], txid=b"t" * 16)
    first = _raw(server, msgpack.packb(["publish", body], use_bin_type=True))
    again = _raw(server, msgpack.packb(["publish", body], use_bin_type=True))
    assert first is not None and again is not None
    assert first[0] == 0 and again[0] == 0
    assert first[1]["heads"] == again[1]["heads"]  # the second is the first, recognised
    lean.close()


@pytest.mark.parametrize("payload", [
    b"",                                         # empty frame
    b"\xc1",                                     # never-used msgpack byte
    msgpack.packb({"op": "get"}),                # not a list
    msgpack.packb(["nosuchop"]),
    msgpack.packb(["get"]),                      # missing argument
    msgpack.packb(["get", b"short"]),            # not 32 bytes
    msgpack.packb(["get", "zz" * 32]),           # not hex
    msgpack.packb(["get_many", [b"x" * 32] * 5000]),  # over the batch limit
    msgpack.packb(["get_many", "notalist"]),
    msgpack.packb(["publish", b"\x93\x01\x02\x03"]),  # not a publish map
    msgpack.packb(["publish", "text, not bytes"]),
    msgpack.packb(["list", "v", "live", None, []]),                 # no paths
    msgpack.packb(["list", "v", "live", None, [b""] * 17]),         # too many paths
    msgpack.packb(["list", "v", "live", "0123abcd", [b""]]),        # a branch and a prefix
    msgpack.packb(["list", "v", None, "xyz", [b""]]),               # not a snapshot prefix
    msgpack.packb(["list", "../v", "live", None, [b""]]),           # not a volume name
    msgpack.packb(["list", "v", "../x", None, [b""]]),              # not a branch name
    msgpack.packb(["list", "v", "live", None, [b"../etc"]]),        # a hostile path
    msgpack.packb(["list", "v", "live", None, ["text, not a bin"]]),
    msgpack.packb(["list", "nosuchvolume", "live", None, [b""]]),
    msgpack.packb([[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]),
])
def test_hostile_frames_are_refused_and_the_server_keeps_serving(server: Server,
                                                                 payload: bytes) -> None:
    answer = _raw(server, payload)
    assert answer is not None
    status, body = answer
    assert status in (400, 404), (status, body)
    assert body["error"] in ("InvalidInput", "NotFound")
    rs = _lean_only(server)
    assert rs.list_volumes() == ["v"]
    assert rs.get_object(bytes.fromhex(rs.head("v", "live")))  # the stream still answers
    rs.close()


def test_an_oversized_frame_is_refused_before_its_body(server: Server) -> None:
    # The length says 1 GiB and no body follows: the answer comes at once (the
    # server never waits for, nor holds, the body), then the connection closes.
    answer = _raw(server, b"", length=MAX_BODY + 1)
    assert answer is not None and answer[0] == 413
    rs = _lean_only(server)
    assert rs.list_volumes() == ["v"]
    rs.close()


def test_a_frame_cut_short_leaves_the_server_serving(server: Server) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(lean_path(server.sock))
        s.sendall(FRAME.pack(1000) + b"\x93" + b"x" * 10)  # then hang up mid-frame
    rs = _lean_only(server)
    t = Transaction(rs, "v")
    t.write("after", b"ok")
    t.commit()
    assert Transaction(rs, "v").read("after") == b"ok"
    rs.close()


def test_without_the_lean_socket_the_client_uses_http(server: Server) -> None:
    os.unlink(lean_path(server.sock))  # as a server from before the lean stream
    rs = server.remote(retry_for=2.0)
    t = Transaction(rs, "v")
    t.write("f", b"x" * 100_000)
    t.commit()
    assert Transaction(rs, "v").read("f") == b"x" * 100_000
    assert rs._lean_after > 0  # it tried once, then stayed on HTTP
    rs.close()


def test_a_publish_larger_than_the_socket_buffer(server: Server) -> None:
    # A 3 MiB publish body (blocks inline) cannot go in one write of a unix socket:
    # the client must send it whole and the server read it whole, under its budget.
    from strata.engine.interface import ChangeSet
    from strata.engine.objects import BLOCK, FILENODE, K_FILE, Entry, FileNode, object_id
    lean = _lean_only(server)
    blocks = [os.urandom(64 * 1024) for _ in range(48)]
    node = FileNode.v1(48 * 64 * 1024, 64 * 1024, tuple(object_id(BLOCK, b) for b in blocks))
    raw = node.encode()
    cs = ChangeSet("v", "live", lean.head("v", "live"),
                   {"big": Entry(K_FILE, 0o644, size=node.size,
                                 ref=object_id(FILENODE, raw))})
    heads = lean.publish([cs], [(BLOCK, b) for b in blocks] + [(FILENODE, raw)])
    assert getattr(lean._local, "lean", None) is not None and lean._lean_after == 0  # lean
    assert lean.head("v", "live") == heads[0]
    assert Transaction(_http_only(server), "v").read("big") == b"".join(blocks)
    lean.close()


def _one_file_changeset(store: RemoteStore, name: str) -> Any:
    from strata.engine.interface import ChangeSet
    from strata.engine.objects import K_DIR, K_FILE, Entry
    return ChangeSet("v", "live", store.head("v", "live"),
                     {"d": Entry(K_DIR, 0o755),
                      f"d/{name}": Entry(K_FILE, 0o644, size=1, data=b"1")})


def test_a_publish_without_prefetch_answers_the_heads_alone(server: Server) -> None:
    from strata.server import wire
    lean = _lean_only(server)
    for prefetch in (True, False):
        body = wire.encode_publish([_one_file_changeset(lean, f"p{prefetch}")], [],
                                   txid=os.urandom(16), prefetch=prefetch)
        answer = _raw(server, msgpack.packb(["publish", body], use_bin_type=True))
        assert answer is not None and answer[0] == 0
        assert len(answer[1]["heads"]) == 1
        assert bool(answer[1]["prefetch"]) is prefetch  # new snapshot + nodes, or nothing
    http = _http_only(server)
    http.prefetch = False
    before = http.head("v", "live")
    head = http.publish([_one_file_changeset(http, "h")])[0]
    assert head != before and head not in http._snap_cache  # nothing came back
    bad = _raw(server, msgpack.packb(["publish", msgpack.packb(
        {"changesets": [], "prefetch": "yes"})], use_bin_type=True))
    assert bad is not None and bad[0] == 400 and "prefetch" in bad[1]["message"]
    lean.close()
    http.close()


def test_prefetched_nodes_are_verified_and_read_without_a_round_trip(server: Server) -> None:
    from strata.engine.objects import TREE, TreeNode, object_id
    rs = _lean_only(server)
    head = rs.publish([_one_file_changeset(rs, "x")])[0]
    root = rs.snapshot(head).root.ref  # came back with the publish
    assert root is not None and root in rs._prefetch_raw
    served = int(rs.admin("GET", "stats")["objects_served"])
    assert TreeNode.decode(rs.get_object(root)) is not None
    assert int(rs.admin("GET", "stats")["objects_served"]) == served  # no request
    # Bytes that do not hash to the id they came under are never kept.
    forged = TreeNode(()).encode()
    rs._prefetched(root.hex(), forged)
    assert root not in rs._prefetch_raw
    assert object_id(TREE, rs.get_object(root)) == root  # read from the server instead
    assert int(rs.admin("GET", "stats")["objects_served"]) == served + 1
    rs.close()


def test_a_clients_caches_stay_bounded_over_many_publishes(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every publish sends back its snapshot and root nodes: what is kept has a bound."""
    from strata.server import client
    monkeypatch.setattr(client, "PREFETCH_KEEP_BYTES", 4096)
    rs = _lean_only(server)
    rs.snapshot_cache_keep = 8
    for i in range(40):
        rs.publish([_one_file_changeset(rs, f"f{i}")])
        assert len(rs._snap_cache) <= 9
    assert rs._prefetch_bytes == sum(len(r) for r in rs._prefetch_raw.values()) <= 4096
    rs.close()


def test_connections_past_the_cap_fall_back_to_http(server: Server,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from strata.server import lean
    held = []
    try:
        for _ in range(lean.MAX_CONNECTIONS):  # idle connections, each holding a thread
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(lean_path(server.sock))
            held.append(s)
        rs = _lean_only(server)
        t = Transaction(rs, "v")
        t.write("capped", b"still served")
        t.commit()  # the stream hangs up on this connection: HTTP answers
        assert rs._lean_after > 0
        assert Transaction(_http_only(server), "v").read("capped") == b"still served"
        rs.close()
    finally:
        for s in held:
            s.close()
    # The threads of the closed connections end; the stream serves again.
    deadline = time.monotonic() + 10
    while True:
        rs = _lean_only(server)
        rs.get_object(bytes.fromhex(rs.head("v", "live")))
        ok = rs._lean_after == 0
        rs.close()
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ok


def test_stop_does_not_wait_for_a_slow_sender_and_lands_nothing_of_it(server: Server) -> None:
    # A request is in flight once its body has arrived: a stop does not wait for
    # a client that is still sending, and that half-sent publish never lands.
    from strata.server import wire
    lean = _lean_only(server)
    before = lean.head("v", "live")
    body = wire.encode_publish([_one_file_changeset(lean, "late")], [], txid=os.urandom(16))
    frame = msgpack.packb(["publish", body], use_bin_type=True)
    lean.close()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(lean_path(server.sock))
        s.sendall(FRAME.pack(len(frame)) + frame[:10])
        time.sleep(0.2)  # the server's thread is reading the body
        t0 = time.monotonic()
        assert server.stop() == 0
        assert time.monotonic() - t0 < 10  # not the 60 s a stalled frame may take
        with contextlib.suppress(OSError):
            s.sendall(frame[10:])
        f = s.makefile("rb")
        head = f.read(4)
        if len(head) == 4:  # answered before the hang-up: a refusal, never a success
            status, _result = msgpack.unpackb(f.read(FRAME.unpack(head)[0]), raw=False)
            assert status == 503
    server.start()
    rs = server.remote()
    assert rs.head("v", "live") == before
    rs.close()


def test_a_file_and_its_blocks_in_one_round_trip(server: Server) -> None:
    from strata.engine.errors import InvalidInput
    lean, http = _lean_only(server), _http_only(server)
    block = os.urandom(64 * 1024)
    t = Transaction(lean, "v")
    t.write("multi", os.urandom(5 * 64 * 1024 + 100))
    t.write("same", block * 3)                       # one block id, three times
    t.write("holes", b"\0" * (3 * 64 * 1024) + b"end")  # holes are never sent
    t.write("big", os.urandom(40 << 20))               # more than one answer holds
    t.commit()
    r, h = Transaction(lean, "v"), Transaction(http, "v")
    for name, (off, n) in [("multi", (70_000, 200_000)), ("multi", (0, None)),
                           ("same", (0, None)), ("holes", (10, None)), ("big", (0, None)),
                           ("multi", (5 * 64 * 1024 + 99, 1)), ("multi", (3, 0))]:
        assert r.read(name, off, n) == h.read(name, off, n), (name, off, n)
    same = r.lookup("same")
    assert same is not None and same.ref is not None
    # Random content may end a file node early (a content-defined boundary), so
    # a file of a few chunks can have inner nodes: count the walk's ids, nodes too.
    walk = list(FileNode.decode(http.get_object(same.ref)).range_ids(0, same.size,
                                                                     http.get_object))
    served = int(http.admin("GET", "stats")["objects_served"])
    assert r.read("same") == block * 3
    # The node, each node below it and each distinct chunk once, in one answer.
    assert int(http.admin("GET", "stats")["objects_served"]) == served + 1 + len(walk)
    e = r.lookup("multi")
    assert e is not None and e.ref is not None
    ref = e.ref
    _node, blocks = lean.get_file(ref, 0, 1 << 40)
    assert len(blocks) == len(list(FileNode.decode(http.get_object(ref)).range_ids(
        0, e.size, http.get_object)))
    root = lean.snapshot(lean.head("v", "live")).root.ref
    assert root is not None
    for bad in ([root, 0, 1], [ref, -1, 5], [ref, 9, 3]):
        with pytest.raises(InvalidInput):
            lean._lean_call("get_file", *bad)
    lean.close()
    http.close()


def test_a_write_into_an_unread_directory_fetches_its_path_in_one_round_trip(
        server: Server) -> None:
    from strata.engine.errors import InvalidInput
    from strata.engine.objects import TREE, TreeNode, object_id
    rs = _lean_only(server)
    t = Transaction(rs, "v")
    for d in range(3):
        t.mkdir(f"d{d}")
        for f in range(300):  # several leaves under an inner node
            t.write(f"d{d}/f{f:03}", b"%d" % f)
    t.commit()
    rs.close()
    cold = _lean_only(server)  # nothing cached: every node is read from the server
    ops: list[str] = []
    real = cold._lean_call

    def counted(*request: Any) -> Any:
        ops.append(str(request[0]))
        return real(*request)

    cold._lean_call = counted  # type: ignore[method-assign]
    t = Transaction(cold, "v")
    ops.clear()
    t.write("d1/new", b"new")
    assert ops == ["get_path"]  # the root's leaf, d1's inner node and the leaf for "new"
    assert t.read("d1/f150") == b"150"
    assert ops == ["get_path", "get"]  # another leaf of d1
    t.commit()
    assert Transaction(_http_only(server), "v").read("d1/new") == b"new"
    # What it answers: each node under its own id, the root first.
    root = cold.snapshot(cold.head("v", "live")).root.ref
    assert root is not None
    got = real("get_path", root, [b"d2", b"f007"])
    assert [object_id(TREE, raw) for _oid, raw in got] == [oid for oid, _raw in got]
    assert got[0][0] == root and TreeNode.decode(got[-1][1]).level == 0
    assert len(got) >= 3  # the root's leaf, then d2's inner node and a leaf
    snap = bytes.fromhex(cold.head("v", "live"))
    for bad in ([snap, [b"x"]], [root, [b"x"] * 5000], [root, ["str"]], [b"\1" * 32, [b"x"]]):
        with pytest.raises((InvalidInput, NotFound)):
            real("get_path", *bad)
    cold.close()
