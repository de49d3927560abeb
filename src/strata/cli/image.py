"""Images: `strata image import|list|log|diff|inspect|export|rm`.

An IMAGE is `NAME[:TAG]` (the tag defaults to `latest`), `NAME@TAG`, or
`NAME#SNAPSHOT` for one version; NAME is a volume and each TAG a branch of
it (strata/image/refs.py says how `ghcr.io/org/app:1`-style names map).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from strata.cli.common import fmt_time, open_store, parse_size, print_json, short
from strata.cli.show import print_changes
from strata.engine.errors import InvalidInput, NotFound

if TYPE_CHECKING:
    from strata.engine.interface import Store

IMAGE_HELP = "NAME[:TAG] (tag 'latest' if none), NAME@TAG or NAME#SNAPSHOT"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    img = sub.add_parser("image", parents=[common],
                         help="root filesystems kept as volumes: import, export, list, run")
    isub = img.add_subparsers(dest="image_command", metavar="ACTION", required=True)

    p = isub.add_parser(
        "import", parents=[common],
        help="an OCI layout directory, an oci-archive or docker-archive tarball, or a "
             "plain root directory, as NAME:TAG; prints the snapshot id",
        description="Import an image as NAME:TAG (a volume NAME, branch TAG). Layers are "
                    "applied in order with whiteouts, hard links, owners, modes, xattrs and "
                    "device nodes; digests are checked; hostile layers and tar bombs are "
                    "refused and nothing is published.")
    p.add_argument("source", metavar="SOURCE",
                   help="OCI layout directory, oci-archive or docker-archive file, or a root "
                        "directory (one without oci-layout, e.g. mmdebstrap's output); "
                        "skopeo's oci:DIR:REF, oci-archive:FILE:REF and "
                        "docker-archive:FILE:REPO:TAG work too")
    p.add_argument("image", metavar="NAME[:TAG]")
    p.add_argument("--source-ref", metavar="REF", default=None,
                   help="which image of a SOURCE that holds several: its OCI ref name, or a "
                        "docker-archive's REPO:TAG")
    p.add_argument("-m", "--message", default="")
    p.add_argument("--max-bytes", type=parse_size, default=None, metavar="BYTES",
                   help="the most the layers may expand to (default 64G, and at most "
                        "--max-ratio times the compressed layers, or 1G)")
    p.add_argument("--max-ratio", type=int, default=None, metavar="N",
                   help="expansion allowed over the compressed layers (default 100)")
    p.add_argument("--max-entries", type=int, default=None, metavar="N",
                   help="members of all layers together (default 1,000,000)")
    p.set_defaults(func=cmd_import)

    p = isub.add_parser("list", parents=[common], help="images and their tags")
    p.add_argument("--json", action="store_true",
                   help='[{"name", "tag", "head", "ref", "source", "time"}]')
    p.set_defaults(func=cmd_list)

    p = isub.add_parser("log", parents=[common], help="the versions of a tag, newest first")
    p.add_argument("image", metavar="IMAGE", help=IMAGE_HELP)
    p.add_argument("-n", type=int, default=None, metavar="N", dest="limit")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_log)

    p = isub.add_parser("diff", parents=[common], help="what changed between two images")
    p.add_argument("image_a", metavar="IMAGE_A", help=IMAGE_HELP)
    p.add_argument("image_b", metavar="IMAGE_B", help=IMAGE_HELP)
    p.add_argument("--json", action="store_true", help='[{"path", "change"}]')
    p.set_defaults(func=cmd_diff)

    p = isub.add_parser("inspect", parents=[common],
                        help="an image's config (Env, Entrypoint, Cmd, WorkingDir, User)")
    p.add_argument("image", metavar="IMAGE", help=IMAGE_HELP)
    p.set_defaults(func=cmd_inspect)

    p = isub.add_parser("export", parents=[common],
                        help="write an OCI image layout (umoci and skopeo read it)")
    p.add_argument("image", metavar="IMAGE", help=IMAGE_HELP)
    p.add_argument("dir", metavar="DIR", help="a new or empty directory")
    p.add_argument("--tag", default=None, help="the ref name in index.json (default: TAG)")
    p.set_defaults(func=cmd_export)

    p = isub.add_parser("rm", parents=[common],
                        help="remove tags; the image goes with its last tag")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="NAME:TAG, or NAME with --all")
    p.add_argument("--all", action="store_true", help="every tag of each NAME")
    p.set_defaults(func=cmd_rm)


def resolve_image(store: Store, text: str) -> tuple[str, str, str]:
    """(volume, tag or "", snapshot id) of an IMAGE argument; it must hold an image."""
    from strata.image.meta import image_branches
    from strata.image.refs import parse_image_ref
    if "#" in text:
        from strata.cli.common import parse_ref
        ref = parse_ref(text)
        image_branches(store, ref.volume)
        return ref.volume, "", ref.resolve(store)
    iref = parse_image_ref(text)
    branches = image_branches(store, iref.volume)
    if iref.branch not in branches:
        raise NotFound(f"image {iref.volume!r} has no tag {iref.branch!r} "
                       f"(it has {', '.join(sorted(branches))})")
    return iref.volume, iref.branch, branches[iref.branch]


def cmd_import(args: argparse.Namespace) -> int:
    from strata.image.importer import import_image
    from strata.image.layers import Limits
    from strata.image.refs import parse_image_ref
    iref = parse_image_ref(args.image)
    base = Limits()
    limits = Limits(max_bytes=args.max_bytes if args.max_bytes is not None else base.max_bytes,
                    max_ratio=args.max_ratio if args.max_ratio is not None else base.max_ratio,
                    max_entries=(args.max_entries if args.max_entries is not None
                                 else base.max_entries))
    if args.max_bytes is not None:  # an explicit ceiling is also the floor's
        limits = Limits(limits.max_bytes, min(base.floor_bytes, limits.max_bytes),
                        limits.max_ratio, limits.max_entries)

    def progress(what: str) -> None:
        if sys.stderr.isatty():
            print(f"importing {iref}: {what}", file=sys.stderr)

    from strata.image.sources import parse_source
    path, ref = parse_source(args.source)
    if ref is not None and args.source_ref is not None and ref != args.source_ref:
        raise InvalidInput(f"{args.source!r} names {ref!r}, --source-ref {args.source_ref!r}")
    with open_store(args) as store:
        sid = import_image(store, path, iref.volume, iref.branch, ref=iref.given,
                           tag=args.source_ref or ref, limits=limits, message=args.message,
                           progress=progress)
    print(sid)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from strata.image.meta import find_meta
    rows: list[dict[str, Any]] = []
    with open_store(args) as store:
        for vol in sorted(store.list_volumes()):
            for tag, head in sorted(store.list_branches(vol).items()):
                meta = find_meta(store, head, 8)
                if meta is None:
                    continue
                rows.append({"name": vol, "tag": tag, "head": head,
                             "ref": meta.get("ref") or "", "source": meta.get("source") or "",
                             "time": store.snapshot(head).time_ns / 1e9})
    if args.json:
        print_json(rows)
    else:
        for r in rows:
            print(f"{r['name']}:{r['tag']}\t{short(r['head'])}\t{r['source']}\t"
                  f"{fmt_time(int(r['time'] * 1e9))}")
    return 0


def cmd_log(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        _vol, _tag, sid = resolve_image(store, args.image)
        infos = [i for i in store.log(sid, args.limit)
                 if not (i.parent is None and i.time_ns == 0)]
    if args.json:
        print_json([i.to_json() for i in infos])
    else:
        for i in infos:
            print(f"{short(i.id)}  {fmt_time(i.time_ns)}  {i.message}".rstrip())
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from strata.engine.tree import Trees, change_kind
    with open_store(args) as store:
        sid_a = resolve_image(store, args.image_a)[2]
        sid_b = resolve_image(store, args.image_b)[2]
        rows = [{"path": path, "change": change_kind(old, new)} for path, old, new in
                Trees(store).diff(store.snapshot(sid_a).root, store.snapshot(sid_b).root)]
    print_changes(rows, as_json=args.json)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from strata.image.meta import find_meta
    with open_store(args) as store:
        vol, tag, sid = resolve_image(store, args.image)
        meta = find_meta(store, sid) or {}
    print_json({"name": vol, "tag": tag, "snapshot": sid, **meta})
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from strata.image.export import export_oci
    from strata.image.meta import find_meta
    with open_store(args) as store:
        vol, tag, sid = resolve_image(store, args.image)
        digest = export_oci(store, sid, args.dir, tag=args.tag or tag or "latest",
                            meta=find_meta(store, sid))
    print(digest)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from strata.image.meta import image_branches
    from strata.image.refs import parse_image_ref
    with open_store(args) as store:
        for text in args.images:
            if args.all:
                volume = parse_image_ref(text).volume
                image_branches(store, volume)
                store.delete_volume(volume)
                continue
            if ":" not in text.rpartition("/")[2] and "@" not in text:
                raise InvalidInput(f"{text!r}: name the tag to remove (NAME:TAG), or use --all")
            iref = parse_image_ref(text)
            branches = image_branches(store, iref.volume)
            if iref.branch not in branches:
                raise NotFound(f"image {iref.volume!r} has no tag {iref.branch!r}")
            if len(branches) == 1:
                store.delete_volume(iref.volume)  # its last tag: the image goes
            else:
                store.delete_branch(iref.volume, iref.branch)
    return 0
