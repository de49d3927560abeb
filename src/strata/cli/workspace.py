"""Durable workspaces: `strata workspace create|attach|detach|snapshot|fork|list|log`."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from strata.cli.common import (
    fmt_time,
    open_remote,
    open_store,
    parse_ref,
    parse_size,
    print_json,
    progress_bar,
    short,
)
from strata.engine.errors import InvalidInput
from strata.engine.names import check_branch

if TYPE_CHECKING:
    from strata.engine.interface import Store
    from strata.server.client import RemoteStore


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    ws = sub.add_parser("workspace", parents=[common],
                        help="durable workspaces: a filesystem whose fsync survives the host")
    wsub = ws.add_subparsers(dest="workspace_command", metavar="ACTION", required=True)

    p = wsub.add_parser("create", parents=[common], help="a new, empty workspace")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--size", type=parse_size, default=20 << 30, metavar="BYTES",
                   help="device size (default 20G); never-written space costs nothing")
    p.add_argument("--block-size", type=parse_size, default=64 << 10, metavar="BYTES",
                   help="the unit of storage and of lazy fetches (4K..1M, default 64K)")
    p.add_argument("--seed", metavar="DIR", default=None,
                   help="copy DIR in (owners, modes, links, xattrs kept), e.g. a root "
                        "filesystem mmdebstrap built")
    p.add_argument("--seed-image", metavar="IMAGE", default=None,
                   help="copy an image in (NAME[:TAG], NAME@TAG or NAME#SNAPSHOT; see "
                        "`strata image import`), owners, modes, links, xattrs, set-id bits "
                        "and device nodes kept")
    p.set_defaults(func=cmd_create)

    p = wsub.add_parser("attach", parents=[common],
                        help="mount NAME[@BRANCH] on DIR, fencing any earlier holder "
                             "(NAME#SNAPSHOT: that snapshot, read-only)")
    p.add_argument("name", metavar="NAME[@BRANCH|#SNAPSHOT]")
    p.add_argument("dir", metavar="DIR")
    p.set_defaults(func=cmd_attach)

    p = wsub.add_parser("detach", parents=[common], help="flush, unmount and let go")
    p.add_argument("dir", metavar="DIR")
    p.set_defaults(func=cmd_detach)

    p = wsub.add_parser("snapshot", parents=[common], help="a named point in the log")
    p.add_argument("name", metavar="NAME[@BRANCH]")
    p.add_argument("-m", "--message", default="snapshot")
    p.set_defaults(func=cmd_snapshot)

    p = wsub.add_parser("fork", parents=[common],
                        help="NAME@NEW: a new branch of the workspace, in constant time")
    p.add_argument("name", metavar="NAME[@BRANCH|#SNAPSHOT]")
    p.add_argument("new", metavar="NEW")
    p.set_defaults(func=cmd_fork)

    p = wsub.add_parser("list", parents=[common], help="workspaces, and where attached here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = wsub.add_parser("log", parents=[common],
                        help="named snapshots (and, with --all, every flush)")
    p.add_argument("name", metavar="NAME[@BRANCH]")
    p.add_argument("--all", action="store_true", help="every flush, not only named snapshots")
    p.add_argument("-n", type=int, default=50, metavar="N")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_log)


def cmd_create(args: argparse.Namespace) -> int:
    from strata.workspace.device import Layout, create
    if args.seed is not None and args.seed_image is not None:
        raise InvalidInput("give --seed or --seed-image, not both")
    size = -(-args.size // (1 << 20)) << 20  # whole extents
    with open_store(args) as store:
        image = _image_snapshot(store, args.seed_image) if args.seed_image else None
        head = create(store, args.name, Layout(size=size, block=args.block_size))
    if args.seed is not None:
        with open_remote(args) as remote:
            head = _seed(remote, args.name, args.seed)
    if image is not None:
        with open_remote(args) as remote:
            head = _seed_image(remote, args.name, image)
    print(head)
    return 0


def _image_snapshot(store: Store, text: str) -> str:
    """The snapshot an IMAGE argument names (checked before the workspace is made)."""
    from strata.cli.image import resolve_image
    return resolve_image(store, text)[2]


def _seed_image(store: RemoteStore, name: str, sid: str) -> str:
    """Write the image out (privileged: it is a root filesystem), then seed from that copy.

    A freshly made ext4 holds lost+found, and an export wants an empty
    target, so the image goes through a scratch directory.
    """
    import shutil
    import tempfile

    from strata.fsio import export_snapshot
    tmp = tempfile.mkdtemp(prefix="strata-seed-image-", dir="/var/tmp")
    try:
        root = os.path.join(tmp, "root")
        with progress_bar("exporting the image") as progress:
            export_snapshot(store, sid, root, privileged=True,
                            progress=None if progress is None else
                            lambda done, _total: progress(done, 0))
        return _seed(store, name, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _seed(store: RemoteStore, name: str, source: str) -> str:
    import tempfile

    from strata.workspace.attach import attach, detach
    if not os.path.isdir(source):
        raise InvalidInput(f"{source} is not a directory")
    target = tempfile.mkdtemp(prefix="strata-seed-")
    try:
        attach(store.url, store.token, name, "live", target, owner=os.getpid())
        with progress_bar("seeding") as progress:
            try:
                _copy_tree(source, target, progress)
            finally:
                if progress is not None:
                    progress(0, 0, "seeding: flushing to the store")
                detach(target)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(target)  # only when empty: never into a mounted workspace
    return store.head(name, "live")


def _copy_tree(source: str, target: str, progress: Callable[..., None] | None) -> None:
    """`cp -a` SOURCE/. into TARGET; on a terminal, entries copied of those counted first.

    cp keeps what a copy must (owners, modes, links, xattrs, holes); with -v it
    names each entry as it copies it, one line each, which is what is counted.
    """
    import subprocess
    import tempfile

    total = 0
    if progress is not None:
        for _dir, dirs, files in os.walk(source):
            total += len(dirs) + len(files)
        progress(0, total, "seeding: copying")
    with tempfile.TemporaryFile() as errors:  # not a pipe: cp may say more than one holds
        p = subprocess.Popen(["cp", "-a", *(["-v"] if progress else []), "--",
                              os.path.join(source, "."), target],
                             stdout=subprocess.PIPE if progress else subprocess.DEVNULL,
                             stderr=errors)
        if progress is not None and p.stdout is not None:
            done = 0
            for _line in p.stdout:
                done += 1  # a name holding a newline counts twice: hence min()
                if done % 16 == 0:
                    progress(min(done, total), total, "seeding: copying")
            progress(total, total, "seeding: copying")
        if p.wait() != 0:
            errors.seek(0)
            said = errors.read()[-2000:].decode(errors="replace").strip()
            raise InvalidInput(f"seeding failed: {said[-500:]}")


def cmd_attach(args: argparse.Namespace) -> int:
    from strata.workspace.attach import attach
    ref = parse_ref(args.name)
    from strata.fleet.client import FleetStore
    with open_remote(args) as store:
        sid = ref.resolve(store) if ref.snapshot else ""
        members, named = ((",".join(store.members), store.store or "")
                          if isinstance(store, FleetStore) else ("", ""))
        att = attach(store.url, store.token, ref.volume, ref.branch or "live", args.dir,
                     snapshot=sid, fleet=members, fleet_store=named)
    what = f"{ref.volume}#{sid[:12]} (read-only)" if sid else f"{ref.volume}@{att.branch}"
    print(f"attached {what} at {att.dir}")
    return 0


def cmd_detach(args: argparse.Namespace) -> int:
    from strata.workspace.attach import detach
    detach(args.dir)
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    from strata.workspace.attach import snapshot
    ref = parse_ref(args.name)
    with open_store(args) as store:
        print(snapshot(store, ref.volume, ref.branch or "live", args.message))
    return 0


def cmd_fork(args: argparse.Namespace) -> int:
    from strata.workspace.device import read_layout
    ref = parse_ref(args.name)
    new = args.new.split("@", 1)[1] if args.new.startswith(ref.volume + "@") else args.new
    check_branch(new)
    with open_store(args) as store:
        at = ref.resolve(store)
        read_layout(store, at)
        print(store.fork(ref.volume, new, at=at))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from strata.workspace.device import read_layout
    from strata.workspace.state import attached, fenced_note
    here = {(a.volume, a.branch): a.dir for a in attached()}
    fenced = {(a.volume, a.branch) for a in attached() if fenced_note(a) is not None}
    rows: list[dict[str, Any]] = []
    with open_remote(args) as store:
        for vol in store.list_volumes():
            branches = store.list_branches(vol)
            try:
                layout = read_layout(store, branches.get("live") or next(iter(branches.values())))
            except (InvalidInput, StopIteration):
                continue
            except Exception:  # noqa: BLE001 - a volume we cannot read is not listed
                continue
            for br, head in sorted(branches.items()):
                rows.append({"workspace": f"{vol}@{br}", "size": layout.size, "head": head,
                             "attached": here.get((vol, br)),
                             "fenced": (vol, br) in fenced})
    if args.json:
        print_json(rows)
    else:
        for r in rows:
            where = r["attached"] or "-"
            if r["fenced"]:
                where += " (fenced: another holder took it over; detach it)"
            print(f"{r['workspace']}\t{r['size'] >> 30}G\t{short(r['head'])}\t{where}")
    return 0


def cmd_log(args: argparse.Namespace) -> int:
    ref = parse_ref(args.name)
    with open_store(args) as store:
        head = ref.resolve(store)
        out = []
        for info in store.log(head, None if not args.all else args.n):
            kind = info.meta.get("workspace")
            if args.all or kind in ("snapshot", "create"):
                out.append(info)
            if len(out) >= args.n:
                break
    if args.json:
        print_json([i.to_json() for i in out])
    else:
        for i in out:
            print(f"{short(i.id)}  {fmt_time(i.time_ns)}  {i.message}")
    return 0
