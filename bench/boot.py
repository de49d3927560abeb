"""Image boot benchmarks: a cold `strata run --image` to the first output of python3.

The image is a root filesystem of this machine's files, at least 500 MB:
the interpreter and its libraries, the whole standard library and the
system's Python packages, /usr/bin and /usr/include (real programs and
headers, which a boot never reads). It is imported into a plain volume.

- Local: the same tree on the local disk, as the root of the same bwrap
  sandbox through an overlay with a fresh upper directory (what a container
  runtime does with an unpacked image), against `strata run --image` with an
  empty content cache: first the boot that records the trace, then boots
  that prefetch from it. The kernel's caches are dropped before every boot,
  on both sides. "Bytes fetched" is what the store's server sent the mount
  (its `bytes_served` counter) against the image's size.
- Second host: a store restored from the bucket (moto on loopback, behind
  a proxy that adds 20 ms to every request: S3 Express answers in 5-10 ms,
  S3 Standard in 50-100 ms; loopback moto in about one) with a 16 MiB local
  budget, so every pack is only in the bucket, booted cold with
  the trace and, on another restore with the trace branch deleted, without.
  Bytes are what came from the bucket: 1 MiB ranged windows, plus packs the
  tier fetched back whole because they were read again and again. The
  budget (16 MiB, the least a store takes) may keep up to four 4 MiB packs.

What is cold is the image: after the caches are dropped, the sandbox runs
once without it (bwrap `true`; for strata, `strata run -- true`, which
brings the CLI, the step service and the server back into memory), then the
boot is timed.

Figures are medians where a boot is repeated. Nothing here asserts.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cli_env import STRATA, CliEnv
from bench.latency import SlowProxy
from bench.report import row

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bucketutil import BUCKET, Moto  # noqa: E402

MB = 1_000_000
MIB = 1 << 20
BUCKET_LATENCY = 0.02  # seconds added to every bucket request (bench/latency.py)
BUDGET = 16 * MIB  # the second host's local disk budget: the least a store may have
PYTHON = os.path.realpath("/usr/bin/python3")
CMD = ["/usr/bin/python3", "-c", "print(1)"]


def _log(msg: str) -> None:
    print(f"[boot] {msg}", file=sys.stderr, flush=True)


def build_image(target: str, min_bytes: int) -> int:
    """A root filesystem of at least `min_bytes` under `target`; its size in bytes."""
    os.makedirs(os.path.join(target, "usr", "lib", "x86_64-linux-gnu"))
    os.makedirs(os.path.join(target, "usr", "lib64"))
    libs = set()
    out = subprocess.run(["ldd", PYTHON], capture_output=True, text=True).stdout
    for word in out.split():
        if word.startswith("/") and "ld-linux" not in word:
            libs.add(word)  # copied under its soname
    for lib in libs:
        shutil.copy2(lib, os.path.join(target, "usr", "lib", "x86_64-linux-gnu"))
    ld = "ld-linux-x86-64.so.2"
    shutil.copy2(os.path.realpath(f"/lib64/{ld}"),
                 os.path.join(target, "usr", "lib", "x86_64-linux-gnu", ld))
    os.symlink(f"../lib/x86_64-linux-gnu/{ld}", os.path.join(target, "usr", "lib64", ld))
    stdlib = os.path.join("/usr/lib", os.path.basename(PYTHON))
    parts = [stdlib, "/usr/lib/python3", "/usr/bin", "/usr/include", "/usr/share/doc",
             "/usr/share/locale", "/usr/share/i18n", "/usr/share/perl"]
    for src in parts:
        if _size(target) >= min_bytes:
            break
        if os.path.isdir(src):
            dest = os.path.join(target, src.lstrip("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            subprocess.run(["cp", "-a", src, dest], check=True, capture_output=True)
    for name, to in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"),
                     ("sbin", "usr/bin")):
        os.symlink(to, os.path.join(target, name))
    for d in ("proc", "dev", "tmp", "etc", "root", "run", "var/tmp"):
        os.makedirs(os.path.join(target, d), exist_ok=True)
    return _size(target)


def _size(path: str) -> int:
    p = subprocess.run(["du", "-sb", path], capture_output=True, text=True)
    return int(p.stdout.split()[0]) if p.returncode == 0 else 0


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def first_output(argv: list[str], env: dict[str, str] | None = None,
                 start: Any = None) -> tuple[float, str, str]:
    """Seconds from launch to the first line on stdout; that line, and the rest (stderr)."""
    t0 = time.perf_counter()
    if start is not None:
        p = start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    else:
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    elapsed = time.perf_counter() - t0
    rest, err = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"{argv[:3]} exited {p.returncode}: {err.strip()[-400:]}")
    if err.strip():
        _log(f"{argv[:3]} said on stderr: {err.strip()[-400:]}")
    return elapsed, line.strip(), rest


class Host(CliEnv):
    """One store and its server; boots run on it with a fresh content cache each."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.boots = 0

    def stats(self) -> dict[str, Any]:
        return dict(json.loads(self.cli("stats", "--json")))

    def boot(self, *, cold: bool = True) -> dict[str, Any]:
        """One boot; cold: the kernel's caches dropped, an empty content cache."""
        if cold:
            self.boots += 1
        cache = os.path.join(self.root, f"cache-{self.boots}")
        env = {**self.env, "XDG_CACHE_HOME": cache}
        before = self.stats()
        if cold:
            drop_caches()
        # strata's own processes and bwrap come back into memory without the image, as
        # the baseline's bwrap does: what is cold is the image alone.
        self.cli("run", "--sandbox", "bwrap", "-v", "v", "--", "true")
        argv = [*STRATA, "run", "--json", "--sandbox", "bwrap", "--image", "img", "-v", "v",
                "--", *CMD]
        elapsed, line, rest = first_output(argv, env)
        if line != "1":
            raise RuntimeError(f"the image printed {line!r}")
        self._wait_torn_down()
        after = self.stats()
        try:
            report = json.loads(rest)
        except ValueError:
            _log(f"no --json report after the output: {rest[:300]!r}")
            report = {}
        b0, b1 = before.get("bucket") or {}, after.get("bucket") or {}
        return {"seconds": elapsed,
                "served": after["bytes_served"] - before["bytes_served"],
                "windows": b1.get("ranged_reads", 0) - b0.get("ranged_reads", 0),
                "fetched_back": b1.get("fetched_back", 0) - b0.get("fetched_back", 0),
                "events": report.get("boot", []),
                "timings": {k: round(v, 4) for k, v in report.get("timings", {}).items()
                            if k != "began"}}

    def _wait_torn_down(self, timeout: float = 30.0) -> None:
        # The runner answers before its teardown; the mount process's prefetch and the
        # trace's publish end with that teardown.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not os.path.isdir(self.scratch) or not os.listdir(self.scratch):
                return
            time.sleep(0.05)

    def trace_branch(self) -> str | None:
        for b in json.loads(self.cli("branch", "list", "img", "--json")):
            if b["name"].startswith("boot-trace/"):
                return str(b["name"])
        return None

    def wait_trace(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            name = self.trace_branch()
            if name is not None:
                return name
            time.sleep(0.2)
        raise RuntimeError("the first boot published no trace")


def local_boot(image: str, scratch: str, i: int, *, cold: bool = True) -> float:
    """The same bwrap sandbox with the local tree as its root, through a fresh overlay."""
    from bench.steps import _Plain
    plain = _Plain("bwrap", f"bootbench-{os.getpid()}-{i}", scratch)
    upper = tempfile.mkdtemp(dir=scratch)
    root = os.path.join(plain.jail.stage if plain.jail else plain.work, "root")
    os.mkdir(root, 0o755)
    try:
        os.makedirs(os.path.join(upper, "u"))
        os.makedirs(os.path.join(upper, "w"))
        # The root directory belongs to the sandbox's root, as strata's view shows it
        # (bwrap makes its mount points there as that id).
        assert plain.jail is not None
        os.chown(os.path.join(upper, "u"), plain.jail.id_base, plain.jail.id_base)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={image},upperdir={upper}/u,workdir={upper}/w",
                        root], check=True, capture_output=True)
        assert plain.jail is not None and plain.jail.jail is not None
        plain.jail.jail.root = root
        if cold:
            drop_caches()
        warm = _Plain("bwrap", f"bootwarm-{os.getpid()}-{i}", scratch)  # bwrap, not the image
        try:
            warm.start(["true"]).wait()
        finally:
            warm.close()
        elapsed, line, _ = first_output(CMD, start=plain.start)
        if line != "1":
            raise RuntimeError(f"the local root printed {line!r}")
        return elapsed
    finally:
        subprocess.run(["umount", "-l", root], capture_output=True)
        plain.close()
        shutil.rmtree(upper, ignore_errors=True)


def run(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not shutil.which("bwrap"):
        print("boot benchmarks skipped: they need root, /dev/fuse and bwrap", file=sys.stderr)
        return []
    work = tempfile.mkdtemp(prefix="strata-bootbench-", dir=root)
    moto = Moto(Path(work)).start()
    proxy = SlowProxy("127.0.0.1", moto.port, BUCKET_LATENCY).start()
    os.environ.update(moto.env(proxy.endpoint))
    hosts: list[Host] = []
    try:
        return _run_all(work, f"s3://{BUCKET}/boot", hosts, quick)
    finally:
        for h in hosts:
            h.close()
        proxy.stop()
        moto.stop()
        subprocess.run(["umount", "-R", "-l", work], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def _run_all(work: str, url: str, hosts: list[Host], quick: bool) -> list[dict[str, Any]]:
    reps = 2 if quick else 3
    image = os.path.join(work, "rootfs")
    size = build_image(image, (150 if quick else 520) * MB)
    _log(f"image: {size / MB:.0f} MB at {image}")
    a = Host(os.path.join(work, "a"))
    hosts.append(a)
    a.cli("init", "--bucket", url)
    a.cli("volume", "create", "img")
    a.cli("volume", "create", "v")
    t0 = time.perf_counter()
    a.cli("import", "img", image, "-m", "a python root")
    _log(f"imported in {time.perf_counter() - t0:.1f} s")
    scratch = os.path.join(work, "plain")
    os.makedirs(scratch)
    local_boot(image, scratch, 0)  # warm: bwrap, the overlay module
    local = [local_boot(image, scratch, i + 1) for i in range(reps)]
    first = a.boot()
    trace = a.wait_trace()
    traced = [a.boot() for _ in range(reps)]
    warm = statistics.median(a.boot(cold=False)["seconds"] for _ in range(reps))
    local_warm = statistics.median(local_boot(image, scratch, 10 + i, cold=False)
                                   for i in range(reps))
    local_s = statistics.median(local)
    traced_s = statistics.median(b["seconds"] for b in traced)
    traced_bytes = statistics.median(b["served"] for b in traced)
    _log(f"local {local}, first {first}, traced {traced}")
    rows = [
        row(f"boot: cold python3 print(1), {size / MB:.0f} MB image, no trace (first boot)",
            first["seconds"] * 1e3, "ms", local_s * 1e3, "bwrap over overlayfs on local disk",
            "", met=None),
        row(f"boot: cold python3 print(1), {size / MB:.0f} MB image, with the boot trace",
            traced_s * 1e3, "ms", local_s * 1e3, "bwrap over overlayfs on local disk",
            "<= 1.5x local", met=traced_s <= 1.5 * local_s),
        row("boot: the same boot warm (image cached), the step's fixed cost", warm * 1e3, "ms",
            local_warm * 1e3, "the same bwrap over overlayfs, warm", "", met=None),
        row("boot: what a cold image adds over a warm boot, with the trace",
            (traced_s - warm) * 1e3, "ms", (local_s - local_warm) * 1e3,
            "cold minus warm on local disk", "", met=None),
        row("boot: bytes fetched by a cold boot with the trace", traced_bytes / MB, "MB",
            size / MB, "the image's size", "< 10% of the image",
            met=traced_bytes < 0.1 * size),
        row("boot: bytes fetched by the first boot (no trace)", first["served"] / MB, "MB",
            size / MB, "the image's size", "< 10% of the image",
            met=first["served"] < 0.1 * size),
    ]
    # A second host: the store restored from the bucket, every pack left there.
    key = os.path.join(a.store, "bucket.key")
    a.stats()  # the server flushes nothing on a stats call; the stop below does
    a.close()
    second: dict[str, list[dict[str, Any]]] = {"with": [], "without": []}
    for n, (name, keep_trace) in enumerate([("with", True), ("without", False)] * reps):
        h = Host(os.path.join(work, f"b-{n}-{name}"))
        hosts.append(h)
        hosts[-2].close()
        h.cli("restore", "--bucket", url, "--key-file", key, "--cache-size", "16M")
        _wait_evicted(h)
        if not keep_trace and h.trace_branch() is not None:
            h.cli("branch", "delete", f"img@{trace}")
        second[name].append(h.boot())
        _log(f"second host {name} the trace: {second[name][-1]}")
        h.close()

    def med(name: str, key: str) -> float:
        return statistics.median(float(b[key]) for b in second[name])

    w_s, wo_s = med("with", "seconds"), med("without", "seconds")
    rows += [
        row("boot: second host, packs in the bucket, cold boot with the trace",
            w_s * 1e3, "ms", wo_s * 1e3, "the same boot without the trace",
            ">= 2x faster", met=wo_s >= 2 * w_s),
        row("boot: second host, what the cold image adds over a warm boot, with the trace",
            (w_s - warm) * 1e3, "ms", (wo_s - warm) * 1e3, "without the trace", "",
            met=None),
        row("boot: second host, bucket bytes (1 MiB windows) with the trace",
            med("with", "windows") * MIB / MB, "MB", med("without", "windows") * MIB / MB,
            "without the trace",
            f"packs fetched back whole: {med('with', 'fetched_back'):.0f} with, "
            f"{med('without', 'fetched_back'):.0f} without", met=None),
    ]
    return rows


def _wait_evicted(h: Host, timeout: float = 90.0) -> None:
    """Until the restored store's packs are in the bucket and its index is copied in.

    A store restored a while ago has its whole index locally (the background
    pass copies it in); what is measured is reading the image from the bucket.
    """
    deadline = time.monotonic() + timeout
    hydrated = -1
    while time.monotonic() < deadline:
        tier = h.stats().get("bucket") or {}
        if tier.get("local_bytes", BUDGET + 1) <= BUDGET and tier.get("uploads_queued") == 0 \
                and tier.get("packs_only_in_bucket", 0) > 0 \
                and tier.get("index_entries_hydrated") == hydrated:
            return
        hydrated = tier.get("index_entries_hydrated", 0)
        time.sleep(1.0)
    _log(f"packs still local after {timeout:.0f} s: {h.stats().get('bucket')}")
