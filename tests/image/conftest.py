"""Fixtures for the image tests: one set of real images per session, a fresh store per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from imagekit import TAG, Images, build_layout, skopeo_copy, umoci_unpack

from strata.engine.local import LocalStore, init_store


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    root = tmp_path_factory.mktemp("images")
    layout = build_layout(root, TAG)
    skopeo_copy(layout, TAG, f"oci-archive:{root / 'oci.tar'}:{TAG}")
    skopeo_copy(layout, TAG, f"docker-archive:{root / 'docker.tar'}:img:{TAG}")
    rootfs = umoci_unpack(layout, TAG, root / "bundle")
    return Images(layout, root / "oci.tar", root / "docker.tar", rootfs)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    init_store(str(tmp_path / "store"))
    with LocalStore(str(tmp_path / "store")) as s:
        yield s
