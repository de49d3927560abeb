"""Reading image sources: indexes that name indexes, several images, names, xattr spellings."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
from imagekit import (
    differences,
    tar_bytes,
    tree_of_dir,
    tree_of_snapshot,
    umoci_unpack,
    write_layout,
)

from strata.engine.errors import InvalidInput, NotFound
from strata.engine.local import LocalStore
from strata.image.importer import import_image
from strata.image.refs import parse_image_ref
from strata.run.imagecfg import image_process
from strata.run.spec import parse_image


def _wrap_in_platform_index(layout: Path) -> None:
    """index.json -> an index of two platforms, only amd64's being this image."""
    index = json.loads((layout / "index.json").read_text())
    mine = index["manifests"][0]
    other = dict(mine, platform={"architecture": "arm64", "os": "linux"})
    mine = dict(mine, platform={"architecture": "amd64", "os": "linux"})
    mine.pop("annotations")
    other.pop("annotations")
    inner = json.dumps({"schemaVersion": 2,
                        "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": [other, mine]}).encode()
    digest = hashlib.sha256(inner).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(inner)
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.index.v1+json",
         "digest": f"sha256:{digest}", "size": len(inner),
         "annotations": {"org.opencontainers.image.ref.name": "multi"}}]}))


def test_an_index_of_platforms_is_followed_to_this_machines(store: LocalStore,
                                                            tmp_path: Path) -> None:
    import os
    if os.uname().machine != "x86_64":
        pytest.skip("the fixture names amd64")
    layout = write_layout(tmp_path / "l", [tar_bytes(("hello", {"data": b"hi"}))])
    _wrap_in_platform_index(layout)
    sid = import_image(store, str(layout), "img", "t")
    assert "hello" in tree_of_snapshot(store, sid)


def test_a_layout_of_several_images_needs_one_named(store: LocalStore, tmp_path: Path) -> None:
    layout = write_layout(tmp_path / "l", [tar_bytes(("a", {"data": b"a"}))], tag="one")
    index = json.loads((layout / "index.json").read_text())
    second = dict(index["manifests"][0],
                  annotations={"org.opencontainers.image.ref.name": "two"})
    index["manifests"].append(second)
    (layout / "index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidInput, match="holds 2 images .*--source-ref"):
        import_image(store, str(layout), "img", "t")
    with pytest.raises(NotFound, match="no image named 'three'"):
        import_image(store, str(layout), "img", "t", tag="three")
    import_image(store, str(layout), "img", "t", tag="two")
    assert store.list_volumes() == ["img"]


def test_libarchive_xattrs_are_read_too(store: LocalStore, tmp_path: Path) -> None:
    value = b"\x01\x00\xff binary"
    layer = tar_bytes(("f", {"data": b"x", "pax": {
        "LIBARCHIVE.xattr.user.bin": base64.b64encode(value).decode().rstrip("=")}}))
    sid = import_image(store, str(write_layout(tmp_path / "l", [layer])), "img", "t")
    assert tree_of_snapshot(store, sid)["f"][6] == ((b"user.bin", value),)


@pytest.mark.parametrize(("text", "volume", "branch"), [
    ("debian", "debian", "latest"),
    ("debian:bookworm", "debian", "bookworm"),
    ("ghcr.io/org/app:1.2", "ghcr.io_org_app", "1.2"),
    ("localhost:5000/app", "localhost:5000_app", "latest"),
    ("app@v1", "app", "v1"),
])
def test_image_names_map_onto_volumes_and_branches(text: str, volume: str, branch: str
                                                   ) -> None:
    if ":" in volume:
        with pytest.raises(InvalidInput, match="not a volume name"):
            parse_image_ref(text)
        return
    ref = parse_image_ref(text)
    assert (ref.volume, ref.branch, ref.given) == (volume, branch, text)


@pytest.mark.parametrize("text", ["", "app:_bad", "app@sha256:" + "0" * 64, "a b:c"])
def test_bad_image_names_are_refused(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse_image_ref(text)


def test_run_takes_image_names_too() -> None:
    assert (parse_image("debian:bookworm").volume, parse_image("debian:bookworm").branch) == (
        "debian", "bookworm")
    assert parse_image("debian").branch == "live"  # the runner falls back to 'latest'
    assert parse_image("debian@x").branch == "x"


def test_an_images_config_makes_the_process_as_docker_run_does() -> None:
    cfg = {"Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo hi"], "Env": ["A=1", "PATH=/x"],
           "WorkingDir": "work", "User": "1000:100"}
    p = image_process(cfg, [])
    assert p.argv == ["/bin/sh", "-c", "echo hi"] and p.env == {"A": "1", "PATH": "/x"}
    assert (p.cwd, p.uid, p.gid) == ("/work", 1000, 100)
    assert image_process(cfg, ["echo other"]).argv == ["/bin/sh", "-c", "echo other"]
    assert image_process({"Cmd": ["true"]}, ["ls"]).argv == ["ls"]
    assert image_process({"User": "root"}, ["x"]).uid == 0
    assert image_process(cfg, [], entrypoint="/bin/env").argv == ["/bin/env"]
    assert image_process(cfg, ["ls", "/"], entrypoint="").argv == ["ls", "/"]
    with pytest.raises(InvalidInput, match="names none"):
        image_process({}, [])
    with pytest.raises(InvalidInput, match="numeric"):
        image_process({"User": "nginx"}, ["x"])


@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_a_sparse_member_within_the_budget_imports_whole(store: LocalStore, tmp_path: Path,
                                                         fmt: str) -> None:
    import subprocess
    work = tmp_path / "w"
    work.mkdir()
    with open(work / "sparse", "wb") as f:
        f.seek(3 << 20)
        f.write(b"data in the middle")
        f.seek(8 << 20)
        f.write(b"end")
    subprocess.run(["tar", "--sparse", f"--format={fmt}", "-C", str(work), "-cf",
                    str(tmp_path / "s.tar"), "sparse"], check=True)
    layout = write_layout(tmp_path / "l", [(tmp_path / "s.tar").read_bytes()])
    sid = import_image(store, str(layout), "img", "t")
    want = hashlib.sha256((work / "sparse").read_bytes()).hexdigest()
    assert tree_of_snapshot(store, sid)["sparse"][5][0] == want


def test_whiteouts_and_opaque_directories_act_on_the_layers_below_only(
        store: LocalStore, tmp_path: Path) -> None:
    dir_ = {"type": b"5", "mode": 0o755}
    one = tar_bytes(("d/", dir_), ("d/a", {"data": b"a1"}), ("d/b", {"data": b"b1"}),
                    ("o/", dir_), ("o/old", {"data": b"old"}))
    two = tar_bytes(("o/new", {"data": b"new"}), ("o/.wh..wh..opq", {}),  # marker after
                    ("d/x", {"data": b"x"}), ("d/.wh.x", {}),              # this layer's own
                    ("d/.wh.a", {}), ("d/a", {"data": b"a2"}),             # hide, then re-add
                    ("d/.wh.missing", {}))                                 # nothing to hide
    layout = write_layout(tmp_path / "l", [one, two])
    tree = tree_of_snapshot(store, import_image(store, str(layout), "img", "t"))
    assert sorted(tree) == ["d", "d/a", "d/b", "d/x", "o", "o/new"]
    assert tree["d/a"][5][0] == hashlib.sha256(b"a2").hexdigest()
    # umoci reads the same layers the same way.
    rootfs = umoci_unpack(layout, "t", tmp_path / "bundle")
    assert differences(tree, tree_of_dir(rootfs)) == []
