"""Web view benchmark: opening a 100k-entry directory, beside `ls` of one on the local disk.

A real `strata serve` on loopback TCP answers `GET /ui/api/tree` (the page
the web view's directory listing reads) with a read-only token's cookie:
the first page cold (a fresh server, nothing cached), the first page warm,
and a page in the middle of the directory (the cursor seeks in the B-tree).
The baseline is `ls` of a directory of as many files on the local disk, in
the same run. The target is under one second to open. Nothing
here asserts.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.report import row
from bench.server import _env, _free_port
from strata.engine.local import LocalStore, init_store
from strata.engine.txn import Transaction
from strata.server.client import RemoteStore, default_socket


def _get(port: int, path: str, cookie: str) -> tuple[float, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.perf_counter()
    conn.request("GET", path, headers={"Cookie": f"strata_ui={cookie}"})
    resp = conn.getresponse()
    body = resp.read()
    dt = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{path}: {resp.status} {body[:200]!r}")
    return dt, json.loads(body)


def run(root: str, quick: bool = False) -> list[dict[str, Any]]:
    n = 10_000 if quick else 100_000
    work = tempfile.mkdtemp(prefix="strata-bench-ui-", dir=root)
    try:
        local = os.path.join(work, "local")
        os.makedirs(local)
        for i in range(n):
            with open(os.path.join(local, f"f{i:06d}"), "wb") as f:
                f.write(b"x")
        subprocess.run(["sync"], check=False)
        t0 = time.perf_counter()
        subprocess.run(["ls", local], stdout=subprocess.DEVNULL, check=True)
        ls_time = time.perf_counter() - t0

        store = os.path.join(work, "store")
        init_store(store)
        with LocalStore(store) as s:
            s.create_volume("v")
            t = Transaction(s, "v")
            t.mkdir("big")
            for i in range(n):
                t.write(f"big/f{i:06d}", b"x")
            head = t.commit("big directory")
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata", "serve", "--store", store,
             "--listen", f"tcp:127.0.0.1:{port}"], env=_env(),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            sock = default_socket(store)
            deadline = time.monotonic() + 30
            while not os.path.exists(sock) and time.monotonic() < deadline:
                time.sleep(0.02)
            owner = RemoteStore("unix:" + sock, retry_for=30)
            tok = owner.admin("POST", "tokens", {"volume": "v", "branch": None,
                                                 "writable": False, "ttl": 600})["token"]
            owner.close()
            page = f"/ui/api/tree?v=v&s={head}&p=big&limit=200"
            cold, first = _get(port, page, tok)
            assert first["count"] == n and len(first["entries"]) == 200
            warm = min(_get(port, page, tok)[0] for _ in range(5))
            middle = min(_get(port, page + f"&after=f{n // 2:06d}", tok)[0] for _ in range(5))
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    what = f"ls of {n:,} files, all printed; a page is 200 and the count"
    return [
        row(f"web view: open a {n:,}-entry directory, cold", cold * 1000, "ms",
            ls_time * 1000, what, "< 1000 ms", met=cold < 1.0),
        row(f"web view: open a {n:,}-entry directory, warm", warm * 1000, "ms",
            ls_time * 1000, what, "< 1000 ms", met=warm < 1.0),
        row("web view: a page from the middle of it", middle * 1000, "ms",
            ls_time * 1000, what, "< 1000 ms", met=middle < 1.0),
    ]


if __name__ == "__main__":
    from bench.report import print_table
    print_table("web view", run(os.environ.get("STRATA_BENCH_DIR", "/var/tmp"),
                                quick="--quick" in sys.argv))
