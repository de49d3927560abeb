"""The `strata` command line: one module per command group.

This is the only layer that reads environment variables and prints. Each
command module registers its subcommands on the parser built in `main` and
returns an exit code; errors travel up as `StrataError` and become one line
on stderr and the exit code documented in the README.
"""
