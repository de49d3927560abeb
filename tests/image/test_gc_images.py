"""Images and garbage collection: what tags reach stays, what a refused import left goes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from imagekit import (
    TAG,
    Images,
    differences,
    tar_bytes,
    tree_of_dir,
    tree_of_snapshot,
    write_layout,
)

from strata.engine import gc as gcmod
from strata.engine.errors import InvalidInput
from strata.engine.local import LocalStore
from strata.image.importer import import_image

MiB = 1 << 20


def test_gc_keeps_every_tag_and_frees_a_removed_one(images: Images, store: LocalStore,
                                                    tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gcmod, "UPLOAD_PIN", 0.0)
    import_image(store, str(images.layout), "img", "a", tag=TAG)
    import_image(store, str(images.layout), "img", "b", tag=f"{TAG}-2")
    big = write_layout(tmp_path / "big", [tar_bytes(("blob", {"data": os.urandom(6 * MiB)}))])
    import_image(store, str(big), "other", "x")
    store.gc(min_age=0)
    store.gc(min_age=0)
    a = tree_of_snapshot(store, store.head("img", "a"))
    assert differences(a, tree_of_dir(images.rootfs)) == []
    assert "data/added.txt" in tree_of_snapshot(store, store.head("img", "b"))
    store.delete_volume("other")  # `strata image rm other:x`, its last tag
    first = store.gc(min_age=0)
    assert first["bytes_freed"] >= 6 * MiB
    assert store.fsck()["ok"]


def test_gc_takes_what_a_refused_import_uploaded(store: LocalStore, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gcmod, "UPLOAD_PIN", 0.0)
    # 12 MiB of content streams to the store (past the writer's 8 MiB batch) before
    # the wrong diff id is found at the end of the layer.
    layer = tar_bytes(("blob", {"data": os.urandom(12 * MiB)}))
    bad = write_layout(tmp_path / "bad", [layer], diff_ids=["sha256:" + "0" * 64])
    with pytest.raises(InvalidInput, match="hashes to"):
        import_image(store, str(bad), "img", "t")
    assert store.list_volumes() == []
    report = store.gc(min_age=0)
    assert report["bytes_freed"] >= 8 * MiB
