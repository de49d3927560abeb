"""Entry point for ``python -m bench``: run every benchmark, print, write JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench import engine, server
from bench.report import print_table


def main() -> None:
    """Run all benchmarks."""
    ap = argparse.ArgumentParser(prog="python -m bench")
    ap.add_argument("--dir", default=os.environ.get("STRATA_BENCH_DIR", "/var/tmp"),
                    help="directory on the local disk to run in")
    ap.add_argument("--out", default="bench/results/engine.json")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    args = ap.parse_args()
    rows = engine.run(args.dir, quick=args.quick)
    rows += server.run(args.dir, quick=args.quick)
    print_table("strata engine and server benchmarks (local disk baseline from the same run)",
                rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"results written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
