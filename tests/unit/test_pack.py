"""Pack files: frame encoding, verification, scanning, torn tails and seals."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.engine import pack as packfmt
from strata.engine.errors import Corrupt
from strata.engine.objects import BLOCK, TREE, object_id

STORE_ID = bytes(range(16))
SYNC = bytes(range(100, 116))  # the pack's marker in these tests


def new_pack(path: Path, number: int = 7) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        packfmt.write_header(fd, number, STORE_ID, SYNC)
    finally:
        os.close(fd)


def framed(body: bytes) -> bytes:
    """A marker-less frame as the writer appends it: the pack's marker first."""
    return SYNC + body


def append(path: Path, data: bytes) -> int:
    with open(path, "ab") as f:
        off = f.tell()
        f.write(data)
    return off


def obj(raw: bytes, kind: int = BLOCK, compress: bool = False) -> bytes:
    return framed(packfmt.encode_object(kind, object_id(kind, raw), raw, compress))


def flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def test_header_layout_and_pack_name() -> None:
    assert packfmt.HEADER_SIZE == 56
    assert packfmt.FRAME_SIZE == 26
    assert packfmt.pack_name(0x1A) == "0000001a.pack"


def test_header_is_checked(tmp_path: Path) -> None:
    p = tmp_path / packfmt.pack_name(3)
    new_pack(p, 3)
    data = p.read_bytes()
    assert packfmt.read_header(data, p.name) == packfmt.PackInfo(3, packfmt.PACK_VERSION, SYNC, 56)
    # A version 1 pack (older strata): 40-byte header, frames start with "SR".
    v1 = packfmt.HEADER_V1.pack(packfmt.PACK_MAGIC, 1, 0, 3, 0, STORE_ID)
    assert packfmt.read_header(v1, p.name) == packfmt.PackInfo(3, 1, b"SR", 40)
    with pytest.raises(Corrupt, match="bad magic"):
        packfmt.read_header(b"NOTAPACK" + data[8:], p.name)
    with pytest.raises(Corrupt, match="version 99.*upgrade"):
        packfmt.read_header(data[:8] + struct.pack("<H", 99) + data[10:], p.name)
    with pytest.raises(Corrupt, match="truncated"):
        packfmt.read_header(data[:20], p.name)


@given(st.sampled_from([packfmt.R_OBJECT, packfmt.R_COMMIT]), st.binary(max_size=300),
       st.integers(0, 1))
def test_frame_round_trip(rtype: int, payload: bytes, flags: int) -> None:
    frame = framed(packfmt.encode_frame(rtype, payload, flags))
    assert len(frame) == packfmt.FRAME_SIZE + len(payload)
    assert frame[:16] == SYNC
    assert packfmt.verify_frame(frame, SYNC, "p", 0) == (rtype, flags, payload)


@given(st.binary(min_size=1, max_size=200), st.data())
def test_every_single_bit_flip_is_detected(payload: bytes, data: st.DataObject) -> None:
    frame = bytearray(framed(packfmt.encode_frame(packfmt.R_COMMIT, payload)))
    pos = data.draw(st.integers(0, len(frame) - 1))
    frame[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(Corrupt) as info:
        packfmt.verify_frame(bytes(frame), SYNC, "00000001.pack", 1234)
    assert info.value.pack == "00000001.pack"
    assert info.value.offset == 1234


@given(st.binary(max_size=5000), st.booleans())
def test_object_frame_round_trip(raw: bytes, compress: bool) -> None:
    oid = object_id(TREE, raw)
    frame = framed(packfmt.encode_object(TREE, oid, raw, compress))
    assert packfmt.decode_object(frame, SYNC, "p", 0) == (TREE, oid, raw)


def test_compression_only_when_it_pays() -> None:
    text = b"abc" * 2000
    small = obj(text, compress=True)
    assert len(small) < len(text) // 4
    assert packfmt.verify_frame(small, SYNC, "p", 0)[1] & packfmt.F_ZSTD
    noise = os.urandom(6000)
    frame = obj(noise, compress=True)
    assert packfmt.verify_frame(frame, SYNC, "p", 0)[1] == 0
    assert packfmt.decode_object(frame, SYNC, "p", 0)[2] == noise


def test_decode_object_refuses_other_record_types() -> None:
    frame = framed(packfmt.encode_frame(packfmt.R_COMMIT, b"x" * 50))
    with pytest.raises(Corrupt, match="expected an object record"):
        packfmt.decode_object(frame, SYNC, "p", 99)
    with pytest.raises(Corrupt, match="marker"):
        packfmt.decode_object(frame, bytes(16), "p", 99)


def test_object_with_wrong_length_header_is_corrupt() -> None:
    raw = b"payload"
    oid = object_id(BLOCK, raw)
    body = packfmt.OBJ_HEAD.pack(BLOCK, oid, len(raw) + 1) + raw
    with pytest.raises(Corrupt, match="length"):
        packfmt.decode_object(framed(packfmt.encode_frame(packfmt.R_OBJECT, body)), SYNC,
                              "p", 0)


def test_scan_reads_every_record(tmp_path: Path) -> None:
    p = tmp_path / "00000001.pack"
    new_pack(p)
    offsets = [append(p, obj(b"block %d" % i * (i + 1))) for i in range(20)]
    commit_off = append(p, framed(packfmt.encode_frame(packfmt.R_COMMIT, b"ops")))
    res = packfmt.scan(str(p))
    assert [r.offset for r in res.records] == offsets + [commit_off]
    assert res.records[-1].rtype == packfmt.R_COMMIT
    assert res.end == p.stat().st_size
    assert not res.torn and not res.damaged and not res.sealed
    kind, oid = next(packfmt.iter_objects(res.records[3], p.name))
    assert (kind, oid) == (BLOCK, object_id(BLOCK, b"block 3" * 4))
    # Scanning from a later record start sees only the rest.
    assert [r.offset for r in packfmt.scan(str(p), offsets[10]).records] == (
        offsets[10:] + [commit_off])


@pytest.mark.parametrize("cut", [1, 5, 11, 12, 13, 30])
def test_partial_last_frame_is_a_torn_tail(tmp_path: Path, cut: int) -> None:
    p = tmp_path / "00000001.pack"
    new_pack(p)
    for i in range(5):
        append(p, obj(b"r%d" % i * 40))
    good_end = p.stat().st_size
    append(p, obj(b"the record being written when the power went" * 3)[:cut])
    res = packfmt.scan(str(p))
    assert res.torn
    assert res.end == good_end
    assert res.damaged == []
    assert len(res.records) == 5


def test_garbage_after_the_last_record_is_a_torn_tail(tmp_path: Path) -> None:
    p = tmp_path / "00000001.pack"
    new_pack(p)
    append(p, obj(b"x" * 100))
    end = p.stat().st_size
    # Garbage that even contains the marker but no whole valid frame.
    append(p, b"\0" * 100 + SYNC + os.urandom(50) + SYNC + b"\x01")
    res = packfmt.scan(str(p))
    assert res.torn and res.end == end and not res.damaged


def test_damage_in_the_middle_is_reported_not_torn(tmp_path: Path) -> None:
    p = tmp_path / "00000001.pack"
    new_pack(p)
    offsets = [append(p, obj(os.urandom(200))) for _ in range(10)]
    flip(p, offsets[4] + packfmt.FRAME_SIZE + 60, 3)
    res = packfmt.scan(str(p))
    assert not res.torn
    assert [off for off, _ in res.damaged] == [offsets[4]]
    assert "checksum" in res.damaged[0][1]
    assert [r.offset for r in res.records] == offsets[:4] + offsets[5:]
    assert res.end == p.stat().st_size


def test_damaged_frame_header_resyncs_to_the_next_record(tmp_path: Path) -> None:
    p = tmp_path / "00000001.pack"
    new_pack(p)
    offsets = [append(p, obj(os.urandom(100))) for _ in range(6)]
    flip(p, offsets[2] + 16 + 5, 7)  # the high byte of the length field
    res = packfmt.scan(str(p))
    assert [off for off, _ in res.damaged] == [offsets[2]]
    assert [r.offset for r in res.records] == offsets[:2] + offsets[3:]
    assert not res.torn


def test_damage_in_the_last_record_looks_like_a_torn_tail(tmp_path: Path) -> None:
    # Nothing good follows it, so scan cannot tell it from an unfinished append.
    p = tmp_path / "00000001.pack"
    new_pack(p)
    offsets = [append(p, obj(os.urandom(100))) for _ in range(3)]
    flip(p, offsets[2] + 40)
    res = packfmt.scan(str(p))
    assert res.torn and res.end == offsets[2] and not res.damaged


def test_seal_detection(tmp_path: Path) -> None:
    p = tmp_path / "00000001.pack"
    new_pack(p)
    assert not packfmt.is_sealed(str(p))
    append(p, obj(b"a" * 300))
    assert not packfmt.is_sealed(str(p))
    size = p.stat().st_size
    append(p, packfmt.seal_frame(size, SYNC))
    assert packfmt.is_sealed(str(p))
    res = packfmt.scan(str(p))
    assert res.sealed and res.records[-1].rtype == packfmt.R_SEAL
    assert res.end == size + packfmt.FRAME_SIZE + packfmt.SEAL_PAYLOAD.size


def test_a_seal_naming_the_wrong_offset_does_not_seal(tmp_path: Path) -> None:
    p = tmp_path / "00000001.pack"
    new_pack(p)
    append(p, obj(b"a" * 300))
    append(p, packfmt.seal_frame(12345, SYNC))
    assert not packfmt.is_sealed(str(p))


def test_a_damaged_seal_does_not_seal(tmp_path: Path) -> None:
    p = tmp_path / "00000001.pack"
    new_pack(p)
    append(p, obj(b"a" * 300))
    off = append(p, packfmt.seal_frame(p.stat().st_size, SYNC))
    flip(p, off + packfmt.FRAME_SIZE + 1)
    assert not packfmt.is_sealed(str(p))


def test_a_seal_that_is_not_last_does_not_seal(tmp_path: Path) -> None:
    p = tmp_path / "00000001.pack"
    new_pack(p)
    append(p, packfmt.seal_frame(p.stat().st_size, SYNC))
    append(p, obj(b"written after the seal"))
    assert not packfmt.is_sealed(str(p))


def _forged_commit(marker: bytes) -> bytes:
    """A well-formed commit frame a client could hide inside a block it uploads."""
    from strata.engine.objects import packb
    return marker + packfmt.encode_frame(packfmt.R_COMMIT, packb(
        {"t": 1, "ops": [["vol+", "pwned"]]}))


@pytest.mark.parametrize("damage", ["header", "payload", "none"])
def test_bytes_inside_a_payload_are_never_read_as_a_frame(tmp_path: Path, damage: str) -> None:
    """A block holding forged frames (v1 magic, guessed markers) stays a block.

    Whatever the damage around it, the scan resynchronises only on the pack's
    own random marker, which no client ever sees.
    """
    p = tmp_path / "00000001.pack"
    new_pack(p)
    before = append(p, obj(os.urandom(300)))
    forged = b"".join(_forged_commit(m) for m in (b"SR", bytes(16), b"\xff" * 16))
    hostile = append(p, obj(os.urandom(40) + forged + os.urandom(40)))
    after = append(p, obj(os.urandom(300)))
    if damage == "header":
        flip(p, before + 16 + 3, 6)  # the length of the record before it
    elif damage == "payload":
        flip(p, hostile + packfmt.FRAME_SIZE + 10)  # the hostile record itself
    res = packfmt.scan(str(p))
    assert all(r.rtype == packfmt.R_OBJECT for r in res.records), res.records
    assert {r.offset for r in res.records} <= {before, hostile, after}
    assert after in {r.offset for r in res.records}
    assert not res.torn


def test_a_record_over_the_payload_limit_is_refused_when_written() -> None:
    from strata.engine.errors import InvalidInput
    with pytest.raises(InvalidInput, match="over the limit"):
        packfmt.encode_frame(packfmt.R_OBJECT, bytes(packfmt.MAX_PAYLOAD + 1))


def test_version_1_packs_are_still_read(tmp_path: Path) -> None:
    p = tmp_path / "00000001.pack"
    v1_frame = b"SR" + packfmt.encode_frame(packfmt.R_COMMIT, b"old")
    p.write_bytes(packfmt.HEADER_V1.pack(packfmt.PACK_MAGIC, 1, 0, 1, 0, STORE_ID) + v1_frame)
    res = packfmt.scan(str(p))
    assert [(r.offset, r.payload) for r in res.records] == [(40, b"old")]
