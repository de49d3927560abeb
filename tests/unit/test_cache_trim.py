"""The content cache stays bounded when only steps use it (cache.trim_if_due).

A step's mount does not measure the cache (walking it would cost more than
the step); the runner calls `trim_if_due` after each step, which measures and
evicts at most once per interval. Real files in a real directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from strata.engine.objects import BLOCK, object_id
from strata.mount.cache import ContentCache, trim_if_due


def _fill(cache: ContentCache, n: int, size: int) -> None:
    for i in range(n):
        data = i.to_bytes(4, "big") * (size // 4)
        cache.keep(object_id(BLOCK, data), data)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_trim_if_due_measures_once_per_interval_and_evicts_past_the_limit(
        tmp_path: Path) -> None:
    path = tmp_path / "objects"
    cache = ContentCache(str(path), limit=1 << 30, measure=False)  # as a step's mount
    _fill(cache, 40, 64 * 1024)
    assert _size(path) == 40 * 64 * 1024
    assert trim_if_due(str(path), every=600, limit=1 << 20)  # 2.5 MiB held, 1 MiB allowed
    assert _size(path) <= int(0.9 * (1 << 20))
    assert os.path.exists(str(path) + ".measured")
    _fill(cache, 40, 64 * 1024)
    assert not trim_if_due(str(path), every=600, limit=1 << 20)  # measured a moment ago
    assert _size(path) > 1 << 20
    assert trim_if_due(str(path), every=0, limit=1 << 20)
    assert _size(path) <= int(0.9 * (1 << 20))
