"""Publishing and copying: `strata put|rm|import|export`.

`put` and `rm` publish a one-path change; `import` publishes a whole
directory as one change set. With `--base` the change is made against an
older snapshot, so the store replays it onto the moved head or reports a
conflict, exactly as for a long-running writer.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from strata.cli.common import open_store, parse_ref, progress_bar, quote_path, resolve_base
from strata.engine.names import split_path


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("put", parents=[common],
                       help="write one file (from stdin or --from) and publish; prints the id")
    p.add_argument("ref", metavar="REF")
    p.add_argument("path", metavar="PATH",
                   help="the path in the volume, relative to its root")
    p.add_argument("--from", dest="source", metavar="FILE", help="read the content from FILE")
    _base_and_message(p)
    p.set_defaults(func=cmd_put)

    p = sub.add_parser("rm", parents=[common], help="remove one path and publish; prints the id")
    p.add_argument("ref", metavar="REF")
    p.add_argument("path", metavar="PATH",
                   help="the path in the volume, relative to its root")
    p.add_argument("-r", dest="recursive", action="store_true",
                   help="remove a directory and everything in it")
    _base_and_message(p)
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("import", parents=[common],
                       help="make a branch equal to a local directory; prints the id")
    p.add_argument("ref", metavar="REF")
    p.add_argument("dir", metavar="DIR", help="the local directory whose tree the branch takes")
    _base_and_message(p)
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", parents=[common],
                       help="write a snapshot into an empty directory, metadata and all")
    p.add_argument("ref", metavar="REF")
    p.add_argument("dir", metavar="DIR", help="an empty or absent directory to write into")
    p.add_argument("--privileged", action="store_true",
                   help="also restore setuid/setgid bits, device nodes and security.* / "
                        "trusted.* xattrs such as file capabilities (a snapshot is not "
                        "trusted to grant privileges on this host unless you say so)")
    p.set_defaults(func=cmd_export)


def _base_and_message(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", metavar="SNAPSHOT",
                   help="make the change against this snapshot (id or prefix) instead of "
                        "the branch head; it is replayed onto the head or conflicts")
    p.add_argument("-m", dest="message", metavar="MSG", help="snapshot message")
    p.add_argument("--merge-identical", action="store_true",
                   help="accept a path the head already holds exactly as written here; by "
                        "default any path changed since the base conflicts (only for "
                        "idempotent jobs: for a read-modify-write it loses an update)")


def cmd_put(args: argparse.Namespace) -> int:
    from strata.engine.txn import Transaction
    ref = parse_ref(args.ref)
    branch = ref.need_branch()
    parts = split_path(args.path)  # refuse a hostile path before reading any input
    if args.source is not None:
        with open(args.source, "rb") as f:
            data = f.read()
    else:
        data = sys.stdin.buffer.read()
    with open_store(args) as store:
        txn = Transaction(store, ref.volume, branch, base=resolve_base(store, args.base))
        txn.identical = args.merge_identical
        if len(parts) > 1:
            txn.mkdir("/".join(parts[:-1]), parents=True, exist_ok=True)
        txn.write(args.path, data)
        sid = txn.commit(args.message if args.message is not None
                         else f"put {quote_path(args.path)}")
    print(sid)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from strata.engine.txn import Transaction
    ref = parse_ref(args.ref)
    branch = ref.need_branch()
    split_path(args.path)
    with open_store(args) as store:
        txn = Transaction(store, ref.volume, branch, base=resolve_base(store, args.base))
        txn.identical = args.merge_identical
        txn.remove(args.path, recursive=args.recursive)
        sid = txn.commit(args.message if args.message is not None
                         else f"rm {quote_path(args.path)}")
    print(sid)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from strata.fsio import import_dir
    from strata.memtrim import return_large_buffers_to_the_os
    return_large_buffers_to_the_os()  # upload batches of big files are freed for real
    ref = parse_ref(args.ref)
    branch = ref.need_branch()
    src = args.dir
    message = (args.message if args.message is not None
               else f"import {quote_path(os.path.abspath(src))}")
    with open_store(args) as store:
        base = resolve_base(store, args.base)
        with progress_bar("importing") as progress:
            sid = import_dir(store, ref.volume, branch, src, base=base, message=message,
                             progress=progress, identical=args.merge_identical)
    print(sid)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from strata.fsio import export_snapshot
    ref = parse_ref(args.ref)
    with open_store(args) as store:
        sid = ref.resolve(store)
        from strata.workspace import is_workspace
        if is_workspace(store, sid):  # its files, not its block map
            from strata.workspace.view import export, snapshot_files
            with snapshot_files(store, ref.volume, sid) as root:
                export(root, args.dir)
            return 0
        with progress_bar("exporting") as progress:
            report = export_snapshot(store, sid, args.dir, privileged=args.privileged,
                                     progress=progress)
    for what in report.skipped:
        print(f"strata: warning: not restored: {what}", file=sys.stderr)
    return 0
