"""`strata run`: a command in a sandbox as one transaction over its volumes."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from strata.cli.common import (
    ensure_server,
    open_remote,
    parse_size,
    print_json,
    quote_path,
    server_url,
    store_path,
)
from strata.engine.errors import InvalidInput

DEFAULT_PIDS = 4096  # run/sandbox.py's DEFAULT_PIDS (not imported: the CLI starts light)
# Exit status of a step that strata itself could not run (the command's own statuses
# pass through; 3 is a conflict; 124 the timeout): as `docker run` answers 125.
STEP_FAILED = 125


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "run", parents=[common], help="run a command as a transaction over volumes",
        description="Run CMD in a sandbox with each volume at /storage/NAME. Exit 0 publishes "
                    "every changed read-write volume atomically; anything else publishes "
                    "nothing. SPEC is NAME[@BRANCH][:ro|:rw][:exclusive][:run].")
    p.add_argument("-v", "--volume", action="append", default=[], dest="specs",
                   metavar="SPEC", help="a volume for the step (repeatable)")
    p.add_argument("--sandbox", choices=("none", "bwrap", "gvisor"), default="bwrap",
                   help="bwrap (default) or gvisor: a fresh root, an unprivileged identity on "
                        "the host, nothing of the host reachable (docs/sandbox.md); none: "
                        "runs CMD as you, on the host, with everything you can reach; only "
                        "for trusted code")
    p.add_argument("--timeout", type=float, default=None, metavar="S")
    p.add_argument("--memory", type=parse_size, default=None, metavar="BYTES",
                   help="memory limit (suffixes K, M, G allowed)")
    p.add_argument("--pids", type=int, default=DEFAULT_PIDS, metavar="N",
                   help=f"processes and threads the step may have at once (default "
                        f"{DEFAULT_PIDS}); a fork bomb fails the step, nothing else")
    p.add_argument("--disk", type=parse_size, default=None, metavar="BYTES",
                   help="room for the step's writes to its volumes (suffixes K, M, G); "
                        "past it writes fail with ENOSPC inside (default: the scratch "
                        "filesystem's free space)")
    p.add_argument("--network", action="store_true",
                   help="share the host's network (default: loopback of its own only)")
    p.add_argument("--root", metavar="ws:NAME[@BRANCH]", default=None,
                   help="a workspace as the sandbox's whole root filesystem (durable, "
                        "not a transaction: what the command writes stays); volumes given "
                        "with -v are at /storage in it, published on exit 0 as in any step")
    p.add_argument("--image", metavar="NAME[:TAG]|VOLUME[@BRANCH]", default=None,
                   help="the sandbox's root filesystem from an image (`strata image import`) "
                        "or a volume holding a root directory, read lazily as of the step's "
                        "start; what the step changes in it is thrown away. An image's config "
                        "applies as in docker run: CMD replaces its Cmd after its "
                        "Entrypoint, and its Env, WorkingDir and User are the step's")
    p.add_argument("--entrypoint", metavar="CMD", default=None,
                   help="with --image: run CMD instead of the image's Entrypoint (and drop "
                        "its Cmd), as docker run --entrypoint; '' runs the command line alone")
    p.add_argument("--takeover", action="store_true",
                   help="with --root: take the workspace over even if it is attached on this "
                        "host (that attach is fenced; what it writes after is dropped)")
    p.add_argument("-m", "--message", default=None)
    p.add_argument("--merge-identical", action="store_true",
                   help="accept a path the head already holds exactly as this step left it; by "
                        "default any path changed since the step's snapshot conflicts (only "
                        "for idempotent jobs: for a read-modify-write it loses an update)")
    p.add_argument("--json", action="store_true")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")
    p.set_defaults(func=cmd_run, exit_at_once=True, own_failure=STEP_FAILED)


def _run_root(args: argparse.Namespace, argv: list[str]) -> int:
    from strata.cli.common import parse_ref
    from strata.run.runner import run_in_workspace
    if not args.root.startswith("ws:"):
        raise InvalidInput(f"--root takes ws:NAME[@BRANCH], not {args.root!r}")
    ref = parse_ref(args.root[3:])
    if ref.snapshot:
        raise InvalidInput("--root takes a workspace branch, not a snapshot")
    if args.specs:  # volumes at /storage in the workspace root: a step beside it
        return _run(args, argv, root=(ref.volume, ref.branch or "live"))
    if args.disk is not None:
        raise InvalidInput("--disk limits a step's writes to its volumes; a workspace root "
                           "has its own size (strata workspace create --size)")
    with open_remote(args) as store:
        result = run_in_workspace(store, ref.volume, ref.branch or "live", argv,
                                  sandbox=args.sandbox, timeout=args.timeout,
                                  memory=args.memory, network=args.network, pids=args.pids,
                                  takeover=args.takeover)
    if args.json:
        print_json({"status": result.status, "run": result.run_id, "head":
                    result.published.get(ref.volume), "timed_out": result.timed_out,
                    "oom": result.oom, "timings": result.timings})
    return result.status


def cmd_run(args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv and args.image is None:  # an image may name its own command
        raise InvalidInput("no command given (strata run -v VOL -- CMD ...)")
    if args.entrypoint is not None and args.image is None:
        raise InvalidInput("--entrypoint applies to an image's config: give --image")
    if args.root is not None:
        if args.image is not None:
            raise InvalidInput("give --root or --image, not both")
        return _run_root(args, argv)
    if not args.specs and args.image is None:  # a transaction over volumes, or an image
        raise InvalidInput("no volume given (strata run -v VOL -- CMD ..., "
                           "or --root ws:NAME for a workspace as the whole root)")
    if server_url(args) is None and os.environ.get("STRATA_RUN_IN_PROCESS") != "1":
        return _report(args, _via_service(args, argv))
    return _run(args, argv)


def _run(args: argparse.Namespace, argv: list[str], root: tuple[str, str] | None = None
         ) -> int:
    """The step in this process (a workspace root, --server, or STRATA_RUN_IN_PROCESS=1)."""
    from strata.run.runner import run_step
    from strata.run.spec import parse_image, parse_spec
    specs = [parse_spec(s) for s in args.specs]
    image = parse_image(args.image) if args.image is not None else None
    if len({s.volume for s in specs}) != len(specs):
        raise InvalidInput("a volume appears twice")
    if root is not None and root[0] in {s.volume for s in specs}:
        raise InvalidInput(f"{root[0]} is the root workspace; it cannot be a volume too")
    with open_remote(args) as store:
        result = run_step(store, specs, argv, sandbox=args.sandbox, timeout=args.timeout,
                          memory=args.memory, network=args.network, message=args.message,
                          identical=args.merge_identical, root=root, pids=args.pids,
                          disk=args.disk, image=image, takeover=args.takeover,
                          entrypoint=args.entrypoint)
    return _report(args, result.to_json())


def _via_service(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The step, run by the store's step service (run/service.py).

    The service has the mount stack loaded already; this process only passes
    its stdio and waits.
    """
    from strata.run import client
    store = os.path.abspath(store_path(args))
    if not client.server_answers(store):
        ensure_server(store)
    request = {
        "argv": argv, "specs": list(args.specs), "sandbox": args.sandbox,
        "timeout": args.timeout, "memory": args.memory, "network": args.network,
        "pids": args.pids, "disk": args.disk, "image": args.image,
        "message": args.message, "identical": args.merge_identical}
    if args.entrypoint is not None:  # only when given: an older service knows no such field
        request["entrypoint"] = args.entrypoint
    return client.call(store, request)


def _report(args: argparse.Namespace, result: dict[str, Any]) -> int:
    """Print a step's result (StepResult.to_json) as the CLI shows it; its exit status."""
    if args.json:
        print_json({"status": result["status"], "published": result["published"],
                    "conflicts": result["conflicts"], "run": result["run"],
                    "rejected": result["rejected"], "timed_out": result["timed_out"],
                    "oom": result["oom"], "timings": result["timings"],
                    **({"boot": result["boot"]} if result.get("boot") else {})})
    elif result["conflicts"]:
        print(f"strata: error: conflict: {len(result['conflicts'])} path(s) changed since the "
              f"step began; nothing was published (kept on rejected/{result['run']})",
              file=sys.stderr)
        for path in result["conflicts"]:
            print(quote_path(path), file=sys.stderr)
    elif result["timed_out"]:
        print(f"strata: step timed out after {args.timeout:g}s; nothing was published",
              file=sys.stderr)
    status: int = result["status"]
    return status
