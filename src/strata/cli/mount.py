"""`strata mount`, `commit`, `status` and `unmount`: a writable view of a snapshot."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from strata.cli.common import (
    ensure_server,
    open_remote,
    parse_ref,
    print_json,
    server_url,
    short,
    store_path,
)
from strata.engine.errors import InvalidInput

if TYPE_CHECKING:
    from strata.engine.interface import Store


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("mount", parents=[common],
                       help="mount a snapshot at DIR (writable; publish with 'strata commit')",
                       description="Mount REF at DIR. With several REFs (or --multi) each "
                                   "volume appears as DIR/NAME; a REF may be written "
                                   "NAME=REF to choose NAME, and end in :ro.")
    p.add_argument("refs", metavar="REF", nargs="+",
                   help="what to mount: VOLUME[@BRANCH|#SNAPSHOT][:ro], or NAME=REF for a "
                        "subdirectory of its own")
    p.add_argument("dir", metavar="DIR", help="the mount point (made if missing; must be empty)")
    p.add_argument("--ro", action="store_true", help="read-only mount")
    p.add_argument("--privileged", action="store_true",
                   help="let setuid/setgid bits and device nodes in the volume take effect "
                        "(by default the mount is nosuid,nodev: whoever can publish to the "
                        "volume is not trusted to grant privileges on this host)")
    p.add_argument("--multi", action="store_true",
                   help="present volumes as subdirectories even for one REF")
    p.add_argument("--background", action="store_true",
                   help="return once the mount is ready and keep serving in the background")
    p.set_defaults(func=cmd_mount, exit_at_once=True)

    c = sub.add_parser("commit", parents=[common], help="publish a mount's changes")
    c.add_argument("dir", metavar="DIR", help="a mount point of `strata mount`")
    c.add_argument("-m", "--message", default="")
    c.add_argument("--volume", action="append", dest="volumes", metavar="NAME",
                   help="commit only this volume of a multi-volume mount (repeatable); "
                        "by default all change in one atomic commit")
    c.add_argument("--merge-identical", action="store_true",
                   help="accept a path the head already holds exactly as this mount has it; by "
                        "default any path changed since the mount's snapshot conflicts (only "
                        "for idempotent jobs: for a read-modify-write it loses an update)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_commit)

    s = sub.add_parser("status", parents=[common], help="paths a mount changed since its pin")
    s.add_argument("dir", metavar="DIR", help="a mount point of `strata mount`")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    r = sub.add_parser("reload", parents=[common],
                       help="move a mount onto its branch's head, keeping uncommitted changes")
    r.add_argument("dir", metavar="DIR", help="a mount point of `strata mount`")
    r.set_defaults(func=cmd_reload, exit_at_once=True)

    u = sub.add_parser("unmount", parents=[common], help="unmount (refuses to drop changes)")
    u.add_argument("dir", metavar="DIR", help="a mount point of `strata mount`")
    u.add_argument("--discard", action="store_true", help="drop uncommitted changes")
    u.set_defaults(func=cmd_unmount)


@contextlib.contextmanager
def _store_for(args: argparse.Namespace, state: Any) -> Iterator[Store]:
    """The store of a mount: the server it was made with.

    The local store's own server is started again if it has exited idle.
    """
    from strata.server.client import RemoteStore
    server, token = state.server, state.token
    if server is not None and server_url(args) is None:
        if state.store:
            ensure_server(state.store)
        store = RemoteStore(server, token)
        try:
            yield store
        finally:
            store.close()
        return
    with open_remote(args) as s:
        yield s


RefParts = tuple[str, str, "str | None", "str | None", bool]


def _mount_refs(args: argparse.Namespace) -> list[RefParts]:
    """The REFs, [NAME=]REF[:ro|:rw], parsed without the store.

    As (name, volume, branch, snapshot, ro): mount/state.py's MountRef.
    """
    refs: list[RefParts] = []
    for text in args.refs:
        name, sep, spec = text.partition("=")
        if not sep:
            name, spec = "", text
        ro = False
        if spec.endswith(":ro"):
            spec, ro = spec[:-3], True
        elif spec.endswith(":rw"):
            spec = spec[:-3]
        ref = parse_ref(spec)
        refs.append((name, ref.volume, ref.branch, ref.snapshot, ro))
    return refs


def cmd_mount(args: argparse.Namespace) -> int:
    target = os.path.abspath(args.dir)
    if not os.path.lexists(target):
        os.makedirs(target)  # as `mkdir -p` would
    if not os.path.isdir(target):
        raise InvalidInput(f"{args.dir} is not a directory")
    if os.listdir(target):
        raise InvalidInput(f"{args.dir} is not empty")
    single = len(args.refs) == 1 and not args.multi
    if (args.background and server_url(args) is None
            and os.environ.get("STRATA_MOUNT_IN_PROCESS") != "1"):
        return _mount_via_service(args, target, single)
    from strata.mount.state import MountRef, mount_volumes, new_state
    from strata.procs import keepalive_every
    refs = [MountRef(*r) for r in _mount_refs(args)]
    with open_remote(args) as store:
        vols = mount_volumes(store, refs, ro=args.ro, single=single)
        url, token = store.url, store.token
    state = new_state(target, url, vols, single=single)
    state.token = token
    state.privileged = bool(args.privileged)
    if server_url(args) is None:
        # The local store's own server exits when idle, but the mount reads through
        # it for its whole life: the mount process keeps it busy, and commit,
        # status and unmount start it again if it is gone.
        state.store = store_path(args)
        state.keepalive = keepalive_every()
    state.save()
    return serve_mount(state, background=args.background)


def _mount_via_service(args: argparse.Namespace, target: str, single: bool) -> int:
    """`mount --background`, made by the store's step service (run/service.py).

    Its mount processes are forked ahead with pyfuse3 and trio loaded, so
    this process only asks and waits.
    """
    from strata.run import client
    refs = [list(r) for r in _mount_refs(args)]
    store = os.path.abspath(store_path(args))
    if not client.server_answers(store):
        ensure_server(store)
    result = client.call(store, {"op": "mount", "refs": refs, "target": target,
                                     "ro": args.ro, "single": single,
                                     "privileged": args.privileged}, kind="mount")
    print(f"mounted {result['mountpoint']}")
    return 0


def serve_mount(state: Any, *, background: bool) -> int:
    """Run the FUSE view for `state`, putting the overlays on top once it is up."""
    from strata.mount.process import start
    error = start(state, background=background)
    if error is not None:
        print(f"strata: error: {error}", file=sys.stderr)
        return 1
    if background:
        print(f"mounted {state.mountpoint}")
    return 0


def _state(args: argparse.Namespace) -> Any:
    from strata.mount.state import find_mount
    return find_mount(args.dir)


def cmd_commit(args: argparse.Namespace) -> int:
    from strata.memtrim import return_large_buffers_to_the_os
    from strata.mount.session import commit
    return_large_buffers_to_the_os()  # upload batches of big files are freed for real
    from strata.engine.errors import Conflict
    state = _state(args)
    with _store_for(args, state) as store:
        try:
            result = commit(store, state, message=args.message, names=args.volumes,
                            identical=args.merge_identical)
        except Conflict as exc:
            if not args.json:
                raise
            # A script asked for JSON: the conflict is an answer, on stdout, exit 3.
            print_json({"published": {}, "conflicts": exc.paths, "changed": 0})
            return exc.exit_code
        # Onto what it published, so the upper directory keeps only what is uncommitted
        # (mount/move.py); a mount in use stays, and says why.
        from strata.mount.move import after_commit
        now, stayed = after_commit(store, state)
    if args.json:
        print_json({"published": result.published, "changed": result.changed_paths,
                    "uploaded_bytes": result.uploaded_bytes, "seconds": result.seconds,
                    "read": {"files": result.read_files, "bytes": result.read_bytes},
                    "moved": now is not state,
                    **({"stayed": stayed} if stayed else {})})
    else:
        for sid in result.published.values():
            print(sid)
        if stayed:
            print(f"strata: the mount stays on its snapshot ({stayed}); 'strata reload "
                  f"{args.dir}' moves it when that is done", file=sys.stderr)
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    from strata.mount.move import reload
    state = _state(args)
    with _store_for(args, state) as store:
        new = reload(store, state)
    for v in new.volumes:
        print(f"{v.name or v.volume}: {v.pinned}" if not new.single else v.pinned)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from strata.mount.session import status
    state = _state(args)
    with _store_for(args, state) as store:
        report = status(store, state)
    if args.json:
        print_json(report if not state.single else next(iter(report.values())))
        return 0
    for name, vol in report.items():
        if not state.single:
            print(f"{name}:")
        if vol.get("readonly"):
            print("  read-only")
            continue
        print(f"pinned {short(vol['pinned'])}, last published {short(vol['base'])}, "
              f"{len(vol['uncommitted'])} uncommitted path(s)")
        # Only what a commit would publish now; what earlier commits published stays in
        # the mount's upper layer too (`--json` lists it under "changes").
        kinds = {c["path"]: c["change"] for c in vol["changes"]}
        shown = [p or "." for p in vol["uncommitted"]]
        if shown:  # one write: a mount may list tens of thousands
            print("\n".join(f"{kinds.get(p, 'changed'):>9}  {p}" for p in shown))
        committed = len(vol["changes"]) - len(shown)
        if committed > 0:
            print(f"({committed} other path(s) written since the mount are committed)")
    return 0


def cmd_unmount(args: argparse.Namespace) -> int:
    from strata.mount.session import has_uncommitted, teardown
    state = _state(args)
    if not args.discard:
        with _store_for(args, state) as store:
            if has_uncommitted(store, state):
                raise InvalidInput(f"{args.dir} has uncommitted changes: 'strata commit' "
                                   "them, or unmount with --discard")
    teardown(state)
    return 0
