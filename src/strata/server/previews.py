"""A file's content as the web view shows it: bytes, what they are, text, SQLite, diffs.

Every function here takes a store and an entry and returns plain values,
bounded: a file's size is its file node's (an entry's own size is a claim:
one claiming 1,000 bytes over a 256 MiB node once reached the SQLite
view's temporary file whole), holes are read as slices of one buffer of
zeros, text stops at TEXT_LIMIT bytes and LINE_LIMIT lines, a unified diff
takes DIFF_FILE_LIMIT bytes a side, and a SQLite file is opened read-only
and immutable, each query stopped after SQLITE_STEPS steps.

They block (the web view runs them in the executor, server/ui.py) and never
touch HTTP, nor write to the store.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import sqlite3
import tempfile
import urllib.parse
from collections.abc import Iterator
from typing import Any

from strata.engine.interface import Store
from strata.engine.names import split_path
from strata.engine.objects import K_FILE, Entry, FileNode
from strata.engine.tree import Trees

TEXT_LIMIT = 2 * 1024 * 1024   # bytes of a text file shown
LINE_LIMIT = 20_000
DIFF_FILE_LIMIT = 1024 * 1024  # each side of a unified diff
SQLITE_LIMIT = 64 * 1024 * 1024
SQLITE_ROWS = 100
SQLITE_TABLES = 50
SQLITE_STEPS = 2_000_000  # VM steps per query before it is stopped
SQLITE_ANSWER = 4 * 1024 * 1024  # characters of cells in one SQLite answer, about
SNIFF = 8192          # bytes `sniff` looks at
ZEROS = memoryview(bytes(1024 * 1024))  # holes are read as slices of this, never allocated
IMAGES = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg",
          b"GIF87a": "image/gif", b"GIF89a": "image/gif"}


def file_node(store: Store, e: Entry) -> FileNode | None:
    """A file's node, None for content kept in the entry."""
    return FileNode.decode(store.get_object(e.ref)) if e.ref is not None else None


def file_size(e: Entry, node: FileNode | None) -> int:
    """A file's size: its node's, never the entry's claim.

    Publish refuses an entry whose size differs from its node's, but a store
    may hold entries from before that check.
    """
    return node.size if node is not None else len(e.data or b"")


def read_file(store: Store, e: Entry, limit: int | None = None, node: FileNode | None = None
              ) -> Iterator[bytes | memoryview]:
    """A file's bytes, piece by piece (at most `limit` bytes); holes cost no memory."""
    if e.ref is None:
        yield (e.data or b"")[:limit]
        return
    if node is None:
        node = FileNode.decode(store.get_object(e.ref))
    size = node.size if limit is None else min(node.size, limit)
    if size <= 0:
        return
    for length, data in node.pieces(0, size, store.get_object):
        if data is not None:
            yield data
            continue
        while length > 0:
            n = min(length, len(ZEROS))
            yield ZEROS[:n]
            length -= n


def sniff(head: bytes) -> str:
    """What a file's first bytes say it is: image/…, sqlite, text or binary."""
    for magic, ctype in IMAGES.items():
        if head.startswith(magic):
            return ctype
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "image/webp"
    if head.startswith(b"SQLite format 3\x00"):
        return "sqlite"
    if b"\x00" in head:
        return "binary"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the end
            return "binary"
    return "text"


def sniff_file(store: Store, e: Entry, node: FileNode | None) -> str:
    """`sniff` of a file's first SNIFF bytes."""
    return sniff(b"".join(read_file(store, e, SNIFF, node)))


def text_lines(store: Store, e: Entry, node: FileNode | None) -> tuple[list[str], bool]:
    """A text file's first lines (TEXT_LIMIT bytes, LINE_LIMIT lines), and whether it was cut."""
    data = b"".join(read_file(store, e, TEXT_LIMIT, node))
    lines = data.decode("utf-8", "replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    cut = file_size(e, node) > TEXT_LIMIT or len(lines) > LINE_LIMIT
    return lines[:LINE_LIMIT], cut


def _side(store: Store, sid: str, path: str) -> tuple[Entry | None, bytes | None]:
    e = Trees(store, store.node_cache).resolve(store.snapshot(sid).root, split_path(path))
    if e is None or e.kind != K_FILE:
        return e, None
    return e, b"".join(read_file(store, e, DIFF_FILE_LIMIT + 1))


def file_diff(store: Store, a: str, b: str, path: str, label: str) -> dict[str, Any]:
    """One path's change between snapshots a and b: a unified diff for text, else hashes.

    `label` names the path in the diff's headers (a/LABEL, b/LABEL).
    """
    ea, da = _side(store, a, path)
    eb, db = _side(store, b, path)
    out: dict[str, Any] = {"old_size": ea.size if ea else None,
                           "new_size": eb.size if eb else None}
    texts: list[list[str]] = []
    for data in (da, db):
        if data is None:
            texts.append([])
            continue
        if len(data) > DIFF_FILE_LIMIT or sniff(data[:SNIFF]) != "text":
            out["kind"] = "binary"
            out["old_sha256"] = hashlib.sha256(da).hexdigest() if da is not None else None
            out["new_sha256"] = hashlib.sha256(db).hexdigest() if db is not None else None
            return out
        texts.append(data.decode("utf-8", "replace").splitlines())
    out["kind"] = "text"
    out["diff"] = list(difflib.unified_diff(texts[0], texts[1], f"a/{label}", f"b/{label}",
                                            lineterm=""))
    return out


def _cell(v: Any) -> Any:
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    if isinstance(v, str) and len(v) > 500:
        return v[:500] + "…"
    return v


def sqlite_tables(store: Store, e: Entry, node: FileNode | None) -> dict[str, Any]:
    """The tables of a SQLite file: columns and the first rows, read-only, bounded.

    The bytes go to a private temporary file opened read-only and immutable
    (no journal, no lock, nothing written); every query is stopped after
    SQLITE_STEPS steps, so a hostile file cannot keep a thread busy, and the
    cells shown stop at about SQLITE_ANSWER characters (columns computed on
    read could otherwise make far more than the file holds).
    """
    if file_size(e, node) > SQLITE_LIMIT:  # the node's size: the entry's is only a claim
        return {"error": f"database over {SQLITE_LIMIT >> 20} MiB: not opened"}
    fd, tmp = tempfile.mkstemp(prefix="strata-ui-", suffix=".db")
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in read_file(store, e, node=node):
                f.write(piece)
        uri = "file:" + urllib.parse.quote(tmp) + "?mode=ro&immutable=1"
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        try:
            steps = [0]

            def progress() -> int:
                steps[0] += 1
                return 1 if steps[0] * 1000 > SQLITE_STEPS else 0

            conn.set_progress_handler(progress, 1000)
            conn.execute("PRAGMA query_only = 1")
            # Hardening only (query_only and immutable already keep the file read-only):
            # a SQLite that refuses the pragma may still show the file.
            with contextlib.suppress(sqlite3.Error):
                conn.execute("PRAGMA trusted_schema = 0")
            names = [r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name LIMIT ?",
                (SQLITE_TABLES,))]
            tables = []
            left = SQLITE_ANSWER
            for name in names:
                steps[0] = 0
                ident = '"' + str(name).replace('"', '""') + '"'
                try:
                    cur = conn.execute(f"SELECT * FROM {ident} LIMIT {SQLITE_ROWS}")
                    cols = [d[0] for d in cur.description or ()]
                    rows = []
                    for row in cur:
                        cells = [_cell(v) for v in row]
                        left -= sum(len(c) if isinstance(c, str) else 16 for c in cells)
                        if left < 0:
                            break
                        rows.append(cells)
                    steps[0] = 0
                    count = conn.execute(f"SELECT count(*) FROM {ident}").fetchone()[0]
                    tables.append({"name": str(name), "columns": cols, "rows": rows,
                                   "count": count, "cut": left < 0})
                except sqlite3.Error as exc:
                    tables.append({"name": str(name), "error": str(exc)})
            return {"tables": tables, "limit": SQLITE_ROWS}
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return {"error": f"not a readable SQLite database: {exc}"}
    finally:
        os.unlink(tmp)
