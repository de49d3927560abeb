"""A fenced workspace says so: what a new user lost without an error.

Workspace `box` was attached at a directory; `strata run --root ws:box` took it
over; then a write and `sync` there, and `workspace detach`, all returned 0,
and the file was not in the store.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from ws_harness import WsEnv, tiny_root


def test_a_fenced_attach_is_listed_and_its_detach_fails_naming_the_loss(wsenv: WsEnv) -> None:
    seed = tiny_root(wsenv.root / "seed", ("sh", "true"))
    wsenv.run("workspace", "create", "box", "--size", "256M", "--seed", str(seed))
    d = wsenv.attach("box", "box")
    # A run on this host does not take the workspace from under its attach unasked.
    p = wsenv.run("run", "--root", "ws:box", "--", "/bin/sh", "-c", "true", rc=125)
    assert "is attached at" in p.stderr and "--takeover" in p.stderr
    wsenv.run("run", "--root", "ws:box", "--takeover", "--", "/bin/sh", "-c",
              "echo from-run > /from-run")
    (d / "after-run.txt").write_text("hello\n")
    subprocess.run(["sync"], check=False)
    def fenced() -> list[bool]:
        listed = json.loads(wsenv.run("workspace", "list", "--json").stdout)
        return [r["fenced"] for r in listed if r["workspace"] == "box@live"]

    deadline = time.monotonic() + 10  # the lease renewal notices within a quarter TTL
    while fenced() != [True] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fenced() == [True]
    p = wsenv.run("workspace", "detach", str(d), rc=None)
    wsenv.attached.remove(d)
    assert p.returncode != 0 and "fenced" in p.stderr and "dropped" in p.stderr, p.stderr
    e = wsenv.attach("box", "look")
    assert (e / "from-run").read_text() == "from-run\n"
    assert not os.path.exists(e / "after-run.txt")
    wsenv.detach(e)
