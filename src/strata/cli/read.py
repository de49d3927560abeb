"""Reading snapshots: `strata log|ls|cat|stat|diff`. Nothing here publishes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from strata.cli.common import (
    REF_HELP,
    entry_json,
    fmt_time,
    long_line,
    lookup,
    open_store,
    parse_ref,
    print_json,
    short,
    show_path,
)
from strata.cli.show import print_changes
from strata.engine.errors import InvalidInput


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("log", parents=[common], help="history of REF, newest first")
    p.add_argument("ref", metavar="REF",
                   help=REF_HELP)
    p.add_argument("-n", dest="limit", type=int, metavar="N", help="show at most N snapshots")
    p.add_argument("--json", action="store_true",
                   help='[{"id", "parent", "time", "message"}]')
    p.set_defaults(func=cmd_log)

    p = sub.add_parser("ls", parents=[common], help="list a directory")
    p.add_argument("ref", metavar="REF",
                   help=REF_HELP)
    p.add_argument("path", metavar="PATH", nargs="?", default="",
                   help="volume-relative path (default: the root)")
    p.add_argument("-l", dest="long", action="store_true", help="long listing")
    p.add_argument("--json", action="store_true", help="print entries as JSON")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("cat", parents=[common], help="write a file's content to stdout")
    p.add_argument("ref", metavar="REF",
                   help=REF_HELP)
    p.add_argument("path", metavar="PATH",
                   help="a path in the snapshot, relative to its root")
    p.set_defaults(func=cmd_cat)

    p = sub.add_parser("stat", parents=[common], help="show one entry's metadata")
    p.add_argument("ref", metavar="REF",
                   help=REF_HELP)
    p.add_argument("path", metavar="PATH",
                   help="a path in the snapshot, relative to its root")
    p.add_argument("--json", action="store_true", help="print the entry as JSON")
    p.set_defaults(func=cmd_stat)

    p = sub.add_parser("diff", parents=[common], help="paths that differ between two refs")
    p.add_argument("ref_a", metavar="REF_A",
                   help="the older side of the comparison (a REF)")
    p.add_argument("ref_b", metavar="REF_B",
                   help="the newer side (a REF)")
    p.add_argument("--json", action="store_true",
                   help='[{"path", "change"}], change being added|modified|deleted')
    p.set_defaults(func=cmd_diff)


def cmd_log(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 0:
        raise InvalidInput("-n must not be negative")
    ref = parse_ref(args.ref)
    with open_store(args) as store:
        infos = store.log(ref.resolve(store), args.limit)
    if args.json:
        print_json([i.to_json() for i in infos])
    else:
        for i in infos:
            if i.parent is None and i.time_ns == 0:  # every volume's first snapshot
                print(f"{short(i.id)}  (empty volume)")
                continue
            print(f"{short(i.id)}  {fmt_time(i.time_ns)}  {i.message}".rstrip())
        if infos and infos[-1].parent is not None and (args.limit is None
                                                       or len(infos) < args.limit):
            print("(older history expired: retention policy)")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from strata.engine.objects import K_DIR
    from strata.engine.tree import Trees, decode_name
    ref = parse_ref(args.ref)
    with open_store(args) as store:
        sid = ref.resolve(store)
        if _is_workspace(store, sid):
            return _ws_ls(args, store, ref.volume, sid)
        e = lookup(store, sid, args.path)
        if e.kind == K_DIR and e.ref is not None:
            prefix = f"{args.path}/" if args.path else ""
            items = [(decode_name(n), c) for n, c in Trees(store).iter_dir(e.ref)]
        else:
            prefix = ""
            items = [(args.path, e)]
    return _print_listing(args, prefix, items)


def _print_listing(args: argparse.Namespace, prefix: str, items: list[tuple[str, Any]]
                   ) -> int:
    if args.json:
        print_json([entry_json(prefix + name, c) | {"name": name} for name, c in items])
    elif args.long:
        for name, c in items:
            print(long_line(show_path(name), c))
    else:
        for name, _c in items:
            print(show_path(name))
    return 0


def cmd_cat(args: argparse.Namespace) -> int:
    from strata.engine.objects import K_FILE, FileNode
    ref = parse_ref(args.ref)
    out = sys.stdout.buffer
    with open_store(args) as store:
        sid = ref.resolve(store)
        if _is_workspace(store, sid):
            return _ws_cat(args, store, ref.volume, sid)
        e = lookup(store, sid, args.path)
        if e.kind != K_FILE:
            raise InvalidInput(f"{args.path!r} is not a regular file")
        if e.ref is None:
            out.write(e.data or b"")
        else:
            # Block by block, so a large file never sits in memory whole.
            node = FileNode.decode(store.get_object(e.ref))
            for length, data in node.pieces(0, node.size, store.get_object):
                out.write(bytes(length) if data is None else data)
    out.flush()
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    ref = parse_ref(args.ref)
    with open_store(args) as store:
        sid = ref.resolve(store)
        if _is_workspace(store, sid):
            from strata.workspace.view import entry_of, inside, snapshot_files
            with snapshot_files(store, ref.volume, sid) as root:
                e = entry_of(inside(root, args.path))
        else:
            e = lookup(store, sid, args.path)
    info = entry_json(args.path, e)
    if args.json:
        print_json(info)
        return 0
    info["mtime"] = fmt_time(e.mtime_ns) + f".{e.mtime_ns % 1_000_000_000:09d}"
    del info["mtime_ns"]
    width = max(len(k) for k in info)
    for k, v in info.items():
        if k == "xattrs":
            for name, value in v.items():
                print(f"{'xattr':<{width}}  {name}={value}")
        else:
            print(f"{k:<{width}}  {v if k != 'path' else v or '/'}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from strata.engine.tree import Trees, change_kind
    ref_a, ref_b = parse_ref(args.ref_a), parse_ref(args.ref_b)
    with open_store(args) as store:
        sid_a, sid_b = ref_a.resolve(store), ref_b.resolve(store)
        rows = []
        if _is_workspace(store, sid_a) and _is_workspace(store, sid_b):
            if ref_a.volume != ref_b.volume:
                raise InvalidInput("a file-by-file diff compares snapshots of one workspace")
            from strata.workspace.view import changed, snapshot_files
            with snapshot_files(store, ref_a.volume, sid_a) as a, \
                    snapshot_files(store, ref_b.volume, sid_b) as b:
                rows = [{"path": p, "change": c} for p, c in changed(a, b)]
        else:
            root_a = store.snapshot(sid_a).root
            root_b = store.snapshot(sid_b).root
            for path, old, new in Trees(store).diff(root_a, root_b):
                change = change_kind(old, new)
                rows.append({"path": path, "change": change})
    print_changes(rows, as_json=args.json)
    return 0


# -- workspaces: their snapshots file by file, through a read-only attach ------------------

def _is_workspace(store: Any, sid: str) -> bool:
    from strata.workspace import is_workspace
    return is_workspace(store, sid)


def _ws_ls(args: argparse.Namespace, store: Any, volume: str, sid: str) -> int:
    import os

    from strata.workspace.view import entry_of, inside, snapshot_files
    with snapshot_files(store, volume, sid) as root:
        where = inside(root, args.path)
        e = entry_of(where)
        if os.path.isdir(where) and not os.path.islink(where):
            prefix = f"{args.path}/" if args.path else ""
            names = sorted(os.listdir(where), key=os.fsencode)
            items = [(n, entry_of(os.path.join(where, n))) for n in names]
        else:
            prefix, items = "", [(args.path, e)]
    return _print_listing(args, prefix, items)


def _ws_cat(args: argparse.Namespace, store: Any, volume: str, sid: str) -> int:
    import os
    import shutil

    from strata.workspace.view import inside, snapshot_files
    out = sys.stdout.buffer
    with snapshot_files(store, volume, sid) as root:
        where = inside(root, args.path)
        if not os.path.isfile(where) or os.path.islink(where):
            raise InvalidInput(f"{args.path!r} is not a regular file")
        with open(where, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)
    out.flush()
    return 0
