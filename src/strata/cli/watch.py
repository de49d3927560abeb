"""Watching the store: `strata watch` (a live terminal view) and `strata ui` (the web view's URL).

Nothing here changes a volume; `strata ui` creates one short-lived read-only token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from strata.cli.common import (
    ensure_server,
    fleet_members,
    open_remote,
    server_url,
    store_path,
)
from strata.engine.errors import InvalidInput, NotFound, Unavailable
from strata.engine.names import check_branch, check_volume

RECONNECT_FOR = 30.0  # seconds a watch keeps reconnecting to a server that went away


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("watch", parents=[common],
                       help="follow publishes, conflicts, failed steps, forks and branch "
                            "moves live")
    p.add_argument("refs", metavar="REF", nargs="*",
                   help="VOLUME (all its branches) or VOLUME@BRANCH; default: everything "
                        "the credentials may see")
    p.add_argument("--json", action="store_true", help="one JSON event per line")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("ui", parents=[common],
                       help="print (or open) the web view's URL with a short-lived "
                            "read-only token")
    p.add_argument("volume", metavar="VOLUME",
                   help="a volume to follow")
    p.add_argument("--url", metavar="URL",
                   help="the server's address for the browser, http://HOST:PORT "
                        "(default: the server's first TCP listener)")
    p.add_argument("--ttl", type=float, default=3600.0, metavar="S",
                   help="the token's lifetime in seconds (default 3600)")
    p.add_argument("--open", action="store_true", help="open the URL in a browser")
    p.set_defaults(func=cmd_ui)


def _check_ref(ref: str) -> None:
    vol, sep, branch = ref.partition("@")
    check_volume(vol)
    if sep:
        check_branch(branch)


def cmd_watch(args: argparse.Namespace) -> int:
    for ref in args.refs:
        _check_ref(ref)
    out = _JsonOut() if args.json else _RichOut()
    since: str | None = None
    heads: dict[str, str] = {}
    gone_at: float | None = None
    while True:
        try:
            with open_remote(args) as store:
                for ev in store.events(args.refs, since, heads):
                    gone_at = None
                    since = ev.pop("_id", since)
                    _track(heads, ev)
                    out.show(ev)
        except Unavailable:
            pass
        # The stream ended: the server stopped or handed the store over. Resume from
        # where we were; the server replays, or catches up from history.
        now = time.monotonic()
        gone_at = gone_at or now
        if now - gone_at > RECONNECT_FOR:
            raise Unavailable("the server went away and did not come back")
        time.sleep(0.2)
        if server_url(args) is None and fleet_members(args) is None:
            ensure_server(store_path(args))  # a fleet's members need no local server


def _track(heads: dict[str, str], ev: dict[str, Any]) -> None:
    ref = f"{ev.get('volume')}@{ev.get('branch')}"
    kind = ev.get("type")
    if kind == "hello":
        heads.clear()
        heads.update(ev.get("heads", {}))
    elif kind in ("publish", "fork", "branch_moved"):
        heads[ref] = ev["snapshot"]
    elif kind == "branch_deleted":
        heads.pop(ref, None)
    elif kind == "volume_deleted":
        for r in [r for r in heads if r.startswith(f"{ev.get('volume')}@")]:
            del heads[r]


class _JsonOut:
    def show(self, ev: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(ev, separators=(",", ":")) + "\n")
        sys.stdout.flush()


class _RichOut:
    """One line per event, coloured by kind; a table of heads when the stream starts."""

    def __init__(self) -> None:
        from rich.console import Console
        self.console = Console(highlight=False)

    def show(self, ev: dict[str, Any]) -> None:
        from rich.markup import escape
        from rich.table import Table
        kind = ev.get("type")
        when = time.strftime("%H:%M:%S", time.localtime(ev.get("time") or time.time()))
        ref = escape(f"{ev.get('volume')}@{ev.get('branch')}")
        replay = " [dim](from history)[/]" if ev.get("replayed") else ""
        if kind == "hello":
            if ev.get("resync"):
                self.console.print("[yellow]reconnected; caught up from history[/]")
                return
            table = Table(title="watching", show_edge=False)
            table.add_column("branch")
            table.add_column("head")
            for r, h in ev.get("heads", {}).items():
                table.add_row(escape(r), h[:12])
            self.console.print(table)
        elif kind == "publish":
            counts = (f"[green]+{ev.get('added', 0)}[/] [red]-{ev.get('deleted', 0)}[/] "
                      f"[yellow]M{ev.get('modified', 0)}[/]")
            status = ev.get("status")
            exit_ = "" if status is None else f" exit {status}"
            self.console.print(f"{when} [bold green]publish[/] {ref} "
                               f"{str(ev.get('snapshot'))[:12]} {counts}{exit_} "
                               f"{escape(str(ev.get('message', '')))}{replay}")
        elif kind == "conflict":
            paths = ", ".join(ev.get("paths", [])[:5])
            more = ev.get("npaths", 0) - min(len(ev.get("paths", [])), 5)
            status = ev.get("status")
            exit_ = "" if status is None else f" exit {status}"
            self.console.print(f"{when} [bold red]conflict[/] {ref}{exit_}: "
                               f"{escape(paths)}{f' (+{more} more)' if more > 0 else ''} "
                               f"[dim]{escape(str(ev.get('message', '')))}[/]")
        elif kind == "step":
            why = ("timed out" if ev.get("timed_out") else "out of memory" if ev.get("oom")
                   else f"exit {ev.get('status')}")
            argv = " ".join(str(a) for a in ev.get("argv", []))[:80]
            self.console.print(f"{when} [bold red]failed[/] {ref} run {escape(str(ev.get('run')))}"
                               f" {why}, nothing published [dim]{escape(argv)}[/]")
        elif kind == "fork":
            label = "rejected" if str(ev.get("branch", "")).startswith("rejected/") else "fork"
            colour = "red" if label == "rejected" else "cyan"
            self.console.print(f"{when} [bold {colour}]{label}[/] {ref} at "
                               f"{str(ev.get('snapshot'))[:12]}{replay}")
        elif kind == "branch_moved":
            self.console.print(f"{when} [bold magenta]moved[/] {ref} "
                               f"{str(ev.get('previous'))[:12]} -> "
                               f"{str(ev.get('snapshot'))[:12]}{replay}")
        elif kind == "resync":
            self.console.print("[yellow]fell behind the server's event ring; "
                               "caught up from history[/]")
        else:
            what = escape(str(kind)).replace("_", " ")
            target = escape(str(ev.get("volume"))) if kind and kind.startswith("volume") \
                else ref
            self.console.print(f"{when} [bold]{what}[/] {target}{replay}")


def cmd_ui(args: argparse.Namespace) -> int:
    check_volume(args.volume)
    if not 0 < args.ttl <= 7 * 86400:
        raise InvalidInput("--ttl must be between 0 and 7 days")
    with open_remote(args) as store:
        base = args.url or _tcp_url(store.admin("GET", "stats").get("listen", []))
        if base is None:
            raise NotFound("the server listens on no TCP address: start it with "
                           "'strata serve --listen tcp:127.0.0.1:PORT', or pass --url")
        tok = store.admin("POST", "tokens", {"volume": args.volume, "branch": None,
                                             "writable": False, "ttl": args.ttl})
    import urllib.parse
    parsed = urllib.parse.urlsplit(base)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InvalidInput(f"--url must be http://HOST:PORT, not {base!r}")
    url = (f"{parsed.scheme}://{parsed.netloc}/ui/login?"
           + urllib.parse.urlencode({"token": tok["token"],
                                     "next": f"/ui/?v={args.volume}"}))
    print(url)
    if args.open:
        import webbrowser
        webbrowser.open(url)
    return 0


def _tcp_url(listens: list[str]) -> str | None:
    for spec in listens:
        if spec.startswith("tcp:"):
            host, _, port = spec[4:].rpartition(":")
            if host in ("0.0.0.0", "::", ""):
                host = "127.0.0.1"
            if ":" in host and not host.startswith("["):
                host = f"[{host}]"
            return f"http://{host}:{port}"
    return None
