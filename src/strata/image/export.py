"""`strata image export`: a snapshot written as an OCI image layout.

One layer, a gzip-compressed tar of the whole tree (PAX format: owners,
modes, nanosecond mtimes, xattrs, device nodes and hard links kept), then
the config (the runtime config the import kept, and the layer's diff id),
the manifest and index.json, each named by its sha256. The tar is written
through two hashes at once (the diff id over the tar, the blob digest over
the gzip), so the layer is streamed, never held in memory.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
import time
from collections.abc import Iterator
from typing import IO, Any, cast

from strata.engine.errors import InvalidInput
from strata.engine.interface import Store
from strata.engine.objects import K_BLK, K_CHR, K_DIR, K_FIFO, K_FILE, K_SOCK, K_SYMLINK, Entry
from strata.engine.tree import NodeCache, Trees, decode_name
from strata.engine.txn import ContentWriter
from strata.image.sources import REF_NAME

CHUNK = 1 << 20


class _HashWriter:
    """A file object that hashes what passes through it on its way to `inner`."""

    def __init__(self, inner: IO[bytes] | None) -> None:
        self.inner = inner
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.inner is not None:
            self.inner.write(data)
        return len(data)

    def flush(self) -> None:
        if self.inner is not None:
            self.inner.flush()


class _EntryReader:
    """A file entry's bytes, read a megabyte at a time through the content writer."""

    def __init__(self, cw: ContentWriter, e: Entry) -> None:
        self.cw, self.e, self.off = cw, e, 0

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.e.size - self.off
        data = self.cw.read(self.e, self.off, min(n, CHUNK * 8))
        self.off += len(data)
        return data


def _walk(trees: Trees, d: Entry, prefix: str) -> Iterator[tuple[str, Entry]]:
    if d.ref is None:
        return
    for raw, e in trees.iter_dir(d.ref):
        path = f"{prefix}/{decode_name(raw)}" if prefix else decode_name(raw)
        yield path, e
        if e.kind == K_DIR:
            yield from _walk(trees, e, path)


def _tarinfo(path: str, e: Entry) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(path)
    ti.mode = e.mode & 0o7777
    ti.uid, ti.gid = e.uid, e.gid
    ti.uname = ti.gname = ""
    ti.mtime = e.mtime_ns // 10**9
    pax: dict[str, str] = {}
    if e.mtime_ns % 10**9:
        pax["mtime"] = f"{e.mtime_ns // 10**9}.{e.mtime_ns % 10**9:09d}"
    for key, value in e.xattrs:
        pax["SCHILY.xattr." + decode_name(key)] = value.decode("utf-8", "surrogateescape")
    ti.pax_headers = pax
    return ti


def write_layer(store: Store, sid: str, out: IO[bytes]) -> tuple[str, str, int]:
    """The snapshot's tree as a gzip'd tar into `out`: (diff id, digest, size)."""
    cw = ContentWriter(store)
    trees = Trees(cw, NodeCache(1024))
    root = store.snapshot(sid).root
    blob = _HashWriter(out)
    # mtime=0 and no file name in the gzip header: the same tree gives the same bytes.
    with gzip.GzipFile(fileobj=blob, mode="wb", mtime=0, filename="",
                       compresslevel=6) as gz:
        tar_out = _HashWriter(gz)  # type: ignore[arg-type]
        with tarfile.open(fileobj=tar_out, mode="w|", format=tarfile.PAX_FORMAT,  # type: ignore[call-overload]
                          encoding="utf-8", errors="surrogateescape") as tf:
            ti = _tarinfo(".", root)
            ti.type = tarfile.DIRTYPE
            tf.addfile(ti)
            links: dict[int, str] = {}
            for path, e in _walk(trees, root, ""):
                ti = _tarinfo("./" + path, e)
                body = None
                if e.kind == K_DIR:
                    ti.type = tarfile.DIRTYPE
                elif e.kind == K_FILE:
                    if e.ino and e.ino in links:
                        ti.type, ti.linkname = tarfile.LNKTYPE, links[e.ino]
                    else:
                        ti.type, ti.size = tarfile.REGTYPE, e.size
                        body = _EntryReader(cw, e)
                        if e.ino:
                            links[e.ino] = "./" + path
                elif e.kind == K_SYMLINK:
                    ti.type = tarfile.SYMTYPE
                    ti.linkname = (e.data or b"").decode("utf-8", "surrogateescape")
                elif e.kind in (K_CHR, K_BLK):
                    ti.type = tarfile.CHRTYPE if e.kind == K_CHR else tarfile.BLKTYPE
                    ti.devmajor, ti.devminor = os.major(e.rdev), os.minor(e.rdev)
                elif e.kind == K_FIFO:
                    ti.type = tarfile.FIFOTYPE
                elif e.kind == K_SOCK:
                    continue  # tar cannot hold a socket (and no image needs one)
                tf.addfile(ti, cast(IO[bytes], body))
    return (tar_out.sha.hexdigest(), blob.sha.hexdigest(), blob.size)


def _put_blob(layout: str, raw: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(raw).hexdigest()
    with open(os.path.join(layout, "blobs", "sha256", digest), "wb") as f:
        f.write(raw)
    return digest, len(raw)


def export_oci(store: Store, sid: str, layout: str, *, tag: str,
               meta: dict[str, Any] | None) -> str:
    """Write snapshot `sid` into a new OCI layout at `layout`; return the manifest digest.

    `meta` is the image meta the import kept (None for a volume that is not
    an image: then the config says only what the layer needs).
    """
    if os.path.lexists(layout) and (not os.path.isdir(layout) or os.listdir(layout)):
        raise InvalidInput(f"export target {layout!r} exists and is not an empty directory")
    os.makedirs(os.path.join(layout, "blobs", "sha256"), exist_ok=True)
    tmp = os.path.join(layout, "blobs", "sha256", ".layer.tmp")
    with open(tmp, "wb") as f:
        diff_id, digest, size = write_layer(store, sid, f)
    os.rename(tmp, os.path.join(layout, "blobs", "sha256", digest))
    meta = meta or {}
    info = store.snapshot(sid)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info.time_ns / 1e9))
    config = {
        "created": created,
        "architecture": meta.get("architecture") or _arch(),
        "os": meta.get("os") or "linux",
        "config": meta.get("config") or {},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        "history": [{"created": created, "created_by": f"strata image export {sid[:12]}"}],
    }
    cdigest, csize = _put_blob(layout, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": f"sha256:{cdigest}", "size": csize},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": f"sha256:{digest}", "size": size}],
    }
    mdigest, msize = _put_blob(layout, json.dumps(manifest, sort_keys=True).encode())
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                            "digest": f"sha256:{mdigest}", "size": msize,
                            "annotations": {REF_NAME: tag}}]}
    with open(os.path.join(layout, "index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(layout, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    return f"sha256:{mdigest}"


def _arch() -> str:
    m = os.uname().machine
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)
