"""Volumes: `strata volume create|list|delete`."""

from __future__ import annotations

import argparse
from typing import Any

from strata.cli.common import open_store, print_json


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    vol = sub.add_parser("volume", parents=[common], help="create, list and delete volumes")
    vsub = vol.add_subparsers(dest="volume_command", metavar="ACTION", required=True)

    p = vsub.add_parser("create", parents=[common],
                        help="create a volume whose branch 'live' is empty")
    p.add_argument("name", metavar="NAME",
                   help="the name of the volume")
    p.set_defaults(func=cmd_create)

    p = vsub.add_parser("list", parents=[common], help="list volumes")
    p.add_argument("--json", action="store_true", help='[{"name": ..., "branches": N}]')
    p.set_defaults(func=cmd_list)

    p = vsub.add_parser("delete", parents=[common], help="delete a volume and its branches")
    p.add_argument("name", metavar="NAME",
                   help="the name of the volume")
    p.add_argument("--yes", action="store_true",
                   help="do not ask (on a terminal, delete asks first)")
    p.set_defaults(func=cmd_delete)


def cmd_create(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        store.create_volume(args.name)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        rows = [{"name": v, "branches": len(store.list_branches(v))}
                for v in store.list_volumes()]
    if args.json:
        print_json(rows)
    else:
        for r in rows:
            print(r["name"])
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    import sys
    with open_store(args) as store:
        if not args.yes and sys.stdin.isatty():
            n = len(store.list_branches(args.name))
            answer = input(f"delete volume {args.name!r} and its {n} branch(es)? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing deleted", file=sys.stderr)
                return 1
        store.delete_volume(args.name)
    return 0
