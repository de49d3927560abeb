"""`strata image import` against real images, compared with `umoci unpack` of the same image.

The images are built by umoci and copied by skopeo (tests/image/imagekit.py):
two layers, the second with a whiteout, an opaque directory and a hard link
to a file of the first; owners, a setuid bit, an xattr, nanosecond mtimes, a
device node, a fifo and a name that is not UTF-8. Each form (OCI layout,
oci-archive, docker-archive) must import to exactly the tree umoci unpacks,
metadata included; an export must unpack to it again.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from imagekit import TAG, Images, differences, tree_of_dir, tree_of_snapshot, umoci_unpack

from strata.engine.local import LocalStore
from strata.engine.objects import K_DIR, Entry
from strata.engine.tree import Trees, decode_name
from strata.fsio import export_snapshot
from strata.image.export import export_oci
from strata.image.importer import import_image
from strata.image.meta import find_meta, runtime_of

KINDS = ("oci", "oci-archive", "docker-archive")


def _top(store: LocalStore, sid: str) -> dict[str, Entry]:
    ref = store.snapshot(sid).root.ref
    assert ref is not None
    return {decode_name(n): e for n, e in Trees(store).iter_dir(ref)}


def _root_attrs(path: Path) -> tuple[int, int, int]:
    s = os.lstat(path)
    return (s.st_mode & 0o7777, s.st_uid, s.st_gid)


@pytest.mark.parametrize("kind", KINDS)
def test_each_form_imports_to_the_tree_umoci_unpacks(images: Images, store: LocalStore,
                                                      kind: str) -> None:
    sid = import_image(store, str(images.source(kind)), "img", TAG, ref=f"img:{TAG}",
                       tag=TAG if kind == "oci" else None)
    ours = tree_of_snapshot(store, sid)
    theirs = tree_of_dir(images.rootfs)
    assert differences(ours, theirs) == []
    root = store.snapshot(sid).root
    assert (root.mode, root.uid, root.gid) == _root_attrs(images.rootfs)
    # What the image is made to test is really there.
    assert "data/gone.txt" not in ours                         # whiteout
    assert sorted(p for p in ours if p.startswith("opq/")) == ["opq/new1"]  # opaque dir
    assert ours["data/link2"][5][1] == ours["data/linked.txt"][5][1] != ""  # one link group
    assert ours["dev/null"][5] == os.makedev(1, 3)
    assert (b"user.strata", b"image-test") in ours["etc/xattr.txt"][6]
    assert ours["data/ns"][4] % 10**9 == 123456789
    assert ours["data/setuid"][1] == 0o4755 and ours["data/owned"][2:4] == (1000, 1000)
    assert any(not p.isascii() for p in ours)


def test_the_config_is_kept_with_the_image(images: Images, store: LocalStore) -> None:
    sid = import_image(store, str(images.layout), "img", TAG, ref="img:t", tag=TAG)
    meta = find_meta(store, sid)
    assert meta is not None and meta["source"] == "oci" and meta["ref"] == "img:t"
    config = runtime_of(meta)
    assert config["Entrypoint"] == ["/bin/sh", "-c"]
    assert config["WorkingDir"] == "/data"
    assert "GREETING=the image" in config["Env"]
    assert meta["config_digest"].startswith("sha256:")
    # The tag is a branch of the image's volume, and nothing else was made.
    assert store.list_volumes() == ["img"]
    assert set(store.list_branches("img")) == {TAG}


def test_a_new_version_of_a_tag_follows_the_old_one_and_shares_its_blocks(
        images: Images, store: LocalStore) -> None:
    first = import_image(store, str(images.layout), "img", "v", tag=TAG)
    second = import_image(store, str(images.layout), "img", "v", tag=f"{TAG}-2")
    assert store.snapshot(second).parent == first
    assert [i.id for i in store.log(second)][:2] == [second, first]
    a, b = tree_of_snapshot(store, first), tree_of_snapshot(store, second)
    assert differences(a, b) == [
        f"'data/added.txt': None != {b['data/added.txt']}",
        f"'data/keep.txt': {a['data/keep.txt']} != {b['data/keep.txt']}"]
    # The unchanged directories are the same objects: nothing stored twice.
    assert _top(store, first)["bin"] == _top(store, second)["bin"]


def test_importing_the_same_image_again_changes_nothing(images: Images,
                                                        store: LocalStore) -> None:
    first = import_image(store, str(images.layout), "img", TAG, tag=TAG)
    assert import_image(store, str(images.docker_archive), "img", TAG) == first


def test_a_plain_root_directory_imports_as_an_image(images: Images, store: LocalStore,
                                                    tmp_path: Path) -> None:
    sid = import_image(store, str(images.rootfs), "rootdir", "latest", ref="rootdir")
    assert differences(tree_of_snapshot(store, sid), tree_of_dir(images.rootfs)) == []
    meta = find_meta(store, sid)
    assert meta is not None and meta["source"] == "dir" and runtime_of(meta) == {}


def test_export_round_trips_through_umoci_and_skopeo(images: Images, store: LocalStore,
                                                     tmp_path: Path) -> None:
    sid = import_image(store, str(images.layout), "img", TAG, tag=TAG)
    out = tmp_path / "exported"
    digest = export_oci(store, sid, str(out), tag="again", meta=find_meta(store, sid))
    inspect = subprocess.run(["skopeo", "inspect", f"oci:{out}:again"], check=True,
                             capture_output=True, text=True)
    info = json.loads(inspect.stdout)
    assert info["Digest"] == digest
    assert "GREETING=the image" in info["Env"]
    rootfs = umoci_unpack(out, "again", tmp_path / "bundle")
    assert differences(tree_of_dir(rootfs), tree_of_dir(images.rootfs)) == []
    assert differences(tree_of_dir(rootfs), tree_of_snapshot(store, sid)) == []
    config = json.loads((tmp_path / "bundle" / "config.json").read_text())
    assert config["process"]["cwd"] == "/data"
    assert config["process"]["args"][:2] == ["/bin/sh", "-c"]
    # And strata reads its own export back to the same tree.
    again = import_image(store, str(out), "img", "again")
    assert store.snapshot(again).root.ref == store.snapshot(sid).root.ref


def test_an_exported_layer_is_the_same_bytes_each_time(images: Images, store: LocalStore,
                                                       tmp_path: Path) -> None:
    sid = import_image(store, str(images.layout), "img", TAG, tag=TAG)
    a = export_oci(store, sid, str(tmp_path / "a"), tag="x", meta=None)
    b = export_oci(store, sid, str(tmp_path / "b"), tag="x", meta=None)
    assert a == b


def test_a_snapshot_export_restores_what_umoci_unpacked(images: Images, store: LocalStore,
                                                        tmp_path: Path) -> None:
    """The imported image written out with `strata export --privileged`: the same tree."""
    sid = import_image(store, str(images.oci_archive), "img", TAG)
    export_snapshot(store, sid, str(tmp_path / "out"), privileged=True)
    assert differences(tree_of_dir(tmp_path / "out"), tree_of_dir(images.rootfs)) == []
    assert store.snapshot(sid).root.kind == K_DIR
