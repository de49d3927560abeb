"""Import and export between a local directory and a snapshot (strata.fsio).

Also holds the regression test for the change-set validation that made large
imports quadratic (engine/changes.py `parse_changes`).
"""

from __future__ import annotations

import pytest

from strata.engine.changes import parse_changes
from strata.engine.errors import InvalidInput
from strata.engine.objects import K_DIR, K_FILE, Entry

FILE = Entry(kind=K_FILE, size=1, data=b"x")
DIR = Entry(kind=K_DIR)


def test_parse_changes_refuses_changes_below_a_deleted_or_replaced_path() -> None:
    with pytest.raises(InvalidInput, match="deletes 'a'"):
        parse_changes({"a": None, "a/b": FILE})
    # Not adjacent in the sorted order: 'a/b' < 'a/b/c' with 'a/a' between.
    with pytest.raises(InvalidInput, match="deletes 'a/b'"):
        parse_changes({"a": DIR, "a/a": FILE, "a/b": FILE, "a/b/c/d": FILE})
    with pytest.raises(InvalidInput):
        parse_changes({"x": None, "x/y": DIR, "x/y/z": FILE})


def test_parse_changes_accepts_siblings_that_share_a_prefix() -> None:
    # 'a-b' and 'a.b' sort between 'a' and 'a/…' as strings but not as components.
    out = parse_changes({"a": None, "a-b": FILE, "a.b/c": FILE, "a.b": DIR, "b": FILE})
    assert [p for p, _ in out] == [("a",), ("a-b",), ("a.b",), ("a.b", "c"), ("b",)]


def test_parse_changes_handles_an_import_sized_change_set() -> None:
    # 20k files: the old check compared every path with every earlier file (O(n^2)).
    changes: dict[str, Entry | None] = {}
    for d in range(20):
        changes[f"d{d}"] = DIR
        for f in range(1000):
            changes[f"d{d}/f{f}"] = FILE
    assert len(parse_changes(changes)) == 20020
