"""A store kept in a bucket: binding, restoring, and preparing to serve it.

`bucket_meta` binds a bucket to one store; `restore` makes a directory a
copy of the store in a bucket (claiming the log first, so the old owner is
fenced, then the newest checkpoint and the log's segments from its
`log_from`); `prepare` is what `strata serve --bucket` does before serving.
Opening a store kept in a bucket is engine/tier.py's `open_tier`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

from strata.engine.bucket import Bucket, OwnerLog, log_name
from strata.engine.checkpoint import Checkpoint
from strata.engine.errors import (
    AlreadyExists,
    Corrupt,
    Fenced,
    InvalidInput,
    NotFound,
    StrataError,
)
from strata.engine.index import Index
from strata.engine.packstore import LocalPacks
from strata.engine.seal import KEY_FILE, BucketKey, read_key_file
from strata.engine.seal import MAGIC as SEAL_MAGIC
from strata.engine.storedir import init_store, write_durably
from strata.engine.tierstate import (
    BUCKET_FORMAT,
    BUCKET_META,
    TIER_CHECKPOINT,
    TIER_STATE,
    Progress,
)


def apply_segments(local: LocalPacks, log: OwnerLog, start: int, end: int,
                   skip: set[int], progress: Progress | None = None) -> dict[str, Any]:
    """Rebuild, byte for byte, the packs the log holds from record `start` to `end`.

    Packs in `skip` (uploaded whole) are left alone. Chunks are applied in log
    order, so a cut or a rewrite after a crash wins over what came before.
    """
    files: dict[int, int] = {}
    report: dict[str, Any] = {"segments": 0, "bytes": 0, "packs": 0}
    try:
        for seq, body in log.read_many(range(start, end)):
            if progress is not None:
                progress(seq - start, end - start, report["bytes"])
            if body["kind"] == "dropped":
                # Only segments below a checkpoint's `log_from` are dropped, and this
                # range starts at the newest one's: the log does not hold what it needs.
                raise Corrupt(log_name(seq), 0, "this log segment was dropped (by epoch "
                                                f"{body['epoch']}), and the restore needs it")
            if body["kind"] != "segment":
                continue
            report["segments"] += 1
            for n, offset, data in body["chunks"]:
                n, offset = int(n), int(offset)
                if n in skip:
                    continue
                fd = files.get(n)
                if fd is None:
                    fd = files[n] = local.open_raw(n)
                if data is None:
                    os.ftruncate(fd, offset)
                else:
                    os.pwrite(fd, bytes(data), offset)
                    report["bytes"] += len(data)
        for fd in files.values():
            os.fsync(fd)
    finally:
        for fd in files.values():
            os.close(fd)
    for n in files:
        if local.size(n) == 0:  # removed by its owner (garbage collection): not a pack
            local.remove(n)
    report["packs"] = len(files)
    kept = set(local.numbers())
    report["rebuilt"] = [n for n in sorted(files) if n in kept]
    return report


def iter_log_back(log: OwnerLog, end: int) -> Iterator[tuple[int, dict[str, Any]]]:
    return log.read_many(range(end - 1, -1, -1))  # newest first, a window read ahead


def store_key(store_dir: str, meta: dict[str, Any]) -> BucketKey | None:
    """The key a store's bucket is sealed with (None: a bucket of format 1, unauthenticated).

    Whether there must be one comes from the store's own settings, never from
    the bucket: a bucket rewritten to look older is not read without a key.
    """
    fmt = int(meta.get("bucket_format", 1))
    if fmt == 1:
        return None
    if fmt != BUCKET_FORMAT:
        raise InvalidInput(f"the store's bucket format is {fmt}; this strata reads 1 and "
                           f"{BUCKET_FORMAT}: upgrade strata")
    path = os.path.join(store_dir, KEY_FILE)
    try:
        secret = read_key_file(path)
    except NotFound:
        raise NotFound(f"{path} is missing: the store's bucket is sealed with the key kept "
                       "there (restore the store with --key-file to make it again)") from None
    return BucketKey(secret, encrypt=meta.get("encrypt") is not False)


def bucket_meta(bucket: Bucket, store_id: str, block_size: int) -> None:
    """Bind the bucket to this store (create-only), or check it is bound to it."""
    fields: dict[str, Any] = {"format": 1, "store_id": store_id, "block_size": block_size}
    if bucket.key is not None:
        fields.update(format=BUCKET_FORMAT, encrypted=bucket.key.encrypt)
    try:
        bucket.put_new(BUCKET_META, json.dumps(fields, sort_keys=True).encode())
        return
    except AlreadyExists:
        pass
    theirs = read_meta(bucket)
    if theirs["store_id"] != store_id:
        raise InvalidInput(f"the bucket at {bucket.url} holds another store "
                           f"({theirs['store_id']}), not {store_id}")


def read_meta(bucket: Bucket) -> dict[str, Any]:
    """The bucket's binding to its store, of the format the reader's key calls for.

    With a key it must be sealed under that key (format 2); without one it
    must be a format 1 binding, which nothing authenticates.
    """
    stored = bucket.get_stored(BUCKET_META)
    sealed = stored[:4] == SEAL_MAGIC
    if bucket.key is None and sealed:
        raise InvalidInput(f"the store in the bucket at {bucket.url} is sealed with a key "
                           f"(bucket format {BUCKET_FORMAT}): give its key file (--key-file "
                           "or STRATA_BUCKET_KEY_FILE)")
    if bucket.key is not None and not sealed:
        raise InvalidInput(
            f"{BUCKET_META} in {bucket.url} is not sealed: the bucket holds a store made "
            "before bucket keys (bucket format 1, unauthenticated), not one of this key. If "
            "the store was made with a key, someone rewrote the bucket; if not, restore it "
            "without a key, with --unauthenticated")
    data = bucket.key.open(BUCKET_META, stored) if bucket.key is not None else stored
    try:
        meta = json.loads(data)
        fmt = meta.get("format")
    except (ValueError, TypeError, AttributeError) as exc:
        raise Corrupt(BUCKET_META, 0, f"does not decode: {exc}") from None
    want = BUCKET_FORMAT if bucket.key is not None else 1
    if fmt != want:
        if isinstance(fmt, int) and fmt > BUCKET_FORMAT:
            raise InvalidInput(f"{BUCKET_META} in {bucket.url} has bucket format {fmt}; "
                               f"this strata reads 1 and {BUCKET_FORMAT}: upgrade strata")
        raise Corrupt(BUCKET_META, 0, f"format {fmt!r} where {want} belongs")
    if not isinstance(meta.get("store_id"), str) or not isinstance(meta.get("block_size"), int):
        raise Corrupt(BUCKET_META, 0, "lacks store_id or block_size")
    return dict(meta)


def newest_checkpoint(bucket: Bucket, log: OwnerLog, end: int) -> Checkpoint | None:
    """The checkpoint named by the last `checkpoint` record before `end`."""
    for _seq, body in iter_log_back(log, end):
        if body["kind"] == "checkpoint":
            name = str(body["name"])
            cp = Checkpoint.decode(name, bucket.get(name))
            cp.load_tables(bucket.get)
            return cp
    return None


def _check_ours(log: OwnerLog, seq: int, epoch: Any) -> None:
    """The last record this store wrote is still there, and still its own.

    Records are never deleted by strata (a segment is at most overwritten by a
    `dropped` record), so a missing one means the bucket's newest records were
    deleted: a rollback, which only state kept outside
    the bucket (here, tier.json) can show.
    """
    if seq < 0:
        return
    try:
        body = log.read(seq)
    except NotFound:
        raise Corrupt(log_name(seq), 0, "this store wrote this log record and it is gone "
                                        "from the bucket: the log was rolled back (its "
                                        "newest records deleted)") from None
    if body["kind"] == "dropped" and body["epoch"] != epoch:
        # A successor gave this segment's bytes back: only an owner does that.
        raise Fenced(f"this store was taken over (epoch {body['epoch']} dropped log record "
                     f"{seq}); restore it from {log.bucket.url} instead")
    if body["epoch"] != epoch:
        raise Corrupt(log_name(seq), 0, f"this store (epoch {epoch}) wrote this log record, "
                                        f"and the bucket holds one of epoch {body['epoch']}")


def restore(url: str, store_dir: str, *, key: bytes | None = None,
            unauthenticated: bool = False, sync: str = "local",
            cache_size: int | None = None, progress: Progress | None = None
            ) -> dict[str, Any]:
    """Make `store_dir` a copy of the store in the bucket, downloading no packs.

    `key` is the store's bucket key; a bucket of format 1 (made before keys)
    is read without one only with `unauthenticated`, since nothing in it can
    be told from a forgery. Claims the log first, so the old owner is fenced
    before the tail is read. Then: the newest checkpoint (its tables; the
    object index stays in the bucket and is read a block at a time), and the
    log's segments from the checkpoint's `log_from`, rebuilding the packs that
    were not uploaded. Opening the store replays what lies past the checkpoint.
    """
    if os.path.exists(os.path.join(store_dir, "STRATA")):
        raise InvalidInput(f"{store_dir} is already a store")
    t0 = time.monotonic()
    bucket = Bucket(url, BucketKey(key) if key is not None else None)
    bucket.check_conditional()
    try:
        meta = read_meta(bucket)
    except NotFound:
        raise NotFound(f"no strata store in the bucket at {url}") from None
    if bucket.key is None and not unauthenticated:
        raise InvalidInput(
            f"the bucket at {url} holds an unauthenticated store (bucket format 1, made "
            "before bucket keys): anyone who can write to the bucket could have changed "
            "it unseen. Restore it anyway with --unauthenticated")
    if bucket.key is not None:
        bucket.key.encrypt = meta.get("encrypted") is not False  # write as it was written
    log = OwnerLog(bucket)
    epoch = log.claim(socket.gethostname())
    cp = newest_checkpoint(bucket, log, epoch)
    if cp is not None and cp.store_id.hex() != meta["store_id"]:
        raise Corrupt(BUCKET_META, 0, "the checkpoint belongs to another store")
    init_store(store_dir, block_size=int(meta["block_size"]), store_id=str(meta["store_id"]),
               bucket=url, sync=sync, cache_size=cache_size, bucket_key=key,
               encrypt=bucket.key.encrypt if bucket.key is not None else False,
               unauthenticated=bucket.key is None)
    local = LocalPacks(os.path.join(store_dir, "packs"))
    try:
        report = apply_segments(local, log, cp.log_from if cp else 0, epoch,
                                set(cp.packs) if cp else set(), progress)
    finally:
        local.close()
    if cp is not None:
        index = Index(os.path.join(store_dir, "index"))
        try:
            index.load_tables(cp.applied, cp.volumes, cp.refs, cp.leases, cp.policies)
            stamp = struct.pack("<Q", time.time_ns())
            index.note_expired((sid, stamp) for sid in cp.expired)
            # The index is that checkpoint's runs (read lazily) plus what replaying
            # the log past it adds: its next checkpoint writes only those.
            index.set_checkpoint_base(cp.name)
        finally:
            index.close()
        write_durably(os.path.join(store_dir, TIER_CHECKPOINT), cp.raw)
    # The fenced owner's pins are unknown here: nothing is deleted while they may last.
    from strata.engine.gc import inherit_unknown_pins
    inherit_unknown_pins(store_dir)
    # Clean: the packs rebuilt here are what the log holds, so nothing needs shipping.
    rebuilt = report.pop("rebuilt")
    write_durably(os.path.join(store_dir, TIER_STATE), json.dumps(
        {"epoch": epoch, "next": epoch + 1, "clean": True, "from_log": rebuilt,
         "checkpoint": cp.name if cp is not None else None}).encode())
    report.update(epoch=epoch, checkpoint=bool(cp), seconds=time.monotonic() - t0,
                  packs_in_bucket=len(cp.packs) if cp else 0,
                  authenticated=bucket.key is not None,
                  encrypted=bucket.key is not None and bucket.key.encrypt)
    return report


def prepare(store_dir: str, url: str, *, takeover: bool, key: bytes | None = None,
            unauthenticated: bool = False, encrypt: bool = True, sync: str = "local",
            cache_size: int | None = None, progress: Progress | None = None) -> str:
    """Make `store_dir` ready to serve the store kept at `url` (`strata serve --bucket`).

    An existing store must be kept in that bucket. Otherwise an empty bucket
    gets a new store (sealed with `key`, or a new key), and a bucket that
    already holds one is restored here only with `takeover`, since restoring
    fences the owner serving it now. Returns what was done: "opened",
    "created" or "restored".
    """
    if os.path.exists(os.path.join(store_dir, "STRATA")):
        from strata.engine.storedir import read_store_meta
        have = read_store_meta(store_dir).get("bucket")
        if have != url:
            raise InvalidInput(f"{store_dir} is kept in {have or 'no bucket'}, not {url}")
        return "opened"
    bucket = Bucket(url, BucketKey(key) if key is not None else None)
    bucket.check_conditional()
    if not bucket.exists(BUCKET_META):
        init_store(store_dir, bucket=url, sync=sync, cache_size=cache_size, bucket_key=key,
                   encrypt=encrypt)
        return "created"
    if not takeover:
        owner: Any = "?"
        host: Any = "?"
        with contextlib.suppress(StrataError):  # without the key, or damaged: who is unsaid
            log = OwnerLog(bucket)
            end = log.find_end()
            owner = log.read(end - 1)["epoch"] if end else None
            host = (log.read(owner).get("host") if owner is not None else None) or "?"
        raise InvalidInput(f"the bucket at {url} already holds a store (owner epoch {owner}, "
                           f"host {host}); pass --takeover to fence that owner and serve the "
                           "store here")
    restore(url, store_dir, key=key, unauthenticated=unauthenticated, sync=sync,
            cache_size=cache_size, progress=progress)
    return "restored"
