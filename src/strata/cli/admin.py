"""Store administration: `strata init`, `restore`, `stats` and `fsck`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from strata.cli.common import (
    Progress,
    add_key_options,
    bucket_key,
    open_store,
    parse_size,
    print_json,
    progress_bar,
    show_path,
    store_path,
)
from strata.engine.errors import InvalidInput


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("init", parents=[common], help="create an empty store")
    p.add_argument("--bucket", metavar="URL",
                   help="keep the store in this bucket too: s3://BUCKET/PREFIX, gs://…, "
                        "az://… or file:///PATH (credentials from the usual environment)")
    p.add_argument("--sync", choices=["local", "bucket"], default="local",
                   help="bucket: acknowledge a publish only once the bucket holds it")
    p.add_argument("--cache-size", type=parse_size, default=None, metavar="BYTES",
                   help="with --bucket: local disk budget; packs safely in the bucket are "
                        "evicted above it, least recently read first")
    p.add_argument("--no-encrypt", action="store_true",
                   help="with --bucket: authenticate what goes to the bucket, but do not "
                        "encrypt it")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("restore", parents=[common],
                       help="make --store a copy of the store in a bucket (no download)")
    p.add_argument("--bucket", metavar="URL", required=True)
    p.add_argument("--sync", choices=["local", "bucket"], default="local")
    p.add_argument("--cache-size", type=parse_size, default=None, metavar="BYTES",
                   help="local disk budget (see init)")
    add_key_options(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("stats", parents=[common], help="engine counters and the bucket tier")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("fsck", parents=[common],
                       help="verify every pack record, the index and every branch's tree")
    p.add_argument("--rebuild-index", action="store_true",
                   help="throw the index away and rebuild it from the packs first")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_fsck)


def cmd_init(args: argparse.Namespace) -> int:
    from strata.engine.local import init_store
    path = store_path(args)
    if args.bucket:
        from strata.engine.bucket import Bucket  # obstore: only with a bucket
        from strata.engine.tier import BUCKET_META
        bucket = Bucket(args.bucket)
        bucket.check_conditional()
        if bucket.exists(BUCKET_META):
            raise InvalidInput(f"{args.bucket} holds a store already: `strata restore "
                               f"{args.bucket}` makes a store from it; a new store needs "
                               "a prefix of its own")
    init_store(path, bucket=args.bucket, sync=args.sync, cache_size=args.cache_size,
               encrypt=not args.no_encrypt)
    if args.bucket:
        # Bind the prefix to this store now (create-only), not at the server's first
        # start: a second `init` on it is refused here, not by a server that exits.
        import shutil

        from strata.engine.storedir import read_store_meta
        from strata.engine.tier import bucket_meta, store_key
        meta = read_store_meta(path)
        try:
            bucket_meta(Bucket(args.bucket, store_key(path, meta)), str(meta["id"]),
                        int(meta["block_size"]))
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # the store this command just made
            raise
    print(f"strata store at {path}" + (f", kept in {args.bucket}" if args.bucket else ""))
    if args.bucket:
        from strata.engine.seal import KEY_FILE
        print(f"its bucket key is {os.path.join(path, KEY_FILE)}: keep a copy away from this "
              "host and the bucket; a restore needs it (--key-file)")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from strata.engine.tier import restore
    path = store_path(args)
    progress = Progress("replaying the log")
    try:
        report = restore(args.bucket, path, key=bucket_key(args),
                         unauthenticated=args.unauthenticated, sync=args.sync,
                         cache_size=args.cache_size, progress=progress)
    finally:
        progress.close()
    if args.json:
        print_json(report)
    else:
        print(f"restored {path} from {args.bucket} in {report['seconds']:.2f} s: owner epoch "
              f"{report['epoch']}, {report['packs_in_bucket']} pack(s) left in the bucket, "
              f"{report['segments']} log segment(s) replayed ({report['bytes']} bytes)")
    if not report["authenticated"]:
        print("strata: warning: the bucket is unauthenticated (bucket format 1, made before "
              "bucket keys): what was restored is unverified", file=sys.stderr)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from strata.engine.local import LocalStore
    from strata.server.client import RemoteStore
    with open_store(args) as store:
        if isinstance(store, LocalStore):
            stats: dict[str, Any] = {**store.stats, "bucket": store.tier_report(),
                                     "gc": store.gc_report()}
        else:
            assert isinstance(store, RemoteStore)
            stats = store.admin("GET", "stats")
    if args.json:
        print_json(stats)
        return 0
    tier = stats.pop("bucket", None)
    gc = stats.pop("gc", None)
    from strata.cli.show import fmt_value
    for k, v in sorted(stats.items()):
        print(f"{k:>22}: {fmt_value(k, v)}")
    if gc:
        print("last garbage collection:")
        for k in ("started", "seconds", "live_bytes", "dead_bytes", "bytes_freed",
                  "bytes_reclaimed", "objects_deleted", "snapshots_expired", "packs_deleted",
                  "packs_compacted", "waiting"):
            print(f"{k:>22}: {fmt_value(k, gc.get(k))}")
    else:
        print("last garbage collection: none yet (`strata gc` runs one; the server runs "
              "one every 10 minutes)")
    if tier:
        print("bucket tier:")
        for k, v in tier.items():
            print(f"{k:>22}: {fmt_value(k, v)}")
    return 0


def _print_affected(entry: dict[str, Any]) -> None:
    """The places a damaged or missing object costs: VOLUME@BRANCH:PATH, VOLUME#SNAPSHOT:PATH."""
    if "affected" not in entry:
        return  # a server older than this client, or nothing to name (a torn tail)
    places, more = entry["affected"], entry.get("affected_more", 0)
    if not places:
        print("  no branch or kept snapshot reaches it")
        return
    for p in places:
        ref = (f"{p['volume']}@{p['branch']}" if "branch" in p
               else f"{p['volume']}#{p['snapshot'][:12]}")
        print(f"  {ref}:{show_path(p['path'])}" if p["path"] else f"  {ref}")
    if more:
        print(f"  ... and {more} more")


def cmd_fsck(args: argparse.Namespace) -> int:
    from strata.engine.local import LocalStore
    from strata.server.client import RemoteStore
    with open_store(args) as store:
        if isinstance(store, LocalStore):
            rebuilt = store.rebuild_index() if args.rebuild_index else None
            with progress_bar("fsck") as progress:  # STRATA_IN_PROCESS=1: how far it got
                report = store.fsck(progress)
            if rebuilt is not None:
                report["rebuilt"] = rebuilt
        else:
            assert isinstance(store, RemoteStore)
            # The server logs its phases; the bar shows only that it goes on.
            with progress_bar("fsck (in the server)"):
                report = store.admin("POST", "fsck",
                                     {"rebuild_index": bool(args.rebuild_index)})
        rebuilt = report.get("rebuilt")
        recovery = report.get("recovery") or {}
    if args.json:
        print_json(report)
        return 0 if report["ok"] else 1
    if rebuilt is not None:
        print(f"index rebuilt: {rebuilt['volumes']} volume(s), {rebuilt['branches']} "
              f"branch(es), {rebuilt['objects']} object(s)")
    for t in recovery.get("truncated", []):
        print(f"recovered: truncated a torn tail of {t['bytes']} byte(s) in {t['pack']} "
              f"at offset {t['offset']}")
    for d in report["damaged"]:
        where = f"{d['pack']} at offset {d['offset']}" if "pack" in d else d.get("object", "?")
        what = f" ({d['kind']} {d['object']})" if "pack" in d and "object" in d else ""
        print(f"damaged: {where}{what}: {d['reason']}")
        _print_affected(d)
    for m in report["missing"]:
        print(f"missing: {m['kind']} {m['object']} (reachable from {m['from']})")
        _print_affected(m)
    if report["index_mismatch"]:
        print(f"index: {report['index_mismatch']} entr(ies) disagree with the packs "
              "(run with --rebuild-index)")
    status = "ok" if report["ok"] else "NOT OK"
    print(f"{status}: {report['packs']} pack(s), {report['records']} record(s), "
          f"{report['objects']} object(s)")
    return 0 if report["ok"] else 1
