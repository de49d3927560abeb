"""The `strata` entry point: global options, subcommand dispatch, exit codes.

Exit codes: 0 ok, 1 error, 2 usage (bad arguments or input), 3 conflict (the
conflicting paths follow on stderr, one a line), 4 not found.

Start-up time is part of every command, so this module imports almost
nothing: `strata ls` first tries `fastls` (one request on the lean stream, no
argparse), and otherwise `parser.py` builds the parser (imported only then); a
command whose name is known (`parser.COMMANDS`) builds only its own module's
parsers. Heavy modules (the engine,
aiohttp, pyfuse3, trio, rich) are imported by the command functions that need
them; tests/test_cli_imports.py holds the budget.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line, if it can be told without parsing."""
    takes_value = {"--store", "--server", "--token", "--log-level"}
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif arg == "--" or (arg.startswith("-") and arg not in ("--debug", "--log-json")
                             and not arg.startswith(("--store=", "--server=", "--token=",
                                                     "--log-level="))):
            return None  # --help, --version, or something to leave to argparse
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with a known `command`, only its module's subcommands are registered."""
    from strata.cli.parser import build_parser as build
    return build(command)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_of(argv)
    if command == "ls":
        from strata.cli import fastls
        done = fastls.run(argv)
        if done is not None:
            return done
    from strata.cli.common import unquote_path
    from strata.cli.show import quote_path
    from strata.engine.errors import Conflict, StrataError
    args = build_parser(command).parse_args(argv)
    # Names that are not UTF-8 come back out as the bytes they were, as `ls` does.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape")
    debug = bool(getattr(args, "debug", False))
    if getattr(args, "log_level", None) or getattr(args, "log_json", False):
        from strata.logs import configure_from_args  # only then: logging is no light import
        configure_from_args(getattr(args, "log_level", None), bool(getattr(args, "log_json",
                                                                            False)))
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
        # `strata run` answers with the command's own status: its own failures take
        # a code of their own (STEP_FAILED), which a caller can tell apart and retry.
        return int(getattr(args, "own_failure", 0) or exc.exit_code)
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
        return int(getattr(args, "own_failure", 0) or 1)


def _trace(debug: bool) -> None:
    if debug:
        import traceback
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
