"""Where pack bytes live, behind one small interface.

The journal, recovery, the indexer's readers and fsck reach pack bytes only
through a `PackStore`: they name packs by number and never see a path or a
file descriptor. `LocalPacks` keeps them as files in `STORE/packs/`; a later
tier (a local cache in front of a bucket, fetching evicted packs with ranged
reads) is another implementation, and the rest of the engine does not change.

What every implementation promises (docs/design.md, "Pack storage"):

- `numbers()` lists the packs in ascending order; a new pack takes the
  number after the newest.
- Bytes a `PackWriter` wrote are durable once its `datasync()` returns, and
  `create`, `open_append` and `sync` return only once what the pack holds
  so far (and, for `create`, that the pack exists) is durable.
- A sealed pack never changes again: `pread` and `mapped` of it return the
  same bytes forever. Only the newest unsealed pack is written, and only
  through its one writer; `cut` (recovery's torn-tail truncation) and
  `remove` are the only other changes, made before anything is appended.

Format knowledge stays in pack.py: this module moves bytes, except that a
pack's header is parsed once here so that readers need not read it again.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager

from strata.engine import pack as packfmt
from strata.engine.errors import Corrupt
from strata.engine.storedir import fsync_dir, make_private


class PackWriter(ABC):
    """The open end of the one pack being appended to."""

    @abstractmethod
    def write(self, data: bytes | memoryview) -> int:
        """Append `data`; return how many bytes were written (possibly fewer, as os.write)."""

    @abstractmethod
    def truncate(self, size: int) -> None:
        """Cut the pack back to `size` bytes: undoes an append that failed."""

    @abstractmethod
    def datasync(self) -> None:
        """Return once every byte written so far is durable."""

    def seal_sync(self) -> None:
        """Make a seal durable: as `datasync`, but it acknowledges nothing.

        So no gate may refuse it: a refused seal sync left the journal's tail
        before a seal already written, and the next record landed past it.
        """
        self.datasync()

    @abstractmethod
    def close(self) -> None: ...


class PackStore(ABC):
    """The packs of one store, by number (see the module docstring for the promises)."""

    @abstractmethod
    def numbers(self) -> list[int]:
        """Every pack's number, in ascending order."""

    @abstractmethod
    def size(self, number: int) -> int: ...

    @abstractmethod
    def pread(self, number: int, length: int, offset: int) -> bytes:
        """`length` bytes at `offset` (fewer at the pack's end), as os.pread."""

    @abstractmethod
    def info(self, number: int) -> packfmt.PackInfo:
        """A pack's header (its format and sync marker), read once and kept."""

    @abstractmethod
    def mapped(self, number: int) -> AbstractContextManager[packfmt.Buffer]:
        """The whole pack's bytes, for a scan, while the context lasts."""

    def label(self, number: int) -> str:
        """How errors name the pack: where its bytes were read from."""
        return packfmt.pack_name(number)

    def verify_reads(self, number: int) -> bool:
        """Whether objects read from this pack must be hashed against their ids.

        True for bytes that came from outside the store's own disk.
        """
        return False

    @abstractmethod
    def create(self, number: int, header: bytes) -> PackWriter:
        """Make a new pack holding `header`; it and its header are durable on return."""

    @abstractmethod
    def open_append(self, number: int) -> PackWriter:
        """Open an existing unsealed pack to append to; what it holds is durable on return."""

    @abstractmethod
    def sync(self, number: int) -> None:
        """Make what a pack holds durable (one that will not be appended to again)."""

    @abstractmethod
    def seal(self, number: int) -> None:
        """The pack (its writer closed, its seal record durable) never changes again."""

    @abstractmethod
    def cut(self, number: int, size: int) -> None:
        """Truncate a torn tail at `size`, durably (recovery on open only)."""

    @abstractmethod
    def remove(self, number: int) -> None:
        """Delete a pack, durably (recovery on open only: one that never got its header)."""

    @abstractmethod
    def close(self) -> None: ...


class LocalPacks(PackStore):
    """Packs as files in one directory; read through a cache of read-only descriptors."""

    def __init__(self, path: str) -> None:
        self.path = path
        make_private(path)
        self._read_fds: dict[int, int] = {}
        self._read_fds_guard = threading.Lock()
        self._infos: dict[int, packfmt.PackInfo] = {}

    def _path(self, number: int) -> str:
        return os.path.join(self.path, packfmt.pack_name(number))

    def numbers(self) -> list[int]:
        out = []
        for name in os.listdir(self.path):
            if name.endswith(".pack") and len(name) == 13:
                try:
                    out.append(int(name[:8], 16))
                except ValueError:
                    continue
        return sorted(out)

    def size(self, number: int) -> int:
        return os.path.getsize(self._path(number))

    def _read_fd(self, number: int) -> int:
        fd = self._read_fds.get(number)
        if fd is None:
            with self._read_fds_guard:
                fd = self._read_fds.get(number)
                if fd is None:
                    fd = os.open(self._path(number), os.O_RDONLY)
                    self._read_fds[number] = fd
        return fd

    def pread(self, number: int, length: int, offset: int) -> bytes:
        return os.pread(self._read_fd(number), length, offset)

    def info(self, number: int) -> packfmt.PackInfo:
        info = self._infos.get(number)
        if info is None:
            name = packfmt.pack_name(number)
            info = packfmt.read_header(self.pread(number, packfmt.HEADER_SIZE, 0), name)
            if info.number != number:
                raise Corrupt(name, 0, f"header names pack {info.number}")
            self._infos[number] = info
        return info

    @contextlib.contextmanager
    def mapped(self, number: int) -> Iterator[packfmt.Buffer]:
        with open(self._path(number), "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                yield b""  # mmap refuses an empty file; the scan reports it
                return
            # Map rather than read: packs are up to 256 MiB and scanned once.
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                yield data

    def create(self, number: int, header: bytes) -> PackWriter:
        fd = os.open(self._path(number), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL,
                     0o600)
        os.write(fd, header)
        os.fsync(fd)
        fsync_dir(self.path)
        return LocalWriter(fd)

    def open_append(self, number: int) -> PackWriter:
        fd = os.open(self._path(number), os.O_WRONLY | os.O_APPEND)
        os.fsync(fd)
        return LocalWriter(fd)

    def sync(self, number: int) -> None:
        fd = os.open(self._path(number), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def seal(self, number: int) -> None:
        os.chmod(self._path(number), 0o400)

    def cut(self, number: int, size: int) -> None:
        path = self._path(number)
        if os.stat(path).st_mode & 0o200 == 0:
            os.chmod(path, 0o600)
        with open(path, "r+b") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())

    def remove(self, number: int) -> None:
        # A later pack may be created under this number: forget what was read of this one.
        fd = self._read_fds.pop(number, None)
        if fd is not None:
            os.close(fd)
        self._infos.pop(number, None)
        os.remove(self._path(number))
        fsync_dir(self.path)

    def adopt(self, number: int, data: bytes) -> None:
        """Keep a sealed pack fetched from elsewhere (a bucket), durably and read-only."""
        tmp = self._path(number) + ".part"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o400)
        os.rename(tmp, self._path(number))
        fsync_dir(self.path)

    def open_raw(self, number: int) -> int:
        """A read-write descriptor of a pack, created if absent (a restore rebuilds packs)."""
        return os.open(self._path(number), os.O_RDWR | os.O_CREAT, 0o600)

    def close(self) -> None:
        for fd in self._read_fds.values():
            os.close(fd)
        self._read_fds.clear()


class LocalWriter(PackWriter):
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes | memoryview) -> int:
        return os.write(self.fd, data)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def datasync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
