"""The argument parser of every command (argparse), built only when a command needs it.

It owns the command table: `COMMANDS` says which module registers each
command, and with a known command only that module is imported and
registered. `cli/main.py` imports this module only once it needs a parser
(never for the fast `strata ls`); this module never imports main.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module
from typing import Any

from strata import __version__

# Which module registers each top-level command (tests/test_cli_imports.py checks
# that this table and the modules agree).
MODULES = ("admin", "volumes", "branches", "lifecycle", "read", "write", "serve", "mount",
           "run", "watch", "workspace", "image", "fleet")
COMMANDS = {
    "init": "admin", "restore": "admin", "stats": "admin", "fsck": "admin",
    "volume": "volumes", "branch": "branches", "fork": "branches",
    "gc": "lifecycle", "tag": "lifecycle", "policy": "lifecycle",
    "log": "read", "ls": "read", "cat": "read", "stat": "read", "diff": "read",
    "put": "write", "rm": "write", "import": "write", "export": "write",
    "serve": "serve", "token": "serve",
    "mount": "mount", "commit": "mount", "status": "mount", "unmount": "mount",
    "reload": "mount",
    "run": "run", "watch": "watch", "ui": "watch", "workspace": "workspace",
    "image": "image", "fleet": "fleet",
}

EPILOG = """\
A REF is VOLUME, VOLUME@BRANCH (the branch defaults to 'live') or VOLUME#SNAPSHOT
(a snapshot id or a unique prefix of at least 8 hex digits).

exit codes: 0 ok, 1 error, 2 usage, 3 conflict (paths on stderr), 4 not found
"""


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
    common.add_argument("--fleet", metavar="MEMBERS", default=argparse.SUPPRESS,
                        help="use a fleet: http://HOST:PORT of members, comma-separated; "
                             "any live one answers (default: $STRATA_FLEET); with serve, "
                             "the fleet's bucket URL to join")
    common.add_argument("--fleet-store", metavar="STORE", default=argparse.SUPPRESS,
                        help="send every request to this store of the fleet, and place new "
                             "volumes there (default: $STRATA_FLEET_STORE, else the "
                             "fleet's catalog places each volume)")
    common.add_argument("--token", metavar="TOKEN", default=argparse.SUPPRESS,
                        help="bearer token for a TCP server (default: $STRATA_TOKEN)")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show a traceback on errors")
    # strata.logs.LEVELS, not imported: logging would weigh on every command's start.
    common.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        default=argparse.SUPPRESS,
                        help="what the processes this command starts log (default: "
                             "$STRATA_LOG_LEVEL, else info)")
    common.add_argument("--log-json", action="store_true", default=argparse.SUPPRESS,
                        help="log one JSON object a line (default: $STRATA_LOG_JSON)")
    parser = _Parser(
        prog="strata", parents=[common], epilog=EPILOG, formatter_class=_RawFormatter,
        description="A versioned, transactional, forkable filesystem.")
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = MODULES if command not in COMMANDS else (COMMANDS[command],)
    for name in wanted:
        import_module(f"strata.cli.{name}").register(sub, common)
    return parser
