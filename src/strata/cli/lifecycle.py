"""Lifecycle: `strata gc`, `strata tag` and `strata policy` (engine/gc.py)."""

from __future__ import annotations

import argparse
import re
from typing import Any

from strata.cli.common import open_remote, open_store, parse_ref, print_json, progress_bar
from strata.cli.show import fmt_duration
from strata.engine.errors import InvalidInput
from strata.engine.names import check_branch

TAGS = "tags/"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """30, 45s, 10m, 12h, 7d, 2w."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 10m, 7d)")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("gc", parents=[common],
                       help="expire what retention policies let go, free its space")
    p.add_argument("--dry-run", action="store_true", help="report what would be freed")
    p.add_argument("--min-age", type=parse_duration, default=None, metavar="DURATION",
                   help="delete only what has been unreachable this long (default 5m; "
                        "0 for tests and demos)")
    p.add_argument("--full", action="store_true",
                   help="mark from every kept snapshot, not only from what changed, and "
                        "check the incremental accounting against it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("tag", parents=[common],
                       help="name a snapshot (VOLUME#SNAP or VOLUME@BRANCH) so it is kept; "
                            "`strata tag list VOLUME` lists a volume's tags",
                       description="strata tag REF NAME names REF's snapshot NAME (kept "
                                   "forever); strata tag VOLUME NAME --delete removes it; "
                                   "strata tag list VOLUME lists them.")
    p.add_argument("ref", metavar="REF", help="the snapshot to name, or `list`")
    p.add_argument("name", metavar="NAME", help="the tag (with `list`: the volume)")
    p.add_argument("--delete", action="store_true", help="remove the tag VOLUME NAME")
    p.add_argument("--json", action="store_true", help='with list: [{"name", "snapshot"}]')
    p.set_defaults(func=cmd_tag)

    pol = sub.add_parser("policy", parents=[common], help="retention policies")
    psub = pol.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    p = psub.add_parser("show", parents=[common], help="a volume's (or branch's) policy")
    p.add_argument("ref", metavar="VOLUME[@BRANCH]",
                   help="a volume (its default policy) or one of its branches")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policy)
    p = psub.add_parser("set", parents=[common], help="set a volume's (or branch's) policy")
    p.add_argument("ref", metavar="VOLUME[@BRANCH]",
                   help="a volume (its default policy) or one of its branches")
    p.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="keep each branch's last N snapshots")
    p.add_argument("--keep-newer", type=parse_duration, default=None, metavar="DURATION",
                   help="keep snapshots newer than this")
    p.add_argument("--keep-all", action="store_true", help="keep all history again")
    p.add_argument("--expire-runs", type=parse_duration, default=None, metavar="DURATION",
                   help="delete run/* and rejected/* branches this old (default 1d)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policy)


def cmd_gc(args: argparse.Namespace) -> int:
    payload: dict[str, Any] = {"dry_run": bool(args.dry_run), "full": bool(args.full)}
    if args.min_age is not None:
        payload["min_age"] = args.min_age
    from strata.engine.local import LocalStore
    from strata.server.client import RemoteStore
    with open_store(args) as store:
        if isinstance(store, LocalStore):  # STRATA_IN_PROCESS=1: the phases, as they start
            with progress_bar("garbage collection") as progress:
                report = store.gc(dry_run=payload["dry_run"], progress=progress,
                                  full=payload["full"],
                                  **({"min_age": args.min_age} if args.min_age is not None
                                     else {}))
        else:
            # The pass runs in the server, which does not say how far it got: the bar
            # shows only that it goes on, and for how long.
            assert isinstance(store, RemoteStore)
            with progress_bar("garbage collection (in the server)"):
                report = store.admin("POST", "gc", payload)
    if args.json:
        print_json(report)
        return 0
    dry = report["dry_run"]
    print(f"gc: {'would drop' if dry else 'dropped'} {report['objects_deleted']} unreachable "
          f"object(s) ({_mb(report['bytes_freed'])} of data); "
          f"{report['snapshots_expired']} snapshot(s) and "
          f"{len(report['branches_expired'])} branch(es) expired")
    print(f"gc: {'would give' if dry else 'gave'} back {_mb(report['bytes_reclaimed'])} of "
          f"disk now ({len(report['packs_deleted'])} pack(s) deleted); compaction "
          f"{'would copy' if dry else 'copied'} {_mb(report['bytes_copied'])} of live data "
          f"out of {len(report['packs_compacted'])} pack(s)")
    print(f"gc: {report.get('mode', 'full')} pass, {report.get('objects_examined', 0)} "
          f"object(s) examined" + (f" ({report['fallback']})" if report.get("fallback") else ""))
    recounted = report.get("recount")
    if recounted:  # the first pass on a restored store
        print(f"gc: the accounting was recounted from {recounted['nodes']} node(s) in "
              f"{recounted['seconds']:.2f} s" + ("" if recounted["exact"] else
                                                 f", unfinished: {recounted['why']}"))
    pending = report.get("bytes_pending", 0)
    if pending:
        # Packs go one pass after they empty: a reader that began before this pass
        # may still be reading them (docs/design.md, "Garbage collection").
        print(f"gc: {_mb(pending)} in {len(report['packs_pending'])} pack(s) "
              f"{'would be' if dry else 'is'} given back by the next pass (run `strata gc` "
              "again; the server's own pass, every 10 minutes by default, does it too)")
    print(f"gc: live {_mb(report['live_bytes'])}, dead {_mb(report['dead_bytes'])}; "
          f"{report['seconds']:.2f} s")
    if report.get("waiting"):
        print(f"gc: {report['waiting']}")
    return 0


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_tag(args: argparse.Namespace) -> int:
    from strata.engine.errors import AlreadyExists
    if args.ref == "list" and not args.delete:
        with open_store(args) as store:
            tags = {b[len(TAGS):]: h for b, h in store.list_branches(args.name).items()
                    if b.startswith(TAGS)}
        if args.json:
            print_json([{"name": n, "snapshot": h} for n, h in sorted(tags.items())])
        else:
            for n, h in sorted(tags.items()):
                print(f"{n}\t{h}")
        return 0
    name = check_branch(TAGS + args.name)
    with open_store(args) as store:
        if args.delete:
            store.delete_branch(args.ref.partition("@")[0].partition("#")[0], name)
            return 0
        ref = parse_ref(args.ref)
        sid = ref.resolve(store)
        try:
            store.fork(ref.volume, name, at=sid)
        except AlreadyExists:
            raise AlreadyExists(f"tag {args.name!r} exists in {ref.volume} already (a tag "
                                "never moves: delete it first with --delete)") from None
    print(sid)
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    volume, _, branch = args.ref.partition("@")
    with open_remote(args) as store:
        if args.policy_command == "set":
            fields: dict[str, Any] = {}
            if args.keep_all:
                fields.update(keep_last=None, keep_newer=None)
            if args.keep_last is not None:
                if args.keep_last < 1:
                    raise InvalidInput("--keep-last must be at least 1 (the head is kept)")
                fields["keep_last"] = args.keep_last
            if args.keep_newer is not None:
                fields["keep_newer"] = args.keep_newer
            if args.expire_runs is not None:
                fields["expire_runs"] = args.expire_runs
            pol = store.admin("POST", "policy", {"volume": volume, "branch": branch or None,
                                                 **fields})
        else:
            q = f"volume={volume}" + (f"&branch={branch}" if branch else "")
            pol = store.admin("GET", f"policy?{q}")
    if args.json:
        print_json(pol)
        return 0
    keep = []
    if pol["keep_last"] is not None:
        keep.append(f"the last {pol['keep_last']} snapshot(s)")
    if pol["keep_newer"] is not None:
        keep.append(f"snapshots newer than {fmt_duration(pol['keep_newer'])}")
    print(f"{args.ref}: keeps " + (" and ".join(keep) if keep else "all history")
          + f"; run/* and rejected/* expire after {fmt_duration(pol['expire_runs'])}; heads "
          "and tags are always kept")
    return 0
