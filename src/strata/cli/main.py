"""The `strata` entry point: global options, subcommand dispatch, exit codes.

Exit codes: 0 ok, 1 error, 2 usage (bad arguments or input), 3 conflict (the
conflicting paths follow on stderr, one a line), 4 not found.

Start-up time is part of every command, so this module imports only argparse
and the command modules' `register` functions; a command whose name is known
(`COMMANDS`) builds only its own module's parsers. Heavy modules (the engine,
aiohttp, pyfuse3, trio, rich) are imported by the command functions that need
them; tests/test_cli_imports.py holds the budget.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import import_module
from typing import Any

from strata import __version__
from strata.cli.common import quote_path, unquote_path
from strata.engine.errors import Conflict, StrataError

# Which module registers each top-level command (tests/test_cli_imports.py checks
# that this table and the modules agree).
MODULES = ("admin", "volumes", "branches", "lifecycle", "read", "write", "serve", "mount",
           "run", "watch", "workspace")
COMMANDS = {
    "init": "admin", "restore": "admin", "stats": "admin", "fsck": "admin",
    "volume": "volumes", "branch": "branches", "fork": "branches",
    "gc": "lifecycle", "tag": "lifecycle", "policy": "lifecycle",
    "log": "read", "ls": "read", "cat": "read", "stat": "read", "diff": "read",
    "put": "write", "rm": "write", "import": "write", "export": "write",
    "serve": "serve", "token": "serve",
    "mount": "mount", "commit": "mount", "status": "mount", "unmount": "mount",
    "run": "run", "watch": "watch", "ui": "watch", "workspace": "workspace",
}

EPILOG = """\
A REF is VOLUME, VOLUME@BRANCH (the branch defaults to 'live') or VOLUME#SNAPSHOT
(a snapshot id or a unique prefix of at least 8 hex digits).

exit codes: 0 ok, 1 error, 2 usage, 3 conflict (paths on stderr), 4 not found
"""


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line, if it can be told without parsing."""
    takes_value = {"--store", "--server", "--token"}
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif arg == "--" or (arg.startswith("-") and arg not in ("--debug",)
                             and not arg.startswith(("--store=", "--server=", "--token="))):
            return None  # --help, --version, or something to leave to argparse
        elif not arg.startswith("-"):
            return arg
    return None


def _width() -> int:
    """What `shutil.get_terminal_size` would say, less 2 (as argparse does)."""
    try:
        width = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        width = 0
    if width <= 0:
        try:
            width = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            width = 80
    return width - 2


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter without its `import shutil` (and bz2, lzma) at every parser."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position, width or _width())


class _RawFormatter(argparse.RawDescriptionHelpFormatter, _Formatter):
    pass


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with a known `command`, only its module's subcommands are registered."""
    # The global options are accepted after the subcommand too; SUPPRESS keeps a
    # subcommand's absent option from overwriting one given before it.
    common = _Parser(add_help=False)
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
    parser = _Parser(
        prog="strata", parents=[common], epilog=EPILOG, formatter_class=_RawFormatter,
        description="A versioned, transactional, forkable filesystem.")
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = MODULES if command not in COMMANDS else (COMMANDS[command],)
    for name in wanted:
        import_module(f"strata.cli.{name}").register(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command_of(argv)).parse_args(argv)
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
        if getattr(args, "exit_at_once", False):
            # The command holds pyfuse3 and trio, and has closed what it opened:
            # tearing the interpreter down only cost tens of ms after the work.
            sys.stderr.flush()
            os._exit(code)
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
        import traceback
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
