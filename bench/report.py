"""Printing benchmark rows as a table: strata figure, local-disk baseline, ratio."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def row(name: str, value: float, unit: str, baseline: float | None = None,
        baseline_what: str = "", target: str = "", *, lower_is_better: bool = True,
        met: bool | None = None) -> dict[str, Any]:
    """One result; `ratio` is strata / baseline (for times) or baseline / strata (rates)."""
    ratio = None
    if baseline:
        ratio = value / baseline if lower_is_better else baseline / value if value else None
    return {"name": name, "value": value, "unit": unit, "baseline": baseline,
            "baseline_what": baseline_what, "ratio": ratio, "target": target, "met": met}


def print_table(title: str, rows: list[dict[str, Any]], *, baseline: str = "local disk",
                caption: str = "ratio = strata's cost / the local disk's cost "
                "(time over time, or rate over rate inverted): 1.0 is parity") -> None:
    table = Table(title=title, caption=caption)
    for col in ("benchmark", "strata", baseline, "ratio", "target", "met"):
        table.add_column(col, justify="left" if col in ("benchmark", "target") else "right",
                         overflow="fold")
    for r in rows:
        base = "" if r["baseline"] is None else f"{_fmt(r['baseline'])} {r['unit']}"
        if r["baseline_what"]:
            base += f" ({r['baseline_what']})"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        table.add_row(r["name"], f"{_fmt(r['value'])} {r['unit']}", base, ratio, r["target"],
                      met)
    Console(width=180).print(table)


def _fmt(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def print_grid(title: str, columns: tuple[str, ...] | list[str], rows: list[list[str]],
               caption: str = "") -> None:
    """A table of any shape: one row per subject (e.g. a rung), one column per figure."""
    table = Table(title=title, caption=caption or None, show_lines=True)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", overflow="fold")
    for r in rows:
        table.add_row(*r)
    Console(width=200).print(table)
