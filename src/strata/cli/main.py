"""The `strata` entry point: global options, subcommand dispatch, exit codes.

Exit codes: 0 ok, 1 error, 2 usage (bad arguments or input), 3 conflict (the
conflicting paths follow on stderr, one a line), 4 not found.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from strata import __version__
from strata.cli import (
    admin,
    branches,
    lifecycle,
    mount,
    read,
    run,
    serve,
    volumes,
    watch,
    write,
)
from strata.cli.common import quote_path, unquote_path
from strata.engine.errors import Conflict, StrataError

EPILOG = """\
A REF is VOLUME, VOLUME@BRANCH (the branch defaults to 'live') or VOLUME#SNAPSHOT
(a snapshot id or a unique prefix of at least 8 hex digits).

exit codes: 0 ok, 1 error, 2 usage, 3 conflict (paths on stderr), 4 not found
"""


def build_parser() -> argparse.ArgumentParser:
    # The global options are accepted after the subcommand too; SUPPRESS keeps a
    # subcommand's absent option from overwriting one given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", metavar="DIR", default=argparse.SUPPRESS,
                        help="store directory (default: $STRATA_STORE or "
                             "~/.local/share/strata)")
    common.add_argument("--server", metavar="URL", default=argparse.SUPPRESS,
                        help="use the server at unix:PATH or http://HOST:PORT "
                             "(default: $STRATA_SERVER, else the store's own server)")
    common.add_argument("--token", metavar="TOKEN", default=argparse.SUPPRESS,
                        help="bearer token for a TCP server (default: $STRATA_TOKEN)")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show a traceback on errors")
    parser = argparse.ArgumentParser(
        prog="strata", parents=[common], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A versioned, transactional, forkable filesystem.")
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (admin, volumes, branches, lifecycle, read, write, serve, mount, run, watch):
        module.register(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Names that are not UTF-8 come back out as the bytes they were, as `ls` does.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape")
    debug = bool(getattr(args, "debug", False))
    if isinstance(getattr(args, "path", None), str):
        args.path = unquote_path(args.path)  # a name typed as the CLI shows it
    try:
        code: int = args.func(args)
        sys.stdout.flush()
        return code
    except Conflict as exc:
        _trace(debug)
        print(f"strata: error: conflict: {len(exc.paths)} path(s) changed on both sides since "
              "the base; nothing was published", file=sys.stderr)
        for path in exc.paths:
            print(quote_path(path) if path else "/", file=sys.stderr)
        return exc.exit_code
    except StrataError as exc:
        _trace(debug)
        print(f"strata: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        # The reader went away (`strata cat ... | head`): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        _trace(debug)
        where = f": {exc.filename}" if exc.filename else ""
        print(f"strata: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1


def _trace(debug: bool) -> None:
    if debug:
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
