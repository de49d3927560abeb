"""`strata fleet`: join a fleet, add stores, show it, move a store, leave."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from strata.cli.common import add_key_options, bucket_key, print_json


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("fleet", parents=[common],
                       help="many hosts on one bucket: join, status, move, leave")
    fsub = p.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)

    j = fsub.add_parser("join", parents=[common],
                        help="make this host a member: route for all, own some stores, "
                             "stand by for the rest (runs until stopped)")
    j.add_argument("url", metavar="URL", help="the fleet's bucket prefix (s3://BUCKET/PREFIX)")
    j.add_argument("--name", required=True, help="this member's name (unique in the fleet)")
    j.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="where clients and other members reach this member (TCP)")
    j.add_argument("--advertise", metavar="URL",
                   help="the address other members use (default: http://HOST:PORT)")
    j.add_argument("--dir", required=True, metavar="DIR",
                   help="where this member keeps the stores it owns (a cache of the bucket)")
    j.add_argument("--ttl", type=float, default=None, metavar="S",
                   help="lease time to live of the stores it claims (default 2 s)")
    add_key_options(j)
    j.set_defaults(func=cmd_join)

    a = fsub.add_parser("add-store", parents=[common], help="add a store to the catalog")
    a.add_argument("url", metavar="URL")
    a.add_argument("name", metavar="STORE")
    a.add_argument("--sync", choices=["local", "bucket"], default="local",
                   help="bucket: acknowledge a publish only once the bucket holds it "
                        "(nothing acknowledged is lost when an owner dies)")
    a.set_defaults(func=cmd_add_store)

    s = fsub.add_parser("status", parents=[common],
                        help="members, stores, owners, epochs, lease ages, mode, lag")
    s.add_argument("url", metavar="URL")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    u = fsub.add_parser("ui", parents=[common],
                        help="print the fleet page's URL with a read-only view ticket")
    u.add_argument("url", metavar="URL")
    u.add_argument("--member", metavar="MEMBER",
                   help="the member whose port the browser opens (default: the first)")
    u.add_argument("--ttl", type=float, default=3600.0, metavar="S",
                   help="the ticket's lifetime in seconds (default 3600, at most a week)")
    u.set_defaults(func=cmd_ui)

    m = fsub.add_parser("move", parents=[common],
                        help="hand a store to another member (planned, through the bucket)")
    m.add_argument("url", metavar="URL")
    m.add_argument("name", metavar="STORE")
    m.add_argument("--to", required=True, metavar="MEMBER")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_move)

    lv = fsub.add_parser("leave", parents=[common],
                         help="hand a member's stores to others, then stop it")
    lv.add_argument("url", metavar="URL")
    lv.add_argument("--name", required=True)
    lv.set_defaults(func=cmd_leave)


def _token() -> str | None:
    return os.environ.get("STRATA_FLEET_TOKEN") or None


def _post(addr: str, path: str, payload: Any, timeout: float = 60.0) -> Any:
    import urllib.request  # only when used: it pulls in email, heavy for every --help
    headers = {"Content-Type": "application/json"}
    token = _token()
    if token:
        headers["X-Strata-Fleet-Token"] = token
    req = urllib.request.Request(addr + path, data=json.dumps(payload).encode(),
                                 headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - http only
        return json.loads(resp.read())


def move_policy() -> Any:
    """The move policy's settings: defaults, or $STRATA_FLEET_MOVE_* (docs/fleet.md)."""
    from strata.engine.errors import InvalidInput
    from strata.fleet.traffic import MovePolicy
    env = os.environ
    try:
        return MovePolicy(
            share=float(env.get("STRATA_FLEET_MOVE_SHARE", MovePolicy.share)),
            window=float(env.get("STRATA_FLEET_MOVE_WINDOW", MovePolicy.window)),
            min_requests=int(env.get("STRATA_FLEET_MOVE_MIN", MovePolicy.min_requests)),
            cooldown=float(env.get("STRATA_FLEET_MOVE_COOLDOWN", MovePolicy.cooldown)),
            enabled=env.get("STRATA_FLEET_MOVE", "1") != "0")
    except ValueError as exc:
        raise InvalidInput(f"a STRATA_FLEET_MOVE_* setting is not a number: {exc}") from None


def cmd_join(args: argparse.Namespace) -> int:
    return join(args.url, args.name, args.listen, args.dir, key=bucket_key(args),
                ttl=args.ttl, advertise=args.advertise)


def join(url: str, name: str, listen: str, data_dir: str, *, key: bytes | None,
         ttl: float | None, advertise: str | None) -> int:
    """Run this host as a member of the fleet at `url` until stopped.

    The one way in: `strata fleet join` and `strata serve --fleet` both come here.
    """
    import asyncio
    import faulthandler
    import signal

    from strata.engine.errors import InvalidInput
    from strata.fleet.lease import LEASE_TTL
    from strata.fleet.member import Member
    from strata.logs import setup
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidInput(f"--listen must be HOST:PORT, not {listen!r}")
    os.makedirs(data_dir, exist_ok=True)
    setup(os.path.join(data_dir, "member.log"))
    # SIGUSR1 prints every thread's stack to stderr: what a stuck member is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    member = Member(url, name, host, int(port), data_dir, key=key,
                    ttl=ttl or LEASE_TTL, token=_token(), advertise=advertise,
                    move=move_policy())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, member.stop)
        print(f"strata: member {name} of {url} on http://{listen}",
              file=sys.stderr, flush=True)
        await member.run()

    asyncio.run(main())
    return 0


def cmd_add_store(args: argparse.Namespace) -> int:
    from strata.fleet.records import FleetRecords
    added = FleetRecords(args.url).add_store(args.name, args.sync)
    print(f"{'added' if added else 'already in the catalog:'} {args.name}", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from strata.fleet.status import fleet_status
    st = fleet_status(args.url)
    if args.json:
        print_json(st)
        return 0
    print("MEMBER        ADDRESS                     HEARTBEAT")
    for name, m in st["members"].items():
        print(f"{name:<13} {m['addr'] or '-':<27} {m['heartbeat_age']:.1f}s ago"
              + ("  (leaving)" if m.get("leaving") else ""))
    print()
    print("STORE         OWNER         STATE      EPOCH  LEASE AGE  SYNC    LAG")
    for name, s in st["stores"].items():
        age = f"{s['lease_age']:.2f}s" if isinstance(s["lease_age"], float) else "-"
        lag = f"{s['lag']:.2f}s" if isinstance(s["lag"], float) else "-"
        print(f"{name:<13} {s['owner'] or '-':<13} {s['state']:<10} "
              f"{s['epoch'] if s['epoch'] is not None else '-':<6} {age:<10} "
              f"{s['sync']:<7} {lag}")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    from strata.engine.errors import InvalidInput, NotFound
    from strata.fleet.records import FleetRecords
    from strata.fleet.ui import make_ticket
    secret = _token()
    if not secret:
        raise InvalidInput("a view ticket is signed with the fleet's secret: set "
                           "STRATA_FLEET_TOKEN")
    members = FleetRecords(args.url).members()
    name = args.member or next(iter(sorted(members)), None)
    if name is None or name not in members:
        raise NotFound(f"no member {name!r} in the fleet" if name else "the fleet has no members")
    print(f"{members[name]['addr']}/fleet/ui/login?ticket={make_ticket(secret, args.ttl)}")
    return 0


def cmd_move(args: argparse.Namespace) -> int:
    from strata.engine.errors import NotFound, Unavailable
    from strata.fleet.records import FleetRecords
    rec = FleetRecords(args.url)
    lease = rec.lease(args.name)
    if lease is None or lease.state != "serving":
        raise Unavailable(f"store {args.name} has no serving owner to move it from")
    if lease.holder == args.to:
        print(f"{args.name} is on {args.to} already", file=sys.stderr)
        return 0
    if args.to not in rec.members():
        raise NotFound(f"no member {args.to!r} in the fleet")
    t0 = time.monotonic()
    released = _post(lease.addr, "/fleet/v1/move", {"store": args.name, "to": args.to})
    while True:
        now = rec.lease(args.name)
        if now is not None and now.state == "serving" and now.holder == args.to:
            break
        if time.monotonic() - t0 > 60:
            raise Unavailable(f"{args.to} did not take {args.name} within 60 s")
        time.sleep(0.02)
    result = {"store": args.name, "from": lease.holder, "to": args.to, "epoch": now.epoch,
              "released_in": released.get("released_in"),
              "gap_seconds": round(time.monotonic() - t0, 3)}
    if args.json:
        print_json(result)
    else:
        print(f"moved {args.name} from {lease.holder} to {args.to} (epoch {now.epoch}); "
              f"no owner for at most {result['gap_seconds']:.2f} s", file=sys.stderr)
    return 0


def cmd_leave(args: argparse.Namespace) -> int:
    from strata.engine.errors import NotFound
    from strata.fleet.records import FleetRecords
    member = FleetRecords(args.url).members().get(args.name)
    if member is None:
        raise NotFound(f"no member {args.name!r} in the fleet")
    got = _post(str(member["addr"]), "/fleet/v1/leave", {})
    for m in got.get("moved", []):
        print(f"handed {m['store']} to {m['to'] or 'whoever claims it first'}",
              file=sys.stderr)
    print(f"{args.name} left the fleet", file=sys.stderr)
    return 0
