"""Mount benchmarks: the same work on a strata mount and on the local disk, in one run.

Every workload runs twice, once in a local directory and once in a writable
strata mount (FUSE lower, overlayfs, ext4 upper) on the same disk, and the
row gives both figures and their ratio. The store, its server, the mount
scratch and the content cache all live in a fresh directory under --dir, so
the cache starts cold and nothing outside is touched (the npm cache is only
read). Nothing here is a test: it measures and reports, it never asserts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from bench.cli_env import STRATA, CliEnv
from bench.report import row

MIB = 1024 * 1024


class Env(CliEnv):
    """A store with its server and the mounts made on it."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.mounts: list[str] = []

    def mount(self, ref: str, name: str) -> str:
        target = os.path.join(self.root, "mnt", name)
        os.makedirs(target, exist_ok=True)
        self.cli("mount", ref, target, "--background")
        self.mounts.append(target)
        return target

    def unmount(self, target: str) -> None:
        self.cli("unmount", target, "--discard")
        self.mounts.remove(target)

    def commit(self, target: str) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        out = json.loads(self.cli("commit", target, "--json"))
        return time.perf_counter() - t0, out

    def stats(self) -> dict[str, int]:
        from strata.server.client import RemoteStore, default_socket
        rs = RemoteStore("unix://" + default_socket(self.store))
        try:
            return dict(rs.admin("GET", "stats"))
        finally:
            rs.close()

    def close(self) -> None:
        for target in list(self.mounts):
            with contextlib.suppress(RuntimeError):
                self.unmount(target)
        for target in list(self.mounts):
            subprocess.run(["umount", "-l", target], capture_output=True)
        super().close()


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _run(*cmd: str, cwd: str | None = None) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)


def _evict(paths: list[str]) -> None:
    """Drop these files' pages from the page cache (only theirs: no global drop_caches)."""
    for p in paths:
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _files_under(path: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(path):
        out.extend(os.path.join(root, f) for f in files)
    return out


# -- generated inputs ------------------------------------------------------------------

def make_tarball(gen: str, nfiles: int) -> str:
    """A tarball of `nfiles` small files (200 B to 6 KiB) in directories of 100."""
    src = os.path.join(gen, "tree")
    blob = os.urandom(8192)
    for i in range(nfiles):
        d = os.path.join(src, f"pkg{i // 1000:02d}", f"mod{i // 100 % 10}")
        if i % 100 == 0:
            os.makedirs(d, exist_ok=True)
        size = 200 + (i * 7919) % 6000
        with open(os.path.join(d, f"file{i:05d}.js"), "wb") as f:
            f.write(blob[i % 2000:i % 2000 + size])
    tar = os.path.join(gen, "tree.tar")
    _run("tar", "-cf", tar, "-C", src, ".")
    shutil.rmtree(src)
    return tar


def make_repo(gen: str, nfiles: int, commits: int) -> str:
    """A git repository of `nfiles` files in 40 directories, with `commits` commits."""
    repo = os.path.join(gen, "repo")
    os.makedirs(repo)
    env_args = ("-c", "user.name=bench", "-c", "user.email=bench@example.com",
                "-c", "commit.gpgsign=false")
    _run("git", "init", "-q", "-b", "main", repo)
    for c in range(commits):
        step = 1 if c == 0 else 7
        for i in range(0, nfiles, step):
            d = os.path.join(repo, f"src{i % 40:02d}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"m{i:05d}.py"), "w") as f:
                f.write(f"# module {i}, revision {c}\n" + "def f(x):\n    return x\n" * (i % 30))
        _run("git", "add", "-A", cwd=repo)
        _run("git", *env_args, "commit", "-q", "-m", f"revision {c}", cwd=repo)
    return repo


def npm_deps() -> tuple[dict[str, Any] | None, str]:
    """Up to two registry tarballs already in the npm cache, as a lockfile; or why not.

    Only the local cache index is read: the benchmark never needs the network.
    """
    if shutil.which("npm") is None:
        return None, "npm is not installed"
    index = os.path.join(os.path.expanduser("~"), ".npm", "_cacache", "index-v5")
    found: dict[str, tuple[str, str, str, int]] = {}
    for path in _files_under(index) if os.path.isdir(index) else []:
        with contextlib.suppress(OSError, UnicodeDecodeError), open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError, KeyError, TypeError, IndexError):
                    rec = json.loads(line.split("\t", 1)[1])
                    url = rec["key"].removeprefix("make-fetch-happen:request-cache:")
                    if "/-/" not in url or not url.endswith(".tgz") or not rec["integrity"]:
                        continue
                    name = url.split("registry.npmjs.org/", 1)[-1].split("/-/")[0]
                    ver = url.rsplit("/-/", 1)[1][:-4].removeprefix(name.split("/")[-1] + "-")
                    found[name] = (ver, url, rec["integrity"], int(rec.get("size") or 0))
    if not found:
        return None, "no registry package in the npm cache (and no network is used)"
    picked = sorted(found.items(), key=lambda kv: kv[1][3])[:2]
    deps = {name: ver for name, (ver, _u, _i, _s) in picked}
    lock: dict[str, Any] = {"name": "bench", "version": "1.0.0", "lockfileVersion": 3,
                            "requires": True,
                            "packages": {"": {"name": "bench", "version": "1.0.0",
                                              "dependencies": deps}}}
    for name, (ver, url, integrity, _s) in picked:
        lock["packages"][f"node_modules/{name}"] = {"version": ver, "resolved": url,
                                                    "integrity": integrity}
    return lock, ", ".join(f"{n}@{v}" for n, v in deps.items())


# -- workloads ---------------------------------------------------------------------------

def _creates(d: str, n: int) -> float:
    os.makedirs(d)
    t0 = time.perf_counter()
    for i in range(n):
        os.close(os.open(os.path.join(d, f"c{i:06d}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                         0o644))
    return n / (time.perf_counter() - t0)


def _stat_rate(paths: list[str]) -> float:
    t0 = time.perf_counter()
    for p in paths:
        os.stat(p)
    return len(paths) / (time.perf_counter() - t0)


def _write_file(path: str, size: int) -> float:
    buf = bytearray(os.urandom(MIB))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(size // MIB):
            for j in range(0, MIB, 65536):  # every 64 KiB block distinct: no dedupe
                buf[j:j + 8] = (i * MIB + j).to_bytes(8, "little")
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size / MIB / (time.perf_counter() - t0)


def _read_file(path: str) -> float:
    t0 = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(MIB):
            total += len(chunk)
    return total / MIB / (time.perf_counter() - t0)


def _npm_ci(d: str, lock: dict[str, Any]) -> float:
    os.makedirs(d)
    pkg = {k: lock["packages"][""][k] for k in ("name", "version", "dependencies")}
    with open(os.path.join(d, "package.json"), "w") as f:
        json.dump({**pkg, "private": True}, f)
    with open(os.path.join(d, "package-lock.json"), "w") as f:
        json.dump(lock, f)
    return _timed(lambda: _run("npm", "ci", "--offline", "--ignore-scripts", "--no-audit",
                               "--no-fund", cwd=d))


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    old = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(old)


def _mount_in_process(env: Env, volume: str, name: str) -> float:
    """Mount and list the root through the library (no CLI interpreter start)."""
    from strata.mount import process
    from strata.mount.state import VolumeState, new_state
    from strata.server.client import RemoteStore, default_socket
    target = os.path.join(env.root, "mnt", name)
    os.makedirs(target)
    url = "unix://" + default_socket(env.store)
    with _environ({k: env.env[k] for k in ("STRATA_SCRATCH", "XDG_CACHE_HOME")}):
        t0 = time.perf_counter()
        rs = RemoteStore(url)
        sid = rs.list_branches(volume)["live"]
        rs.close()
        state = new_state(target, url, [VolumeState("", volume, "live", sid, sid)], single=True)
        state.token = None
        state.save()
        error = process.start(state, background=True)
        if error is not None:
            raise RuntimeError(error)
        env.mounts.append(target)
        os.listdir(target)
        return time.perf_counter() - t0


def fill_big_volume(store: str, volume: str, nfiles: int, per_dir: int) -> None:
    """A volume of `nfiles` small files, written through the Transaction API (embedded)."""
    from strata.engine.local import LocalStore, StoreConfig
    from strata.engine.txn import Transaction
    s = LocalStore(store, StoreConfig())
    try:
        s.create_volume(volume)
        t = Transaction(s, volume)
        ndirs = nfiles // per_dir
        for d in range(ndirs):
            t.mkdir(f"d{d:03d}")
        for i in range(nfiles):
            t.write(f"d{i % ndirs:03d}/f{i:06d}", b"x%d\n" % i)
        t.commit("fill")
    finally:
        s.close()


def run(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    """Run the mount benchmarks in a fresh directory under `root`; return table rows."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("mount benchmarks skipped: they need root and /dev/fuse", file=sys.stderr)
        return []
    work = tempfile.mkdtemp(prefix="strata-mountbench-", dir=root)
    env = Env(work)
    try:
        return _run_all(env, quick)
    finally:
        env.close()
        shutil.rmtree(work, ignore_errors=True)


def _run_all(env: Env, quick: bool) -> list[dict[str, Any]]:
    n_tar = 2_000 if quick else 20_000
    n_big = 10_000 if quick else 100_000
    big = (128 if quick else 1024) * MIB
    n_creates = 2_000 if quick else 10_000
    gen = os.path.join(env.root, "gen")
    local = os.path.join(env.root, "local")
    os.makedirs(gen)
    os.makedirs(local)
    rows: list[dict[str, Any]] = []

    _log("generating inputs")
    tar = make_tarball(gen, n_tar)
    repo = make_repo(gen, 200 if quick else 2000, 5 if quick else 20)
    lock, npm_what = npm_deps()
    _run(*STRATA, "init", "--store", env.store)
    fill_big_volume(env.store, "big", n_big, 1000)
    env.cli("volume", "create", "w")
    m = env.mount("w", "w")

    # Extract a tarball of small files, then publish it.
    # Extract a tarball of small files, then publish it. Best of two runs each,
    # alternating; the second copies are removed before anything else is committed.
    _log("tar extract")
    _read_file(tar)  # into the page cache for both sides
    tl = _timed(lambda: _run("tar", "-xf", tar, "-C", _mkdir(local, "x")))
    tm = _timed(lambda: _run("tar", "-xf", tar, "-C", _mkdir(m, "x")))
    wall, res = env.commit(m)
    tl = min(tl, _timed(lambda: _run("tar", "-xf", tar, "-C", _mkdir(local, "x2"))))
    tm = min(tm, _timed(lambda: _run("tar", "-xf", tar, "-C", _mkdir(m, "x2"))))
    rows.append(row(f"extract {n_tar // 1000}k-file tarball", tm, "s", tl, "tar -x on ext4",
                    "<= 1.5x", met=tm <= 1.5 * tl))
    rows.append(row(f"commit of the {n_tar // 1000}k new files", wall, "s", None,
                    f"{res['changed']} paths, {res['uploaded_bytes'] / MIB:.1f} MiB sent",
                    "<= 5 s", met=wall <= 5.0))
    rows.append(row("  of which inside commit()", float(res["seconds"]), "s", None,
                    "scan, hash, upload, publish"))

    _log("git clone")
    clone = ("git", "clone", "-q", "--no-local", repo)
    tl = _timed(lambda: _run(*clone, os.path.join(local, "g1")))
    tm = _timed(lambda: _run(*clone, os.path.join(m, "g1")))
    tl = min(tl, _timed(lambda: _run(*clone, os.path.join(local, "g2"))))
    tm = min(tm, _timed(lambda: _run(*clone, os.path.join(m, "g2"))))
    rows.append(row("git clone --no-local (2k files, 20 commits)" if not quick else
                    "git clone --no-local", tm, "s", tl, "same clone on ext4"))
    for d in ("x2", "g2"):
        shutil.rmtree(os.path.join(local, d))
        shutil.rmtree(os.path.join(m, d))

    _log("creates")  # best of three, interleaved: this one swings with other load
    cl = cm = 0.0
    for i in range(3):
        os.sync()  # no writeback of earlier work competing with either side
        cl = max(cl, _creates(os.path.join(local, f"c{i}"), n_creates))
        os.sync()
        cm = max(cm, _creates(os.path.join(m, f"c{i}"), n_creates))
    rows.append(row("file creates", cm, "files/s", cl, "ext4", lower_is_better=False))

    if lock is None:
        print(f"npm ci skipped: {npm_what}", file=sys.stderr)
    else:
        _log(f"npm ci ({npm_what})")
        tl = _npm_ci(os.path.join(local, "npm"), lock)
        tm = _npm_ci(os.path.join(m, "npm"), lock)
        tl = min(tl, _npm_ci(os.path.join(local, "npm2"), lock))
        tm = min(tm, _npm_ci(os.path.join(m, "npm2"), lock))
        shutil.rmtree(os.path.join(local, "npm2"))
        shutil.rmtree(os.path.join(m, "npm2"))
        rows.append(row(f"npm ci, warm cache ({npm_what})", tm, "s", tl, "ext4", "<= 1.3x",
                        met=tm <= 1.3 * tl))

    _log("sequential write")  # best of two, in the order local, mount, mount, local
    wl = _write_file(os.path.join(local, "big.bin"), big)
    wm = _write_file(os.path.join(m, "big.bin"), big)
    wm = max(wm, _write_file(os.path.join(m, "big.bin"), big))
    wl = max(wl, _write_file(os.path.join(local, "big.bin"), big))
    rows.append(row(f"sequential write {big // MIB} MiB + fsync", wm, "MB/s", wl, "ext4",
                    lower_is_better=False))
    wall, res = env.commit(m)
    rows.append(row(f"commit of a new {big // MIB} MiB file", wall, "s", None,
                    f"{res['uploaded_bytes'] / MIB:.0f} MiB sent"))

    # A fresh mount of the published head: reads are the lazy path (cold content
    # cache, store packs evicted from the page cache), then warm.
    _log("lazy read")
    env.unmount(m)
    r = env.mount("w", "r")
    _evict([os.path.join(local, "big.bin"), *_files_under(os.path.join(env.store))])
    before = env.stats()
    rl = _read_file(os.path.join(local, "big.bin"))
    rm = _read_file(os.path.join(r, "big.bin"))
    fetched = env.stats()["bytes_served"] - before["bytes_served"]
    rows.append(row(f"sequential read {big // MIB} MiB, cold (lazy fetch)", rm, "MB/s", rl,
                    "ext4, evicted from page cache", lower_is_better=False))
    rows.append(row("  bytes fetched by that read", fetched / MIB, "MiB", big / MIB,
                    "file size"))
    rl = _read_file(os.path.join(local, "big.bin"))
    rm = _read_file(os.path.join(r, "big.bin"))
    rows.append(row(f"sequential re-read {big // MIB} MiB, warm", rm, "MB/s", rl,
                    "ext4, page cache", lower_is_better=False))

    # stat over the published 20k files in the lower (FUSE) layer.
    _log("stat")
    lower_paths = sorted(_files_under(os.path.join(r, "x")))  # readdir only
    local_paths = sorted(_files_under(os.path.join(local, "x")))
    sl = max(_stat_rate(local_paths) for _ in range(3))
    cold = _stat_rate(lower_paths)  # first stat of each: a lookup per directory entry
    rows.append(row(f"first stat after a walk, {n_tar // 1000}k lower files", cold,
                    "stat/s", sl, "ext4, dentry cache", lower_is_better=False))
    sm = max(_stat_rate(lower_paths) for _ in range(3))
    rows.append(row(f"warm stat, {n_tar // 1000}k files in the lower (FUSE) layer", sm,
                    "stat/s", sl, "ext4, dentry cache", ">= 0.5x local",
                    lower_is_better=False, met=sm >= 0.5 * sl))
    env.unmount(r)

    # Second mount on the shared content cache: no fetches. Cache files and the
    # local file are evicted from the page cache: both sides read from disk.
    r2 = env.mount("w", "r2")
    _evict([os.path.join(local, "big.bin"), *_files_under(env.cache)])
    before = env.stats()
    rm = _read_file(os.path.join(r2, "big.bin"))
    fetched = env.stats()["objects_served"] - before["objects_served"]
    rl = _read_file(os.path.join(local, "big.bin"))
    rows.append(row(f"read {big // MIB} MiB, new mount, shared cache", rm, "MB/s", rl,
                    f"ext4, evicted; {fetched} objects fetched", lower_is_better=False))
    env.unmount(r2)

    # Mount a 100k-file volume and list its root.
    _log("mount 100k")
    cli_times, old_times, lib_times, fetched_objs = [], [], [], []
    for i in range(3):
        before = env.stats()
        target = os.path.join(env.root, "mnt", f"big{i}")
        t0 = time.perf_counter()
        env.mounts.append(target)
        os.makedirs(target)
        env.cli("mount", "big", target, "--background")  # made by the step service
        os.listdir(target)
        cli_times.append(time.perf_counter() - t0)
        fetched_objs.append(env.stats()["objects_served"] - before["objects_served"])
        env.unmount(target)
        # The same with the mount process forked by the CLI itself, as before the service.
        target = os.path.join(env.root, "mnt", f"old{i}")
        os.makedirs(target)
        env.mounts.append(target)
        t0 = time.perf_counter()
        subprocess.run([*STRATA, "mount", "big", target, "--background"], check=True,
                       env={**env.env, "STRATA_MOUNT_IN_PROCESS": "1"}, capture_output=True)
        os.listdir(target)
        old_times.append(time.perf_counter() - t0)
        env.unmount(target)
        lib_times.append(_mount_in_process(env, "big", f"lib{i}"))
        env.unmount(os.path.join(env.root, "mnt", f"lib{i}"))
    cli_t, old_t, lib_t = sorted(cli_times)[1], sorted(old_times)[1], sorted(lib_times)[1]
    rows.append(row(f"mount {n_big // 1000}k-file volume + list root (CLI)", cli_t, "s", None,
                    f"{max(fetched_objs)} objects fetched", "<= 0.1 s", met=cli_t <= 0.1))
    rows.append(row("  same, mount process forked by the CLI (as before the step service)",
                    old_t, "s", None, "", "<= 0.1 s", met=old_t <= 0.1))
    rows.append(row("  same, in-process (no interpreter start)", lib_t, "s", None, "",
                    "<= 0.1 s", met=lib_t <= 0.1))
    return rows


def _mkdir(parent: str, name: str) -> str:
    path = os.path.join(parent, name)
    os.makedirs(path)
    return path


def _log(what: str) -> None:
    print(f"[mount bench] {what}", file=sys.stderr, flush=True)


def main() -> None:
    """Run only the mount benchmarks (``python -m bench.mount [--quick]``)."""
    import argparse

    from bench.report import print_table
    ap = argparse.ArgumentParser(prog="python -m bench.mount")
    ap.add_argument("--dir", default=os.environ.get("STRATA_BENCH_DIR", "/var/tmp"))
    ap.add_argument("--out", default="bench/results/mount.json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rows = run(args.dir, quick=args.quick)
    print_table("strata mount benchmarks (local disk baseline from the same run)", rows)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
