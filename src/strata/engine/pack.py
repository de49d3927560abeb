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
from collections.abc import Iterator
from dataclasses import dataclass

import zstandard

from strata.engine.errors import Corrupt

PACK_MAGIC = b"STRATAPK"
PACK_VERSION = 1
HEADER = struct.Struct("<8sHHIQ16s")  # magic, version, flags, pack number, created ns, store id
HEADER_SIZE = HEADER.size  # 40
FRAME = struct.Struct("<2sBBII")  # magic, type, flags, payload length, crc32
FRAME_SIZE = FRAME.size  # 12
FRAME_MAGIC = b"SR"
MAX_PAYLOAD = 64 * 1024 * 1024

# Record types.
R_OBJECT = 1
R_COMMIT = 2
R_SEAL = 3

# Frame flags.
F_ZSTD = 1

OBJ_HEAD = struct.Struct("<B32sI")  # kind, id, raw length
OBJ_HEAD_SIZE = OBJ_HEAD.size  # 37

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
    head = struct.pack("<BBI", rtype, flags, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return FRAME.pack(FRAME_MAGIC, rtype, flags, len(payload), crc) + payload


def encode_object(kind: int, oid: bytes, raw: bytes, compress: bool) -> bytes:
    """Frame one object, zstd-compressed when that saves at least an eighth."""
    flags = 0
    body = raw
    if compress and len(raw) >= 512:
        packed = _zc().compress(raw)
        if len(packed) <= len(raw) - (len(raw) >> 3):
            body, flags = packed, F_ZSTD
    return encode_frame(R_OBJECT, OBJ_HEAD.pack(kind, oid, len(raw)) + body, flags)


def decode_object(frame: bytes, pack: str, offset: int) -> tuple[int, bytes, bytes]:
    """Verify one object frame and return (kind, id, raw bytes)."""
    rtype, flags, payload = verify_frame(frame, pack, offset)
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


def verify_frame(frame: bytes, pack: str, offset: int) -> tuple[int, int, bytes]:
    if len(frame) < FRAME_SIZE:
        raise Corrupt(pack, offset, "truncated frame header")
    magic, rtype, flags, length, crc = FRAME.unpack_from(frame)
    if magic != FRAME_MAGIC:
        raise Corrupt(pack, offset, "bad frame magic")
    payload = frame[FRAME_SIZE:FRAME_SIZE + length]
    if len(payload) != length:
        raise Corrupt(pack, offset, "truncated frame payload")
    if zlib.crc32(payload, zlib.crc32(frame[2:8])) != crc:
        raise Corrupt(pack, offset, "checksum mismatch")
    return rtype, flags, payload


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
SEAL_FRAME_SIZE = FRAME_SIZE + SEAL_PAYLOAD.size


def seal_frame(offset: int) -> bytes:
    """The fixed-size record that ends a sealed pack."""
    return encode_frame(R_SEAL, SEAL_PAYLOAD.pack(offset))


def is_sealed(path: str) -> bool:
    """True if the pack's last record is a valid seal record."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < HEADER_SIZE + SEAL_FRAME_SIZE:
            return False
        f.seek(size - SEAL_FRAME_SIZE)
        tail = f.read(SEAL_FRAME_SIZE)
    try:
        rtype, _flags, payload = verify_frame(tail, os.path.basename(path), size - SEAL_FRAME_SIZE)
    except Corrupt:
        return False
    return rtype == R_SEAL and SEAL_PAYLOAD.unpack(payload)[0] == size - SEAL_FRAME_SIZE


def write_header(fd: int, number: int, store_id: bytes) -> None:
    os.write(fd, HEADER.pack(PACK_MAGIC, PACK_VERSION, 0, number, time.time_ns(), store_id))


def read_header(data: bytes, pack: str) -> int:
    if len(data) < HEADER_SIZE:
        raise Corrupt(pack, 0, "truncated pack header")
    magic, version, _flags, number, _created, _sid = HEADER.unpack_from(data)
    if magic != PACK_MAGIC:
        raise Corrupt(pack, 0, "not a strata pack (bad magic)")
    if version != PACK_VERSION:
        raise Corrupt(pack, 0, f"unsupported pack version {version}")
    return int(number)


def scan(path: str, start: int = HEADER_SIZE) -> ScanResult:
    """Read every record from `start`, telling a torn tail from real damage.

    A bad frame followed by no good frame is a torn tail (the last append did
    not finish). A bad frame with good frames after it is damage: it is
    reported and skipped by searching forward for the next good frame.
    """
    name = os.path.basename(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_SIZE:
            raise Corrupt(name, 0, "truncated pack header")
        # Map rather than read: packs are up to 256 MiB and only touched once here.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _scan_data(data, name, start)


def _scan_data(data: mmap.mmap, name: str, start: int) -> ScanResult:
    read_header(data[:HEADER_SIZE], name)
    records: list[Record] = []
    damaged: list[tuple[int, str]] = []
    pos = start
    end = start
    sealed = False
    n = len(data)
    while pos < n:
        try:
            rec = _parse_at(data, pos, name)
        except Corrupt as exc:
            nxt = _resync(data, pos + 1, name)
            if nxt is None:
                return ScanResult(records, end, damaged, True, sealed)
            damaged.append((pos, exc.detail))
            pos = nxt
            continue
        records.append(rec)
        pos += rec.length
        end = pos
        if rec.rtype == R_SEAL:
            sealed = True
    return ScanResult(records, end, damaged, False, sealed)


def _parse_at(data: mmap.mmap, pos: int, name: str) -> Record:
    if pos + FRAME_SIZE > len(data):
        raise Corrupt(name, pos, "truncated frame header")
    _m, _t, _f, length, _c = FRAME.unpack_from(data, pos)
    if length > MAX_PAYLOAD:
        raise Corrupt(name, pos, "implausible record length")
    frame = data[pos:pos + FRAME_SIZE + length]
    rtype, flags, payload = verify_frame(frame, name, pos)
    return Record(pos, FRAME_SIZE + length, rtype, flags, payload)


def _resync(data: mmap.mmap, pos: int, name: str) -> int | None:
    while True:
        pos = data.find(FRAME_MAGIC, pos)
        if pos < 0:
            return None
        try:
            _parse_at(data, pos, name)
            return pos
        except Corrupt:
            pos += 1


def complete_frame_at(path: str, offset: int) -> bool:
    """True if a frame header at `offset` claims a length that fits in the file."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(offset)
        head = f.read(FRAME_SIZE)
    if len(head) < FRAME_SIZE:
        return False
    magic, _t, _f, length, _c = FRAME.unpack(head)
    return bool(magic == FRAME_MAGIC and offset + FRAME_SIZE + length == size)


def iter_objects(rec: Record, pack: str) -> Iterator[tuple[int, bytes]]:
    """Yield (kind, id) of an object record without decompressing it."""
    if len(rec.payload) < OBJ_HEAD_SIZE:
        raise Corrupt(pack, rec.offset, "object record too short")
    kind, oid, _n = OBJ_HEAD.unpack_from(rec.payload)
    yield kind, oid


def object_from_record(rec: Record, pack: str) -> tuple[int, bytes, bytes]:
    return _object_payload(rec.flags, rec.payload, pack, rec.offset)
