"""Real images for the image tests, built offline with Debian's own tools.

`build_layout` makes a two-layer OCI image layout with umoci (`umoci init`,
`new`, `raw add-layer` of layer tars written here, `config`): busybox-static
as the image's shell and entrypoint, and in the second layer a whiteout, an
opaque directory and a hard link to a file of the first layer. `skopeo copy`
turns the layout into oci-archive and docker-archive tarballs. `tree_of`
describes a directory or a snapshot the same way, so a strata import can be
compared with `umoci unpack` of the same image byte for byte, metadata
included.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from strata.engine.interface import Store
from strata.engine.objects import K_BLK, K_CHR, K_DIR, K_FIFO, K_FILE, K_SYMLINK, Entry
from strata.engine.tree import Trees, decode_name
from strata.engine.txn import ContentWriter

TAG = "t"


@dataclass(frozen=True)
class Images:
    """The same two-layer image as an OCI layout, an oci-archive and a docker-archive."""

    layout: Path
    oci_archive: Path
    docker_archive: Path
    rootfs: Path  # `umoci unpack` of it, the reference every import is compared with

    def source(self, kind: str) -> Path:
        return {"oci": self.layout, "oci-archive": self.oci_archive,
                "docker-archive": self.docker_archive}[kind]


BUSYBOX = "/bin/busybox"
T0 = 1_700_000_000
TOOLS = ("umoci", "skopeo")


def need_tools(*tools: str) -> None:
    """These tests need real tools; `make deps` installs them (APT_PKGS), so a missing one fails."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed (make apt-deps installs them)")


def _add(tf: tarfile.TarFile, name: str, *, type: bytes = tarfile.REGTYPE, data: bytes = b"",
         mode: int = 0o644, uid: int = 0, gid: int = 0, mtime: float = T0,
         linkname: str = "", pax: dict[str, str] | None = None, dev: tuple[int, int] = (0, 0)
         ) -> None:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = type, mode, uid, gid, mtime
    ti.linkname = linkname
    ti.devmajor, ti.devminor = dev
    ti.pax_headers = dict(pax or {})
    if ti.pax_headers.get("mtime") is None and mtime != int(mtime):
        ti.pax_headers["mtime"] = repr(mtime)
    if type == tarfile.REGTYPE:
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    else:
        tf.addfile(ti)


def layer_one(path: Path) -> None:
    rnd = hashlib.sha256(b"seed").digest() * 8192  # 256 KiB, several blocks
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tf:
        _add(tf, "./", type=tarfile.DIRTYPE, mode=0o755)
        for d in ("bin", "etc", "data", "opq", "dev", "tmp"):
            _add(tf, f"{d}/", type=tarfile.DIRTYPE, mode=0o1777 if d == "tmp" else 0o755)
        _add(tf, "bin/busybox", data=Path(BUSYBOX).read_bytes(), mode=0o755)
        for tool in ("sh", "echo", "cat", "ls", "env", "pwd", "id", "true"):
            _add(tf, f"bin/{tool}", type=tarfile.SYMTYPE, linkname="busybox", mode=0o777)
        _add(tf, "etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n")
        _add(tf, "etc/xattr.txt", data=b"has xattrs\n",
             pax={"SCHILY.xattr.user.strata": "image-test"})
        _add(tf, "data/gone.txt", data=b"whited out in layer 2\n")
        _add(tf, "data/keep.txt", data=b"version 1\n")
        _add(tf, "data/linked.txt", data=b"a file linked from layer 2\n")
        _add(tf, "data/big.bin", data=rnd)
        _add(tf, "data/owned", data=b"owned by 1000\n", uid=1000, gid=1000, mode=0o640)
        _add(tf, "data/setuid", data=b"#!/bin/sh\n", mode=0o4755)
        _add(tf, "data/ns", data=b"nanoseconds\n", pax={"mtime": f"{T0}.123456789"})
        _add(tf, "data/abs-link", type=tarfile.SYMTYPE, linkname="/etc/passwd", mode=0o777)
        _add(tf, "opq/old1", data=b"1\n")
        _add(tf, "opq/old2", data=b"2\n")
        _add(tf, "dev/null", type=tarfile.CHRTYPE, mode=0o666, dev=(1, 3))
        _add(tf, "dev/fifo", type=tarfile.FIFOTYPE, mode=0o600)
        _add(tf, "data/naïve-\udcff", data=b"a name that is not UTF-8\n")


def layer_two(path: Path) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tf:
        _add(tf, "data/", type=tarfile.DIRTYPE, mode=0o755, mtime=T0 + 10)
        _add(tf, "data/.wh.gone.txt")
        _add(tf, "data/keep.txt", data=b"version 2\n", mtime=T0 + 10)
        _add(tf, "data/link2", type=tarfile.LNKTYPE, linkname="data/linked.txt")
        _add(tf, "opq/", type=tarfile.DIRTYPE, mode=0o700, mtime=T0 + 10)
        _add(tf, "opq/.wh..wh..opq")
        _add(tf, "opq/new1", data=b"new\n", mtime=T0 + 10)


def build_layout(root: Path, tag: str = "t") -> Path:
    """A two-layer OCI layout at root/layout (tag `tag`), made with umoci."""
    need_tools("umoci")
    layout = root / "layout"
    subprocess.run(["umoci", "init", "--layout", str(layout)], check=True)
    subprocess.run(["umoci", "new", "--image", f"{layout}:{tag}"], check=True)
    for i, make in enumerate((layer_one, layer_two)):
        tar = root / f"layer{i + 1}.tar"
        make(tar)
        subprocess.run(["umoci", "raw", "add-layer", "--image", f"{layout}:{tag}", str(tar)],
                       check=True)
    subprocess.run(["umoci", "config", "--image", f"{layout}:{tag}",
                    "--config.entrypoint", "/bin/sh", "--config.entrypoint", "-c",
                    "--config.cmd", 'echo "hello from $GREETING in $(pwd)"',
                    "--config.env", "GREETING=the image",
                    "--config.env", "PATH=/bin",
                    "--config.workingdir", "/data"], check=True)
    # A second version, tag `TAG-2`: one more layer on top.
    tar = root / "layer3.tar"
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as tf:
        _add(tf, "data/keep.txt", data=b"version 3\n", mtime=T0 + 20)
        _add(tf, "data/added.txt", data=b"new in version 2 of the image\n", mtime=T0 + 20)
    subprocess.run(["umoci", "raw", "add-layer", "--image", f"{layout}:{tag}", "--tag",
                    f"{tag}-2", str(tar)], check=True)
    return layout


def skopeo_copy(layout: Path, tag: str, dest: str) -> None:
    need_tools("skopeo")
    subprocess.run(["skopeo", "copy", "--quiet", f"oci:{layout}:{tag}", dest], check=True,
                   capture_output=True)


def umoci_unpack(layout: Path, tag: str, bundle: Path) -> Path:
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:{tag}", str(bundle)], check=True,
                   capture_output=True)
    return bundle / "rootfs"


# -- one description for a directory and a snapshot ---------------------------------

Desc = dict[str, tuple[Any, ...]]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_of_dir(root: Path, *, skip_xattrs: tuple[bytes, ...] = ()) -> Desc:
    """Every path below `root`: kind, mode, owner, mtime, content, rdev, xattrs, link group."""
    out: Desc = {}
    inodes: dict[tuple[int, int], str] = {}
    broot = os.fsencode(root)
    for dirpath, dirs, files in os.walk(broot):
        for name in sorted(dirs + files):
            full = os.path.join(dirpath, name)
            rel = os.fsdecode(os.path.relpath(full, broot))
            s = os.lstat(full)
            xattrs = tuple(sorted(
                (os.fsencode(k), os.getxattr(full, k, follow_symlinks=False))
                for k in os.listxattr(full, follow_symlinks=False)
                if not os.fsencode(k).startswith(skip_xattrs)))
            if stat.S_ISREG(s.st_mode):
                group = ""
                if s.st_nlink > 1:
                    group = inodes.setdefault((s.st_dev, s.st_ino), rel)
                with open(full, "rb") as f:
                    body: Any = (_sha(f.read()), group)
                kind = K_FILE
            elif stat.S_ISDIR(s.st_mode):
                kind, body = K_DIR, None
            elif stat.S_ISLNK(s.st_mode):
                kind, body = K_SYMLINK, os.readlink(full)
            elif stat.S_ISCHR(s.st_mode) or stat.S_ISBLK(s.st_mode):
                kind = K_CHR if stat.S_ISCHR(s.st_mode) else K_BLK
                body = s.st_rdev
            else:
                kind, body = K_FIFO, None
            mode = 0o777 if kind == K_SYMLINK else stat.S_IMODE(s.st_mode)
            mtime = None if kind == K_SYMLINK else s.st_mtime_ns
            out[rel] = (kind, mode, s.st_uid, s.st_gid, mtime, body, xattrs)
    return out


def tree_of_snapshot(store: Store, sid: str) -> Desc:
    cw = ContentWriter(store)
    trees = Trees(cw)
    out: Desc = {}
    groups: dict[int, str] = {}

    def walk(d: Entry, prefix: str) -> None:
        assert d.ref is not None
        for raw, e in trees.iter_dir(d.ref):
            rel = f"{prefix}/{decode_name(raw)}" if prefix else decode_name(raw)
            body: Any = None
            if e.kind == K_FILE:
                group = groups.setdefault(e.ino, rel) if e.ino else ""
                body = (_sha(cw.read(e)), group)
            elif e.kind == K_SYMLINK:
                body = os.fsencode((e.data or b"").decode("utf-8", "surrogateescape"))
            elif e.kind in (K_CHR, K_BLK):
                body = e.rdev
            mtime = None if e.kind == K_SYMLINK else e.mtime_ns
            out[rel] = (e.kind, e.mode, e.uid, e.gid, mtime, body, e.xattrs)
            if e.kind == K_DIR:
                walk(e, rel)

    walk(store.snapshot(sid).root, "")
    return out


def differences(a: Desc, b: Desc) -> list[str]:
    out = []
    for path in sorted(a.keys() | b.keys()):
        if a.get(path) != b.get(path):
            out.append(f"{path!r}: {a.get(path)} != {b.get(path)}")
    return out


# -- hand-made layouts, for layers no tool would write -------------------------------

GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
PLAIN = "application/vnd.oci.image.layer.v1.tar"


def tar_bytes(*members: tuple[str, dict[str, Any]]) -> bytes:
    """A tar of (name, fields) members: fields as for `_add` (type, data, linkname...)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, fields in members:
            _add(tf, name, **fields)
    return buf.getvalue()


def write_layout(root: Path, layers: list[bytes], *, media: str = GZIP, tag: str = "t",
                 config: dict[str, Any] | None = None, diff_ids: list[str] | None = None
                 ) -> Path:
    """An OCI layout of `layers` (uncompressed tars, compressed here as `media` says)."""
    import gzip
    import json

    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(raw: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(raw).hexdigest()
        (blobs / digest).write_bytes(raw)
        return f"sha256:{digest}", len(raw)

    descs, ids = [], []
    for tar in layers:
        ids.append(f"sha256:{hashlib.sha256(tar).hexdigest()}")
        if media == GZIP:
            raw = gzip.compress(tar, mtime=0)
        elif media == ZSTD:
            import zstandard
            raw = zstandard.ZstdCompressor().compress(tar)
        else:
            raw = tar
        digest, size = put(raw)
        descs.append({"mediaType": media, "digest": digest, "size": size})
    cfg = {"architecture": "amd64", "os": "linux", "config": config or {},
           "rootfs": {"type": "layers", "diff_ids": diff_ids if diff_ids is not None else ids}}
    cdigest, csize = put(json.dumps(cfg).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": cdigest, "size": csize}, "layers": descs}
    mdigest, msize = put(json.dumps(manifest).encode())
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdigest,
         "size": msize, "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return root
