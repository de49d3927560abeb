"""Sealing what strata puts in a bucket with the store's key, and opening it again.

A bucket is outside the store: anyone who can write to it could plant a log
record, rewrite a checkpoint or alter a pack, and an unkeyed hash would
match their bytes as well as ours. So every object strata relies on is
sealed with a per-store secret key that never leaves the store directory
(`bucket.key`) and the hands of whoever restores it:

- the object is cut into chunks of `CHUNK` bytes, each authenticated on its
  own, so a ranged read of a pack's window or an index run's block verifies
  what it fetched without reading the rest;
- every chunk's tag covers the object's header (its length and random salt),
  its **name** (an object cannot be replayed under another name), the
  chunk's number and whether it is the last (chunks cannot be reordered,
  dropped or cut off);
- encrypted objects use ChaCha20-Poly1305 (the `cryptography` package) under
  a key of their own, derived from the store's encryption subkey and the
  object's 16-byte random salt, with the chunk number and last-chunk flag as
  the nonce (the STREAM construction age uses), so no nonce is ever used
  twice under one key; unencrypted ones carry a 16-byte keyed BLAKE3 tag per
  chunk. The MAC and encryption subkeys are derived from the secret with
  BLAKE3's derive_key mode.

What this module must never do: read a key from anywhere but the bytes it is
given (the CLI finds key files), or return bytes that did not verify.
The layout is in docs/format.md ("Sealed objects"); what a bucket writer
without the key can and cannot do is in the same section.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from strata.engine.errors import Corrupt, InvalidInput, NotFound, Unauthentic

KEY_FILE = "bucket.key"          # in the store directory, 0600, never uploaded
KEY_MAGIC = "strata-bucket-key"
KEY_VERSION = 1
KEY_BYTES = 32
MAGIC = b"STRB"
VERSION = 1
HEADER = struct.Struct("<4sBBHIQ16s")  # magic, version, flags, 0, chunk size, length, salt
CHUNK = 64 << 10   # a 1 MiB window of a pack is 16 chunks; an index-run block, one or two
MAX_CHUNK = 16 << 20
TAG = 16
ENCRYPTED = 1      # flag bit 0: ChaCha20-Poly1305; clear: keyed BLAKE3 tags, plaintext
_MAC_CONTEXT = "strata bucket 2025-06 object authentication"
_ENC_CONTEXT = "strata bucket 2025-06 object encryption"


def sealed_size(length: int, chunk: int = CHUNK) -> int:
    """Bytes a sealed object of `length` bytes of content takes in the bucket."""
    return HEADER.size + length + TAG * _chunks(length, chunk)


def _chunks(length: int, chunk: int) -> int:
    return max(1, -(-length // chunk))  # an empty object still has its (last) chunk


def _nonce(i: int, last: bool) -> bytes:
    return i.to_bytes(11, "big") + (b"\x01" if last else b"\x00")


@dataclass(frozen=True, slots=True)
class Header:
    """A sealed object's header, as read (trusted only once a chunk verifies under it)."""

    raw: bytes
    flags: int
    chunk: int
    length: int
    salt: bytes

    @classmethod
    def parse(cls, name: str, data: bytes) -> Header:
        if len(data) < HEADER.size or data[:4] != MAGIC:
            raise Unauthentic(name, 0, "it is not sealed (written without the store's key: "
                                       "by someone else, or by a strata before bucket format 2)")
        magic, version, flags, zero, chunk, length, salt = HEADER.unpack_from(data)
        if version != VERSION:
            raise Corrupt(name, 4, f"sealed object version {version} is not one this strata "
                                   f"reads ({VERSION}); upgrade strata")
        if flags & ~ENCRYPTED or zero or not 0 < chunk <= MAX_CHUNK:
            raise Unauthentic(name, 0, "its header is not one strata writes")
        return cls(bytes(data[:HEADER.size]), flags, chunk, length, salt)

    @property
    def chunks(self) -> int:
        return _chunks(self.length, self.chunk)

    def stored(self) -> int:
        return sealed_size(self.length, self.chunk)

    def span(self, start: int, end: int) -> tuple[int, int, int]:
        """The chunks holding content bytes [start, end): (first, stored start, stored end)."""
        first = min(start // self.chunk, self.chunks - 1)
        last = min(max(end - 1, start) // self.chunk, self.chunks - 1)
        at = HEADER.size + first * (self.chunk + TAG)
        upto = HEADER.size + min((last + 1) * self.chunk, self.length) + (last + 1) * TAG
        return first, at, upto


class BucketKey:
    """A store's bucket key: seals objects on the way out and opens them on the way in.

    `encrypt` is how this writer seals; a reader opens either kind (the kind is
    in each object's authenticated header).
    """

    def __init__(self, secret: bytes, *, encrypt: bool = True) -> None:
        if len(secret) != KEY_BYTES:
            raise InvalidInput(f"a bucket key is {KEY_BYTES} bytes, not {len(secret)}")
        self._mac = blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()
        self._enc = blake3.blake3(secret, derive_key_context=_ENC_CONTEXT).digest()
        self.encrypt = encrypt

    def _aead(self, salt: bytes) -> ChaCha20Poly1305:
        return ChaCha20Poly1305(blake3.blake3(salt, key=self._enc).digest())

    def _tag(self, ad: bytes, nonce: bytes, part: bytes | memoryview) -> bytes:
        h = blake3.blake3(key=self._mac)
        h.update(ad)
        h.update(nonce)
        h.update(part)
        return h.digest(TAG)

    def seal(self, name: str, data: bytes) -> bytes:
        """`data` sealed for the bucket object `name`."""
        view = memoryview(data)
        return b"".join(self.seal_chunks(name, len(data),
                                         lambda at, size: view[at:at + size]))

    def seal_chunks(self, name: str, length: int,
                    read: Callable[[int, int], bytes | memoryview]) -> Iterator[bytes]:
        """`seal` of `length` bytes that `read(offset, size)` gives a chunk at a time.

        The same bytes as `seal`, in pieces (the header, then each sealed
        chunk), so a large object is never whole in memory on this side.
        """
        salt = os.urandom(16)
        flags = ENCRYPTED if self.encrypt else 0
        header = HEADER.pack(MAGIC, VERSION, flags, 0, CHUNK, length, salt)
        ad = header + name.encode()
        aead = self._aead(salt) if self.encrypt else None
        n = _chunks(length, CHUNK)
        yield header
        for i in range(n):
            size = min(CHUNK, length - i * CHUNK)
            part = read(i * CHUNK, size)
            if len(part) != size:
                raise ValueError(f"{name}: {len(part)} bytes read at {i * CHUNK}, not {size}")
            nonce = _nonce(i, i == n - 1)
            if aead is not None:
                yield aead.encrypt(nonce, part, ad)
            else:
                yield bytes(part) + self._tag(ad, nonce, part)

    def open(self, name: str, data: bytes) -> bytes:
        """The content of the whole sealed object `name`; `Unauthentic` unless it verifies."""
        header = Header.parse(name, data)
        if len(data) != header.stored():
            raise Unauthentic(name, 0, f"it is {len(data)} bytes, its header says "
                                       f"{header.stored()} (cut short or extended)")
        return self.open_chunks(name, header, 0, memoryview(data)[HEADER.size:])

    def open_chunks(self, name: str, header: Header, first: int,
                    data: bytes | memoryview) -> bytes:
        """Content of the consecutive chunks from `first` whose sealed bytes are `data`."""
        ad = header.raw + name.encode()
        aead = self._aead(header.salt) if header.flags & ENCRYPTED else None
        view = memoryview(data)
        out = []
        i, at = first, 0
        while at < len(view):
            size = min(header.chunk, header.length - i * header.chunk)
            if size < 0 or i >= header.chunks:
                raise Unauthentic(name, 0, "it holds more chunks than its header says")
            part = view[at:at + size + TAG]
            at += size + TAG
            if len(part) != size + TAG:
                raise Unauthentic(name, HEADER.size + i * (header.chunk + TAG),
                                  f"chunk {i} is cut short")
            nonce = _nonce(i, i == header.chunks - 1)
            if aead is not None:
                try:
                    out.append(aead.decrypt(nonce, part, ad))
                except InvalidTag:
                    raise Unauthentic(name, HEADER.size + i * (header.chunk + TAG),
                                      f"chunk {i} does not verify under the store's key "
                                      "(altered, forged, put under another name, or sealed "
                                      "with another key)") from None
            else:
                body = part[:size]
                if self._tag(ad, nonce, body) != part[size:]:
                    raise Unauthentic(name, HEADER.size + i * (header.chunk + TAG),
                                      f"chunk {i} does not verify under the store's key "
                                      "(altered, forged, put under another name, or sealed "
                                      "with another key)")
                out.append(bytes(body))
            i += 1
        return b"".join(out)


# -- the key file -------------------------------------------------------------------------


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def format_key(secret: bytes) -> bytes:
    """The key file's bytes: a magic and version line, then the key as hex."""
    return f"{KEY_MAGIC} {KEY_VERSION}\n{secret.hex()}\n".encode()


def write_key_file(path: str, secret: bytes) -> None:
    """Create a key file, mode 0600, durably; refuses to replace one."""
    from strata.engine.storedir import fsync_dir
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, format_key(secret))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path) or ".")


def read_key_file(path: str) -> bytes:
    """The key in a key file (`strata init --bucket` writes one into the store)."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read(4096)
    except FileNotFoundError:
        raise NotFound(f"no bucket key file at {path}") from None
    if not stat.S_ISREG(mode):
        raise InvalidInput(f"{path} is not a file")
    lines = text.decode("ascii", "replace").split()
    if len(lines) != 3 or lines[0] != KEY_MAGIC:
        raise InvalidInput(f"{path} is not a strata bucket key file")
    if lines[1] != str(KEY_VERSION):
        raise InvalidInput(f"{path} is a bucket key file of version {lines[1]}; this strata "
                           f"reads version {KEY_VERSION}")
    try:
        secret = bytes.fromhex(lines[2])
    except ValueError:
        raise InvalidInput(f"{path} does not hold a key in hex") from None
    if len(secret) != KEY_BYTES:
        raise InvalidInput(f"the key in {path} is {len(secret)} bytes, not {KEY_BYTES}")
    return secret
