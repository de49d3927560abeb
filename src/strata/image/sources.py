"""Where images come from: an OCI layout directory, an oci-archive or a docker-archive.

Each source answers the same questions: the image's config (a JSON object,
its digest checked), and its layers in order, each a blob whose bytes are
checked against the digest the manifest names as they stream by (and, once
decompressed, against the config's ``rootfs.diff_ids``). A blob is found by
its digest, never by a path taken from the input, so no name inside an
archive or layout can point anywhere else. Archives are read in place
(tarfile with random access); nothing is unpacked to disk.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, cast

from strata.engine.errors import InvalidInput, NotFound
from strata.image.layers import LayerRefused

MAX_JSON = 4 << 20  # an index, manifest or config larger than this is refused
_DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
REF_NAME = "org.opencontainers.image.ref.name"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": "tar",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar": "tar",
}


@dataclass
class Layer:
    """One layer blob: how to open it, and what it must hash to."""

    open: Callable[[], IO[bytes]]
    size: int
    digest: str | None      # of the blob as stored (None: a docker-archive layer)
    diff_id: str | None     # of the decompressed tar, from the config
    label: str


@dataclass
class ImageSource:
    kind: str                     # "oci", "oci-archive" or "docker-archive"
    config: dict[str, Any]
    config_digest: str
    layers: list[Layer]
    name: str | None = None       # the name the source gives the image, if any
    close: Callable[[], None] = field(default=lambda: None)


def _digest_hex(digest: object, what: str) -> str:
    if not isinstance(digest, str):
        raise LayerRefused(f"refusing the image: {what} has no digest")
    m = _DIGEST_RE.fullmatch(digest)
    if m is None:
        raise LayerRefused(f"refusing the image: {what} has digest {digest[:80]!r} "
                           f"(only sha256 is read)")
    return m.group(1)


def _json(raw: bytes, what: str) -> Any:  # noqa: ANN401 - JSON
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise LayerRefused(f"refusing the image: {what} is not JSON ({exc})") from exc


def _obj(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise LayerRefused(f"refusing the image: {what} is not a JSON object")
    return value


class Verified:
    """A blob's bytes as read, hashed on the way; `check` once they are all read."""

    def __init__(self, inner: IO[bytes], digest: str | None, size: int | None, label: str
                 ) -> None:
        self.inner, self.digest, self.size, self.label = inner, digest, size, label
        self.sha = hashlib.sha256()
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n if n is not None and n >= 0 else 1 << 20)
        self.sha.update(data)
        self.count += len(data)
        if self.size is not None and self.count > self.size:
            raise LayerRefused(f"refusing {self.label}: longer than its manifest says "
                               f"({self.size} bytes)")
        return data

    def check(self) -> None:
        while self.read(1 << 20):
            pass
        if self.size is not None and self.count != self.size:
            raise LayerRefused(f"refusing {self.label}: {self.count} bytes, its manifest "
                               f"says {self.size}")
        if self.digest is not None and self.sha.hexdigest() != self.digest:
            raise LayerRefused(f"refusing {self.label}: its bytes hash to sha256:"
                               f"{self.sha.hexdigest()}, not sha256:{self.digest}")


class _Peeked:
    """A reader with its first bytes looked at (to tell the compression)."""

    def __init__(self, inner: Verified) -> None:
        self.inner = inner
        self.head = inner.read(4)

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = self.head, b""
            if n is not None and 0 <= n < len(out):
                out, self.head = out[:n], out[n:]
                return out
            return out
        return self.inner.read(n)


def decompressed(raw: Verified) -> IO[bytes]:
    """The layer's tar stream, whatever its compression (told by its magic bytes)."""
    p = _Peeked(raw)
    src = cast(IO[bytes], p)
    if p.head.startswith(b"\x1f\x8b"):
        return cast(IO[bytes], gzip.GzipFile(fileobj=src, mode="rb"))
    if p.head.startswith(b"\x28\xb5\x2f\xfd"):
        import zstandard
        return cast(IO[bytes], zstandard.ZstdDecompressor().stream_reader(
            src, read_across_frames=True))
    return src


# -- an OCI layout, in a directory or a tar ----------------------------------------


class _Files:
    """Named files of a layout: a directory's, or an archive's members."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.tar: tarfile.TarFile | None = None
        self.members: dict[str, tarfile.TarInfo] = {}
        if not os.path.isdir(root):
            try:
                self.tar = tarfile.open(root, "r:")  # noqa: SIM115 - closed by close()
            except (tarfile.TarError, OSError) as exc:
                raise InvalidInput(f"{root}: neither a directory nor a tar archive ({exc})"
                                   ) from exc
            for ti in self.tar:
                if ti.isfile():
                    name = "/".join(p for p in ti.name.split("/") if p not in ("", "."))
                    self.members[name] = ti
            self.tar.members = []  # type: ignore[attr-defined]

    def has(self, name: str) -> bool:
        if self.tar is not None:
            return name in self.members
        return os.path.isfile(os.path.join(self.root, name))

    def size(self, name: str) -> int:
        if self.tar is not None:
            return self.members[name].size
        return os.stat(os.path.join(self.root, name)).st_size

    def open(self, name: str) -> IO[bytes]:
        if self.tar is not None:
            ti = self.members.get(name)
            f = self.tar.extractfile(ti) if ti is not None else None
            if f is None:
                raise LayerRefused(f"refusing the image: {self.root} has no {name}")
            return f
        path = os.path.join(self.root, name)
        try:
            return open(path, "rb")  # noqa: SIM115 - the caller closes it
        except FileNotFoundError as exc:
            raise LayerRefused(f"refusing the image: {self.root} has no {name}") from exc

    def read(self, name: str, digest: str | None = None, limit: int = MAX_JSON) -> bytes:
        if not self.has(name):
            raise LayerRefused(f"refusing the image: {self.root} has no {name}")
        if self.size(name) > limit:
            raise LayerRefused(f"refusing the image: {name} is over {limit} bytes")
        with self.open(name) as f:
            raw = f.read(limit + 1)
        if digest is not None and hashlib.sha256(raw).hexdigest() != digest:
            raise LayerRefused(f"refusing the image: {name} does not hash to its digest")
        return raw

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()


def _blob(digest_hex: str) -> str:
    return f"blobs/sha256/{digest_hex}"


def _pick_manifest(files: _Files, index: dict[str, Any], tag: str | None, where: str
                   ) -> tuple[dict[str, Any], str | None]:
    """The manifest descriptor to import: by tag, else the only one; and its name."""
    manifests = index.get("manifests")
    if not isinstance(manifests, list) or not manifests:
        raise LayerRefused(f"refusing the image: {where} lists no manifests")
    descs = [_obj(d, "a manifest descriptor") for d in manifests]
    if tag is not None:
        hits = [d for d in descs if (d.get("annotations") or {}).get(REF_NAME) == tag]
        if not hits:
            names = sorted(str((d.get("annotations") or {}).get(REF_NAME)) for d in descs)
            raise NotFound(f"no image named {tag!r} in {where} (it has {', '.join(names)})")
        descs = hits
    if len(descs) > 1:
        arch = _arch()
        plat = [d for d in descs if (d.get("platform") or {}).get("architecture") == arch]
        if len(plat) == 1:
            descs = plat
        else:
            names = sorted(str((d.get("annotations") or {}).get(REF_NAME)) for d in descs)
            raise InvalidInput(f"{where} holds {len(descs)} images ({', '.join(names)}): "
                               f"name one with --source-ref")
    d = descs[0]
    return d, (d.get("annotations") or {}).get(REF_NAME)


def _arch() -> str:
    m = os.uname().machine
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)


def open_oci(path: str, tag: str | None = None) -> ImageSource:
    """An OCI image layout: a directory, or a tar of one (oci-archive)."""
    files = _Files(path)
    try:
        layout = _obj(_json(files.read("oci-layout"), "oci-layout"), "oci-layout")
        if layout.get("imageLayoutVersion") != "1.0.0":
            raise LayerRefused(f"refusing the image: layout version "
                               f"{layout.get('imageLayoutVersion')!r} (1.0.0 is read)")
        index = _obj(_json(files.read("index.json"), "index.json"), "index.json")
        desc, name = _pick_manifest(files, index, tag, path)
        for _ in range(4):  # an index may name an index (one per platform)
            hexd = _digest_hex(desc.get("digest"), "a manifest")
            manifest = _obj(_json(files.read(_blob(hexd), hexd), "a manifest"), "a manifest")
            if desc.get("mediaType") in INDEX_TYPES or manifest.get("mediaType") in INDEX_TYPES:
                desc, _n = _pick_manifest(files, manifest, None, f"index {hexd[:12]}")
                continue
            break
        else:
            raise LayerRefused("refusing the image: indexes nest too deep")
        cdesc = _obj(manifest.get("config"), "the manifest's config")
        chex = _digest_hex(cdesc.get("digest"), "the config")
        config = _obj(_json(files.read(_blob(chex), chex), "the config"), "the config")
        ldescs = manifest.get("layers")
        if not isinstance(ldescs, list):
            raise LayerRefused("refusing the image: the manifest lists no layers")
        diff_ids = _diff_ids(config, len(ldescs))
        layers = []
        for i, ld in enumerate(ldescs):
            ld = _obj(ld, "a layer descriptor")
            if ld.get("mediaType") not in LAYER_TYPES:
                raise LayerRefused(f"refusing the image: layer {i + 1} has media type "
                                   f"{ld.get('mediaType')!r}")
            lhex = _digest_hex(ld.get("digest"), f"layer {i + 1}")
            size = ld.get("size")
            if not isinstance(size, int) or size < 0:
                raise LayerRefused(f"refusing the image: layer {i + 1} has no size")
            blob_name = _blob(lhex)
            layers.append(Layer(functools.partial(files.open, blob_name), size, lhex, diff_ids[i],
                                f"layer {i + 1} (sha256:{lhex[:12]})"))
        return ImageSource("oci" if files.tar is None else "oci-archive", config, chex,
                           layers, name, files.close)
    except BaseException:
        files.close()
        raise


def _diff_ids(config: dict[str, Any], n: int) -> list[str | None]:
    rootfs = config.get("rootfs")
    ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(ids, list) or len(ids) != n:
        raise LayerRefused(f"refusing the image: the config lists "
                           f"{len(ids) if isinstance(ids, list) else 'no'} diff ids for "
                           f"{n} layers")
    return [_digest_hex(d, "a diff id") for d in ids]


# -- a docker-archive (docker save, podman save, skopeo copy docker-archive:) -------


def _docker_name(name: str) -> str:
    """A docker reference in full, as docker and skopeo write RepoTags (docker.io/library/img:t)."""
    head, slash, _rest = name.partition("/")
    if not slash:
        name = f"docker.io/library/{name}"
    elif "." not in head and ":" not in head and head != "localhost":
        name = f"docker.io/{name}"
    if ":" not in name.rpartition("/")[2]:
        name += ":latest"
    return name


def open_docker(path: str, tag: str | None = None) -> ImageSource:
    files = _Files(path)
    try:
        manifest = _json(files.read("manifest.json"), "manifest.json")
        if not isinstance(manifest, list) or not manifest:
            raise LayerRefused("refusing the image: manifest.json lists no images")
        items = [_obj(m, "a manifest.json item") for m in manifest]
        if tag is not None:
            items = [m for m in items if _docker_name(tag) in
                     {_docker_name(str(t)) for t in m.get("RepoTags") or []}]
            if not items:
                raise NotFound(f"no image tagged {tag!r} in {path}")
        if len(items) > 1:
            raise InvalidInput(f"{path} holds {len(items)} images: name one with --source-ref")
        item = items[0]
        cname = item.get("Config")
        if not isinstance(cname, str):
            raise LayerRefused("refusing the image: manifest.json names no config")
        cname = "/".join(p for p in cname.split("/") if p not in ("", "."))
        m = re.fullmatch(r"(?:blobs/sha256/)?([0-9a-f]{64})(?:\.json)?", cname)
        raw = files.read(cname, m.group(1) if m else None)
        chex = m.group(1) if m else hashlib.sha256(raw).hexdigest()
        config = _obj(_json(raw, "the config"), "the config")
        lnames = item.get("Layers")
        if not isinstance(lnames, list):
            raise LayerRefused("refusing the image: manifest.json lists no layers")
        diff_ids = _diff_ids(config, len(lnames))
        layers = []
        for i, ln in enumerate(lnames):
            if not isinstance(ln, str):
                raise LayerRefused(f"refusing the image: layer {i + 1} has no name")
            ln = "/".join(p for p in ln.split("/") if p not in ("", "."))
            if not files.has(ln):
                raise LayerRefused(f"refusing the image: {path} has no {ln}")
            # A docker-archive names no blob digest: the diff id checks the bytes.
            layers.append(Layer(functools.partial(files.open, ln), files.size(ln), None,
                                diff_ids[i], f"layer {i + 1} ({ln})"))
        tags = item.get("RepoTags") or []
        return ImageSource("docker-archive", config, chex, layers,
                           tags[0] if tags and isinstance(tags[0], str) else None, files.close)
    except BaseException:
        files.close()
        raise


TRANSPORTS = ("oci:", "oci-archive:", "docker-archive:")


def parse_source(text: str) -> tuple[str, str | None]:
    """A SOURCE as skopeo names one, or a plain path: (path, ref or None).

    skopeo's forms are ``oci:DIR[:REF]``, ``oci-archive:FILE[:REF]`` and
    ``docker-archive:FILE[:REPO:TAG]``. A path that exists as given is a
    path, whatever it looks like.
    """
    if os.path.exists(text):
        return text, None
    for prefix in TRANSPORTS:
        if text.startswith(prefix):
            rest = text[len(prefix):]
            if os.path.exists(rest):
                return rest, None
            path, sep, ref = rest.partition(":")
            if sep and os.path.exists(path):
                return path, ref or None
            return rest, None
    return text, None


def open_source(path: str, tag: str | None = None) -> ImageSource:
    """Whichever image `path` holds: an OCI layout (directory or tar) or a docker-archive."""
    if not os.path.exists(path):
        raise NotFound(f"no such file or directory: {path!r}")
    if os.path.isdir(path):
        return open_oci(path, tag)
    files = _Files(path)
    try:
        oci, docker = files.has("oci-layout"), files.has("manifest.json")
    finally:
        files.close()
    if oci:
        return open_oci(path, tag)
    if docker:
        return open_docker(path, tag)
    raise InvalidInput(f"{path}: not an OCI layout, oci-archive or docker-archive")
