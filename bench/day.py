"""The day benchmark: one agent's day on every rung of the storage ladder.

Reference 002 walks one day through each common workspace design; this module
runs that day on this machine, every rung in the same run, over the same moto
bucket on loopback:

1. clone a real repository (the running Python's standard library, 1,500
   files by default, as a local bare repository) and `npm ci` a real lockfile
   (bench/fixtures/day: 224 packages, about 2,600 files) from a warm npm cache;
2. `git add -A && git commit` an edit;
3. `sync -f` the workspace, then 4 KiB write + `os.fsync` in a loop (p50/p99);
4. "kill the host", resume on host 2: `git status`, `git log -1`, and count
   the acknowledged bytes lost (the fsynced 4 KiB records, the files as they
   were after `sync -f`) and whether the commit survived;
5. fork three attempts, and in each `git checkout -b tryN`, edit, commit;
6. detach, evict to the bucket, attach cold and run `git status`.

What "host kill" means, per rung (also in docs/workspaces.md, "The day benchmark"):

- local disk: nothing is killed; the day resumes on the same disk. The row is
  the baseline for speed only: a host that is really lost takes this disk with
  it, and the sandbox that replaces it starts empty.
- upload at stop: the host's directory is deleted (its disk went with it);
  host 2 downloads the last upload, which the day never made: everything since
  the last stop is lost.
- s3fs, rclone mount: the FUSE daemon is SIGKILLed, its mount detached lazily
  (`fusermount3 -uz`) and its local cache directory deleted; host 2 mounts the
  same bucket prefix at a new directory.
- s3backer: the s3backer daemon is SIGKILLed, ext4 and the FUSE mount are
  detached lazily and the loop device freed; host 2 starts s3backer again
  (`--force`, the mounted flag is still set) and mounts ext4, which replays
  its journal.
- strata workspace: every process serving the attach is SIGKILLed and the
  directory detached lazily; host 2 runs `strata workspace attach`.

A rung that breaks at a step records the error text in that step's cell; the
steps that needed it are left blank, and a rung that has spent its time budget
starts no further step. Nothing here asserts; it measures and reports. Sizes
come from environment variables (DAY_*, see `Config.from_env`). Every mount,
loop device and process the harness made is undone in `finally`, also on
failure; it never touches another process, mount or loop device.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cli_env import STRATA

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bucketutil import Moto  # noqa: E402
from serverutil import free_port  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "day"
RECORD = 4096
SKIPPED = "not run:"
ALL_RUNGS = ("local", "upload", "s3fs", "s3backer", "rclone", "nfs", "strata")
LABELS = {"local": "local disk (ext4)", "upload": "upload at stop (tar+zstd)",
          "s3fs": "s3fs-fuse", "s3backer": "s3backer + ext4", "rclone": "rclone mount",
          "nfs": "NFS (kernel nfsd)", "strata": "strata workspace"}
GIT_ENV = {"GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@example.com",
           "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "agent@example.com",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_COUNT": "2",
           "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*",
           "GIT_CONFIG_KEY_1": "commit.gpgsign", "GIT_CONFIG_VALUE_1": "false"}


@dataclass
class Config:
    """Sizes and switches; every one has a DAY_* environment variable."""

    root: str
    rungs: list[str] = field(default_factory=lambda: list(ALL_RUNGS))
    repo_src: str = ""          # DAY_REPO_SRC: a source tree (default: the stdlib)
    repo_files: int = 1500      # DAY_REPO_FILES: at most this many of its files
    npm: bool = True            # DAY_NPM=0 skips `npm ci`
    npm_dir: str = str(FIXTURE)  # DAY_NPM_DIR: package.json + package-lock.json
    npm_cache: str = "/var/tmp/strata-day-npm-cache"  # DAY_NPM_CACHE (kept between runs)
    fsync_iters: int = 200      # DAY_FSYNC_ITERS
    step_timeout: float = 150.0  # DAY_STEP_TIMEOUT: seconds per command
    s3backer_size: str = "2G"   # DAY_S3BACKER_SIZE
    forks: int = 3              # DAY_FORKS
    rung_budget: float = 240.0  # DAY_RUNG_BUDGET: seconds; later steps are not started

    @classmethod
    def from_env(cls, root: str, *, quick: bool = False) -> Config:
        e = os.environ
        cfg = cls(root=root)
        if quick:
            cfg.repo_files, cfg.fsync_iters, cfg.step_timeout = 500, 50, 90.0
        cfg.rungs = [r for r in e.get("DAY_RUNGS", ",".join(cfg.rungs)).split(",") if r]
        cfg.repo_src = e.get("DAY_REPO_SRC", cfg.repo_src)
        cfg.repo_files = int(e.get("DAY_REPO_FILES", cfg.repo_files))
        cfg.npm = e.get("DAY_NPM", "1") != "0"
        cfg.npm_dir = e.get("DAY_NPM_DIR", cfg.npm_dir)
        cfg.npm_cache = e.get("DAY_NPM_CACHE", cfg.npm_cache)
        cfg.fsync_iters = int(e.get("DAY_FSYNC_ITERS", cfg.fsync_iters))
        cfg.step_timeout = float(e.get("DAY_STEP_TIMEOUT", cfg.step_timeout))
        cfg.s3backer_size = e.get("DAY_S3BACKER_SIZE", cfg.s3backer_size)
        cfg.forks = int(e.get("DAY_FORKS", cfg.forks))
        cfg.rung_budget = float(e.get("DAY_RUNG_BUDGET", cfg.rung_budget))
        return cfg


class Broke(Exception):
    """A step of the day failed on a rung; the message is what the table shows."""


def _tail(text: str, n: int = 160) -> str:
    """The last line that says what went wrong (npm ends with where its log is instead)."""
    lines = [ln.strip() for ln in text.strip().splitlines()
             if ln.strip() and "A complete log of this run" not in ln and "/_logs/" not in ln]
    return (lines[-1] if lines else "")[:n]


def sh(*cmd: str, cwd: str | None = None, timeout: float = 180.0,
       env: dict[str, str] | None = None) -> str:
    """Run a command; a failure or a timeout raises Broke with the error's last line."""
    try:
        p = subprocess.run(cmd, cwd=cwd, env={**os.environ, **GIT_ENV, **(env or {})},
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise Broke(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''}: timed out after "
                    f"{timeout:.0f} s") from exc
    except OSError as exc:
        raise Broke(f"{cmd[0]}: {exc}") from exc
    if p.returncode != 0:
        raise Broke(f"{' '.join(cmd[:2])}: {_tail(p.stderr or p.stdout)} (exit {p.returncode})")
    return p.stdout


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _quiet(*cmd: str) -> None:
    subprocess.run(cmd, capture_output=True, timeout=60)


def _wait_mounted(path: str, proc: subprocess.Popen[bytes] | None, log: str,
                  timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.ismount(path):
        if proc is not None and proc.poll() is not None:
            raise Broke(f"mount exited {proc.returncode}: {_tail(Path(log).read_text())}")
        if time.monotonic() > deadline:
            raise Broke(f"not mounted after {timeout:.0f} s: {_tail(Path(log).read_text())}")
        time.sleep(0.05)


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


# -- inputs: the repository and the npm cache -------------------------------------------

def make_bare_repo(cfg: Config, gen: str) -> str:
    """A bare repository of a real source tree, with the npm project at its root."""
    src = cfg.repo_src or sysconfig.get_paths()["stdlib"]
    tree = os.path.join(gen, "tree")
    os.makedirs(tree)
    n = 0
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__",
                                                     "lib-dynload", ".git", "node_modules")
                         and not d.startswith("config-"))
        for f in sorted(files):
            p = os.path.join(root, f)
            if n >= cfg.repo_files or os.path.islink(p) or os.path.getsize(p) >= 1 << 20:
                continue
            dst = os.path.join(tree, "lib", os.path.relpath(p, src))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(p, dst)
            n += 1
    if cfg.npm:
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(os.path.join(cfg.npm_dir, name), os.path.join(tree, name))
    with open(os.path.join(tree, ".gitignore"), "w") as out:
        out.write("node_modules/\n")
    sh("git", "init", "-q", "-b", "main", tree)
    sh("git", "add", "-A", cwd=tree)
    sh("git", "commit", "-q", "-m", f"import {n} files of {src}", cwd=tree)
    bare = os.path.join(gen, "origin.git")
    sh("git", "clone", "-q", "--bare", tree, bare)
    shutil.rmtree(tree)
    return bare


def warm_npm_cache(cfg: Config, gen: str) -> str | None:
    """Fill the npm cache once (the registry may be used here); None, or why npm can't run."""
    if not cfg.npm:
        return "skipped (DAY_NPM=0)"
    if shutil.which("npm") is None:
        return "npm is not installed"
    d = os.path.join(gen, "npm-warm")
    os.makedirs(d)
    for f in ("package.json", "package-lock.json"):
        shutil.copyfile(os.path.join(cfg.npm_dir, f), os.path.join(d, f))
    try:
        sh("npm", "ci", "--prefer-offline", "--no-audit", "--no-fund", "--cache", cfg.npm_cache,
           cwd=d, timeout=600)
        shutil.rmtree(os.path.join(d, "node_modules"))
        sh(*_npm_ci_cmd(cfg), cwd=d, timeout=600)  # the offline run the day times works
    except Broke as exc:
        return f"npm cache could not be warmed: {exc}"
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return None


def _npm_ci_cmd(cfg: Config) -> list[str]:
    return ["npm", "ci", "--offline", "--prefer-offline", "--no-audit", "--no-fund",
            "--cache", cfg.npm_cache]


# -- the rungs ----------------------------------------------------------------------------

class Ctx:
    """What every rung shares: config, moto, and the cleanup registry."""

    def __init__(self, cfg: Config, work: str) -> None:
        self.cfg = cfg
        self.work = work
        self.moto: Moto | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.mounts: list[str] = []  # innermost last
        self.loops: list[str] = []

    def s3(self) -> Any:
        assert self.moto is not None
        return self.moto.s3()

    def bucket(self, name: str) -> str:
        if self.moto is None:
            self.moto = Moto(Path(self.work)).start()
        self.s3().create_bucket(Bucket=name)
        return name

    def spawn(self, argv: list[str], log: str, env: dict[str, str] | None = None,
              drop: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        full = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in drop}
        with open(log, "ab") as f:
            p = subprocess.Popen(argv, stdout=f, stderr=f, env=full, start_new_session=True)
        self.procs.append(p)
        return p

    def unmount(self, path: str, *, fuse: bool) -> None:
        """Detach lazily: a dead daemon's mount must not block the harness."""
        if fuse:
            _quiet("fusermount3", "-uz", path)
        if os.path.ismount(path):
            _quiet("umount", "-l", path)
        with contextlib.suppress(ValueError):
            self.mounts.remove(path)

    def close(self) -> None:
        for m in reversed(list(self.mounts)):
            _quiet("fusermount3", "-uz", m)
            _quiet("umount", "-l", m)
        self.mounts.clear()
        for loop in self.loops:
            _quiet("losetup", "-d", loop)
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
        if self.moto is not None:
            self.moto.stop()


class Rung:
    """One storage design. `attach` returns the directory the agent works in."""

    name = ""
    kill_means = ""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.dir = os.path.join(ctx.work, self.name)
        os.makedirs(self.dir, exist_ok=True)
        self.bucket_name: str | None = None
        self.fork_prep = 0.0
        self.notes: list[str] = []

    def unavailable(self) -> str | None:
        """Why this rung cannot run on this machine, or None."""
        return None

    def setup(self) -> None:
        pass

    def attach(self, host: str) -> str:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def fork(self, i: int) -> str:
        raise NotImplementedError

    def detach(self) -> None:
        raise NotImplementedError

    def evict(self) -> None:
        pass

    def bucket_bytes(self) -> int | None:
        if self.bucket_name is None:
            return None
        total = 0
        for page in self.ctx.s3().get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket_name):
            total += sum(o["Size"] for o in page.get("Contents", []))
        return total

    def copy_prefix(self, src: str, dst: str) -> int:
        """A server-side copy of every object under `src/`: how a bucket-backed tree forks.

        Eight copies in flight, as `aws s3 cp --recursive` or `rclone copy` would run them.
        """
        from concurrent.futures import ThreadPoolExecutor
        s3 = self.ctx.s3()
        keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket_name, Prefix=src + "/")
                for o in page.get("Contents", [])]

        def copy(key: str) -> None:
            s3.copy_object(Bucket=self.bucket_name, Key=dst + key[len(src):],
                           CopySource={"Bucket": self.bucket_name, "Key": key})

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(copy, keys))
        return len(keys)


class LocalDisk(Rung):
    name = "local"
    kill_means = ("nothing is killed: the day resumes on the same disk (a host that is "
                  "really lost takes this disk with it)")

    def attach(self, host: str) -> str:
        ws = os.path.join(self.dir, "ws")
        os.makedirs(ws, exist_ok=True)
        return ws

    def kill(self) -> None:
        pass

    def fork(self, i: int) -> str:
        dst = os.path.join(self.dir, f"fork{i}")
        sh("cp", "-a", "--reflink=auto", os.path.join(self.dir, "ws"), dst,
           timeout=self.cfg.step_timeout)
        return dst

    def detach(self) -> None:
        pass


class UploadAtStop(Rung):
    name = "upload"
    kill_means = ("the host's directory is deleted; host 2 downloads the last upload "
                  "(made at the last stop)")
    key = "ws.tar.zst"

    def setup(self) -> None:
        self.bucket_name = self.ctx.bucket("day-upload")
        self.host = "host1"

    def _ws(self, host: str) -> str:
        return os.path.join(self.dir, host, "ws")

    def _download(self, dst: str) -> None:
        os.makedirs(dst)
        s3 = self.ctx.s3()
        try:
            s3.head_object(Bucket=self.bucket_name, Key=self.key)
        except Exception:  # noqa: BLE001 - no upload yet: the host starts empty
            return
        tarball = dst + ".tar.zst"
        s3.download_file(self.bucket_name, self.key, tarball)
        sh("tar", "--zstd", "-xf", tarball, "-C", dst, timeout=self.cfg.step_timeout)
        os.unlink(tarball)

    def attach(self, host: str) -> str:
        self.host = host
        ws = self._ws(host)
        self._download(ws)
        return ws

    def upload(self) -> None:
        """The stop: tar + zstd the whole workspace and put it in the bucket."""
        ws = self._ws(self.host)
        tarball = ws + ".tar.zst"
        sh("tar", "--zstd", "-cf", tarball, "-C", ws, ".", timeout=self.cfg.step_timeout)
        self.ctx.s3().upload_file(tarball, self.bucket_name, self.key)
        os.unlink(tarball)

    def kill(self) -> None:
        shutil.rmtree(os.path.join(self.dir, self.host))

    def fork(self, i: int) -> str:
        if i == 0:  # the forks start from the bucket's copy: stop (upload) first
            self.fork_prep = _timed(self.upload)
        dst = os.path.join(self.dir, f"fork{i}", "ws")
        self._download(dst)
        return dst

    def detach(self) -> None:
        self.upload()

    def evict(self) -> None:
        shutil.rmtree(os.path.join(self.dir, self.host))


class _FuseBucket(Rung):
    """A bucket prefix mounted with a FUSE daemon; forks are server-side prefix copies."""

    tool = ""
    fuse = True

    def unavailable(self) -> str | None:
        return None if shutil.which(self.tool) else f"{self.tool} is not installed"

    def setup(self) -> None:
        self.bucket_name = self.ctx.bucket(f"day-{self.name}")
        self.proc: subprocess.Popen[bytes] | None = None
        self.mnt = ""
        self.prefix = "ws"
        self.forks: list[tuple[subprocess.Popen[bytes], str]] = []

    def cache_dir(self, host: str) -> str:
        return os.path.join(self.dir, host, "cache")

    def mount(self, prefix: str, mnt: str, host: str) -> subprocess.Popen[bytes]:
        raise NotImplementedError

    def _mount(self, prefix: str, host: str) -> tuple[subprocess.Popen[bytes], str]:
        mnt = os.path.join(self.dir, host, "mnt")
        os.makedirs(mnt, exist_ok=True)
        os.makedirs(self.cache_dir(host), exist_ok=True)
        log = os.path.join(self.dir, f"{host}.log")
        proc = self.mount(prefix, mnt, host)
        self.ctx.mounts.append(mnt)
        _wait_mounted(mnt, proc, log)
        return proc, mnt

    def attach(self, host: str) -> str:
        self.host = host
        self.proc, self.mnt = self._mount(self.prefix, host)
        return self.mnt

    def flush(self, mnt: str) -> None:
        pass

    def _stop(self, proc: subprocess.Popen[bytes] | None, mnt: str, sig: int) -> None:
        if proc is not None and proc.poll() is None:
            if sig == signal.SIGKILL:
                os.killpg(proc.pid, sig)
            else:  # a clean stop: unmount and let the daemon flush and exit
                self.flush(mnt)
                _quiet("fusermount3", "-u", mnt)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.cfg.step_timeout)
        self.ctx.unmount(mnt, fuse=True)

    def kill(self) -> None:
        self._stop(self.proc, self.mnt, signal.SIGKILL)
        shutil.rmtree(self.cache_dir(self.host), ignore_errors=True)

    def fork(self, i: int) -> str:
        if i == 0:  # a consistent copy needs the daemon's buffered writes in the bucket
            self.fork_prep = _timed(self.detach)
        self.copy_prefix(self.prefix, f"fork{i}")
        proc, mnt = self._mount(f"fork{i}", f"fork{i}")
        self.forks.append((proc, mnt))
        return mnt

    def detach(self) -> None:
        for proc, mnt in self.forks:
            self._stop(proc, mnt, signal.SIGTERM)
        self.forks.clear()
        if self.mnt:
            self._stop(self.proc, self.mnt, signal.SIGTERM)
            self.mnt = ""

    def evict(self) -> None:
        shutil.rmtree(os.path.join(self.dir, self.host), ignore_errors=True)


class S3fs(_FuseBucket):
    name = "s3fs"
    tool = "s3fs"
    kill_means = ("s3fs is SIGKILLed and unmounted lazily; host 2 mounts the same prefix")

    def mount(self, prefix: str, mnt: str, host: str) -> subprocess.Popen[bytes]:
        assert self.ctx.moto is not None
        pw = os.path.join(self.dir, "passwd")
        with open(pw, "w") as f:
            f.write("test:test\n")
        os.chmod(pw, 0o600)
        # s3fs needs the prefix to exist as a directory object before it mounts it.
        self.ctx.s3().put_object(Bucket=self.bucket_name, Key=prefix + "/", Body=b"")
        return self.ctx.spawn(
            ["s3fs", f"{self.bucket_name}:/{prefix}", mnt, "-f",
             "-o", f"url={self.ctx.moto.endpoint}", "-o", "use_path_request_style",
             "-o", f"passwd_file={pw}", "-o", "endpoint=us-east-1",
             "-o", "complement_stat", "-o", "enable_noobj_cache", "-o", "dbglevel=warn"],
            os.path.join(self.dir, f"{host}.log"))


class Rclone(_FuseBucket):
    name = "rclone"
    tool = "rclone"
    kill_means = ("rclone is SIGKILLed, unmounted lazily and its VFS cache (the host's "
                  "disk) deleted; host 2 mounts the same prefix")

    def setup(self) -> None:
        super().setup()
        self.rc: dict[str, int] = {}

    def flush(self, mnt: str) -> None:
        """Wait until rclone has uploaded what its cache holds: it drops it on unmount."""
        import urllib.request
        deadline = time.monotonic() + self.cfg.step_timeout
        while True:
            req = urllib.request.Request(f"http://127.0.0.1:{self.rc[mnt]}/vfs/stats",
                                         data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                disk = json.load(r).get("diskCache", {})
            if disk.get("uploadsInProgress", 0) + disk.get("uploadsQueued", 0) == 0:
                return
            if time.monotonic() > deadline:
                raise Broke(f"rclone still uploading after {self.cfg.step_timeout:.0f} s")
            time.sleep(0.2)

    def mount(self, prefix: str, mnt: str, host: str) -> subprocess.Popen[bytes]:
        assert self.ctx.moto is not None
        env = {"RCLONE_CONFIG_DAY_TYPE": "s3", "RCLONE_CONFIG_DAY_PROVIDER": "Other",
               "RCLONE_CONFIG_DAY_ENDPOINT": self.ctx.moto.endpoint,
               "RCLONE_CONFIG_DAY_ACCESS_KEY_ID": "test",
               "RCLONE_CONFIG_DAY_SECRET_ACCESS_KEY": "test",
               "RCLONE_CONFIG_DAY_REGION": "us-east-1",
               "RCLONE_CONFIG_DAY_FORCE_PATH_STYLE": "true"}
        # --vfs-cache-mode writes: without it git cannot open files read-write. Uploads
        # start --vfs-write-back (5 s, the default) after a file is closed.
        port = free_port()
        self.rc[mnt] = port
        return self.ctx.spawn(
            ["rclone", "mount", f"day:{self.bucket_name}/{prefix}", mnt,
             "--vfs-cache-mode", "writes", "--cache-dir", self.cache_dir(host),
             "--config", "/dev/null", "--log-level", "NOTICE",
             "--rc", "--rc-no-auth", "--rc-addr", f"127.0.0.1:{port}"],
            os.path.join(self.dir, f"{host}.log"), env,
            # rclone's AWS SDK cannot load a CA bundle into its own transport (and the
            # bucket is plain http on loopback anyway).
            drop=("AWS_CA_BUNDLE",))


class S3backer(Rung):
    """ext4 on a loop device over s3backer's one-file FUSE view of the bucket's blocks."""

    name = "s3backer"
    kill_means = ("s3backer is SIGKILLed; ext4, the loop device and the FUSE mount are "
                  "detached lazily; host 2 starts s3backer (--force) and mounts ext4")

    def unavailable(self) -> str | None:
        return None if shutil.which("s3backer") else "s3backer is not installed"

    def setup(self) -> None:
        self.bucket_name = self.ctx.bucket("day-s3backer")
        self.cur: tuple[subprocess.Popen[bytes], str, str] | None = None
        self.forks: list[tuple[subprocess.Popen[bytes], str, str]] = []
        self.host = "host1"
        self.formatted = False

    def _start(self, prefix: str, host: str, *, force: bool
               ) -> tuple[subprocess.Popen[bytes], str, str]:
        assert self.ctx.moto is not None
        fuse = os.path.join(self.dir, host, "fuse")
        mnt = os.path.join(self.dir, host, "mnt")
        os.makedirs(fuse, exist_ok=True)
        os.makedirs(mnt, exist_ok=True)
        log = os.path.join(self.dir, f"{host}.log")
        argv = ["s3backer", "-f", f"--baseURL={self.ctx.moto.endpoint}/", "--accessId=test",
                "--accessKey=test", f"--size={self.cfg.s3backer_size}",
                "--blockSize=256K", f"--prefix={prefix}/", "--listBlocks", "--quiet",
                self.bucket_name or "", fuse]
        if force:
            argv.insert(1, "--force")
        proc = self.ctx.spawn(argv, log)
        self.ctx.mounts.append(fuse)
        _wait_mounted(fuse, proc, log)
        dev = os.path.join(fuse, "file")
        if not self.formatted:
            sh("mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1",
               dev, timeout=self.cfg.step_timeout)
            self.formatted = True
        loop = sh("losetup", "-f", "--show", dev).strip()
        self.ctx.loops.append(loop)
        sh("mount", "-t", "ext4", loop, mnt, timeout=self.cfg.step_timeout)
        self.ctx.mounts.append(mnt)
        return proc, fuse, mnt

    def _stop(self, cur: tuple[subprocess.Popen[bytes], str, str], *, kill: bool) -> None:
        proc, fuse, mnt = cur
        loop = self._loop_of(os.path.join(fuse, "file"))
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            self.ctx.unmount(mnt, fuse=False)
        else:  # clean: ext4 off, loop freed, then s3backer flushes its cache and exits
            sh("umount", mnt, timeout=self.cfg.step_timeout)
            with contextlib.suppress(ValueError):
                self.ctx.mounts.remove(mnt)
        if loop:
            _quiet("losetup", "-d", loop)
            with contextlib.suppress(ValueError):
                self.ctx.loops.remove(loop)
        if not kill:
            # The loop device lets go of s3backer's file a moment after `losetup -d`:
            # until then the unmount fails as busy, and s3backer would never exit.
            deadline = time.monotonic() + 30
            while os.path.ismount(fuse) and time.monotonic() < deadline:
                _quiet("fusermount3", "-u", fuse)
                if os.path.ismount(fuse):
                    time.sleep(0.1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.cfg.step_timeout)
        self.ctx.unmount(fuse, fuse=True)

    @staticmethod
    def _loop_of(backing: str) -> str:
        p = subprocess.run(["losetup", "-j", backing], capture_output=True, text=True)
        return p.stdout.split(":", 1)[0].strip() if p.stdout else ""

    def attach(self, host: str) -> str:
        self.host = host
        self.cur = self._start("ws", host, force=host != "host1")
        return self.cur[2]

    def kill(self) -> None:
        assert self.cur is not None
        self._stop(self.cur, kill=True)
        self.cur = None

    def fork(self, i: int) -> str:
        if i == 0:
            self.fork_prep = _timed(self.detach)
        self.copy_prefix("ws", f"fork{i}")
        cur = self._start(f"fork{i}", f"fork{i}", force=True)
        self.forks.append(cur)
        return cur[2]

    def detach(self) -> None:
        for cur in self.forks:
            self._stop(cur, kill=False)
        self.forks.clear()
        if self.cur is not None:
            self._stop(self.cur, kill=False)
            self.cur = None

    def evict(self) -> None:
        shutil.rmtree(os.path.join(self.dir, self.host), ignore_errors=True)


class Nfs(Rung):
    name = "nfs"
    kill_means = "the NFS client's mount is detached lazily; host 2 mounts the export again"

    def unavailable(self) -> str | None:
        fs = Path("/proc/filesystems").read_text()
        if "nfsd" not in fs:
            try:
                p = subprocess.run(["modprobe", "nfsd"], capture_output=True, text=True)
                why = _tail(p.stderr) or "modprobe nfsd did nothing"
            except OSError as exc:
                why = f"no modprobe: {exc.strerror}"
            if "nfsd" not in Path("/proc/filesystems").read_text():
                return (f"nfsd unavailable: kernel {os.uname().release} has no nfsd "
                        f"filesystem and no module for it ({why})")
        if "\tnfs\n" not in fs and "nfs4" not in fs:
            return "nfsd unavailable: this kernel has no NFS client"
        if shutil.which("exportfs") is None:
            return "nfsd unavailable: nfs-kernel-server is not installed"
        return "NFS rung not written: this kernel has nfsd, wire it up"


class StrataWorkspace(Rung):
    """A strata workspace on a store kept in the bucket (`--sync bucket`).

    Eviction stops the server and restores the store from the bucket into an
    empty directory (no pack is downloaded), so the cold attach reads every
    block it needs from the bucket, as a new machine would.
    """

    name = "strata"
    kill_means = ("every process serving the attach is SIGKILLed and the directory detached "
                  "lazily; host 2 runs `strata workspace attach`")

    def unavailable(self) -> str | None:
        p = subprocess.run([*STRATA, "workspace", "--help"], capture_output=True, text=True)
        return None if p.returncode == 0 else "not built (`strata workspace` does not exist)"

    def setup(self) -> None:
        self.bucket_name = self.ctx.bucket("day-strata")
        assert self.ctx.moto is not None
        store = os.path.join(self.dir, "store")
        self.env = {**self.ctx.moto.env(), "STRATA_STORE": store,
                    "STRATA_SCRATCH": os.path.join(self.dir, "scratch"),
                    "STRATA_WORKSPACE_STATE": os.path.join(self.dir, "wsstate"),
                    "XDG_CACHE_HOME": os.path.join(self.dir, "cache"),
                    "STRATA_SERVER_IDLE_EXIT": "3600"}
        self.url = f"s3://{self.bucket_name}/store"
        self.cli("init", "--bucket", self.url, "--sync", "bucket")
        self.cli("workspace", "create", "ws", "--size", "20G")
        self.mnt = ""
        self.forks: list[str] = []

    def cli(self, *args: str) -> str:
        return sh(*STRATA, *args, env=self.env, timeout=self.cfg.step_timeout)

    def attach(self, host: str) -> str:
        self.mnt = os.path.join(self.dir, host, "mnt")
        os.makedirs(self.mnt, exist_ok=True)
        self.cli("workspace", "attach", "ws", self.mnt)
        self.ctx.mounts.append(self.mnt)
        return self.mnt

    def _serving(self, mnt: str) -> list[int]:
        """The processes whose command line names this attach directory (ours only)."""
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
                    if mnt.encode() in argv and int(d) != os.getpid():
                        pids.append(int(d))
        return pids

    def kill(self) -> None:
        for pid in self._serving(self.mnt):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.ctx.unmount(self.mnt, fuse=True)
        with contextlib.suppress(ValueError):
            self.ctx.mounts.remove(self.mnt)
        # What the dead daemon left (its FUSE directory, waiting requests): cleared the way
        # `detach` does for an attach whose daemon is gone.
        subprocess.run([*STRATA, "workspace", "detach", self.mnt],
                       env={**os.environ, **self.env}, capture_output=True)

    def fork(self, i: int) -> str:
        self.cli("workspace", "fork", "ws", f"fork{i}")
        mnt = os.path.join(self.dir, f"fork{i}")
        os.makedirs(mnt, exist_ok=True)
        self.cli("workspace", "attach", f"ws@fork{i}", mnt)
        self.ctx.mounts.append(mnt)
        self.forks.append(mnt)
        return mnt

    def evict(self) -> None:
        """Everything is in the bucket (--sync bucket): a new machine restores, cold."""
        self.close()
        # The bucket key, kept apart from the lost machine's disk as a user would.
        key = os.path.join(self.dir, "bucket.key")
        shutil.copy2(os.path.join(self.env["STRATA_STORE"], "bucket.key"), key)
        store = os.path.join(self.dir, "store-cold")
        self.env["STRATA_STORE"] = store
        self.cli("restore", "--bucket", self.url, "--store", store, "--key-file", key)

    def detach(self) -> None:
        for mnt in [*self.forks, self.mnt]:
            if mnt and os.path.ismount(mnt):
                self.cli("workspace", "detach", mnt)
                with contextlib.suppress(ValueError):
                    self.ctx.mounts.remove(mnt)
        self.forks.clear()

    def close(self) -> None:
        subprocess.run([*STRATA, "serve", "--stop"], env={**os.environ, **self.env},
                       capture_output=True)


RUNGS: dict[str, type[Rung]] = {"local": LocalDisk, "upload": UploadAtStop, "s3fs": S3fs,
                                "s3backer": S3backer, "rclone": Rclone, "nfs": Nfs,
                                "strata": StrataWorkspace}


# -- the day --------------------------------------------------------------------------------

@dataclass
class Day:
    """What one rung's day measured; `errors` maps a step to how it broke."""

    rung: str
    label: str
    kill_means: str
    figures: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _fsync_loop(path: str, n: int) -> list[float]:
    """Append `n` distinct 4 KiB records, each followed by fsync; the latency of each."""
    lat = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for i in range(n):
            rec = _record(i)
            t0 = time.perf_counter()
            os.write(fd, rec)
            os.fsync(fd)
            lat.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return lat


def _record(i: int) -> bytes:
    head = f"record {i:08d} ".encode()
    return head + bytes([65 + i % 26]) * (RECORD - len(head) - 1) + b"\n"


def _records_lost(path: str, n: int) -> int:
    """Acknowledged bytes of the fsync log that did not survive, whole and in place."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return n * RECORD
    kept = sum(1 for i in range(n) if data[i * RECORD:(i + 1) * RECORD] == _record(i))
    return (n - kept) * RECORD


def _manifest(ws: str) -> dict[str, int]:
    """Every file's size, the fsync log aside: what `sync -f` acknowledged, cheaply."""
    out = {}
    for root, _dirs, files in os.walk(ws):
        for name in files:
            p = os.path.join(root, name)
            with contextlib.suppress(OSError):
                out[os.path.relpath(p, ws)] = os.lstat(p).st_size
    out.pop("fsync.log", None)
    return out


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


class _Steps:
    """Run steps in order; once one breaks, or the rung's budget is spent, skip the rest."""

    def __init__(self, day: Day, budget: float) -> None:
        self.day = day
        self.broken = False
        self.budget = budget
        self.deadline = time.monotonic() + budget

    @contextlib.contextmanager
    def step(self, name: str, *, needs_workspace: bool = True) -> Iterator[bool]:
        if self.broken and needs_workspace:
            yield False
            return
        if needs_workspace and time.monotonic() > self.deadline:
            self.day.errors[name] = (f"{SKIPPED} the rung's {self.budget:.0f} s budget "
                                     "(DAY_RUNG_BUDGET) was spent")
            self.broken = True
            yield False
            return
        _log(f"{self.day.rung}: {name}")
        try:
            yield True
        except Broke as exc:
            self.day.errors[name] = str(exc)
            self.broken = True
            _log(f"{self.day.rung}: {name} broke: {exc}")
        except Exception as exc:  # noqa: BLE001 - any failure of the peer is a result
            self.day.errors[name] = f"{type(exc).__name__}: {exc}"
            self.broken = True
            _log(f"{self.day.rung}: {name} failed: {type(exc).__name__}: {exc}")


def _clone(cfg: Config, bare: str, repo: str) -> None:
    sh("git", "clone", "-q", "--no-hardlinks", f"file://{bare}", repo, timeout=cfg.step_timeout)


def _npm_ci(cfg: Config, repo: str) -> None:
    sh(*_npm_ci_cmd(cfg), cwd=repo, timeout=cfg.step_timeout)


def _commit(cfg: Config, repo: str, what: str) -> str:
    notes = os.path.join(repo, "NOTES.md")
    with open(notes, "a") as f:
        f.write(f"{what}\n")
    for name in sorted(os.listdir(os.path.join(repo, "lib")))[:5]:
        p = os.path.join(repo, "lib", name)
        if os.path.isfile(p):
            with open(p, "a") as f:
                f.write(f"# {what}\n")
    sh("git", "add", "-A", cwd=repo, timeout=cfg.step_timeout)
    sh("git", "commit", "-q", "-m", what, cwd=repo, timeout=cfg.step_timeout)
    return sh("git", "rev-parse", "HEAD", cwd=repo).strip()


def run_day(rung: Rung, bare: str, npm_problem: str | None) -> Day:
    """One day on one rung. Never raises for the rung's own failures: they are results."""
    cfg = rung.cfg
    day = Day(rung.name, LABELS[rung.name], rung.kill_means)
    f = day.figures
    why = rung.unavailable()
    if why is not None:
        day.errors["unavailable"] = why
        return day
    s = _Steps(day, cfg.rung_budget)
    ws = ""
    head = ""
    synced: dict[str, int] = {}
    with s.step("setup") as ok:
        if ok:
            rung.setup()
            ws = rung.attach("host1")
    repo = os.path.join(ws, "repo")
    with s.step("clone") as ok:
        if ok:
            f["clone_s"] = _timed(lambda: _clone(cfg, bare, repo))
    with s.step("npm ci") as ok:
        if ok and npm_problem is None:
            try:
                f["npm_s"] = _timed(lambda: _npm_ci(cfg, repo))
                if isinstance(rung, LocalDisk):
                    # The baseline of every ratio: run the morning once more in a scratch
                    # directory and keep the faster of the two, so one slow moment on a
                    # shared machine does not flatter every other rung.
                    again = os.path.join(rung.dir, "again", "repo")
                    c2 = _timed(lambda: _clone(cfg, bare, again))
                    n2 = _timed(lambda: _npm_ci(cfg, again))
                    shutil.rmtree(os.path.dirname(again))
                    if c2 + n2 < f["clone_s"] + f["npm_s"]:
                        f["clone_s"], f["npm_s"] = c2, n2
                f["clone_npm_s"] = f["clone_s"] + f["npm_s"]
            except Broke as exc:  # git still works without node_modules: the day goes on
                day.errors["npm ci"] = str(exc)
        elif ok:
            day.notes.append(f"npm ci not run: {npm_problem}")
            f["clone_npm_s"] = f["clone_s"]
        if ok:
            f["workspace_bytes"] = _tree_bytes(ws)
    with s.step("commit") as ok:
        if ok:
            t0 = time.perf_counter()
            head = _commit(cfg, repo, "the agent's morning")
            f["commit_s"] = time.perf_counter() - t0
    log = os.path.join(ws, "fsync.log")
    with s.step("fsync") as ok:
        if ok:
            f["sync_s"] = _timed(lambda: sh("sync", "-f", repo, timeout=cfg.step_timeout))
            lat = _fsync_loop(log, cfg.fsync_iters)
            f["fsync_p50_ms"] = _pct(lat, 0.5) * 1000
            f["fsync_p99_ms"] = _pct(lat, 0.99) * 1000
            synced = _manifest(ws)
            f["acked_bytes"] = cfg.fsync_iters * RECORD + sum(synced.values())
    with s.step("host kill") as ok:
        if ok:
            rung.kill()
    with s.step("resume") as ok:
        if ok:
            t0 = time.perf_counter()
            ws = rung.attach("host2")
            repo = os.path.join(ws, "repo")
            try:
                if not os.path.isdir(repo):
                    raise Broke("the repository is gone")
                sh("git", "status", "--porcelain", cwd=repo, timeout=cfg.step_timeout)
                f["resume_s"] = time.perf_counter() - t0
                got = sh("git", "log", "-1", "--format=%H", cwd=repo).strip()
            except Broke as exc:
                got = ""
                day.errors["resume"] = f"git status after the kill: {exc}"
            lost = _records_lost(os.path.join(ws, "fsync.log"), cfg.fsync_iters)
            after = _manifest(ws)
            lost += sum(size for p, size in synced.items() if after.get(p) != size)
            f["commit_survived"] = got == head
            f["lost_bytes"] = lost
            if got != head:
                # The rest of the day needs the morning's work: redo it, untimed, so that
                # forks and the cold attach are measured on the same workspace.
                day.notes.append("the kill lost the commit: the morning was redone, untimed")
                shutil.rmtree(repo, ignore_errors=True)
                _clone(cfg, bare, repo)
                if npm_problem is None and "npm ci" not in day.errors:
                    _npm_ci(cfg, repo)
                head = _commit(cfg, repo, "the agent's morning, again")
    with s.step("fork") as ok:
        if ok:
            times, cmds = [], []
            for i in range(cfg.forks):
                if i and time.monotonic() > s.deadline:
                    day.notes.append(f"{i} of {cfg.forks} forks: the rung's budget was spent")
                    break
                t0 = time.perf_counter()
                fdir = rung.fork(i)
                times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                frepo = os.path.join(fdir, "repo")
                sh("git", "checkout", "-q", "-b", f"try{i}", cwd=frepo, timeout=cfg.step_timeout)
                _commit(cfg, frepo, f"attempt {i}")
                cmds.append(time.perf_counter() - t0)
            f["forks"] = len(times)
            f["fork_s"] = statistics.median(times)
            f["fork_prep_s"] = rung.fork_prep
            f["fork_cmd_s"] = statistics.median(cmds)
    with s.step("cold attach") as ok:
        if ok:
            rung.detach()
            rung.evict()
            t0 = time.perf_counter()
            ws = rung.attach("cold")
            got = sh("git", "log", "-1", "--format=%H", cwd=os.path.join(ws, "repo"),
                     timeout=cfg.step_timeout).strip()
            sh("git", "status", "--porcelain", cwd=os.path.join(ws, "repo"),
               timeout=cfg.step_timeout)
            f["cold_attach_s"] = time.perf_counter() - t0
            if got != head:
                day.notes.append(f"cold attach shows {got[:10]}, not the last commit {head[:10]}")
            rung.detach()
    with s.step("bucket bytes", needs_workspace=False) as ok:
        if ok:
            f["bucket_bytes"] = rung.bucket_bytes()
    day.notes += rung.notes
    # The work directory is gone after the run: name paths inside it by their place only.
    day.errors = {k: v.replace(rung.dir + os.sep, "") for k, v in day.errors.items()}
    return day


# -- running and reporting ----------------------------------------------------------------

def run_rungs(cfg: Config) -> list[Day]:
    """The day on every rung in `cfg.rungs`, in one fresh directory under cfg.root."""
    work = tempfile.mkdtemp(prefix="strata-day-", dir=cfg.root)
    ctx = Ctx(cfg, work)
    days: list[Day] = []
    rungs: list[Rung] = []
    try:
        gen = os.path.join(work, "gen")
        os.makedirs(gen)
        _log("building the origin repository and warming the npm cache (not timed)")
        bare = make_bare_repo(cfg, gen)
        npm_problem = warm_npm_cache(cfg, gen)
        for name in cfg.rungs:
            rung = RUNGS[name](ctx)
            rungs.append(rung)
            try:
                days.append(run_day(rung, bare, npm_problem))
            finally:
                _teardown_rung(ctx, rung)
    finally:
        for rung in rungs:
            with contextlib.suppress(Exception):
                if isinstance(rung, StrataWorkspace):
                    rung.close()
        ctx.close()
        if os.environ.get("DAY_KEEP") == "1":  # the peers' logs, for a post-mortem
            _log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return days


def _teardown_rung(ctx: Ctx, rung: Rung) -> None:
    """Unmount what this rung left, so the next rung starts on a quiet machine."""
    for m in reversed([m for m in ctx.mounts if m.startswith(rung.dir + os.sep)]):
        _quiet("fusermount3", "-uz", m)
        _quiet("umount", "-l", m)
        ctx.mounts.remove(m)


def to_rows(days: list[Day]) -> list[dict[str, Any]]:
    """JSON rows: one per rung and figure, with the local disk's figure as the baseline."""
    base = next((d.figures for d in days if d.rung == "local"), {})
    rows = []
    for d in days:
        rows.append({"name": f"day: {d.label}", "rung": d.rung, "figures": d.figures,
                     "baseline": base if d.rung != "local" else None, "errors": d.errors,
                     "notes": d.notes, "host_kill": d.kill_means})
    return rows


def _fmt_s(v: float) -> str:
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def cells(d: Day, base: dict[str, Any]) -> list[str]:
    """The table's cells for one rung: a figure, or how that step broke, or blank."""
    f, e = d.figures, d.errors
    if "unavailable" in e:
        return [e["unavailable"]] + [""] * 6

    def broke(*steps: str) -> str | None:
        for st in steps:
            if st in e:
                return e[st] if e[st].startswith(SKIPPED) else f"broke at {st}: {e[st]}"
        return None

    out = []
    if "clone_npm_s" in f:
        c = _fmt_s(f["clone_npm_s"])
        if base.get("clone_npm_s") and d.rung != "local":
            c += f" ({f['clone_npm_s'] / base['clone_npm_s']:.2f}x)"
        out.append(c)
    elif "clone_s" in f:
        out.append(f"clone {_fmt_s(f['clone_s'])}; npm ci broke: {e.get('npm ci', '')}")
    else:
        out.append(broke("setup", "clone") or "")
    out.append(f"{f['fsync_p50_ms']:.2f} / {f['fsync_p99_ms']:.2f}" if "fsync_p50_ms" in f
               else broke("commit", "fsync") or "")
    if "lost_bytes" in f:
        c = f"{_bytes(f['lost_bytes'])} of {_bytes(f['acked_bytes'])}"
        if not f["commit_survived"]:
            c += "; commit lost"
        if d.rung == "local":
            c += " (same disk)"
        out.append(c)
    else:
        out.append(broke("host kill", "resume") or "")
    out.append(_fmt_s(f["resume_s"]) if "resume_s" in f else broke("resume") or "")
    if "fork_s" in f:
        c = _fmt_s(f["fork_s"])
        if f.get("fork_prep_s"):
            c += f" (+{_fmt_s(f['fork_prep_s'])} stop first)"
        out.append(c)
    else:
        out.append(broke("fork") or "")
    out.append(_fmt_s(f["cold_attach_s"]) if "cold_attach_s" in f
               else broke("cold attach") or "")
    bb = f.get("bucket_bytes")
    out.append("n/a (no bucket)" if d.rung == "local" else _bytes(bb) if bb is not None
               else broke("bucket bytes") or "")
    return out


COLUMNS = ("rung", "clone + npm ci (× local)", "4 KiB write+fsync p50 / p99 ms",
           "acked bytes lost on host kill", "resume → first git status", "fork (each)",
           "cold attach → git status", "bytes in bucket (workspace + forks)")


def print_day(days: list[Day], cfg: Config | None = None) -> None:
    from bench.report import print_grid
    base = next((d.figures for d in days if d.rung == "local"), {})
    rows = [[d.label, *cells(d, base)] for d in days]
    caption = ("one agent's day per rung, all in this run over one moto bucket on loopback. "
               "Host kill: " + "; ".join(f"{d.rung}: {d.kill_means}" for d in days))
    notes = [f"{d.rung}: {n}" for d in days for n in d.notes]
    if notes:
        caption += ". Notes: " + "; ".join(notes)
    title = "the day"
    if cfg is not None:
        title += (f": repo ≤ {cfg.repo_files} files, npm ci of bench/fixtures/day, "
                  f"{cfg.fsync_iters} fsyncs")
    print_grid(title, COLUMNS, rows, caption)


def run(root: str, *, quick: bool = False) -> list[Day]:
    """The day benchmark; needs root and /dev/fuse for every rung but the first two."""
    cfg = Config.from_env(root, quick=quick)
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("day: no root or /dev/fuse: only the local disk and upload at stop run",
              file=sys.stderr)
        cfg.rungs = [r for r in cfg.rungs if r in ("local", "upload")]
    return run_rungs(cfg)


def _log(msg: str) -> None:
    print(f"[day] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    """`python -m bench.day [--quick] [--out PATH]`: the day alone, table and JSON."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m bench.day")
    ap.add_argument("--dir", default=os.environ.get("STRATA_BENCH_DIR", "/var/tmp"))
    ap.add_argument("--out", default="bench/results/day.json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    days = run(args.dir, quick=args.quick)
    print_day(days, Config.from_env(args.dir, quick=args.quick))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(to_rows(days), f, indent=2)
    print(f"results written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
