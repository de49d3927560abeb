"""Hostile layers are refused, with a clear error, and the import publishes nothing.

A layer tarball is untrusted input. Each case here is a layer (or an image
around it) that must be refused: a path that climbs out with ``..``, links
that escape, a whiteout of ``..``, a 10 GB sparse member, a gzip bomb, too
many entries, a path twice in one layer, a digest that does not match, an
oversized header. After each, the store holds no new volume, branch or
snapshot: a first import leaves no image, a new version leaves the tag where
it was.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
from imagekit import PLAIN, ZSTD, tar_bytes, tree_of_snapshot, write_layout

from strata.engine.errors import InvalidInput
from strata.engine.local import LocalStore
from strata.image.importer import import_image
from strata.image.layers import Limits

DIR: dict[str, Any] = {"type": tarfile.DIRTYPE, "mode": 0o755}
OK = tar_bytes(("etc/", DIR), ("etc/ok", {"data": b"fine\n"}))


def _refused(store: LocalStore, layout: Path, match: str, limits: Limits | None = None
             ) -> None:
    """The import fails naming the problem; neither a fresh image nor a tag of one moves."""
    with pytest.raises(InvalidInput, match=match):
        import_image(store, str(layout), "fresh", "t", limits=limits)
    assert "fresh" not in store.list_volumes()
    before = store.list_branches("kept")
    with pytest.raises(InvalidInput, match=match):
        import_image(store, str(layout), "kept", "t", limits=limits)
    with pytest.raises(InvalidInput, match=match):
        import_image(store, str(layout), "kept", "other", limits=limits)
    assert store.list_branches("kept") == before


@pytest.fixture
def kept(store: LocalStore, tmp_path: Path) -> LocalStore:
    """An image `kept:t` already in the store, which a refused import must leave alone."""
    import_image(store, str(write_layout(tmp_path / "kept", [OK])), "kept", "t")
    return store


def _layout(tmp_path: Path, *tars: bytes, **kw: Any) -> Path:
    return write_layout(tmp_path / "hostile", [OK, *tars], **kw)


@pytest.mark.parametrize("name", ["../evil", "etc/../../evil", "./../evil", "/../evil",
                                  "a/b/../../../evil"])
def test_a_path_that_climbs_out_is_refused(kept: LocalStore, tmp_path: Path, name: str
                                           ) -> None:
    _refused(kept, _layout(tmp_path, tar_bytes((name, {"data": b"x"}))), "contains '..'")


def test_leading_slash_and_dot_slash_are_read_from_the_image_root(store: LocalStore,
                                                                  tmp_path: Path) -> None:
    layer = tar_bytes(("/abs", {"data": b"a"}), ("./dot", {"data": b"d"}),
                      ("//etc///x", {"data": b"x"}))
    sid = import_image(store, str(_layout(tmp_path, layer)), "img", "t")
    assert {"abs", "dot", "etc/x", "etc/ok"} <= set(tree_of_snapshot(store, sid))


@pytest.mark.parametrize("member", [
    ("up", {"type": tarfile.SYMTYPE, "linkname": ".."}),
    ("etc/up", {"type": tarfile.SYMTYPE, "linkname": "../../../etc/shadow"}),
    ("etc/abs", {"type": tarfile.SYMTYPE, "linkname": "/../etc/shadow"}),
    ("etc/hard", {"type": tarfile.LNKTYPE, "linkname": "../etc/passwd"}),
    ("etc/hard", {"type": tarfile.LNKTYPE, "linkname": "etc/missing"}),
])
def test_links_that_escape_are_refused(kept: LocalStore, tmp_path: Path,
                                       member: tuple[str, dict[str, Any]]) -> None:
    _refused(kept, _layout(tmp_path, tar_bytes(member)),
             "climbs out|contains '..'|does not hold")


def test_a_parent_through_a_symlink_that_climbs_out_is_refused(kept: LocalStore,
                                                               tmp_path: Path) -> None:
    layer = tar_bytes(("d/", DIR), ("d/e/", DIR),
                      ("d/e/up", {"type": tarfile.SYMTYPE, "linkname": "../.."}),
                      ("d/e/up/x", {"type": tarfile.SYMTYPE, "linkname": ".."}),
                      ("d/e/up/x/evil", {"data": b"x"}))
    _refused(kept, _layout(tmp_path, layer), "climbs out")


def test_a_symlink_placed_through_a_symlink_is_judged_where_it_really_sits(
        kept: LocalStore, tmp_path: Path) -> None:
    """`d/e/up/x -> ..` reads as two levels down, but `d/e/up` is the root itself."""
    layer = tar_bytes(("d/", DIR), ("d/e/", DIR),
                      ("d/e/up", {"type": tarfile.SYMTYPE, "linkname": "../.."}),
                      ("d/e/up/x", {"type": tarfile.SYMTYPE, "linkname": ".."}))
    _refused(kept, _layout(tmp_path, layer), "climbs out")


def test_a_parent_through_a_symlink_inside_the_image_is_followed(store: LocalStore,
                                                                 tmp_path: Path) -> None:
    layer = tar_bytes(("usr/", DIR), ("usr/lib/", DIR),
                      ("lib", {"type": tarfile.SYMTYPE, "linkname": "usr/lib"}),
                      ("lib/x.so", {"data": b"so"}),
                      ("abs", {"type": tarfile.SYMTYPE, "linkname": "/etc"}),
                      ("abs/y", {"data": b"y"}))
    tree = tree_of_snapshot(store, import_image(store, str(_layout(tmp_path, layer)), "i", "t"))
    assert "usr/lib/x.so" in tree and "etc/y" in tree and "lib/x.so" not in tree


@pytest.mark.parametrize("name", ["etc/.wh...", "etc/.wh..", ".wh.."])
def test_a_whiteout_of_dot_dot_is_refused(kept: LocalStore, tmp_path: Path, name: str) -> None:
    _refused(kept, _layout(tmp_path, tar_bytes((name, {}))), "whiteout of")


def test_a_path_twice_in_one_layer_is_refused(kept: LocalStore, tmp_path: Path) -> None:
    layer = tar_bytes(("etc/x", {"data": b"1"}), ("./etc/x", {"data": b"2"}))
    _refused(kept, _layout(tmp_path, layer), "appears twice")


def test_a_10_gb_sparse_member_is_refused_before_it_is_read(kept: LocalStore,
                                                            tmp_path: Path) -> None:
    """GNU tar's own sparse format: a few KiB on disk, 10 GB declared."""
    work = tmp_path / "sparse"
    work.mkdir()
    subprocess.run(["truncate", "-s", "10G", str(work / "bomb")], check=True)
    subprocess.run(["tar", "--sparse", "-C", str(work), "-cf", str(tmp_path / "b.tar"),
                    "bomb"], check=True)
    tar = (tmp_path / "b.tar").read_bytes()
    assert len(tar) < 1 << 20
    _refused(kept, _layout(tmp_path, tar), "declare more than")


def test_a_pax_sparse_member_is_refused_too(kept: LocalStore, tmp_path: Path) -> None:
    work = tmp_path / "sparse"
    work.mkdir()
    subprocess.run(["truncate", "-s", "10G", str(work / "bomb")], check=True)
    subprocess.run(["tar", "--sparse", "--format=posix", "-C", str(work), "-cf",
                    str(tmp_path / "b.tar"), "bomb"], check=True)
    _refused(kept, _layout(tmp_path, (tmp_path / "b.tar").read_bytes(), media=ZSTD),
             "declare more than")


def test_a_gzip_bomb_is_refused(kept: LocalStore, tmp_path: Path) -> None:
    """64 MiB of zeros compress to 64 KiB; with a 16 MiB budget the layer must stop early."""
    zeros = tar_bytes(("zeros", {"data": bytes(64 << 20)}))
    limits = Limits(max_bytes=16 << 20, floor_bytes=16 << 20)
    _refused(kept, _layout(tmp_path, zeros), "declare more than|decompress to more",
             limits=limits)


def test_padding_after_the_end_marker_counts_too(kept: LocalStore, tmp_path: Path) -> None:
    """A tar whose end is followed by gigabytes of zeros (still read for the diff id)."""
    tar = OK + bytes(32 << 20)
    limits = Limits(max_bytes=8 << 20, floor_bytes=8 << 20)
    _refused(kept, _layout(tmp_path, tar), "decompress to more", limits=limits)


def test_too_many_entries_are_refused(kept: LocalStore, tmp_path: Path) -> None:
    many = tar_bytes(*((f"f{i}", {"data": b""}) for i in range(200)))
    _refused(kept, _layout(tmp_path, many), "more than 100 entries",
             limits=Limits(max_entries=100))


def test_a_blob_that_does_not_match_its_digest_is_refused(kept: LocalStore,
                                                          tmp_path: Path) -> None:
    layout = _layout(tmp_path, tar_bytes(("etc/y", {"data": b"payload"})), media=PLAIN)
    victim = next(p for p in (layout / "blobs" / "sha256").iterdir()
                  if b"payload" in p.read_bytes())
    raw = bytearray(victim.read_bytes())
    raw[raw.index(b"payload")] = ord("P")  # same size, other bytes: a valid tar still
    victim.write_bytes(bytes(raw))
    _refused(kept, layout, "hash")


def test_a_diff_id_that_does_not_match_is_refused(kept: LocalStore, tmp_path: Path) -> None:
    layout = _layout(tmp_path, tar_bytes(("etc/y", {"data": b"y"})),
                     diff_ids=["sha256:" + "0" * 64] * 2)
    _refused(kept, layout, "hashes to")


def test_an_oversized_pax_header_is_refused(kept: LocalStore, tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("big-header")
        ti.pax_headers = {"comment": "x" * (2 << 20)}
        tf.addfile(ti, io.BytesIO(b""))
    _refused(kept, _layout(tmp_path, buf.getvalue()), "extended header")


def test_a_member_type_an_image_cannot_hold_is_refused(kept: LocalStore, tmp_path: Path
                                                       ) -> None:
    _refused(kept, _layout(tmp_path, tar_bytes(("odd", {"type": b"V"}))), "member type")


def test_garbage_is_refused_as_no_tar(kept: LocalStore, tmp_path: Path) -> None:
    _refused(kept, _layout(tmp_path, b"\x00garbage" * 100, media=PLAIN),
             "tar|malformed|ends early|header")


@pytest.mark.parametrize("head", [b"\x1f\x8b\x08\x00", b"\x28\xb5\x2f\xfd"])
def test_a_layer_that_does_not_decompress_is_refused(kept: LocalStore, tmp_path: Path,
                                                     head: bytes) -> None:
    _refused(kept, _layout(tmp_path, head + b"\x00 not really compressed" * 50, media=PLAIN),
             "does not decompress")


def test_zstd_layers_import(store: LocalStore, tmp_path: Path) -> None:
    sid = import_image(store, str(_layout(tmp_path, tar_bytes(("z", {"data": b"zstd"})),
                                          media=ZSTD)), "img", "t")
    assert "z" in tree_of_snapshot(store, sid)


def test_a_blob_name_from_the_input_cannot_point_elsewhere(kept: LocalStore, tmp_path: Path
                                                           ) -> None:
    import json
    layout = _layout(tmp_path)
    index = json.loads((layout / "index.json").read_text())
    index["manifests"][0]["digest"] = "sha256:../../../../etc/passwd"
    (layout / "index.json").write_text(json.dumps(index))
    _refused(kept, layout, "only sha256")
