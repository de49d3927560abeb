"""`strata image import`: an image source into a volume's branch, as one publish.

The layers are applied in order to an `ImageTree` in memory; only once every
layer applied and every digest held is anything published, so a refused
image leaves no volume, branch or snapshot behind (its blocks, uploaded as
they streamed by, are garbage that collection takes). The new snapshot's
parent is the tag's previous version, so `image log` shows the versions and
unchanged files share their blocks. The runtime config is kept in the
snapshot's meta under ``image`` (docs/format.md, "Image meta").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from strata.engine.errors import StrataError
from strata.engine.interface import ChangeSet, Store
from strata.engine.objects import K_DIR, Entry
from strata.engine.tree import NodeCache, Trees, decode_name
from strata.engine.txn import ContentWriter
from strata.image.layers import Budget, CountingReader, ImageTree, LayerRefused, Limits
from strata.image.meta import image_meta
from strata.image.sources import ImageSource, Verified, decompressed, open_source

log = logging.getLogger(__name__)

# The parts of an OCI config's "config" object kept with the image (what a run uses,
# and what an export writes back).
RUNTIME_KEYS = ("User", "Env", "Entrypoint", "Cmd", "WorkingDir", "Labels", "StopSignal",
                "ExposedPorts", "Volumes")
Progress = Callable[[str], None]


def runtime_config(config: dict[str, Any]) -> dict[str, Any]:
    """The runtime part of an OCI image config, checked for the types a run relies on."""
    inner = config.get("config") or config.get("container_config") or {}
    if not isinstance(inner, dict):
        raise LayerRefused("refusing the image: its config's 'config' is not an object")
    out = {k: inner[k] for k in RUNTIME_KEYS if inner.get(k) is not None}
    for key in ("Env", "Entrypoint", "Cmd"):
        v = out.get(key)
        if v is not None and (not isinstance(v, list) or not all(isinstance(s, str) for s in v)):
            raise LayerRefused(f"refusing the image: config {key} is not a list of strings")
    for key in ("WorkingDir", "User", "StopSignal"):
        if key in out and not isinstance(out[key], str):
            raise LayerRefused(f"refusing the image: config {key} is not a string")
    return out


def import_image(store: Store, src: str, volume: str, branch: str, *, ref: str = "",
                 tag: str | None = None, limits: Limits | None = None, message: str = "",
                 progress: Progress | None = None) -> str:
    """Import the image at `src` into `volume@branch`; return the new snapshot id.

    `src` is an OCI layout directory, an oci-archive or docker-archive
    tarball, or a plain root directory (one without ``oci-layout``). `tag`
    picks one image out of a source holding several.
    """
    if os.path.isdir(src) and not os.path.exists(os.path.join(src, "oci-layout")):
        return _import_root_dir(store, src, volume, branch, ref=ref, message=message)
    source = open_source(src, tag)
    try:
        return _import_source(store, source, volume, branch, ref=ref,
                              limits=limits or Limits(), message=message, progress=progress)
    finally:
        source.close()


def _import_root_dir(store: Store, src: str, volume: str, branch: str, *, ref: str,
                     message: str) -> str:
    from strata.fsio import import_dir
    base, created = _target(store, volume, branch)
    try:
        return import_dir(store, volume, branch, src, base=base,
                          message=message or f"import root directory {os.path.abspath(src)}",
                          snapshot_meta=image_meta("dir", ref, {}))
    except BaseException:
        _undo(store, volume, branch, created)
        raise


def _import_source(store: Store, source: ImageSource, volume: str, branch: str, *, ref: str,
                   limits: Limits, message: str, progress: Progress | None) -> str:
    runtime = runtime_config(source.config)
    cw = ContentWriter(store)
    tree = ImageTree(cw)
    budget = Budget(limits, sum(layer.size for layer in source.layers))
    for i, layer in enumerate(source.layers):
        if progress is not None:
            progress(f"layer {i + 1}/{len(source.layers)}")
        with layer.open() as raw:
            blob = Verified(raw, layer.digest, layer.size, layer.label)
            stream = CountingReader(decompressed(blob), budget, layer.label)
            tree.apply(stream, budget, layer.label)  # type: ignore[arg-type]
            stream.drain()
            blob.check()
        if layer.diff_id is not None and stream.sha.hexdigest() != layer.diff_id:
            raise LayerRefused(f"refusing {layer.label}: its tar hashes to sha256:"
                               f"{stream.sha.hexdigest()}, the config says sha256:"
                               f"{layer.diff_id}")
    root, top = tree.top_entries()
    cw.flush()
    arch = source.config.get("architecture")
    os_name = source.config.get("os")
    meta = image_meta(source.kind, ref, runtime, digest=f"sha256:{source.config_digest}",
                      os_name=os_name if isinstance(os_name, str) else "linux",
                      arch=arch if isinstance(arch, str) else "")
    base, created = _target(store, volume, branch)
    try:
        changes = _changes(store, base, root, top)
        (sid,) = store.publish([ChangeSet(
            volume, branch, base, changes,
            message or f"import {source.kind} image {ref or volume}", meta)])
    except BaseException:
        _undo(store, volume, branch, created)
        raise
    return sid


def _changes(store: Store, base: str, root: Entry, top: dict[str, Entry]
             ) -> dict[str, Entry | None]:
    """The change set that makes `base`'s tree the image's: whole subtrees at the top."""
    base_root = store.snapshot(base).root
    trees = Trees(store, NodeCache(256))
    old: dict[str, Entry] = {}
    if base_root.kind == K_DIR and base_root.ref is not None:
        old = {decode_name(n): e for n, e in trees.iter_dir(base_root.ref)}
    changes: dict[str, Entry | None] = {name: None for name in old.keys() - top.keys()}
    for name, e in top.items():
        if old.get(name) != e:
            changes[name] = e
    changes[""] = root.with_(ref=None)
    return changes


def _target(store: Store, volume: str, branch: str) -> tuple[str, str]:
    """The base to publish on: the branch's head, creating the volume or branch if needed.

    Returns (base, what was created: "volume", "branch" or "").
    """
    if volume not in store.list_volumes():
        store.create_volume(volume)
        created = "volume"
        if branch != "live":
            store.fork(volume, branch, at=None)
            store.delete_branch(volume, "live")
    else:
        created = ""
        if branch not in store.list_branches(volume):
            store.fork(volume, branch, at=None)
            created = "branch"
    return store.head(volume, branch), created


def _undo(store: Store, volume: str, branch: str, created: str) -> None:
    """A publish that failed leaves nothing this import made."""
    try:
        if created == "volume":
            store.delete_volume(volume)
        elif created == "branch":
            store.delete_branch(volume, branch)
    except StrataError:
        log.warning("could not remove %s@%s after a failed import", volume, branch,
                    exc_info=True)
