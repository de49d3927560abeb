"""Validation of user-supplied names: paths, volume and branch names, ids.

Every string that crosses into the engine from outside goes through one of
these functions first. They never touch the disk.
"""

from __future__ import annotations

import re

from strata.engine.errors import InvalidInput

MAX_NAME = 255
MAX_PATH = 4096
_VOLUME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX_RE = re.compile(r"[0-9a-f]+")


def split_path(path: str) -> tuple[str, ...]:
    """Split a volume-relative path into its components, refusing hostile ones.

    The root is the empty string. Absolute paths, empty components (``a//b``,
    a trailing slash), ``.`` and ``..``, NUL bytes and names over 255 bytes
    are refused with `InvalidInput`.
    """
    if not isinstance(path, str):
        raise InvalidInput(f"path must be a string, not {type(path).__name__}")
    if path == "":
        return ()
    if "\0" in path:
        raise InvalidInput("path contains a NUL byte")
    if path.startswith("/"):
        raise InvalidInput(f"path must be relative to the volume root: {path!r}")
    encoded = _encode(path)
    if len(encoded) > MAX_PATH:
        raise InvalidInput(f"path is longer than {MAX_PATH} bytes")
    parts = tuple(path.split("/"))
    for part in parts:
        if part == "":
            raise InvalidInput(f"path has an empty component: {path!r}")
        if part in (".", ".."):
            raise InvalidInput(f"path may not contain {part!r}: {path!r}")
        if len(_encode(part)) > MAX_NAME:
            raise InvalidInput(f"name is longer than {MAX_NAME} bytes: {part[:40]!r}...")
    return parts


def check_name(name: bytes) -> bytes:
    """One directory entry's name as stored: any bytes but ``/`` and NUL, not ``.``/``..``.

    Names inside tree nodes come from clients like everything else; a name
    that is not a single component could point outside its directory.
    """
    if not isinstance(name, bytes) or not name:
        raise InvalidInput("a directory entry has an empty name")
    if len(name) > MAX_NAME:
        raise InvalidInput(f"a directory entry's name is longer than {MAX_NAME} bytes")
    if b"/" in name or b"\0" in name:
        raise InvalidInput(f"a directory entry's name contains '/' or NUL: {name[:40]!r}")
    if name in (b".", b".."):
        raise InvalidInput(f"a directory entry is named {name.decode()!r}")
    return name


def check_path(path: str) -> str:
    """Return `path` unchanged if it is acceptable, else raise `InvalidInput`."""
    split_path(path)
    return path


def _encode(s: str) -> bytes:
    try:
        return s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:  # a lone surrogate that no byte string can carry
        raise InvalidInput(f"path is not encodable as bytes: {s[:40]!r}") from exc


def check_volume(name: str) -> str:
    """Volume names: 1-128 of ``[A-Za-z0-9._-]``, not starting with a dot or dash."""
    if not isinstance(name, str) or not _VOLUME_RE.fullmatch(name):
        raise InvalidInput(f"invalid volume name {name!r} (use letters, digits, '.', '_', '-')")
    return name


def check_branch(name: str) -> str:
    """Branch names: segments like volume names joined by ``/`` (``run/abc``)."""
    if not isinstance(name, str) or len(name) > 255:
        raise InvalidInput(f"invalid branch name {name!r}")
    for seg in name.split("/"):
        if not _VOLUME_RE.fullmatch(seg):
            raise InvalidInput(
                f"invalid branch name {name!r} (segments of letters, digits, '.', '_', '-')")
    return name


def check_hex_id(value: str, *, min_len: int = 64) -> str:
    """A full (64 hex digits) or, with `min_len` lower, a prefix snapshot id."""
    if (not isinstance(value, str) or not (min_len <= len(value) <= 64)
            or not _HEX_RE.fullmatch(value)):
        if min_len == 64:
            raise InvalidInput(f"invalid snapshot id {value!r} (64 lowercase hex digits)")
        raise InvalidInput(
            f"invalid snapshot id {value!r} ({min_len} to 64 lowercase hex digits)")
    return value
