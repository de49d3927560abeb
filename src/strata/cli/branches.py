"""Branches: `strata branch list|delete` and `strata fork`."""

from __future__ import annotations

import argparse
from typing import Any

from strata.cli.common import REF_HELP, open_store, parse_ref, print_json
from strata.engine.errors import InvalidInput
from strata.engine.names import check_branch


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    br = sub.add_parser("branch", parents=[common], help="list and delete branches")
    bsub = br.add_subparsers(dest="branch_command", metavar="ACTION", required=True)

    p = bsub.add_parser("list", parents=[common], help="list a volume's branches")
    p.add_argument("volume", metavar="VOLUME",
                   help="the volume whose branches to list")
    p.add_argument("--json", action="store_true", help='[{"name": ..., "head": ...}]')
    p.set_defaults(func=cmd_list)

    p = bsub.add_parser("delete", parents=[common], help="delete a branch")
    p.add_argument("ref", metavar="VOLUME@BRANCH", help="the branch to delete")
    p.add_argument("--force", action="store_true",
                   help="also the volume's default branch, 'live', which every REF "
                        "without @BRANCH names")
    p.set_defaults(func=cmd_delete)

    p = sub.add_parser("fork", parents=[common],
                       help="new branch at REF's snapshot, in constant time; "
                            "prints its head")
    p.add_argument("ref", metavar="REF",
                   help="the snapshot to fork from: " + REF_HELP)
    p.add_argument("new_branch", metavar="NEWBRANCH",
                   help="the name of the new branch")
    p.add_argument("--empty", action="store_true", help="start the branch empty instead")
    p.set_defaults(func=cmd_fork)


def cmd_list(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        heads = store.list_branches(args.volume)
    if args.json:
        print_json([{"name": n, "head": h} for n, h in heads.items()])
    else:
        for n, h in heads.items():
            print(f"{n}\t{h}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    if "@" not in args.ref:
        raise InvalidInput(f"name the branch to delete as VOLUME@BRANCH, not {args.ref!r}")
    ref = parse_ref(args.ref)
    branch = ref.need_branch()
    if branch == "live" and not args.force:
        raise InvalidInput(f"'live' is {ref.volume}'s default branch: `strata ls "
                           f"{ref.volume}` and every REF without @BRANCH read it; delete it "
                           "with --force")
    with open_store(args) as store:
        store.delete_branch(ref.volume, branch)
    return 0


def cmd_fork(args: argparse.Namespace) -> int:
    ref = parse_ref(args.ref)
    check_branch(args.new_branch)
    with open_store(args) as store:
        at = None if args.empty else ref.resolve(store)
        if args.empty:
            store.list_branches(ref.volume)  # the volume must exist
        head = store.fork(ref.volume, args.new_branch, at=at)
    print(head)
    return 0
