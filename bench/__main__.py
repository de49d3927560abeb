"""Entry point for ``python -m bench``: run every benchmark, print, write JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench import (
    boot,
    bucket,
    day,
    dedup,
    engine,
    fleet,
    gc,
    image,
    links,
    mount,
    sandbox,
    scale,
    server,
    speed,
    steps,
    ui,
    workspace,
)
from bench.report import print_table


def main() -> None:
    """Run all benchmarks."""
    ap = argparse.ArgumentParser(prog="python -m bench")
    ap.add_argument("--dir", default=os.environ.get("STRATA_BENCH_DIR", "/var/tmp"),
                    help="directory on the local disk to run in")
    ap.add_argument("--out", default="bench/results/engine.json")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--large", action="store_true",
                    help="scale group: 1M against 10M objects (default 100k against 1M)")
    ap.add_argument("--churn-rounds", type=int, default=None,
                    help="rounds of the GC churn on a mount (default 20, 5 with --quick)")
    ap.add_argument("--only",
                    default="engine,server,bucket,gc,mount,steps,sandbox,boot,ui,speed,"
                            "workspace,dedup,image,day",
                    help="comma-separated groups to run (engine, server, bucket, gc, mount, "
                         "steps, sandbox, boot, ui, speed, workspace, dedup, image, day, scale, "
                         "fleet, fleet-move, fleet-failover, links; scale, links and the "
                         "fleet's are left out of the default; fleet includes fleet-move "
                         "and fleet-failover)")
    args = ap.parse_args()
    groups = set(args.only.split(","))
    rows = []
    if "engine" in groups:
        rows += engine.run(args.dir, quick=args.quick)
    if "server" in groups:
        rows += server.run(args.dir, quick=args.quick)
    if "bucket" in groups:
        rows += bucket.run(args.dir, quick=args.quick)
    if "gc" in groups:
        rows += gc.run(args.dir, quick=args.quick, churn_rounds=args.churn_rounds)
    if "ui" in groups:
        rows += ui.run(args.dir, quick=args.quick)
    if "fleet" in groups:
        rows += fleet.run(args.dir, quick=args.quick)
    elif "fleet-failover" in groups:
        rows += fleet.run(args.dir, quick=args.quick, to_work=False)
    elif "fleet-move" in groups:
        rows += fleet.run_move(args.dir, quick=args.quick)
    if "links" in groups:
        rows += links.run(args.dir, quick=args.quick)
    if rows:
        print_table("strata engine, server and bucket benchmarks (baselines from the same run)",
                    rows)
    mount_rows = mount.run(args.dir, quick=args.quick) if "mount" in groups else []
    if mount_rows:
        print_table("strata mount benchmarks (the same work on the local disk in the same run)",
                    mount_rows)
    step_rows = steps.run(args.dir, quick=args.quick) if "steps" in groups else []
    if step_rows:
        print_table("strata step benchmarks (the same command without strata in the same run)",
                    step_rows)
    sandbox_rows = sandbox.run(args.dir, quick=args.quick) if "sandbox" in groups else []
    if sandbox_rows:
        print_table("strata sandbox cost per step (the previous sandbox design in the same run)",
                    sandbox_rows)
    step_rows += sandbox_rows
    boot_rows = boot.run(args.dir, quick=args.quick) if "boot" in groups else []
    if boot_rows:
        print_table("strata image boot: a cold `strata run --image` to python3's first output "
                    "(baselines from the same run)", boot_rows)
    step_rows += boot_rows
    speed_rows = speed.run(args.dir, quick=args.quick) if "speed" in groups else []
    if speed_rows:
        print_table("strata speed: the same work without strata in the same run",
                    speed_rows)
    ws_rows = workspace.run(args.dir, quick=args.quick) if "workspace" in groups else []
    if ws_rows:
        print_table("strata workspaces: baselines from the same run", ws_rows)
    speed_rows += ws_rows
    dedup_rows = dedup.run(args.dir, quick=args.quick) if "dedup" in groups else []
    if dedup_rows:
        print_table("strata image dedup: ten versions of a root tree, baselines from the same "
                    "run", dedup_rows, baseline="baseline",
                    caption="ratio = strata's bytes / the baseline's (below 1 is smaller); "
                    "throughput: baseline rate / strata's")
    speed_rows += dedup_rows
    image_rows = image.run(args.dir, quick=args.quick) if "image" in groups else []
    if image_rows:
        print_table("strata images: import beside `umoci unpack` of the same image, same run",
                    image_rows, baseline="umoci unpack",
                    caption="ratio = strata's time / umoci's (throughput: umoci's rate / "
                    "strata's): 1.0 is parity")
    speed_rows += image_rows
    scale_rows = scale.run(args.dir, quick=args.quick, large=args.large) \
        if "scale" in groups else []
    if scale_rows:
        print_table("strata at scale: each cost beside the same cost on a store a tenth the "
                    "size, measured in the same run", scale_rows, baseline="baseline",
                    caption="ratio = the figure / its baseline (a smaller store, or the "
                    "change's own bytes, as the row says); moto on loopback shares the 2 cores")
    speed_rows += scale_rows
    day_rows: list[dict[str, object]] = []
    if "day" in groups:
        days = day.run(args.dir, quick=args.quick)
        day.print_day(days, day.Config.from_env(args.dir, quick=args.quick))
        day_rows = day.to_rows(days)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows + mount_rows + step_rows + speed_rows + day_rows, f, indent=2)
    print(f"results written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
