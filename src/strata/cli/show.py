"""How the CLI shows names and entries, with nothing heavier than the standard library.

Shared by the commands (through `common`) and by the fast `ls` (`fastls`),
which must not import the engine's codecs: an entry is taken here in its
list form (docs/format.md, "Entries"), as `Entry.to_list` gives it and as
the lean stream's `list` answers it.
"""

from __future__ import annotations

import os
import stat as statmod
import sys
import time

from strata.engine.kinds import ENTRY_KIND_NAMES, IFMT, K_DIR, K_SYMLINK

TYPE_CHECKING = False  # typing costs the CLI's fast path milliseconds to import
if TYPE_CHECKING:
    from typing import Any

_C_ESCAPES = {"\a": "a", "\b": "b", "\t": "t", "\n": "n", "\v": "v", "\f": "f", "\r": "r",
              '"': '"', "\\": "\\"}


def quote_path(path: str) -> str:
    r"""A name as git shows it, quoted only when it must be.

    Printable UTF-8 stays as is; anything else goes in double quotes with C
    escapes, and the bytes that are not UTF-8 in octal ("caf\351.txt").
    Names hold any bytes but / and NUL; in strata's strings a byte that is not
    UTF-8 is a lone surrogate (Python's surrogateescape). `unquote_path` reads
    the quoted form back, so a name shown can be typed as shown.
    """
    if path.isprintable() and '"' not in path and "\\" not in path:
        return path
    out = []
    for ch in path:
        if ch in _C_ESCAPES:
            out.append("\\" + _C_ESCAPES[ch])
        elif 0xDC80 <= ord(ch) <= 0xDCFF:  # a byte that was not UTF-8
            out.append(f"\\{ord(ch) - 0xDC00:03o}")
        elif not ch.isprintable():
            out.extend(f"\\{b:03o}" for b in ch.encode("utf-8", "surrogateescape"))
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def unquote_path(arg: str) -> str:
    """A path argument as the user meant it: a git-style quoted name is unescaped."""
    if len(arg) < 2 or not (arg.startswith('"') and arg.endswith('"')):
        return arg
    body = arg[1:-1]
    raw = bytearray()
    i = 0
    reverse = {v: k for k, v in _C_ESCAPES.items()}
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt in "01234567" and i + 3 < len(body) + 1 and all(
                    c in "01234567" for c in body[i + 1:i + 4]) and len(body[i + 1:i + 4]) == 3:
                raw.append(int(body[i + 1:i + 4], 8) & 0xFF)
                i += 4
                continue
            if nxt in reverse:
                raw.extend(reverse[nxt].encode())
                i += 2
                continue
        raw.extend(ch.encode("utf-8", "surrogateescape"))
        i += 1
    return raw.decode("utf-8", "surrogateescape")


def show_path(path: str) -> str:
    """How the CLI prints a name: quoted on a terminal, the raw bytes into a pipe (as ls)."""
    return quote_path(path) if sys.stdout.isatty() else path


def fmt_time(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def print_json(value: Any) -> None:
    import json
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_changes(rows: list[dict[str, Any]], *, as_json: bool) -> None:
    """A diff's rows ({"path", "change"}): JSON, or one `A|M|D  path` line each."""
    if as_json:
        print_json(rows)
        return
    for r in rows:
        print(f"{r['change'][0].upper()}  {show_path(r['path'])}")


# Fields of an entry's list form.
KIND, MODE, UID, GID, MTIME, SIZE, REF, DATA, RDEV, XATTRS, INO, NLINK = range(12)


def entry_info(path: str, v: list[Any]) -> dict[str, Any]:
    """An entry (list form) as `strata stat --json` and `ls --json` print it."""
    out: dict[str, Any] = {
        "path": path, "type": ENTRY_KIND_NAMES[v[KIND]], "mode": f"{v[MODE]:04o}",
        "uid": v[UID], "gid": v[GID], "size": v[SIZE], "mtime_ns": v[MTIME],
        "nlink": v[NLINK],
    }
    if v[INO]:
        out["ino"] = v[INO]
    if v[KIND] == K_SYMLINK:
        out["target"] = os.fsdecode(v[DATA] or b"")
    if v[RDEV]:
        out["rdev"] = [os.major(v[RDEV]), os.minor(v[RDEV])]
    if v[XATTRS]:
        out["xattrs"] = {os.fsdecode(k): val.decode("utf-8", "backslashreplace")
                         for k, val in v[XATTRS]}
    return out


def long_line(name: str, v: list[Any]) -> str:
    """One line of `ls -l` for an entry (list form)."""
    rdev = v[RDEV]
    size = f"{os.major(rdev)}, {os.minor(rdev)}" if rdev else str(v[SIZE])
    st_mode = IFMT[v[KIND]] | (v[MODE] & 0o7777)
    line = (f"{statmod.filemode(st_mode)} {v[NLINK]:>2} {v[UID]:>5} {v[GID]:>5} {size:>10} "
            f"{fmt_time(v[MTIME])} {name}")
    if v[KIND] == K_SYMLINK:
        line += f" -> {os.fsdecode(v[DATA] or b'')}"
    elif v[KIND] == K_DIR:
        line += "/"
    return line


def fmt_duration(seconds: float) -> str:
    """90 -> 1m30s, 86400 -> 1d: as `--keep-newer` and `--ttl` take them."""
    s = int(round(seconds))
    if s <= 0:
        return "0s"
    out = []
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size:
            out.append(f"{s // size}{unit}")
            s %= size
    return "".join(out[:2])


def fmt_value(key: str, value: Any) -> str:
    """A stats value for people: lists joined, None as '-', times as dates, bytes in units."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt_value(key, v) for v in value) if value else "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt_value(k, v)}" for k, v in value.items()) if value else "-"
    if isinstance(value, float) and key in ("started", "time", "at") and value > 1e9:
        return fmt_time(int(value * 1e9))
    if isinstance(value, (int, float)) and "bytes" in key and value >= 1024:
        n = float(value)
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if n < 1024:
                return f"{n:.1f} {unit}"
            n /= 1024
        return f"{n:.1f} PiB"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
