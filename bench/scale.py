"""Scale benchmark: does every cost grow with the change, not with the store?

Two bucket-backed stores of different sizes are measured the same way in one
run, and each figure of the larger is printed beside the smaller's: ~100k and
~1M objects by default, ~1M and ~10M with --large, ~10k and ~100k with
--quick (a smoke run). Each size gets a fresh moto (S3 protocol, server mode,
loopback, explicit local credentials) and a fresh store:

- **Build.** `strata init --bucket`, then the volume `data` written in-process
  through the engine's store API, 20,000 files a publish: files of 4.2 KiB
  (one compressible block with a unique header, plus its file node: two
  objects each), 1,000 a directory. The tier ships it to the bucket as it
  would any publish; the build ends once the store is closed (its last
  checkpoint written).
- Then everything goes through public surfaces: a `strata serve` process, the
  `RemoteStore` client on its unix socket, and the `strata` CLI.
- **Publish** p50/p99: 4 KiB puts, back to back, into the large volume, each
  into a directory not read yet (cold: the first read decodes the directory);
  then the same number into ten directories already read (warm), whose p50
  is what store size alone costs a publish.
- **1 publish a second** for 60 s (30 s with --quick), once the pack holding
  the publishes above is sealed (by age, 30 s) and uploaded: the server's CPU
  (utime+stime from /proc/PID/stat) and the bytes added to the bucket (moto's
  listing before and after, once shipping and checkpoints have settled; for
  `log/`, the segment bytes the tier shipped in the window instead, since
  older segments shrink meanwhile as they are dropped), beside the change's
  own bytes (what the publishes added to the local packs,
  `bytes_written` in `strata stats --json`). Bytes per checkpoint are the
  window's new `checkpoints/` and `runs/` bytes over its new checkpoints.
- **Steady state**: a second window, twice as long, right after the first,
  once the bulk load's runs have found their levels: bytes per checkpoint,
  and the bytes the tier sent the bucket (log segments, packs, checkpoints,
  runs and tables, from its own counters, so deletions do not hide them)
  over the change's own bytes; with the merged ids per checkpoint.
- **Old index runs** left under `runs/` at the end of the window.
- **The owner log's bytes** left in the bucket after both windows (segments a
  checkpoint passed are overwritten by ~100-byte `dropped` records), beside
  the store's pack bytes (what the log held a second copy of before).
- **GC**: `strata policy set data --keep-last 100`, a first pass over the
  whole store, 1,000 small publishes, then the pass that is timed (wall time
  and the server's CPU). The server's VmHWM is reset (/proc/PID/clear_refs)
  before each pass and read after it.
- **fsck** (`strata fsck --json`, run by the server): wall time, server VmHWM.
- **Restore to the first ls**: the server stopped, `strata restore` into a new
  directory with a copy of the key, then `strata ls data` (which starts that
  store's server): wall time of both.
- **The restored store's GC**: once its index is copied in, its first pass
  (which recounts the accounting: every indexed node read once, from the
  bucket) and the pass after it (incremental), wall time of each.

A step whose time, scaled from the smaller size by the object count, would
pass 15 minutes is skipped at the larger size, and its row says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cli_env import STRATA
from bench.engine import _pct
from bench.report import row
from strata.engine.local import LocalStore
from strata.engine.storedir import StoreConfig
from strata.engine.txn import Transaction
from strata.server.client import RemoteStore, default_socket, is_serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bucketutil import BUCKET, Moto  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
FILES_PER_PUBLISH = 20_000
FILES_PER_DIR = 1_000
SKIP_AFTER_S = 15 * 60
TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Size:
    """What one store size measured; `None` where a step was skipped."""

    label: str
    objects: int = 0
    build_s: float = 0.0
    packs_bytes: int = 0
    pub_p50: float = 0.0
    pub_p99: float = 0.0
    pub_warm_p50: float = 0.0
    pub_warm_p99: float = 0.0
    window_s: float = 0.0
    window_publishes: int = 0
    cpu_core: float = 0.0            # server CPU seconds / wall seconds, at 1 publish/s
    bucket_added: int = 0
    change_bytes: int = 0
    payload_bytes: int = 0
    checkpoints: int = 0
    per_checkpoint: float = 0.0
    steady_s: float = 0.0
    steady_checkpoints: int = 0
    steady_per_checkpoint: float = 0.0
    steady_sent: int = 0             # bytes the tier sent the bucket in the steady window
    steady_change: int = 0
    steady_merged: float = 0.0       # merged ids per checkpoint in the steady window
    runs_left: int = 0
    runs_left_bytes: int = 0
    log_objects: int = 0             # owner-log records in the bucket after the windows
    log_bytes: int = 0               # ... and their bytes (dropped segments are ~100 bytes)
    gc_first_s: float | None = None
    gc_s: float | None = None
    gc_cpu_s: float | None = None
    gc_rss: int | None = None
    fsck_s: float | None = None
    fsck_rss: int | None = None
    restore_s: float | None = None
    restored_gc_first_s: float | None = None  # recounts the accounting (reads every node)
    restored_gc_s: float | None = None        # the pass after it: incremental
    total_s: float = 0.0
    notes: list[str] = field(default_factory=list)


# -- processes and the bucket --------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # After the ")": state is field 3, so utime..cstime (14..17) sit at 11..14.
    return sum(int(x) for x in fields[11:15]) / TICK


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KIB
    return 0


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _cli(*args: str, timeout: float = 3600) -> str:
    p = subprocess.run([*STRATA, *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "STRATA_SERVER_IDLE_EXIT": "600"})
    if p.returncode != 0:
        raise RuntimeError(f"strata {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def _stats(store: str) -> dict[str, Any]:
    return dict(json.loads(_cli("--store", store, "stats", "--json")))


def _listing(moto: Moto, prefix: str) -> dict[str, tuple[int, int]]:
    """Objects and bytes in the bucket under `prefix`, by first name part (runs, log, ...)."""
    out: dict[str, list[int]] = {}
    for page in moto.s3().get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            part = o["Key"][len(prefix) + 1:].split("/", 1)[0]
            c = out.setdefault(part, [0, 0])
            c[0] += 1
            c[1] += int(o["Size"])
    return {k: (v[0], v[1]) for k, v in out.items()}


def _bytes(listing: dict[str, tuple[int, int]]) -> int:
    return sum(b for _n, b in listing.values())


class Serve:
    """One `strata serve` process on a store directory."""

    def __init__(self, store: str, log: str) -> None:
        self.store = store
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([*STRATA, "serve", "--store", store],
                                         stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                         start_new_session=True)
        sock = default_socket(store)
        deadline = time.monotonic() + 300
        while not is_serving(sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"strata serve did not start (see {log})")
            time.sleep(0.05)
        self.url = f"unix:{sock}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(600)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _settle(store: str, limit: float = 300.0) -> dict[str, Any]:
    """Stats once shipping, uploads and checkpoints have stopped for 4 s (or `limit`)."""
    deadline = time.monotonic() + limit
    last, since = None, time.monotonic()
    while True:
        st = _stats(store)
        b = st["bucket"]
        key = (b["checkpoints"], b["segments"], b["packs_uploaded"],
               b.get("segments_dropped", 0))
        busy = b["unshipped_bytes"] or b["uploads_queued"]
        if key != last or busy:
            last, since = key, time.monotonic()
        elif time.monotonic() - since >= 4.0 or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


# -- the steps -----------------------------------------------------------------------------


def _file(n: int) -> bytes:
    # 4.2 KiB: past the inline limit, so a block and a file node; zstd makes it ~100 bytes.
    return b"file %012d\n" % n + b"strata scale benchmark filler line\n" * 120


def build(store: str, url: str, objects: int) -> tuple[float, int]:
    """The store with ~`objects` objects; seconds, and the objects its index holds."""
    t0 = time.perf_counter()
    _cli("init", "--store", store, "--bucket", url)
    files = objects // 2
    with LocalStore(store) as s:
        s.create_volume("data")
        s.policies.set("data", None, keep_last=100)
        done = 0
        while done < files:
            t = Transaction(s, "data")
            end = min(files, done + FILES_PER_PUBLISH)
            for n in range(done, end):
                if n % FILES_PER_DIR == 0:
                    t.mkdir(f"d{n // FILES_PER_DIR:05d}")
                t.write(f"d{n // FILES_PER_DIR:05d}/f{n:08d}", _file(n))
            t.commit(f"build {done}")
            done = end
            print(f"  built {done:,}/{files:,} files, {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        s.sync_index()  # the index trails the commits; count what they wrote
        count = s.index.count_objects()
    return time.perf_counter() - t0, count


def _put(remote: RemoteStore, path: str, data: bytes) -> float:
    t0 = time.perf_counter()
    t = Transaction(remote, "data")
    t.write(path, data)
    t.commit()
    return time.perf_counter() - t0


def measure(work: str, label: str, objects: int, *, window: float, publishes: int,
            smaller: Size | None) -> Size:
    """Build a store of ~`objects` objects on a fresh moto and measure it."""
    t_start = time.perf_counter()
    res = Size(label)
    root = os.path.join(work, label)
    os.makedirs(root)
    moto = Moto(Path(root)).start()
    saved = {k: os.environ.get(k) for k in moto.env()}
    os.environ.update(moto.env())
    prefix = f"scale-{label}"
    url = f"s3://{BUCKET}/{prefix}"
    store = os.path.join(root, "store")
    server: Serve | None = None
    try:
        print(f"scale {label}: building ~{objects:,} objects", file=sys.stderr, flush=True)
        res.build_s, res.objects = build(store, url, objects)
        res.packs_bytes = sum(e.stat().st_size for e in os.scandir(os.path.join(store, "packs")))
        scale = res.objects / smaller.objects if smaller else 1.0

        def too_long(seconds: float | None) -> bool:
            return seconds is None or seconds * scale > SKIP_AFTER_S

        subprocess.run(["sync"], check=True)
        server = Serve(store, os.path.join(root, "serve.log"))
        remote = RemoteStore(server.url)
        dirs = max(1, objects // 2 // FILES_PER_DIR)
        payload = os.urandom(4 * KIB)

        print(f"scale {label}: publish latency", file=sys.stderr, flush=True)
        lat = [_put(remote, f"d{i % dirs:05d}/p{i:06d}", payload[:-8] + i.to_bytes(8, "big"))
               for i in range(publishes)]
        res.pub_p50, res.pub_p99 = _pct(lat, 0.5), _pct(lat, 0.99)
        # The same puts into ten directories the cold series already read.
        warm = [_put(remote, f"d{i % min(10, dirs):05d}/q{i:06d}",
                     payload[:-8] + i.to_bytes(8, "big")) for i in range(publishes)]
        res.pub_warm_p50, res.pub_warm_p99 = _pct(warm, 0.5), _pct(warm, 0.99)

        print(f"scale {label}: {window:.0f} s at 1 publish/s", file=sys.stderr, flush=True)
        # The pack that holds the publishes above is sealed by age (pack_age_limit) and
        # then uploaded: wait for that, or the window counts their bytes as its own.
        time.sleep(StoreConfig().pack_age_limit + 2.0)
        before_st = _settle(store)
        before = _listing(moto, prefix)
        cpu0, w0 = _cpu_s(server.pid), time.perf_counter()
        for i in range(int(window)):
            tick = w0 + i
            time.sleep(max(0.0, tick - time.perf_counter()))
            _put(remote, f"d{i % dirs:05d}/w{i:06d}", payload[:-8] + (10**9 + i).to_bytes(8, "big"))
        after_st = _settle(store)
        res.window_s = time.perf_counter() - w0
        res.cpu_core = (_cpu_s(server.pid) - cpu0) / res.window_s
        after = _listing(moto, prefix)
        res.window_publishes = int(window)
        res.payload_bytes = int(window) * len(payload)
        # The log's share is what the window shipped: its listing also shrinks as older
        # segments are dropped (overwritten small), which is not the window's doing.
        res.bucket_added = (_bytes(after) - after.get("log", (0, 0))[1]
                            - _bytes(before) + before.get("log", (0, 0))[1]
                            + after_st["bucket"]["segment_bytes"]
                            - before_st["bucket"]["segment_bytes"])
        res.change_bytes = after_st["bytes_written"] - before_st["bytes_written"]
        # From the tier's own counters: old checkpoints, runs and tables leave the bucket,
        # so a listing no longer counts what was written.
        b0, b1 = before_st["bucket"], after_st["bucket"]
        res.checkpoints = b1["checkpoints"] - b0["checkpoints"]
        cp_bytes = b1.get("checkpoint_bytes_total", 0) - b0.get("checkpoint_bytes_total", 0)
        res.per_checkpoint = cp_bytes / res.checkpoints if res.checkpoints else 0.0
        runs = after.get("runs", (0, 0))
        # Parts the newest checkpoint does not name (older stores: every run but one).
        res.runs_left = max(0, runs[0] - int(b1.get("index_parts", 1)))
        res.runs_left_bytes = runs[1]

        print(f"scale {label}: steady state, {2 * window:.0f} s at 1 publish/s",
              file=sys.stderr, flush=True)
        w0 = time.perf_counter()
        for i in range(int(2 * window)):
            time.sleep(max(0.0, w0 + i - time.perf_counter()))
            _put(remote, f"d{i % dirs:05d}/s{i:06d}",
                 payload[:-8] + (2 * 10**9 + i).to_bytes(8, "big"))
        steady_st = _settle(store)
        res.steady_s = time.perf_counter() - w0
        b2 = steady_st["bucket"]
        res.log_objects, res.log_bytes = _listing(moto, prefix).get("log", (0, 0))

        def sent(b: dict[str, Any]) -> int:
            return int(b["segment_bytes"] + b["bytes_uploaded"]
                       + b.get("checkpoint_bytes_total", 0))
        res.steady_checkpoints = b2["checkpoints"] - b1["checkpoints"]
        res.steady_sent = sent(b2) - sent(b1)
        res.steady_change = steady_st["bytes_written"] - after_st["bytes_written"]
        steady_cp = b2.get("checkpoint_bytes_total", 0) - b1.get("checkpoint_bytes_total", 0)
        merged = b2.get("merged_entries", 0) - b1.get("merged_entries", 0)
        if res.steady_checkpoints:
            res.steady_per_checkpoint = steady_cp / res.steady_checkpoints
            res.steady_merged = merged / res.steady_checkpoints

        if smaller is None or not too_long(smaller.gc_first_s):
            print(f"scale {label}: gc", file=sys.stderr, flush=True)
            _reset_peak(server.pid)
            t0 = time.perf_counter()
            _cli("--store", store, "gc", "--min-age", "0")
            res.gc_first_s = time.perf_counter() - t0
            peak = _peak_rss(server.pid)
            files = objects // 2
            for i in range(1000):
                n = i * 7919 % files  # overwrite files spread over the volume
                _put(remote, f"d{n // FILES_PER_DIR:05d}/f{n:08d}", os.urandom(200))
            subprocess.run(["sync"], check=True)
            _reset_peak(server.pid)
            cpu0, t0 = _cpu_s(server.pid), time.perf_counter()
            _cli("--store", store, "gc", "--min-age", "0")
            res.gc_s = time.perf_counter() - t0
            res.gc_cpu_s = _cpu_s(server.pid) - cpu0
            res.gc_rss = max(peak, _peak_rss(server.pid))
        else:
            res.notes.append("gc")

        if smaller is None or not too_long(smaller.fsck_s):
            print(f"scale {label}: fsck", file=sys.stderr, flush=True)
            _reset_peak(server.pid)
            t0 = time.perf_counter()
            try:
                report = json.loads(_cli("--store", store, "fsck", "--json"))
            except RuntimeError as exc:  # one step failing must not lose the others' figures
                print(f"scale {label}: fsck failed: {exc}", file=sys.stderr, flush=True)
                res.notes.append("fsck failed")
            else:
                res.fsck_s = time.perf_counter() - t0
                res.fsck_rss = _peak_rss(server.pid)
                if not report.get("ok"):
                    res.notes.append("fsck found damage")
        else:
            res.notes.append("fsck")

        _settle(store)
        server.stop()
        server = None
        if smaller is None or not too_long(smaller.restore_s):
            print(f"scale {label}: restore", file=sys.stderr, flush=True)
            key = os.path.join(root, "kept.key")
            shutil.copy(os.path.join(store, "bucket.key"), key)
            dst = os.path.join(root, "restored")
            subprocess.run(["sync"], check=True)
            t0 = time.perf_counter()
            _cli("restore", "--bucket", url, "--store", dst, "--key-file", key)
            listed = _cli("--store", dst, "ls", "data")
            res.restore_s = time.perf_counter() - t0
            _restored_gc(dst, res)
            _cli("--store", dst, "serve", "--stop")
            if len(listed.splitlines()) != dirs:
                res.notes.append(f"restored ls shows {len(listed.splitlines())} of {dirs} dirs")
        else:
            res.notes.append("restore")
    finally:
        if server is not None:
            server.stop()
        moto.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    res.total_s = time.perf_counter() - t_start
    print(f"scale {label}: done in {res.total_s:.0f} s", file=sys.stderr, flush=True)
    return res


def _restored_gc(store: str, res: Size) -> None:
    """The restored store's first GC pass (it recounts the accounting) and the one after.

    GC waits for the index to be copied in from the bucket: asked again until it
    runs, and only the pass that runs is timed.
    """
    for attr in ("restored_gc_first_s", "restored_gc_s"):
        deadline = time.monotonic() + 1800
        while True:
            t0 = time.perf_counter()
            try:
                report = json.loads(_cli("--store", store, "gc", "--min-age", "0", "--json"))
            except RuntimeError as exc:
                if "still being copied" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(1)
                continue
            setattr(res, attr, time.perf_counter() - t0)
            break
        if report.get("mode") != "incremental":
            res.notes.append(f"restored store's gc pass marked in full: {report.get('recount')}")


# -- the table -----------------------------------------------------------------------------


def _within(big: float | None, small: float | None) -> bool | None:
    if big is None or not small:
        return None
    return big / small <= 1.5


def rows_for(small: Size, big: Size) -> list[dict[str, Any]]:
    """The larger size's figures beside the smaller's, with the issue's targets."""
    b = f"at {small.label}"
    skipped = "skipped: over 15 min at this size"
    out = [
        row(f"scale: objects in the store ({big.label})", big.objects, "objects",
            small.objects, b),
        row(f"scale: build, {big.label} (20k files a publish, to the bucket)", big.build_s, "s",
            small.build_s, b),
        row(f"scale: publish p50, 4 KiB put, {big.label}", big.pub_p50 * 1000, "ms",
            small.pub_p50 * 1000, b, "within 1.5x", met=_within(big.pub_p50, small.pub_p50)),
        row(f"scale: publish p99, 4 KiB put, {big.label}", big.pub_p99 * 1000, "ms",
            small.pub_p99 * 1000, b),
        row(f"scale: publish p50, 4 KiB put into a directory already read, {big.label}",
            big.pub_warm_p50 * 1000, "ms", small.pub_warm_p50 * 1000, b, "within 1.5x",
            met=_within(big.pub_warm_p50, small.pub_warm_p50)),
        row(f"scale: publish p99, 4 KiB put into a directory already read, {big.label}",
            big.pub_warm_p99 * 1000, "ms", small.pub_warm_p99 * 1000, b),
        row(f"scale: bytes per checkpoint, {big.label}", big.per_checkpoint / MIB, "MiB",
            small.per_checkpoint / MIB, b, "within 1.5x",
            met=_within(big.per_checkpoint, small.per_checkpoint)),
    ]
    for s in (small, big):
        out.append(row(f"scale: bucket bytes added, {s.window_publishes} s at 1 publish/s, "
                       f"{s.label}", s.bucket_added / MIB, "MiB", s.change_bytes / MIB,
                       "the change's own pack bytes", "<= 3x",
                       met=s.bucket_added <= 3 * s.change_bytes))
    out += [
        row(f"scale: the change's own pack bytes ({big.window_publishes} x 4 KiB payload), "
            f"{big.label}", big.change_bytes / KIB, "KiB", big.payload_bytes / KIB,
            "payload"),
        row(f"scale: checkpoints in the window, {big.label}", big.checkpoints, "checkpoints",
            small.checkpoints, b),
        row(f"scale: steady state, bytes per checkpoint, {big.label}",
            big.steady_per_checkpoint / MIB, "MiB", small.steady_per_checkpoint / MIB, b,
            "within 1.5x", met=_within(big.steady_per_checkpoint, small.steady_per_checkpoint)),
        row(f"scale: steady state, merged index ids per checkpoint, {big.label}",
            big.steady_merged, "ids", small.steady_merged, b),
    ]
    for s in (small, big):
        out.append(row(f"scale: steady state, bytes sent to the bucket over "
                       f"{s.steady_s:.0f} s at 1 publish/s, {s.label}", s.steady_sent / MIB,
                       "MiB", s.steady_change / MIB, "the change's own pack bytes", "<= 3x",
                       met=s.steady_sent <= 3 * s.steady_change))
    out += [
        row(f"scale: server CPU at 1 publish/s, {big.label}", big.cpu_core * 100,
            "% of a core", small.cpu_core * 100, b, "<= 5%", met=big.cpu_core <= 0.05),
        row(f"scale: old index runs left in the bucket, {big.label}", big.runs_left, "runs",
            small.runs_left, b),
        row(f"scale: index run bytes in the bucket, {big.label}", big.runs_left_bytes / MIB,
            "MiB", small.runs_left_bytes / MIB, b),
    ]
    for s in (small, big):
        out.append(row(f"scale: owner-log bytes left in the bucket ({s.log_objects:,} "
                       f"records), {s.label}", s.log_bytes / MIB, "MiB", s.packs_bytes / MIB,
                       "the store's pack bytes"))

    def timed(name: str, bv: float | None, sv: float | None, unit: str = "s",
              target: str = "", met: bool | None = None) -> dict[str, Any]:
        if bv is None:  # the value column cannot be empty: 0, with the reason in the name
            return row(f"{name} ({skipped})", 0.0, "(skipped)", None, b, target)
        return row(name, bv, unit, sv, b, target, met=met)

    out += [
        timed(f"scale: first gc pass (whole store), {big.label}", big.gc_first_s,
              small.gc_first_s),
        timed(f"scale: gc pass after 1,000 small publishes, {big.label}", big.gc_s,
              small.gc_s, "s", "within 1.5x", _within(big.gc_s, small.gc_s)),
        timed(f"scale: server CPU of that gc pass, {big.label}", big.gc_cpu_s,
              small.gc_cpu_s, "cpu s"),
        timed(f"scale: restore to the first ls, {big.label}", big.restore_s,
              small.restore_s, "s", "within 1.5x", _within(big.restore_s, small.restore_s)),
        timed(f"scale: restored store, first gc pass (recounts every node), {big.label}",
              big.restored_gc_first_s, small.restored_gc_first_s),
        timed(f"scale: restored store, the gc pass after it, {big.label}",
              big.restored_gc_s, small.restored_gc_s, "s", "within 1.5x",
              _within(big.restored_gc_s, small.restored_gc_s)),
        timed(f"scale: fsck, {big.label}", big.fsck_s, small.fsck_s),
    ]
    for name, bv, sv in (("gc", big.gc_rss, small.gc_rss), ("fsck", big.fsck_rss,
                                                           small.fsck_rss)):
        out.append(timed(f"scale: server peak RSS through {name}, {big.label}",
                         None if bv is None else bv / MIB, None if sv is None else sv / MIB,
                         "MiB", "<= 300 MiB", None if bv is None else bv <= 300 * MIB))
    return out


def _show(size: Size) -> None:
    """A size's raw figures as soon as it is done: a later failure must not lose them."""
    print(f"scale {size.label}: {json.dumps(dataclasses.asdict(size), default=str)}",
          file=sys.stderr, flush=True)


def run(root: str, *, quick: bool = False, large: bool = False) -> list[dict[str, Any]]:
    if large:
        sizes = (("1M", 1_000_000), ("10M", 10_000_000))
    elif quick:
        sizes = (("10k", 10_000), ("100k", 100_000))
    else:
        sizes = (("100k", 100_000), ("1M", 1_000_000))
    window = 30.0 if quick else 60.0
    publishes = 100 if quick else 300
    work = os.path.join(root, "strata-bench-scale")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    t0 = time.perf_counter()
    try:
        small = measure(work, sizes[0][0], sizes[0][1], window=window, publishes=publishes,
                        smaller=None)
        _show(small)
        big = measure(work, sizes[1][0], sizes[1][1], window=window, publishes=publishes,
                      smaller=small)
        _show(big)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = rows_for(small, big)
    rows.append(row(f"scale: wall time of the group ({small.label} + {big.label})",
                    time.perf_counter() - t0, "s", small.total_s, f"the {small.label} part"))
    return rows
