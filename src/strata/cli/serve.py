"""`strata serve` (own a store and serve it) and `strata token` (TCP credentials)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from strata.cli.common import (
    Progress,
    add_key_options,
    bucket_key,
    open_remote,
    parse_size,
    print_json,
    progress_bar,
    store_path,
)
from strata.cli.show import fmt_time, fmt_value


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("serve", parents=[common],
                       help="own the store and serve it (unix socket by default)")
    p.add_argument("--listen", action="append", default=[], metavar="ADDR",
                   help="unix:PATH or tcp:HOST:PORT (repeatable; the unix socket "
                        "STORE/serve.sock is always served too); TCP clients need a token")
    p.add_argument("--takeover", action="store_true",
                   help="ask the running owner to hand the store over, then serve it; with "
                        "--bucket, fence the bucket's owner (on any host) and serve here")
    p.add_argument("--bucket", metavar="URL",
                   help="serve the store kept in this bucket: create it there if the "
                        "bucket is empty, restore it here (no download) with --takeover")
    p.add_argument("--sync", choices=["local", "bucket"], default="local",
                   help="for a store --bucket creates or restores: bucket acknowledges a "
                        "publish only once the bucket holds it")
    p.add_argument("--cache-size", type=parse_size, default=None, metavar="BYTES",
                   help="local disk budget of a bucket store: packs safely in the bucket "
                        "are evicted above it, least recently read first")
    add_key_options(p)
    p.add_argument("--no-encrypt", action="store_true",
                   help="for a store --bucket creates: authenticate, do not encrypt")
    p.add_argument("--stop", action="store_true", help="stop the running server")
    p.add_argument("--idle-exit", type=float, default=None, metavar="S",
                   help="exit after S seconds without requests")
    p.add_argument("--name", metavar="MEMBER",
                   help="with --fleet URL: join that fleet as MEMBER, as `strata fleet "
                        "join` does (--listen tcp:HOST:PORT; --store is its directory)")
    p.add_argument("--advertise", metavar="URL",
                   help="with --fleet: the address other members use")
    p.set_defaults(func=cmd_serve)

    t = sub.add_parser("token", parents=[common], help="create, list and revoke tokens")
    tsub = t.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    c = tsub.add_parser("create", parents=[common],
                        help="create a token for VOLUME[@BRANCH] (printed once)")
    c.add_argument("scope", metavar="VOLUME[@BRANCH]",
                   help="what the token may reach: a volume, or one branch of it")
    mode = c.add_mutually_exclusive_group(required=True)
    mode.add_argument("--ro", action="store_true", help="read-only")
    mode.add_argument("--rw", action="store_true", help="read-write")
    c.add_argument("--ttl", type=float, default=None, metavar="S", help="expire after S seconds")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_token_create)
    r = tsub.add_parser("revoke", parents=[common], help="revoke a token (by id or token)")
    r.add_argument("token")
    r.set_defaults(func=cmd_token_revoke)
    ls = tsub.add_parser("list", parents=[common], help="list tokens (never their secrets)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_token_list)


def _stopping(sock: str) -> str:
    """What stopping the server on `sock` involves, as a progress bar's words."""
    if not sys.stderr.isatty():
        return "stopping"
    from strata.engine.errors import StrataError
    from strata.server.client import RemoteStore, is_serving
    if not is_serving(sock):
        return "stopping"
    try:
        store = RemoteStore(f"unix:{sock}")
        try:
            tier = store.admin("GET", "stats").get("bucket") or {}
        finally:
            store.close()
    except StrataError:
        return "stopping"
    left = int(tier.get("unshipped_bytes") or 0) + int(tier.get("upload_queued_bytes") or 0)
    return (f"stopping: uploading {fmt_value('bytes', left)} to the bucket" if left
            else "stopping")


def cmd_serve(args: argparse.Namespace) -> int:
    from strata.server.client import default_socket
    from strata.server.serve import (  # aiohttp: only when serving
        ServeResult,
        run_server,
        stop_server,
    )
    path = store_path(args)
    fleet = getattr(args, "fleet", None)
    if fleet is not None or args.name is not None:
        return _serve_fleet(args, fleet, path)
    if args.stop:
        sock = default_socket(path)
        # A bucket store's server uploads what it still holds before it goes: on a
        # terminal, say how much, and show that it goes on.
        with progress_bar(_stopping(sock)):
            stopped = stop_server(sock)
        print("stopped" if stopped else "no server was running", file=sys.stderr)
        return 0

    if args.bucket:
        from strata.engine.tier import prepare  # obstore: only with a bucket
        progress = Progress("replaying the log")
        try:
            done = prepare(path, args.bucket, takeover=args.takeover, key=bucket_key(args),
                           unauthenticated=args.unauthenticated,
                           encrypt=not args.no_encrypt, sync=args.sync,
                           cache_size=args.cache_size, progress=progress)
        finally:
            progress.close()
        if done != "opened":
            print(f"strata: {done} {path} from {args.bucket}", file=sys.stderr, flush=True)
    if args.cache_size is not None:
        from strata.engine.storedir import set_cache_size
        set_cache_size(path, args.cache_size)

    def ready(result: ServeResult) -> None:
        where = ", ".join(args.listen) or f"unix:{default_socket(path)}"
        print(f"strata: serving {path} on {where}", file=sys.stderr, flush=True)
        if result.gap_seconds is not None:  # printed now, not when this server exits
            print(f"strata: took over the store; requests waited "
                  f"{result.gap_seconds * 1000:.0f} ms", file=sys.stderr, flush=True)

    import asyncio

    from strata.logs import setup
    setup(os.path.join(path, "serve.log"))
    result = asyncio.run(run_server(path, args.listen, takeover=args.takeover, on_ready=ready,
                                    idle_exit=args.idle_exit))
    if result.notes:
        print(f"strata: {'; '.join(result.notes)}", file=sys.stderr)
    if result.fenced:  # served elsewhere now: the Unavailable family's code, not conflict's
        from strata.engine.errors import Fenced
        return Fenced.exit_code
    return 0


def _serve_fleet(args: argparse.Namespace, url: str | None, path: str) -> int:
    """`serve --fleet URL --name MEMBER`: the same member as `strata fleet join`."""
    from strata.cli.fleet import join
    from strata.engine.errors import InvalidInput
    if not url or "://" not in url or url.startswith(("http://", "https://")):
        raise InvalidInput("serve --fleet takes the fleet's bucket URL (s3://BUCKET/PREFIX)")
    if not args.name:
        raise InvalidInput("serve --fleet needs --name MEMBER (unique in the fleet)")
    tcp = [a[len("tcp:"):] if a.startswith("tcp:") else a for a in args.listen]
    if len(tcp) != 1 or tcp[0].startswith("unix:"):
        raise InvalidInput("serve --fleet needs one --listen tcp:HOST:PORT")
    if args.takeover or args.bucket or args.stop or args.idle_exit is not None:
        raise InvalidInput("serve --fleet: the fleet claims and hands over stores itself; "
                           "--takeover, --bucket, --stop and --idle-exit do not apply")
    return join(url, args.name, tcp[0], path, key=bucket_key(args), ttl=None,
                advertise=args.advertise)


def cmd_token_create(args: argparse.Namespace) -> int:
    volume, _, branch = args.scope.partition("@")
    with open_remote(args) as store:
        tok = store.admin("POST", "tokens", {"volume": volume, "branch": branch or None,
                                             "writable": bool(args.rw), "ttl": args.ttl})
    if args.json:
        print_json(tok)
    else:
        print(tok["token"])
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    tid = args.token.split("_")[1] if args.token.startswith("strata_") else args.token
    with open_remote(args) as store:
        store.admin("DELETE", f"tokens/{tid}")
    return 0


def cmd_token_list(args: argparse.Namespace) -> int:
    with open_remote(args) as store:
        tokens = store.admin("GET", "tokens")["tokens"]
    if args.json:
        print_json(tokens)
        return 0
    for t in tokens:
        scope = t["volume"] + (f"@{t['branch']}" if t["branch"] else "")
        mode = "rw" if t["writable"] else "ro"
        expires = fmt_time(int(t["expires"] * 1e9)) if t["expires"] else "never"
        print(f"{t['id']}  {scope}  {mode}  expires {expires}")
    return 0
