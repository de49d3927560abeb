"""The image meta a snapshot carries (docs/format.md, "Image meta"), and reading it back.

Imported by the runner for every `--image` step, so it imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

from strata.engine.errors import InvalidInput, NotFound
from strata.engine.interface import Store

META_KEY = "image"
META_VERSION = 1


def image_meta(source: str, ref: str, runtime: dict[str, Any], *, digest: str = "",
               os_name: str = "linux", arch: str = "") -> dict[str, Any]:
    """The snapshot meta of an imported image."""
    return {META_KEY: {"v": META_VERSION, "source": source, "ref": ref, "config": runtime,
                       "config_digest": digest, "os": os_name, "architecture": arch}}


def find_meta(store: Store, sid: str, depth: int = 64) -> dict[str, Any] | None:
    """The image meta of snapshot `sid`, or of its nearest ancestor that has one.

    A later publish to an image's branch (a `strata put`) carries no meta of
    its own; the image it changed still has the config its import recorded.
    """
    for info in store.log(sid, depth):
        meta = info.meta.get(META_KEY)
        if isinstance(meta, dict) and meta.get("v") == META_VERSION:  # a newer one: unknown
            return meta
    return None


def runtime_of(meta: dict[str, Any] | None) -> dict[str, Any]:
    """The runtime config (Env, Entrypoint, Cmd, WorkingDir, User) of an image meta."""
    if meta is None:
        return {}
    config = meta.get("config")
    return config if isinstance(config, dict) else {}


def image_branches(store: Store, volume: str) -> dict[str, str]:
    """The volume's tags (branches) and heads, refusing a volume that holds no image."""
    branches = store.list_branches(volume)
    for head in branches.values():
        if find_meta(store, head, 8) is not None:
            return branches
    if not branches:
        raise NotFound(f"no image {volume!r}")
    raise InvalidInput(f"{volume!r} is a volume, not an image")
