"""Durable workspaces: a block device kept in a volume (see docs/workspaces.md).

Only what every `strata ls` needs lives here (is this snapshot a workspace?),
so that the check costs no imports beyond the engine's tree code.
"""

from __future__ import annotations

from typing import Any

LAYOUT_PATH = "workspace.json"   # at a workspace volume's root: its layout


def is_workspace(store: Any, sid: str) -> bool:
    """True if snapshot `sid` holds a workspace (its layout file at the root)."""
    from strata.engine.tree import Trees
    return Trees(store).resolve(store.snapshot(sid).root, [LAYOUT_PATH]) is not None
