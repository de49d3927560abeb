"""Server benchmarks: publish and read through `strata serve`, 16 client processes, handoff.

Every figure goes through a real `strata serve` process: the durable 128 KiB
publish over the unix socket and over TCP (with a token), a 128 KiB read over
the socket, 16 client processes publishing to their own branches (commits/s,
and fsyncs per commit from the server's `/v1/admin/stats`), and the handoff
gap under a light load. Each sits beside the same work on the local disk in
the same run. Nothing here is a test: it measures and reports, never asserts.

The client processes are this module run as `python -m bench.server worker ...`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import row
from strata.engine.local import LocalStore, init_store
from strata.engine.txn import Transaction
from strata.server.client import RemoteStore, default_socket

KIB = 1024
ROOT = str(Path(__file__).resolve().parent.parent)  # `-m bench.server` runs from here
GAP = re.compile(r"took over the store; requests waited (\d+) ms")


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _new_store(root: str, name: str, branches: int = 0) -> str:
    path = os.path.join(root, name)
    init_store(path)
    with LocalStore(path) as s:
        head = s.create_volume("v")
        for i in range(branches):
            s.fork("v", f"b{i}", at=head)
    return path


class _Serve:
    """A `strata serve` process with its output in a log file."""

    def __init__(self, store: str, log: str, *extra: str) -> None:
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "strata", "serve", "--store", store, *extra],
                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=_env())

    def text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while "strata: serving" not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"strata serve did not start:\n{self.text()}")
            time.sleep(0.005)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _lat(fn: Any, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def bench_latency(root: str, n: int) -> list[dict[str, Any]]:
    """128 KiB durable publish over the socket and TCP; 128 KiB read over the socket."""
    store = _new_store(root, "latency")
    port = _free_port()
    srv = _Serve(store, os.path.join(root, "latency.log"), "--listen", f"tcp:127.0.0.1:{port}")
    datas = [os.urandom(128 * KIB) for _ in range(16)]
    try:
        srv.wait_ready()
        unix = RemoteStore(f"unix:{default_socket(store)}")
        token = unix.admin("POST", "tokens", {"volume": "v", "writable": True})["token"]
        tcp = RemoteStore(f"http://127.0.0.1:{port}", token)
        unix_http = RemoteStore(f"unix:{default_socket(store)}")
        unix_http._lean = None  # the same socket's HTTP path: before the lean stream
        pub: dict[str, list[float]] = {}
        for name, remote in (("unix", unix), ("unix-http", unix_http), ("tcp", tcp)):
            t = Transaction(remote, "v")

            def publish(i: int, t: Transaction = t) -> None:
                # Exactly 128 KiB (two blocks), each publish a new content.
                t.write(f"f{i % 32}", i.to_bytes(4, "little") + datas[i % 16][4:])
                t.commit()

            _lat(publish, 20)  # warm up: connections, caches
            pub[name] = _lat(publish, n)
        rlats: dict[str, list[float]] = {}
        for name, remote in (("unix", unix), ("unix-http", unix_http)):
            reader = Transaction(remote, "v")
            for i in range(32):
                reader.read(f"f{i}")  # warm: tree nodes in the client's cache, the pack in RAM
            rlats[name] = _lat(lambda i, r=reader: r.read(f"f{i % 32}"), n)
        root_id = unix.snapshot(unix.head("v", "live")).root.ref
        assert root_id is not None
        rtt = {name: _lat(lambda i, r=remote: r.get_object(root_id), n)
               for name, remote in (("unix", unix), ("unix-http", unix_http))}
        unix.close()
        unix_http.close()
        tcp.close()
    finally:
        srv.stop()
    # Baselines: the same bytes appended and fdatasync'ed; pread of a cached file.
    path = os.path.join(root, "latency.base")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        base = _lat(lambda i: (os.write(fd, datas[i % 16]), os.fdatasync(fd)), n)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        rbase = _lat(lambda i: os.pread(fd, 128 * KIB, (i % 16) * 128 * KIB), n)
    finally:
        os.close(fd)
    b50, b99 = _pct(base, 0.5) * 1e3, _pct(base, 0.99) * 1e3
    rows = []
    for name, label, target in (("unix", "unix socket (lean stream)", 1.0),
                                 ("unix-http", "unix socket, HTTP (before)", 1.0),
                                 ("tcp", "TCP + token", 1.5)):
        p50, p99 = _pct(pub[name], 0.5) * 1e3, _pct(pub[name], 0.99) * 1e3
        rows += [
            row(f"server: durable 128 KiB publish p50, {label}", p50, "ms", b50,
                "append+fdatasync", f"<= {target} ms", met=p50 <= target),
            row(f"server: durable 128 KiB publish p99, {label}", p99, "ms", b99,
                "append+fdatasync"),
        ]
    # A 128 KiB file is a file node and two blocks: two round trips on the lean
    # stream (a get and a batch get), three on HTTP.
    for name, label in (("unix", "unix socket (lean stream)"),
                        ("unix-http", "unix socket, HTTP (before)")):
        r50 = _pct(rlats[name], 0.5) * 1e3
        rows.append(row(f"server: 128 KiB file read p50, {label}", r50, "ms",
                        _pct(rbase, 0.5) * 1e3, "pread, page cache", "<= 0.3 ms",
                        met=r50 <= 0.3))
        rows.append(row(f"  one small object's round trip p50, {label}",
                        _pct(rtt[name], 0.5) * 1e6, "us"))
    return rows


def _workers(kind: str, args: list[list[str]]) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, "-m", "bench.server", "worker", kind, *a],
                             cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             text=True, env=_env()) for a in args]


def _race(procs: list[subprocess.Popen[str]], go: str) -> tuple[float, int]:
    """Wait until every worker is ready, start them together; (elapsed, operations)."""
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"worker failed to start: {line!r}")
    Path(go).touch()
    starts, ends, ops = [], [], 0
    for p in procs:
        out, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({p.returncode}): {out[-500:]}")
        _tag, t0, t1, count = out.split()[-4:]
        starts.append(float(t0))
        ends.append(float(t1))
        ops += int(count)
    return max(ends) - min(starts), ops


def bench_group_commit(root: str, per_proc: int, procs: int = 16) -> list[dict[str, Any]]:
    """16 client processes publishing small files, each to its own branch."""
    store = _new_store(root, "group", branches=procs)
    srv = _Serve(store, os.path.join(root, "group.log"))
    url = f"unix:{default_socket(store)}"
    try:
        srv.wait_ready()
        admin = RemoteStore(url)
        go = os.path.join(root, "group.go")
        ws = _workers("publish", [[url, f"b{i}", str(per_proc), go] for i in range(procs)])
        before = admin.admin("GET", "stats")
        try:
            elapsed, commits = _race(ws, go)
        finally:
            for w in ws:
                if w.poll() is None:
                    w.kill()
        after = admin.admin("GET", "stats")
        admin.close()
    finally:
        srv.stop()
    fsyncs = after["fsyncs"] - before["fsyncs"]
    committed = after["commits"] - before["commits"]
    go = os.path.join(root, "group.base.go")
    bs = _workers("fdatasync", [[os.path.join(root, f"group.base{i}"), str(per_proc), go]
                                for i in range(procs)])
    base_elapsed, base_ops = _race(bs, go)
    rate, base_rate = commits / elapsed, base_ops / base_elapsed
    fpc = fsyncs / max(committed, 1)
    return [
        row(f"server: {procs} client processes, publish throughput", rate, "commits/s",
            base_rate, f"{procs} procs, 4 KiB append+fdatasync each", ">= 2,000/s",
            lower_is_better=False, met=rate >= 2000),
        row(f"server: {procs} client processes, fsyncs per commit", fpc, "fsync/commit", 1.0,
            "one fsync per write", "well below 1", met=fpc < 0.5),
    ]


def bench_handoff(root: str, takeovers: int) -> list[dict[str, Any]]:
    """`serve --takeover` again and again while two clients publish and read lightly."""
    store = _new_store(root, "handoff")
    url = f"unix:{default_socket(store)}"
    stop_file = os.path.join(root, "handoff.stop")
    servers = [_Serve(store, os.path.join(root, "handoff0.log"))]
    loads: list[subprocess.Popen[str]] = []
    windows = []
    try:
        servers[0].wait_ready()
        loads = _workers("load", [[url, f"c{i}", stop_file] for i in range(2)])
        time.sleep(1.0)
        for k in range(1, takeovers + 1):
            old = servers[-1]
            t0 = time.time()
            new = _Serve(store, os.path.join(root, f"handoff{k}.log"), "--takeover")
            servers.append(new)
            new.wait_ready()
            t_ready = time.time()
            old.proc.wait(30)
            windows.append((t0, t_ready))
            time.sleep(0.7)
        Path(stop_file).touch()
        calls: list[tuple[float, float]] = []
        for p in loads:
            out, _ = p.communicate(timeout=60)
            if p.returncode != 0:
                raise RuntimeError(f"load client failed ({p.returncode}): {out[-500:]}")
            calls += [(float(a), float(b)) for _tag, a, b in
                      (line.split() for line in out.splitlines() if line.startswith("CALL "))]
    finally:
        for p in loads:
            if p.poll() is None:
                p.kill()
        for srv in servers:
            srv.stop()
    gaps = []
    for srv in servers[1:]:
        m = GAP.search(srv.text())
        if m:
            gaps.append(float(m.group(1)))
    # What a client felt: its longest call that overlapped each handoff.
    stalls = [max((d for s, d in calls if s <= t1 and s + d >= t0), default=0.0) * 1e3
              for t0, t1 in windows]
    ends = [(t1 - t0) * 1e3 for t0, t1 in windows]
    gap = _pct(gaps, 0.5) if gaps else float("nan")
    return [
        row(f"server: handoff gap p50 ({len(gaps)} takeovers, requests waited)", gap, "ms",
            None, "", "<= 2 s", met=gap <= 2000),
        row("server: handoff, longest client call p50", _pct(stalls, 0.5), "ms"),
        row("server: handoff, 'serve --takeover' start to serving p50", _pct(ends, 0.5), "ms"),
    ]


def run(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    work = tempfile.mkdtemp(prefix="strata-bench-server-", dir=root)
    try:
        rows: list[dict[str, Any]] = []
        rows += bench_latency(work, 200 if quick else 1000)
        rows += bench_group_commit(work, 20 if quick else 100)
        rows += bench_handoff(work, 3 if quick else 7)
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- the client processes ------------------------------------------------------------------

def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.0005)


def _worker_publish(url: str, branch: str, count: int, go: str) -> None:
    remote = RemoteStore(url)
    t = Transaction(remote, "v", branch)
    payload = os.urandom(4 * KIB)
    for j in range(3):  # warm: connection, caches
        t.write(f"w{j}", payload)
        t.commit()
    print("READY", flush=True)
    _wait_for(go)
    t0 = time.time()
    for j in range(count):
        t.write(f"g{j % 8}", payload + j.to_bytes(4, "little"))
        t.commit()
    print(f"DONE {t0} {time.time()} {count}", flush=True)
    remote.close()


def _worker_fdatasync(path: str, count: int, go: str) -> None:
    payload = os.urandom(4 * KIB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    print("READY", flush=True)
    _wait_for(go)
    t0 = time.time()
    for _ in range(count):
        os.write(fd, payload)
        os.fdatasync(fd)
    print(f"DONE {t0} {time.time()} {count}", flush=True)
    os.close(fd)


def _worker_load(url: str, prefix: str, stop: str) -> None:
    """A light steady load: one small publish and one read every ~20 ms."""
    remote = RemoteStore(url)
    t = Transaction(remote, "v")
    n = 0
    while not os.path.exists(stop):
        start = time.time()
        t.write(f"{prefix}-{n % 64}", os.urandom(2000))
        t.commit()
        print(f"CALL {start} {time.time() - start}", flush=True)
        start = time.time()
        Transaction(remote, "v").read(f"{prefix}-{n % 64}")
        print(f"CALL {start} {time.time() - start}", flush=True)
        n += 1
        time.sleep(0.02)
    remote.close()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.server")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="only the server benchmarks (make bench runs them all)")
    r.add_argument("--dir", default=os.environ.get("STRATA_BENCH_DIR", "/var/tmp"))
    r.add_argument("--quick", action="store_true")
    w = sub.add_parser("worker", help="a client process of these benchmarks")
    w.add_argument("kind", choices=("publish", "fdatasync", "load"))
    w.add_argument("args", nargs="*")
    args = ap.parse_args()
    if args.cmd == "run":
        from bench.report import print_table
        print_table("strata server benchmarks", run(args.dir, quick=args.quick))
    elif args.kind == "publish":
        url, branch, count, go = args.args
        _worker_publish(url, branch, int(count), go)
    elif args.kind == "fdatasync":
        path, count, go = args.args
        _worker_fdatasync(path, int(count), go)
    else:
        url, prefix, stop = args.args
        _worker_load(url, prefix, stop)


if __name__ == "__main__":
    main()
