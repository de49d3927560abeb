"""The one reader of /proc/PID/mountinfo: what is mounted where, in this mount namespace.

Every part of strata that asks the kernel what is mounted (the mount's
overlays and read-ahead, the runner's sweep, workspaces' clean-up) reads it
here. A mount point arrives as bytes with space, tab, newline and backslash
written as octal escapes (a space is backslash, 040); it is unescaped here
once, byte for byte, and given back as the str `os.fsdecode` makes of those
bytes (names that are not UTF-8 survive as surrogate escapes, as every os
function takes them).
Nothing here mounts or unmounts anything.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class Mount(NamedTuple):
    """One line of mountinfo (proc(5)); the fields strata reads."""

    device: str      # "major:minor" of the filesystem (st_dev)
    point: str       # the mount point, unescaped
    fstype: str      # after the " - " separator, e.g. "fuse.strata", "overlay", "ext4"

    @property
    def fuse_connection(self) -> int | None:
        """The FUSE connection number (/sys/fs/fuse/connections/N) if this is FUSE."""
        major, _, minor = self.device.partition(":")
        if self.fstype.split(".")[0] in ("fuse", "fuseblk") and major == "0" and minor.isdigit():
            return int(minor)
        return None


def unescape(field: bytes) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes come as octal escapes."""
    out = bytearray()
    i = 0
    while i < len(field):
        digits = field[i + 1:i + 4]
        if field[i] == 0x5C and len(digits) == 3 and all(0x30 <= c <= 0x37 for c in digits):
            out.append(int(digits, 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return os.fsdecode(bytes(out))


def parse(text: bytes | str) -> list[Mount]:
    """The mounts a mountinfo text lists, in its order (mount order); odd lines skipped."""
    data = os.fsencode(text) if isinstance(text, str) else text
    out = []
    for line in data.splitlines():
        fields = line.split()
        try:
            fstype = fields[fields.index(b"-", 6) + 1]
        except (ValueError, IndexError):
            continue  # not a mountinfo line (proc(5) guarantees the separator)
        out.append(Mount(os.fsdecode(fields[2]), unescape(fields[4]), os.fsdecode(fstype)))
    return out


def read(pid: int | str = "self") -> list[Mount]:
    """The mounts of `pid`'s mount namespace (this process's by default)."""
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        return parse(f.read())
