"""The store directory: its identity file, settings, permissions and owner lock.

What `strata init` writes and what opening a store checks before anything
reads a pack: the `STRATA` file (docs/format.md), the 0700 rule, and the
exclusive lock that makes one process the owner (docs/design.md, "One owner").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from strata.engine.errors import Corrupt, InvalidInput, NotFound, Unavailable
from strata.engine.objects import DEFAULT_BLOCK_SIZE

STORE_MAGIC = "strata-store"
STORE_VERSION = 2           # 2: the store's bucket is sealed with a key (bucket format 2)
STORE_VERSIONS = (1, 2)     # what this strata reads; stores without such a bucket stay 1


BUCKET_PACK_SIZE = 4 * 1024 * 1024  # default pack size limit of a store kept in a bucket


@dataclass(frozen=True, slots=True)
class StoreConfig:
    pack_size_limit: int = 256 * 1024 * 1024
    pack_age_limit: float = 30.0
    block_size: int = DEFAULT_BLOCK_SIZE
    compress: bool = True
    lock_timeout: float = 30.0
    index_interval: float = 0.05


def init_store(path: str, *, block_size: int = DEFAULT_BLOCK_SIZE,
               pack_size_limit: int | None = None, pack_age_limit: float | None = None,
               bucket: str | None = None, sync: str = "local",
               store_id: str | None = None, cache_size: int | None = None,
               bucket_key: bytes | None = None, encrypt: bool = True,
               unauthenticated: bool = False) -> None:
    """Create an empty store directory (idempotent on an existing store).

    A store with a bucket gets a key (`bucket_key`, else 32 new random bytes)
    in `bucket.key`, mode 0600, which seals everything it puts in the bucket,
    encrypted too unless `encrypt` is off. Only a restore of a bucket made
    before keys passes `unauthenticated`: such a store goes on without one.
    """
    if not 4096 <= block_size <= 16 * 1024 * 1024:
        raise InvalidInput("block size must be between 4 KiB and 16 MiB")
    os.makedirs(path, mode=0o700, exist_ok=True)
    meta = os.path.join(path, "STRATA")
    if os.path.exists(meta):
        read_store_meta(path)
        return
    os.chmod(path, 0o700)  # the store is its owner's alone: data, tokens, socket
    os.makedirs(os.path.join(path, "packs"), mode=0o700, exist_ok=True)
    settings: dict[str, Any] = {"version": 1, "id": store_id or os.urandom(16).hex(),
                                "block_size": block_size}
    if bucket is not None and pack_size_limit is None:
        # A restore rebuilds the unsealed pack from the log: smaller packs bound that.
        pack_size_limit = BUCKET_PACK_SIZE
    if bucket is not None:  # the bucket tier (engine/tier.py)
        if sync not in ("local", "bucket"):
            raise InvalidInput("sync is 'local' or 'bucket'")
        settings["bucket"] = bucket
        settings["sync"] = sync
        if cache_size is not None:
            settings["cache_size"] = _check_cache_size(cache_size)
        if not unauthenticated:
            from strata.engine.seal import KEY_FILE, new_key, write_key_file
            key_path = os.path.join(path, KEY_FILE)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(key_path)  # left by an init that died before STRATA was written
            write_key_file(key_path, bucket_key if bucket_key is not None else new_key())
            settings.update(version=2, bucket_format=2, encrypt=encrypt)
    elif cache_size is not None:
        raise InvalidInput("a cache size needs a bucket: without one every pack is local")
    if pack_size_limit is not None:
        if pack_size_limit < 1024 * 1024:
            raise InvalidInput("pack size limit must be at least 1 MiB")
        settings["pack_size_limit"] = pack_size_limit
    if pack_age_limit is not None:
        if pack_age_limit <= 0:
            raise InvalidInput("pack age limit must be positive")
        settings["pack_age_limit"] = pack_age_limit
    _write_meta(path, settings)


def _check_cache_size(size: int) -> int:
    if size < 16 * 1024 * 1024:
        raise InvalidInput("the cache size must be at least 16 MiB")
    return size


def set_cache_size(path: str, size: int | None) -> None:
    """Change a bucket store's local disk budget (the next open applies it)."""
    settings = read_store_meta(path)
    if not settings.get("bucket"):
        raise InvalidInput(f"{path} has no bucket: without one every pack is local")
    if size is None:
        settings.pop("cache_size", None)
    else:
        settings["cache_size"] = _check_cache_size(size)
    _write_meta(path, settings)


def _write_meta(path: str, settings: dict[str, Any]) -> None:
    body = json.dumps(settings, sort_keys=True)
    version = int(settings.get("version", 1))
    write_durably(os.path.join(path, "STRATA"), f"{STORE_MAGIC} {version}\n{body}\n".encode())


def write_durably(path: str, data: bytes) -> None:
    """Replace `path` whole or not at all (tmp, fsync, rename), durably (directory fsync)."""
    tmp = path + ".tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def read_store_meta(path: str) -> dict[str, Any]:
    meta = os.path.join(path, "STRATA")
    try:
        with open(meta) as f:
            first = f.readline().split()
            body = f.read()
    except FileNotFoundError as exc:
        raise NotFound(f"no strata store at {path} (run 'strata init')") from exc
    if len(first) != 2 or first[0] != STORE_MAGIC:
        raise Corrupt("STRATA", 0, "not a strata store file")
    if not first[1].isdigit() or int(first[1]) not in STORE_VERSIONS:
        raise InvalidInput(f"store format version {first[1]} is not supported (this strata "
                           f"reads {', '.join(map(str, STORE_VERSIONS))}): upgrade strata")
    return dict(json.loads(body))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private(path: str) -> None:
    """Take group and other access away from a directory made before 0700 was the rule."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o700)


class StoreLock:
    """An exclusive flock on the store, waiting a bounded time for another owner."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = os.path.join(path, "lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    owner = self.owner()
                    os.close(self.fd)
                    raise Unavailable(
                        f"store {path} is in use by {owner} (waited {timeout:g}s): `strata "
                        "serve --stop` stops it, `strata serve --takeover` replaces it "
                        "without failing a request") from None
                time.sleep(0.02)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def owner(self) -> str:
        try:
            pid = os.pread(self.fd, 32, 0).decode().strip()
        except OSError:
            pid = ""
        return f"process {pid}" if pid else "another process"

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
