"""TCP access with bearer tokens, driven from the CLI against a real `strata serve`.

One server per module listens on its unix socket (the owner: creates tokens,
checks the store) and on a loopback TCP port (token holders only). Volumes
`a` and `b` hold a file each. Every refusal is checked twice: the caller sees
the right error, and the owner sees nothing changed.
"""

from __future__ import annotations

import hmac
import http.client
import json
import os
import stat
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from serverutil import Server, cli, free_port
from strata.engine.errors import (
    Forbidden,
    InvalidInput,
    NotFound,
    Unauthenticated,
    Unavailable,
)
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
from strata.engine.txn import Transaction
from strata.server import tokens as tokens_mod
from strata.server import wire
from strata.server.client import RemoteStore


class Env:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.store = server.store_dir
        self.owner = server.remote(retry_for=5.0)

    def token(self, scope: str, *flags: str) -> dict[str, Any]:
        """`strata token create SCOPE FLAGS --json` over the owner's socket."""
        p = cli("token", "create", scope, *flags, "--json", store=self.store)
        assert p.returncode == 0, p.stderr
        tok: dict[str, Any] = json.loads(p.stdout)
        assert tok["token"].startswith(f"strata_{tok['id']}_")
        return tok

    def as_token(self, token: str, *args: str, input: bytes | None = None
                 ) -> tuple[int, str, str]:
        """A CLI command over TCP with `token`: (exit code, stdout, stderr)."""
        p = cli(*args, server=self.server.tcp_url, token=token, input=input)
        return p.returncode, p.stdout.decode(), p.stderr.decode()

    def http(self, method: str, path: str, token: str | None = None,
             body: Any = None) -> tuple[int, Any]:
        """One raw request over TCP: (status, decoded JSON body)."""
        assert self.server.tcp_port is not None
        conn = http.client.HTTPConnection("127.0.0.1", self.server.tcp_port, timeout=30)
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        return resp.status, json.loads(data) if data else None

    def state(self) -> dict[str, dict[str, str]]:
        """Every volume's branches and heads, as the owner sees them."""
        return {v: self.owner.list_branches(v) for v in self.owner.list_volumes()}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    store = tmp_path_factory.mktemp("tokens") / "store"
    init_store(str(store))
    server = Server(store, tcp_port=free_port()).start()
    e = Env(server)
    try:
        for vol, content in (("a", b"alpha\n"), ("b", b"bravo secret\n")):
            assert cli("volume", "create", vol, store=store).returncode == 0
            assert cli("put", vol, "f.txt", input=content, store=store).returncode == 0
        yield e
    finally:
        e.owner.close()
        server.stop()


def tcp_store(env: Env, token: str) -> RemoteStore:
    return RemoteStore(env.server.tcp_url, token, retry_for=5.0)


# -- no token, bad tokens ---------------------------------------------------------------------

def test_tcp_refuses_requests_without_a_valid_token(env: Env) -> None:
    for path in ("/v1/volumes", "/v1/info", "/v1/volumes/a/branches"):
        status, body = env.http("GET", path)
        assert status == 401, (path, body)
        assert body["error"] == "Unauthenticated" and "token" in body["message"]
    tok = env.token("a", "--ro")
    tid = tok["id"]
    for bad in ("junk", f"strata_{tid}_wrong-secret", f"strata_{tid}", "strata_nope_x",
                tok["token"] + "x"):
        status, body = env.http("GET", "/v1/volumes", token=bad)
        assert status == 401, (bad, body)
    assert env.http("GET", "/v1/volumes", token=tok["token"]) == (200, {"volumes": ["a"]})
    # The API description is public; the CLI without a token is refused.
    status, body = env.http("GET", "/openapi.json")
    assert status == 200 and "/v1/publish" in body["paths"]
    rc, _out, err = env.as_token("", "ls", "a")
    assert rc == 1 and "bearer token" in err


def test_unix_socket_and_tokens_file_are_owner_only(env: Env) -> None:
    st = os.stat(env.server.sock)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    env.token("a", "--ro")
    assert stat.S_IMODE(os.stat(env.store / "tokens.json").st_mode) == 0o600


def test_tokens_are_stored_only_as_hashes(env: Env) -> None:
    tok = env.token("a", "--rw")
    secret = tok["token"].split("_", 2)[2]
    text = (env.store / "tokens.json").read_text()
    assert tok["id"] in text
    assert secret not in text and tok["token"] not in text
    doc = json.loads(text)
    assert set(doc["tokens"][tok["id"]]) >= {"hash", "volume", "writable"}
    p = cli("token", "list", "--json", store=env.store)
    assert p.returncode == 0 and tok["id"] in p.stdout.decode()
    assert secret not in p.stdout.decode()


# -- read-only and read-write -------------------------------------------------------------------

def test_read_only_token_reads_but_never_writes(env: Env) -> None:
    tok = env.token("a", "--ro")["token"]
    before = env.state()
    assert env.as_token(tok, "ls", "a")[:2] == (0, "f.txt\n")
    assert env.as_token(tok, "cat", "a", "f.txt")[:2] == (0, "alpha\n")
    head = before["a"]["live"]
    assert env.as_token(tok, "cat", f"a#{head[:12]}", "f.txt")[:2] == (0, "alpha\n")
    for args, stdin in ((("put", "a", "new.txt"), b"no"), (("rm", "a", "f.txt"), None),
                        (("fork", "a", "exp"), None),
                        (("branch", "delete", "a@live", "--force"), None)):
        rc, _out, err = env.as_token(tok, *args, input=stdin)
        assert rc == 1 and "read-only" in err, (args, rc, err)
    with tcp_store(env, tok) as remote:
        with pytest.raises(Forbidden, match="read-only"):
            remote.acquire_lease("a", "live", ttl=30)
        with pytest.raises(Forbidden, match="read-only"):
            remote.put_objects([(1, b"a block")])
        with pytest.raises(Forbidden, match="read-only"):
            remote.publish([ChangeSet("a", "live", head, {
                "x": Entry(kind=K_FILE, size=1, data=b"x")})])
    assert env.state() == before


def test_read_write_token_puts_forks_and_leases(env: Env) -> None:
    tok = env.token("a", "--rw")["token"]
    rc, out, err = env.as_token(tok, "put", "a", "rw.txt", input=b"written over tcp")
    assert rc == 0, err
    sid = out.strip()
    assert env.owner.head("a", "live") == sid
    assert env.as_token(tok, "cat", "a", "rw.txt")[:2] == (0, "written over tcp")
    rc, out, err = env.as_token(tok, "fork", "a", "rw-fork")
    assert rc == 0 and out.strip() == sid, err
    with tcp_store(env, tok) as remote:
        lease = remote.acquire_lease("a", "rw-fork", ttl=30, holder="tcp")
        remote.release_lease("a", "rw-fork", lease.id)
        remote.delete_branch("a", "rw-fork")
    assert "rw-fork" not in env.owner.list_branches("a")


# -- one volume, one branch -----------------------------------------------------------------------

def test_a_token_for_one_volume_sees_nothing_of_another(env: Env) -> None:
    tok = env.token("a", "--rw")["token"]
    before = env.state()
    b_head = before["b"]["live"]
    rc, out, _err = env.as_token(tok, "volume", "list")
    assert (rc, out) == (0, "a\n")
    for args in (("branch", "list", "b"), ("ls", "b"), ("cat", "b", "f.txt"),
                 ("log", "b"), ("ls", f"b#{b_head[:12]}"), ("fork", "b", "mine")):
        rc, out, err = env.as_token(tok, *args)
        assert rc != 0 and "bravo" not in out, (args, rc, out, err)
        assert b_head not in out + err
    rc, _out, err = env.as_token(tok, "put", "b", "x", input=b"x")
    assert rc == 1 and "volume 'b'" in err
    # b's snapshot cannot be found from a's side, and the refusal does not name it.
    status, body = env.http("GET", f"/v1/snapshots/{b_head[:8]}", token=tok)
    assert status == 404 and b_head not in json.dumps(body), body
    status, body = env.http("GET", f"/v1/snapshots/{b_head[:8]}?volume=b", token=tok)
    assert status == 403, body
    # Nor used as a fork point or as a publish base in a's volume.
    with tcp_store(env, tok) as remote:
        assert remote.list_volumes() == ["a"]
        with pytest.raises(NotFound):
            remote.fork("a", "stolen", at=b_head)
        with pytest.raises(NotFound):
            remote.publish([ChangeSet("a", "live", b_head, {})])
        with pytest.raises(Forbidden):
            remote.publish([ChangeSet("b", "live", b_head, {
                "x": Entry(kind=K_FILE, size=1, data=b"x")})])
        with pytest.raises(Forbidden):
            remote.create_volume("c")
        with pytest.raises(Forbidden):
            remote.delete_volume("b")
    assert env.state() == before


def test_a_branch_token_writes_only_its_branch(env: Env) -> None:
    env.owner.fork("a", "exp", at=env.owner.head("a", "live"))
    tok = env.token("a@exp", "--rw")["token"]
    before = env.state()
    rc, out, err = env.as_token(tok, "put", "a@exp", "e.txt", input=b"on exp")
    assert rc == 0, err
    assert env.owner.head("a", "exp") == out.strip()
    # Other branches are out of sight (not found), and out of reach for writes.
    rc, out, _err = env.as_token(tok, "branch", "list", "a", "--json")
    assert rc == 0 and [b["name"] for b in json.loads(out)] == ["exp"]
    for args in (("put", "a", "e.txt"), ("put", "a@live", "e.txt")):
        rc, _out, err = env.as_token(tok, *args, input=b"no")
        assert rc == 4 and "no branch 'live'" in err, (args, err)
    rc, _out, err = env.as_token(tok, "fork", "a@exp", "other")
    assert rc == 1 and "not valid for branch 'other'" in err, err
    with tcp_store(env, tok) as remote:
        with pytest.raises(Forbidden, match="not valid for branch 'live'"):
            remote.publish([ChangeSet("a", "live", before["a"]["live"], {
                "e.txt": Entry(kind=K_FILE, size=2, data=b"no")})])
        with pytest.raises(Forbidden, match="not valid for branch 'live'"):
            remote.acquire_lease("a", "live", ttl=30)
        with pytest.raises(Forbidden, match="not valid for branch 'live'"):
            remote.delete_branch("a", "live")
    after = env.state()
    assert after["a"]["live"] == before["a"]["live"] and after["b"] == before["b"]
    assert set(after["a"]) == set(before["a"])


# -- revocation, expiry, administration -----------------------------------------------------------

def test_revoked_tokens_are_refused(env: Env) -> None:
    by_id, by_token = env.token("a", "--ro"), env.token("a", "--ro")
    for tok in (by_id, by_token):
        assert env.as_token(tok["token"], "ls", "a")[0] == 0
    assert cli("token", "revoke", by_id["id"], store=env.store).returncode == 0
    assert cli("token", "revoke", by_token["token"], store=env.store).returncode == 0
    for tok in (by_id, by_token):
        rc, _out, err = env.as_token(tok["token"], "ls", "a")
        assert rc == 1 and "revoked" in err, err
        assert env.http("GET", "/v1/volumes", token=tok["token"])[0] == 401
    listed = cli("token", "list", "--json", store=env.store).stdout.decode()
    assert by_id["id"] not in listed and by_token["id"] not in listed
    p = cli("token", "revoke", by_id["id"], store=env.store)
    assert p.returncode == 4  # already gone: not found


def test_tokens_expire(env: Env) -> None:
    tok = env.token("a", "--ro", "--ttl", "1")
    assert tok["expires"] is not None
    assert env.http("GET", "/v1/volumes", token=tok["token"])[0] == 200
    time.sleep(max(0.0, tok["expires"] - time.time()) + 0.1)
    status, body = env.http("GET", "/v1/volumes", token=tok["token"])
    assert status == 401 and "expired" in body["message"]
    rc, _out, err = env.as_token(tok["token"], "ls", "a")
    assert rc == 1 and "expired" in err


def test_an_unknown_token_id_costs_what_a_known_one_costs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 10: a wrong secret under a known id and under an unknown id take the same work.

    An unknown id used to cost one hash more (4.7 against 3.5 us), which told
    which ids exist. Measured here in process, interleaved, as the median of
    many rounds (a network would only add noise); then checked by structure:
    both paths hash once and compare once, in constant time.
    """
    store = tokens_mod.TokenStore(str(tmp_path))
    _tok, info = store.create("v", None, False, None)
    known = f"strata_{info.id}_{'x' * 43}"
    unknown = f"strata_{'0' * 12}_{'x' * 43}"
    assert info.id != "0" * 12

    def cost(token: str, n: int = 100) -> float:
        refused = 0
        t0 = time.perf_counter()
        for _ in range(n):
            try:
                store.verify(token)
            except Unauthenticated:
                refused += 1
        took = time.perf_counter() - t0
        assert refused == n
        return took

    rounds: dict[str, list[float]] = {known: [], unknown: []}
    for _ in range(150):
        for tok in (known, unknown):
            rounds[tok].append(cost(tok))
    ratio = statistics.median(rounds[unknown]) / statistics.median(rounds[known])
    print(f"unknown id / known id: {ratio:.3f}")
    assert 0.9 < ratio < 1.1, ratio

    calls: dict[str, int] = {"hash": 0, "compare": 0}
    real_hash, real_compare = tokens_mod._hash, hmac.compare_digest

    def counted_hash(secret: str) -> str:
        calls["hash"] += 1
        return real_hash(secret)

    def counted_compare(a: Any, b: Any) -> bool:
        calls["compare"] += 1
        return real_compare(a, b)

    monkeypatch.setattr(tokens_mod, "_hash", counted_hash)
    monkeypatch.setattr(tokens_mod.hmac, "compare_digest", counted_compare)
    for tok in (known, unknown):
        calls.update(hash=0, compare=0)
        with pytest.raises(Unauthenticated):
            store.verify(tok)
        assert calls == {"hash": 1, "compare": 1}, (tok, calls)


def test_administration_is_refused_over_tcp(env: Env) -> None:
    tok = env.token("a", "--rw")["token"]
    before = env.state()
    tokens_before = (env.store / "tokens.json").read_bytes()
    for method, path, body in (
            ("GET", "/v1/admin/tokens", None),
            ("POST", "/v1/admin/tokens", {"volume": "b", "writable": True}),
            ("DELETE", f"/v1/admin/tokens/{tok.split('_')[1]}", None),
            ("GET", "/v1/admin/stats", None),
            ("POST", "/v1/admin/fsck", {"rebuild_index": True}),
            ("POST", "/v1/admin/handoff", {}),
            ("POST", "/v1/admin/stop", {})):
        status, reply = env.http(method, path, token=tok, body=body)
        assert status == 403, (path, status, reply)
        assert "owner" in reply["message"]
        assert env.http(method, path, body=body)[0] == 401
    rc, _out, err = env.as_token(tok, "token", "create", "b", "--rw")
    assert rc == 1 and "owner" in err
    assert (env.store / "tokens.json").read_bytes() == tokens_before
    assert env.state() == before
    # Still serving: the refused stop and handoff did nothing.
    assert env.http("GET", "/v1/volumes", token=tok) == (200, {"volumes": ["a"]})
    with tcp_store(env, tok) as remote:
        with pytest.raises(Unauthenticated):
            RemoteStore(env.server.tcp_url, None, retry_for=1.0).list_volumes()
        assert remote.list_volumes() == ["a"]


def test_another_writer_cannot_use_or_end_a_lease(env: Env) -> None:
    """Finding 5: fencing numbers are guessable, lease ids are not."""
    holder_tok = env.token("a", "--rw")["token"]
    other_tok = env.token("a", "--rw")["token"]
    holder, other = tcp_store(env, holder_tok), tcp_store(env, other_tok)
    try:
        lease = holder.acquire_lease("a", "live", ttl=30, holder="the holder")
        head = other.head("a", "live")
        for n in range(max(1, lease.fencing - 2), lease.fencing + 3):
            status, body = env.http("POST", "/v1/volumes/a/lease/release", other_tok,
                                    {"branch": "live", "fencing": n})
            assert status == 400, body  # a bare fencing number is no longer accepted
            for guess in (str(n), f"{n}.{'0' * 32}"):
                with pytest.raises(Forbidden):
                    other.publish([ChangeSet("a", "live", head, {}, lease=guess)])
                with pytest.raises(Forbidden):
                    other.renew_lease("a", "live", guess, ttl=30)
        with pytest.raises(Unavailable):  # still the holder's
            other.acquire_lease("a", "live", ttl=30)
        holder.release_lease("a", "live", lease.id)
        other.release_lease("a", "live", other.acquire_lease("a", "live", ttl=30).id)
    finally:
        holder.close()
        other.close()


def test_a_token_is_bound_to_its_volume_not_its_name(env: Env) -> None:
    """Finding 6: no token for a volume that does not exist; none outlives its volume."""
    p = cli("token", "create", "nosuch", "--rw", "--json", store=env.store)
    assert p.returncode != 0 and b"nosuch" in p.stderr
    assert cli("volume", "create", "ephemeral", store=env.store).returncode == 0
    tok = env.token("ephemeral", "--rw")["token"]
    assert env.as_token(tok, "ls", "ephemeral")[0] == 0
    assert cli("volume", "delete", "ephemeral", store=env.store).returncode == 0
    assert cli("volume", "create", "ephemeral", store=env.store).returncode == 0
    assert cli("put", "ephemeral", "secret", input=b"new owner's data",
               store=env.store).returncode == 0
    status, body = env.http("GET", "/v1/volumes/ephemeral/branches", tok)
    assert status == 401, body
    rc, _out, err = env.as_token(tok, "cat", "ephemeral", "secret")
    assert rc != 0 and "new owner" not in _out


def test_another_volumes_snapshot_is_answered_as_if_it_did_not_exist(env: Env) -> None:
    """Finding 2: 'exists elsewhere' and 'does not exist' get the same answer."""
    tok = env.token("a", "--rw")["token"]
    b_head = env.owner.head("b", "live")
    nowhere = "f" * 64 if not b_head.startswith("f") else "e" * 64
    a_head = env.owner.head("a", "live")

    def answers(sid: str) -> list[tuple[int, str]]:
        out = []
        for method, path, body in (
                ("GET", f"/v1/snapshots/{sid[:12]}", None),
                ("GET", f"/v1/snapshots/{sid}", None),
                ("POST", "/v1/volumes/a/branches", {"name": "probe", "at": sid})):
            status, reply = env.http(method, path, tok, body)
            out.append((status, json.dumps(reply).replace(sid[:12] if "snapshots/" in path
                                                          and len(path) < 40 else sid, "ID")))
        with tcp_store(env, tok) as remote:
            try:
                remote.publish([ChangeSet("a", "live", sid, {})])
                out.append((200, ""))
            except NotFound as exc:
                out.append((404, str(exc).replace(sid, "ID")))
        return out

    theirs, missing = answers(b_head), answers(nowhere)
    assert theirs == missing, (theirs, missing)
    assert all(status == 404 for status, _ in theirs), theirs
    # The token's own history still resolves, by prefix too.
    status, body = env.http("GET", f"/v1/snapshots/{a_head[:12]}", tok)
    assert (status, body) == (200, {"id": a_head})


# -- objects: an id learned elsewhere is not a capability ----------------------------------------

def _raw(env: Env, method: str, path: str, token: str, body: bytes = b"") -> tuple[int, bytes]:
    assert env.server.tcp_port is not None
    conn = http.client.HTTPConnection("127.0.0.1", env.server.tcp_port, timeout=30)
    try:
        conn.request(method, path, body=body or None,
                     headers={"Authorization": f"Bearer {token}",
                              "Content-Type": "application/octet-stream"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _ids_of_big_file(env: Env, volume: str, path: str) -> tuple[bytes, bytes, bytes]:
    """(root tree, file node, first block) of a file, read with the owner's rights."""
    snap = env.owner.snapshot(env.owner.head(volume, "live"))
    entry = Transaction(env.owner, volume).lookup(path)
    assert entry is not None and entry.ref is not None and snap.root.ref is not None
    node = FileNode.decode(env.owner.get_object(entry.ref))  # chunking may give it inner nodes
    return snap.root.ref, entry.ref, node.all_block_ids(env.owner.get_object)[0]


def test_an_object_of_another_volume_reads_exactly_as_a_missing_one(env: Env) -> None:
    big = os.urandom(300_000)
    assert cli("put", "b", "big.bin", input=big, store=env.store).returncode == 0
    tok = env.token("a", "--ro")["token"]
    nowhere = os.urandom(32)

    def answers(oid: bytes) -> list[tuple[int, bytes]]:
        out = [_raw(env, "GET", f"/v1/objects/{oid.hex()}", tok),
               _raw(env, "POST", "/v1/objects/get", tok, wire.encode_ids([oid])),
               _raw(env, "POST", "/v1/objects/missing", tok, wire.encode_ids([oid]))]
        return [(st, body.replace(oid.hex().encode(), b"ID").replace(oid, b"ID"))
                for st, body in out]

    expected = answers(nowhere)
    assert [st for st, _b in expected] == [404, 404, 200]
    for oid in _ids_of_big_file(env, "b", "big.bin"):
        assert env.owner.get_object(oid)  # it exists
        assert answers(oid) == expected
    # The token's own volume reads as before, over the same requests.
    assert cli("put", "a", "big.bin", input=big[:200_000], store=env.store).returncode == 0
    for oid in _ids_of_big_file(env, "a", "big.bin"):
        status, body = _raw(env, "GET", f"/v1/objects/{oid.hex()}", tok)
        assert status == 200 and body == env.owner.get_object(oid)
        assert _raw(env, "POST", "/v1/objects/missing", tok, wire.encode_ids([oid])) == (200, b"")
    assert env.server.tcp_url is not None
    p = cli("cat", "a", "big.bin", server=env.server.tcp_url, token=tok)
    assert (p.returncode, p.stdout) == (0, big[:200_000]), p.stderr


def test_naming_another_volumes_object_in_a_publish_makes_it_no_more_readable(
        env: Env) -> None:
    """A writer of a cannot claim b's objects by putting their ids in its own tree."""
    big = os.urandom(300_000)
    assert cli("put", "b", "claim.bin", input=big, store=env.store).returncode == 0
    _root, b_node, b_block = _ids_of_big_file(env, "b", "claim.bin")
    tok = env.token("a", "--rw")["token"]
    before = env.state()

    def refusal(publish: Callable[[RemoteStore, bytes], object], oid: bytes) -> str:
        with tcp_store(env, tok) as remote, pytest.raises(InvalidInput) as err:
            publish(remote, oid)
        return str(err.value).replace(oid.hex(), "ID")

    def by_entry(remote: RemoteStore, oid: bytes) -> object:
        return remote.publish([ChangeSet("a", "live", remote.head("a", "live"), {
            "stolen": Entry(kind=K_FILE, size=len(big), ref=oid)})])

    def by_file_node(remote: RemoteStore, oid: bytes) -> object:
        node = FileNode.v1(size=65536, block_size=65536, blocks=(oid,)).encode()
        return remote.publish([ChangeSet("a", "live", remote.head("a", "live"), {
            "stolen": Entry(kind=K_FILE, size=65536, ref=object_id(FILENODE, node))})],
            [(FILENODE, node)])

    def by_tree_node(remote: RemoteStore, oid: bytes) -> object:
        tree = TreeNode(0, entries=((b"f", Entry(kind=K_FILE, size=len(big), ref=oid)),))
        raw = tree.encode()
        return remote.publish([ChangeSet("a", "live", remote.head("a", "live"), {
            "d": Entry(kind=K_DIR, mode=0o755, ref=object_id(TREE, raw))})], [(TREE, raw)])

    for publish, oid in ((by_entry, b_node), (by_file_node, b_block), (by_tree_node, b_node)):
        assert refusal(publish, oid) == refusal(publish, os.urandom(32)), publish.__name__
    assert env.state() == before
    # A file node uploaded ahead that names b's block: the upload is the writer's own
    # bytes, but the block it names stays out of reach.
    node = FileNode.v1(size=65536, block_size=65536, blocks=(b_block,)).encode()
    status, _body = _raw(env, "POST", "/v1/objects", tok, wire.encode_objects([(FILENODE, node)]))
    assert status == 200
    with tcp_store(env, tok) as remote:
        with pytest.raises(InvalidInput, match="the store lacks"):
            remote.publish([ChangeSet("a", "live", remote.head("a", "live"), {
                "stolen": Entry(kind=K_FILE, size=65536, ref=object_id(FILENODE, node))})])
        with pytest.raises(NotFound):
            remote.get_object(b_block)
    assert env.state() == before


def test_a_snapshot_the_owner_brings_into_a_volume_becomes_readable_to_it(env: Env) -> None:
    """Reach follows history: an owner's fork of b's snapshot into a opens its objects to a."""
    big = os.urandom(200_000)
    assert cli("put", "b", "shared.bin", input=big, store=env.store).returncode == 0
    ids = _ids_of_big_file(env, "b", "shared.bin")
    tok = env.token("a", "--ro")["token"]
    assert _raw(env, "GET", f"/v1/objects/{ids[2].hex()}", tok)[0] == 404
    env.owner.fork("a", "from-b", at=env.owner.head("b", "live"))
    try:
        for oid in ids:
            assert _raw(env, "GET", f"/v1/objects/{oid.hex()}", tok) == (
                200, env.owner.get_object(oid))
    finally:
        env.owner.delete_branch("a", "from-b")


def test_a_branch_token_is_told_which_branch_it_is_for(env: Env) -> None:
    """A new user with a token for a@exp ran `strata ls a` and read "no branch 'live'"."""
    assert cli("fork", "a", "scoped", store=env.store).returncode == 0
    tok = env.token("a@scoped", "--ro")["token"]
    rc, _out, err = env.as_token(tok, "ls", "a")
    assert rc == 2 and "this token is for a@scoped" in err, (rc, err)
    assert env.as_token(tok, "ls", "a@scoped")[0] == 0


def test_only_a_writer_of_the_branch_announces_a_failed_step(env: Env) -> None:
    ro = env.token("a", "--ro")["token"]
    other = env.token("b", "--rw")["token"]
    rw = env.token("a", "--rw")["token"]
    for tok in (ro, other):
        with tcp_store(env, tok) as remote, pytest.raises(Forbidden):
            remote.note_step("a", "live", "r1", 1)
    with tcp_store(env, rw) as remote:
        remote.note_step("a", "live", "r1", 1, argv=["make"])
        with pytest.raises(InvalidInput):
            remote.note_step("a", "live", "not a run id!", 1)
        with pytest.raises(InvalidInput):
            remote.note_step("a", "live", "r1", 999)
