"""Fuzzing a live TCP server: schemathesis from /openapi.json, hypothesis for publish bodies.

The server listens on loopback TCP; the fuzzer holds a read-write token for
the one volume `v` (which has a file and a second branch). schemathesis
fuzzes every operation of the served API description with valid data
(positive mode) and with data that breaks the description (negative mode),
with the `{volume}` path parameter sometimes pinned to `v` so that requests
get past the token's scope check into the handlers. The description can
only say "binary" of a publish body, so a hypothesis strategy builds
structured msgpack publish bodies too: near-valid change sets with hostile
paths, numbers, references and object batches.

No 5xx, ever. And "no state change from a refused request", precisely:
around every request the owner (over the unix socket) records every volume,
every branch head, the token list and the engine's counters of commits,
objects and bytes written; if the answer is 4xx, all of it must be
identical afterwards. A 2xx may change it (a fork creates a branch).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from serverutil import Server, cli, free_port
from strata.engine.local import init_store
from strata.engine.txn import Transaction
from strata.server.client import RemoteStore
from strata.server.openapi import OPENAPI

# Per operation and mode (18 x 2 x 6 = 216 requests); raise it to hunt: STRATA_FUZZ_EXAMPLES=200.
EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "6"))
OPERATIONS = [f"{method.upper()} {path}" for path, item in OPENAPI["paths"].items()
              for method in item]

# Publish bodies are msgpack: send what the fuzzer makes as raw bytes.
schemathesis.serializer.alias("application/msgpack", "application/octet-stream")


class Fuzz:
    def __init__(self, server: Server, token: str) -> None:
        self.server = server
        self.token = token
        self.owner = server.remote(retry_for=5.0)
        self.schema = schemathesis.openapi.from_url(f"{server.tcp_url}/openapi.json")
        self.ops = {op.label: op for op in (r.ok() for r in self.schema.get_all_operations())}
        self.seen: dict[str, dict[int, int]] = {}

    def state(self) -> dict[str, Any]:
        stats = self.owner.admin("GET", "stats")
        return {
            "branches": {v: self.owner.list_branches(v) for v in self.owner.list_volumes()},
            "tokens": self.owner.admin("GET", "tokens"),
            "written": {k: stats[k] for k in ("commits", "objects_written", "bytes_written")},
        }


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzz]:
    store = tmp_path_factory.mktemp("fuzz") / "store"
    init_store(str(store))
    server = Server(store, tcp_port=free_port()).start()
    try:
        with RemoteStore(server.unix_url, retry_for=5.0) as owner:
            owner.create_volume("v")
            owner.create_volume("other")
            t = Transaction(owner, "v")
            t.write("f", b"fuzz me")
            head = t.commit()
            owner.fork("v", "side", at=head)
        p = cli("token", "create", "v", "--rw", "--json", store=store)
        assert p.returncode == 0, p.stderr
        f = Fuzz(server, json.loads(p.stdout)["token"])
        yield f
        f.owner.close()
        log = server.log.read_text(errors="replace")
        assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]
    finally:
        server.stop()


def test_the_served_description_lists_every_operation(fuzz: Fuzz) -> None:
    assert sorted(fuzz.ops) == sorted(OPERATIONS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=lambda m: m.value)
@pytest.mark.parametrize("label", OPERATIONS)
def test_fuzz_operation(fuzz: Fuzz, label: str, mode: GenerationMode) -> None:
    op = fuzz.ops[label]
    strategy = op.as_strategy(generation_mode=mode)
    if "{volume}" in op.path:
        strategy = st.one_of(strategy, op.as_strategy(generation_mode=mode,
                                                      path_parameters={"volume": "v"}))
    seen = fuzz.seen.setdefault(f"{label} {mode.value}", {})

    @given(case=strategy)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        before = fuzz.state()
        headers = {"Authorization": f"Bearer {fuzz.token}"}
        response = case.call(base_url=fuzz.server.tcp_url, headers=headers)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        checks = [not_a_server_error]
        if mode is GenerationMode.POSITIVE:
            checks += [status_code_conformance, content_type_conformance,
                       response_schema_conformance]
        case.validate_response(response, checks=checks)
        if 400 <= response.status_code < 500:
            assert fuzz.state() == before, (label, response.status_code, response.text[:300])

    run()
    assert sum(seen.values()) > 0


# -- the msgpack layer: structured publish bodies --------------------------------------------

# Any msgpack value, small.
PACKABLE = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)
NAMES = st.sampled_from(["f", "d", "d/f", "new", "..", "a/../b", "/abs", "a//b", "", "x\0y",
                         "n" * 256, "é" * 200])
INTS = st.one_of(st.integers(0, 0o7777), st.integers(-2**63, 2**64 - 1))


@st.composite
def entries(draw: st.DrawFn) -> Any:
    """Mostly well-formed 12-field entries with hostile numbers, refs and inline data."""
    if draw(st.integers(0, 9)) == 0:
        return draw(PACKABLE)
    data = draw(st.none() | st.binary(max_size=20))
    return [draw(st.integers(0, 9)), draw(INTS), draw(INTS), draw(INTS), draw(INTS),
            len(data) if data is not None and draw(st.booleans()) else draw(INTS),
            draw(st.none() | st.binary(min_size=31, max_size=33)), data, draw(INTS),
            draw(st.none() | st.lists(st.lists(st.binary(max_size=4), min_size=2, max_size=2),
                                      max_size=2)),
            draw(INTS), draw(INTS)]


@st.composite
def object_batches(draw: st.DrawFn) -> bytes:
    """Records of any kind whose bytes are packed junk; ids right more often than not."""
    from strata.engine.objects import object_id, packb
    from strata.server import wire
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.integers(0, 5))
        raw = packb(draw(PACKABLE)) if draw(st.booleans()) else draw(st.binary(max_size=64))
        oid = object_id(kind, raw) if draw(st.integers(0, 3)) else bytes(32)
        out += wire.OBJ_HEAD.pack(kind, oid, len(raw)) + raw
    return out


@st.composite
def publish_bodies(draw: st.DrawFn, heads: dict[str, str]) -> bytes:
    from strata.engine.objects import EMPTY_SNAPSHOT_ID, packb
    changesets = []
    for _ in range(draw(st.integers(1, 2))):
        cs: dict[str, Any] = {
            "volume": draw(st.sampled_from(["v", "v", "other", "nope", 5])),
            "branch": draw(st.sampled_from(["live", "side", "gone", "", None])),
            "base": draw(st.sampled_from([heads["live"], heads["side"], EMPTY_SNAPSHOT_ID,
                                          "zz", "0" * 64, None])),
            "changes": draw(st.lists(st.tuples(NAMES, st.none() | entries()).map(list),
                                     max_size=3) | PACKABLE),
        }
        for key in ("message", "meta", "lease"):
            if draw(st.booleans()):
                cs[key] = draw(PACKABLE)
        changesets.append(cs if draw(st.integers(0, 9)) else draw(PACKABLE))
    body = {"changesets": changesets,
            "objects": draw(st.none() | object_batches())}
    return packb(body)


def test_fuzz_publish_bodies(fuzz: Fuzz) -> None:
    import http.client

    heads = fuzz.owner.list_branches("v")
    seen: dict[int, int] = {}

    @given(body=publish_bodies(heads))
    @settings(max_examples=EXAMPLES * 20, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(body: bytes) -> None:
        before = fuzz.state()
        assert fuzz.server.tcp_port is not None
        conn = http.client.HTTPConnection("127.0.0.1", fuzz.server.tcp_port, timeout=30)
        try:
            conn.request("POST", "/v1/publish", body=body, headers={
                "Content-Type": "application/msgpack",
                "Authorization": f"Bearer {fuzz.token}"})
            resp = conn.getresponse()
            reply = json.loads(resp.read())
        finally:
            conn.close()
        seen[resp.status] = seen.get(resp.status, 0) + 1
        assert resp.status < 500, reply
        if resp.status >= 400:
            assert reply["error"] and reply["message"]
            assert fuzz.state() == before, (resp.status, reply)

    run()
    assert sum(n for s, n in seen.items() if 400 <= s < 500) > 0, seen


# -- stateful: sequences along the description's links -----------------------------------------

STATEFUL_EXAMPLES = int(os.environ.get("STRATA_FUZZ_STATEFUL", "6"))


def test_fuzz_stateful_sequences(fuzz: Fuzz) -> None:
    """Sequences as a client makes them, along the description's links.

    Fork, list, resolve the head, fork again, lease, renew, release, delete,
    with generated data between.
    Same rules at every step: no 5xx, answers that match the description, and a
    refused request changes nothing. Each sequence gets a fresh volume like `v`
    (a file, branches `live` and `side`) and a read-write token for it, so every
    sequence starts from the same state (hypothesis replays sequences and needs
    that), and volumes are pinned to it so that sequences get past the scope
    check (the single-operation fuzzing above covers other volumes).
    """
    steps: dict[str, int] = {}
    made = [0]

    class Workflow(fuzz.schema.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            made[0] += 1
            self.volume = f"seq{made[0]}"
            fuzz.owner.create_volume(self.volume)
            t = Transaction(fuzz.owner, self.volume)
            t.write("f", b"fuzz me")
            fuzz.owner.fork(self.volume, "side", at=t.commit())
            self.token = fuzz.owner.admin("POST", "tokens", {
                "volume": self.volume, "writable": True})["token"]

        def before_call(self, case: Any) -> None:
            if case.path_parameters and "volume" in case.path_parameters:
                case.path_parameters["volume"] = self.volume
            if case.query and "volume" in case.query:
                case.query["volume"] = self.volume
            self.before = fuzz.state()

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": fuzz.server.tcp_url,
                    "headers": {"Authorization": f"Bearer {self.token}"}}

        def validate_response(self, response: Any, case: Any, *args: Any,
                              **kwargs: Any) -> None:
            key = f"{case.operation.label} {response.status_code}"
            steps[key] = steps.get(key, 0) + 1
            case.validate_response(response, checks=[
                not_a_server_error, status_code_conformance, content_type_conformance,
                response_schema_conformance])
            if 400 <= response.status_code < 500:
                assert fuzz.state() == self.before, (key, response.text[:300])

    Workflow.run(settings=settings(max_examples=STATEFUL_EXAMPLES, stateful_step_count=8,
                                   deadline=None, database=None,
                                   suppress_health_check=list(HealthCheck)))
    print("stateful steps by operation and status:", json.dumps(steps, sort_keys=True))
    # The chains really ran: a fork, then the lease it links to, granted.
    assert any(k.startswith("POST /v1/volumes/{volume}/branches 201") for k in steps), steps
