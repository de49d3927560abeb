"""Pack files: the append-only journal that also holds every object.

A pack is a header followed by framed records. Records are only ever appended;
a sealed pack never changes again. This module knows the byte layout (see
docs/format.md) and how to scan, verify and truncate a pack. It does not know
about refs, trees or the index.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import zstandard

from strata.engine.errors import Corrupt, InvalidInput

PACK_MAGIC = b"STRATAPK"
PACK_VERSION = 5          # what this strata writes
PACK_VERSIONS = (1, 2, 3, 4, 5)  # what it reads
# v5: as v4; object records may hold version 2 file nodes (trees of content-defined
# chunks): a v4 reader cannot decode them, and its garbage collection, finding no
# references in a node it cannot read, would delete the file's chunks
# v4: as v3; a commit record may hold a ["policy"] op (retention policies live in the
# journal): a v3 reader would drop it silently and keep the wrong history
# v3: as v2; a commit record may hold a ["state"] op (garbage collection writes the
# whole ref state before it deletes packs): a v2 reader would misread it
# v2: magic, version, flags, pack number, created ns, store id, sync marker
HEADER = struct.Struct("<8sHHIQ16s16s")
HEADER_SIZE = HEADER.size  # 56
HEADER_V1 = struct.Struct("<8sHHIQ16s")
HEADER_V1_SIZE = HEADER_V1.size  # 40
SYNC_SIZE = 16
# A frame is the pack's sync marker followed by this and the payload.
REST = struct.Struct("<BBII")  # type, flags, payload length, crc32
FRAME_SIZE = SYNC_SIZE + REST.size  # 26 in v2 packs
FRAME_MAGIC_V1 = b"SR"  # a v1 pack's "sync marker": the same in every pack
# Objects are at most a file node of 128 GiB of 64 KiB blocks (64 MiB of ids):
# nothing larger is written, so a frame claiming more is damage.
MAX_PAYLOAD = 64 * 1024 * 1024 + 64

# Record types.
R_OBJECT = 1
R_COMMIT = 2
R_SEAL = 3

# Frame flags.
F_ZSTD = 1

OBJ_HEAD = struct.Struct("<B32sI")  # kind, id, raw length
OBJ_HEAD_SIZE = OBJ_HEAD.size  # 37

# Reads `length` bytes at `offset` of one pack (short at its end), as os.pread does:
# how the functions below read a pack wherever its bytes live (engine/packstore.py).
ReadAt = Callable[[int, int], bytes]
# A whole pack's bytes for a scan: a memory map of a local file, or a copy.
Buffer = bytes | mmap.mmap

_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread


def _zc() -> zstandard.ZstdCompressor:
    c: zstandard.ZstdCompressor | None = getattr(_local, "zc", None)
    if c is None:
        c = _local.zc = zstandard.ZstdCompressor(level=1)
    return c


def _zd() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "zd", None)
    if d is None:
        d = _local.zd = zstandard.ZstdDecompressor()
    return d


def pack_name(number: int) -> str:
    return f"{number:08x}.pack"


def encode_frame(rtype: int, payload: bytes, flags: int = 0) -> bytes:
    """A frame without its sync marker (prepended when it is appended to a pack).

    The CRC covers the type, flags, length and payload, not the marker, so a
    frame can be built (and its payload compressed and checksummed) before it
    is known which pack it lands in.
    """
    if len(payload) > MAX_PAYLOAD:
        raise InvalidInput(f"record of {len(payload)} bytes is over the limit of "
                           f"{MAX_PAYLOAD}")
    head = struct.pack("<BBI", rtype, flags, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return REST.pack(rtype, flags, len(payload), crc) + payload


def encode_object(kind: int, oid: bytes, raw: bytes, compress: bool) -> bytes:
    """Frame one object, zstd-compressed when that saves at least an eighth."""
    flags = 0
    body = raw
    if compress and len(raw) >= 512:
        packed = _zc().compress(raw)
        if len(packed) <= len(raw) - (len(raw) >> 3):
            body, flags = packed, F_ZSTD
    return encode_frame(R_OBJECT, OBJ_HEAD.pack(kind, oid, len(raw)) + body, flags)


def peek_object_size(read: ReadAt, offset: int, sync: bytes) -> int:
    """The raw size an object frame's header claims, without reading the body.

    Unverified (the CRC covers the whole payload): good for planning memory,
    never for trusting bytes; capped at what a valid object can be.
    """
    at = len(sync) + REST.size
    head = read(at + OBJ_HEAD_SIZE, offset)
    if len(head) < at + OBJ_HEAD_SIZE:
        return MAX_PAYLOAD
    return min(int(OBJ_HEAD.unpack_from(head, at)[2]), MAX_PAYLOAD)


def decode_object(frame: bytes, sync: bytes, pack: str, offset: int
                  ) -> tuple[int, bytes, bytes]:
    """Verify one object frame (marker included) and return (kind, id, raw bytes)."""
    rtype, flags, payload = verify_frame(frame, sync, pack, offset)
    if rtype != R_OBJECT:
        raise Corrupt(pack, offset, f"expected an object record, found type {rtype}")
    return _object_payload(flags, payload, pack, offset)


def _object_payload(flags: int, payload: bytes, pack: str, offset: int
                    ) -> tuple[int, bytes, bytes]:
    if len(payload) < OBJ_HEAD_SIZE:
        raise Corrupt(pack, offset, "object record too short")
    kind, oid, raw_len = OBJ_HEAD.unpack_from(payload)
    body = payload[OBJ_HEAD_SIZE:]
    if flags & F_ZSTD:
        try:
            body = _zd().decompress(body, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise Corrupt(pack, offset, f"zstd: {exc}") from exc
    if len(body) != raw_len:
        raise Corrupt(pack, offset, "object length does not match its header")
    return kind, oid, body


def verify_frame(frame: bytes, sync: bytes, pack: str, offset: int) -> tuple[int, int, bytes]:
    """Check a whole frame (sync marker, header, payload); return (type, flags, payload)."""
    n = len(sync)
    if len(frame) < n + REST.size:
        raise Corrupt(pack, offset, "truncated frame header")
    if frame[:n] != sync:
        raise Corrupt(pack, offset, "bad frame marker")
    rtype, flags, length, crc = REST.unpack_from(frame, n)
    if length > MAX_PAYLOAD:
        raise Corrupt(pack, offset, "implausible record length")
    payload = frame[n + REST.size:n + REST.size + length]
    if len(payload) != length:
        raise Corrupt(pack, offset, "truncated frame payload")
    if zlib.crc32(payload, zlib.crc32(frame[n:n + 6])) != crc:
        raise Corrupt(pack, offset, "checksum mismatch")
    return rtype, flags, bytes(payload)


@dataclass(frozen=True, slots=True)
class PackInfo:
    """What a pack's header says: how to find and check its frames."""

    number: int
    version: int
    sync: bytes        # the marker every frame of this pack starts with
    header_size: int

    @property
    def frame_overhead(self) -> int:
        return len(self.sync) + REST.size


@dataclass(slots=True)
class Record:
    offset: int
    length: int   # whole frame, header included
    rtype: int
    flags: int
    payload: bytes


@dataclass(slots=True)
class ScanResult:
    records: list[Record]
    end: int                 # offset just past the last good record
    damaged: list[tuple[int, str]]   # (offset, reason) of bad records with good ones after
    torn: bool               # bytes after `end` that are a torn tail
    sealed: bool


SEAL_PAYLOAD = struct.Struct("<Q")  # offset of the seal record itself


def seal_frame(offset: int, sync: bytes) -> bytes:
    """The fixed-size record that ends a sealed pack, marker included."""
    return sync + encode_frame(R_SEAL, SEAL_PAYLOAD.pack(offset))


def new_sync() -> bytes:
    """A fresh random marker for a new pack; it never leaves the store."""
    return os.urandom(SYNC_SIZE)


def is_sealed(path: str) -> bool:
    """True if the pack file's last record is a valid seal record."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        return is_sealed_at(lambda n, at: os.pread(f.fileno(), n, at), size,
                            os.path.basename(path))


def is_sealed_at(read: ReadAt, size: int, pack: str) -> bool:
    """True if the last record of the pack `read` reads (`size` bytes) is a valid seal."""
    try:
        info = read_header(read(HEADER_SIZE, 0), pack)
    except Corrupt:
        return False
    seal_size = info.frame_overhead + SEAL_PAYLOAD.size
    if size < info.header_size + seal_size:
        return False
    tail = read(seal_size, size - seal_size)
    try:
        rtype, _flags, payload = verify_frame(tail, info.sync, pack, size - seal_size)
    except Corrupt:
        return False
    return rtype == R_SEAL and SEAL_PAYLOAD.unpack(payload)[0] == size - seal_size


def encode_header(number: int, store_id: bytes, sync: bytes) -> bytes:
    return HEADER.pack(PACK_MAGIC, PACK_VERSION, 0, number, time.time_ns(), store_id, sync)


def write_header(fd: int, number: int, store_id: bytes, sync: bytes) -> None:
    os.write(fd, encode_header(number, store_id, sync))


def read_header(data: bytes, pack: str) -> PackInfo:
    if len(data) < HEADER_V1_SIZE:
        raise Corrupt(pack, 0, "truncated pack header")
    magic, version, _flags, number, _created, _sid = HEADER_V1.unpack_from(data)
    if magic != PACK_MAGIC:
        raise Corrupt(pack, 0, "not a strata pack (bad magic)")
    if version not in PACK_VERSIONS:
        raise Corrupt(pack, 0, f"unsupported pack format version {version} (this strata "
                               f"reads {', '.join(map(str, PACK_VERSIONS))}; upgrade strata)")
    if version == 1:
        return PackInfo(int(number), 1, FRAME_MAGIC_V1, HEADER_V1_SIZE)
    if len(data) < HEADER_SIZE:
        raise Corrupt(pack, 0, "truncated pack header")
    sync = HEADER.unpack_from(data)[6]
    return PackInfo(int(number), version, bytes(sync), HEADER_SIZE)


def header_incomplete(head: bytes) -> bool:
    """True if a pack is too short to hold its own header (created, then a crash).

    `head` is what the pack holds of its first HEADER_SIZE bytes.
    """
    if len(head) < HEADER_V1_SIZE:
        return True
    version = int.from_bytes(head[8:10], "little")
    return head[:8] == PACK_MAGIC and version >= 2 and len(head) < HEADER_SIZE


def read_info(path: str) -> PackInfo:
    with open(path, "rb") as f:
        return read_header(f.read(HEADER_SIZE), os.path.basename(path))


def scan(path: str, start: int | None = None) -> ScanResult:
    """Read every record from `start` (default: the first), telling a torn tail from damage.

    A bad frame followed by no good frame is a torn tail (the last append did
    not finish). A bad frame with good frames after it is damage: it is
    reported and skipped by searching forward for the next frame that starts
    with the pack's sync marker. In a version 2 pack that marker is 16 random
    bytes no client ever sees, so bytes a client uploaded (a block holding a
    well-formed frame) can never be taken for a record.
    """
    name = os.path.basename(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < HEADER_V1_SIZE:
            raise Corrupt(name, 0, "truncated pack header")
        # Map rather than read: packs are up to 256 MiB and only touched once here.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return scan_buffer(data, name, start)


def scan_buffer(data: Buffer, name: str, start: int | None = None) -> ScanResult:
    """`scan` of a pack's bytes, wherever they were read from."""
    result, records = scan_stream(data, name, start)
    result.records = list(records)
    return result


RELEASE_BYTES = 16 << 20  # a streamed scan hands back the mapped pages behind it this often


def scan_stream(data: Buffer, name: str, start: int | None = None
                ) -> tuple[ScanResult, Iterator[Record]]:
    """`scan_buffer` one record at a time, for a pass that must not hold a pack's records.

    The result's `records` stays empty; its other fields are final once the
    iterator is exhausted. A mapped pack's pages behind the scan are handed
    back every `RELEASE_BYTES` (they are clean: read again if touched), so
    the scan's resident memory stays bounded whatever the pack's size.
    """
    if len(data) < HEADER_V1_SIZE:
        raise Corrupt(name, 0, "truncated pack header")
    info = read_header(data[:HEADER_SIZE], name)
    result = ScanResult([], 0, [], False, False)
    return result, _scan_iter(data, info, name, info.header_size if start is None else start,
                              result)


def _scan_iter(data: Buffer, info: PackInfo, name: str, start: int,
               out: ScanResult) -> Iterator[Record]:
    pos = start
    out.end = start
    n = len(data)
    released = 0
    while pos < n:
        if isinstance(data, mmap.mmap) and pos - released >= RELEASE_BYTES:
            upto = pos // mmap.PAGESIZE * mmap.PAGESIZE
            data.madvise(mmap.MADV_DONTNEED, 0, upto)
            released = upto
        try:
            rec = _parse_at(data, info, pos, name)
        except Corrupt as exc:
            nxt = _resync(data, info, pos + 1, name)
            if nxt is None:
                out.torn = True
                return
            out.damaged.append((pos, exc.detail))
            pos = nxt
            continue
        pos += rec.length
        out.end = pos
        if rec.rtype == R_SEAL:
            out.sealed = True
        yield rec


def _parse_at(data: Buffer, info: PackInfo, pos: int, name: str) -> Record:
    over = info.frame_overhead
    if pos + over > len(data):
        raise Corrupt(name, pos, "truncated frame header")
    if data[pos:pos + len(info.sync)] != info.sync:
        raise Corrupt(name, pos, "bad frame marker")
    _t, _f, length, _c = REST.unpack_from(data, pos + len(info.sync))
    if length > MAX_PAYLOAD:
        raise Corrupt(name, pos, "implausible record length")
    frame = data[pos:pos + over + length]
    rtype, flags, payload = verify_frame(frame, info.sync, name, pos)
    return Record(pos, over + length, rtype, flags, payload)


def _resync(data: Buffer, info: PackInfo, pos: int, name: str) -> int | None:
    while True:
        pos = data.find(info.sync, pos)
        if pos < 0:
            return None
        try:
            _parse_at(data, info, pos, name)
            return pos
        except Corrupt:
            pos += 1


def complete_frame_at(read: ReadAt, size: int, offset: int, pack: str) -> bool:
    """True if a frame header at `offset` claims a length that ends the pack (`size` bytes)."""
    info = read_header(read(HEADER_SIZE, 0), pack)
    head = read(info.frame_overhead, offset)
    if len(head) < info.frame_overhead or head[:len(info.sync)] != info.sync:
        return False
    _t, _f, length, _c = REST.unpack_from(head, len(info.sync))
    return bool(offset + info.frame_overhead + length == size)


def iter_objects(rec: Record, pack: str) -> Iterator[tuple[int, bytes]]:
    """Yield (kind, id) of an object record without decompressing it."""
    if len(rec.payload) < OBJ_HEAD_SIZE:
        raise Corrupt(pack, rec.offset, "object record too short")
    kind, oid, _n = OBJ_HEAD.unpack_from(rec.payload)
    yield kind, oid


def object_from_record(rec: Record, pack: str) -> tuple[int, bytes, bytes]:
    return _object_payload(rec.flags, rec.payload, pack, rec.offset)
