"""Import and export between a local directory and a snapshot (strata.fsio).

Also holds the regression test for the change-set validation that made large
imports quadratic (engine/changes.py `parse_changes`).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from strata.engine.changes import parse_changes
from strata.engine.errors import Conflict, InvalidInput, NotFound
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import K_CHR, K_DIR, K_FILE, ZERO_ID, Entry, FileNode
from strata.engine.tree import Trees
from strata.engine.txn import Transaction
from strata.fsio import export_snapshot, import_dir
from strata.localfile import read_xattrs
from strata.mount.overlay import OVERLAY_PREFIX, UpperScanner

T = 1_700_000_000_000_000_001

FILE = Entry(kind=K_FILE, size=1, data=b"x")
DIR = Entry(kind=K_DIR)


def test_parse_changes_refuses_changes_below_a_deleted_or_replaced_path() -> None:
    with pytest.raises(InvalidInput, match="deletes 'a'"):
        parse_changes({"a": None, "a/b": FILE})
    # Not adjacent in the sorted order: 'a/b' < 'a/b/c' with 'a/a' between.
    with pytest.raises(InvalidInput, match="deletes 'a/b'"):
        parse_changes({"a": DIR, "a/a": FILE, "a/b": FILE, "a/b/c/d": FILE})
    with pytest.raises(InvalidInput):
        parse_changes({"x": None, "x/y": DIR, "x/y/z": FILE})


def test_parse_changes_accepts_siblings_that_share_a_prefix() -> None:
    # 'a-b' and 'a.b' sort between 'a' and 'a/…' as strings but not as components.
    out = parse_changes({"a": None, "a-b": FILE, "a.b/c": FILE, "a.b": DIR, "b": FILE})
    assert [p for p, _ in out] == [("a",), ("a-b",), ("a.b",), ("a.b", "c"), ("b",)]


def test_parse_changes_handles_an_import_sized_change_set() -> None:
    # 20k files: the old check compared every path with every earlier file (O(n^2)).
    changes: dict[str, Entry | None] = {}
    for d in range(20):
        changes[f"d{d}"] = DIR
        for f in range(1000):
            changes[f"d{d}/f{f}"] = FILE
    assert len(parse_changes(changes)) == 20020


# -- import_dir / export_snapshot, in process ------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    init_store(str(tmp_path / "store"), block_size=4096)  # small blocks: more of them
    s = LocalStore(str(tmp_path / "store"))
    s.create_volume("v")
    yield s
    s.close()


def _entry(store: LocalStore, path: str, ref: str = "live") -> Entry | None:
    root = store.snapshot(store.head("v", ref)).root
    return Trees(store).resolve(root, path.split("/"))


def _changed(store: LocalStore, a: str, b: str) -> list[tuple[str, bool, bool]]:
    ra, rb = store.snapshot(a).root, store.snapshot(b).root
    return [(p, old is not None, new is not None) for p, old, new in Trees(store).diff(ra, rb)]


def test_quick_check_trusts_size_and_mtime_and_reuses_content(store: LocalStore,
                                                              tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    f = src / "f"
    f.write_bytes(b"A" * 10_000)
    os.utime(f, ns=(T, T))
    os.utime(src, ns=(T, T))
    first = import_dir(store, "v", "live", str(src))
    before = _entry(store, "f")
    assert before is not None and before.ref is not None and before.size == 10_000

    # Same size and mtime: taken as unchanged, like rsync (documented in fsio).
    f.write_bytes(b"B" * 10_000)
    os.utime(f, ns=(T, T))
    os.utime(src, ns=(T, T))
    assert import_dir(store, "v", "live", str(src)) == first

    # A mode change keeps the content reference; an mtime change re-reads it.
    f.chmod(0o600)
    import_dir(store, "v", "live", str(src))
    after = _entry(store, "f")
    assert after is not None and after.ref == before.ref and after.mode == 0o600
    os.utime(f, ns=(T + 1, T + 1))
    import_dir(store, "v", "live", str(src))
    after = _entry(store, "f")
    assert after is not None and after.ref != before.ref and after.mtime_ns == T + 1


def test_hard_links_keep_one_number_across_imports(store: LocalStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a").write_bytes(b"x" * 5000)
    os.link(src / "a", src / "d" / "b")
    (src / "lonely").write_bytes(b"y")
    os.link(src / "lonely", tmp_path / "outside")  # a link outside the tree does not count
    first = import_dir(store, "v", "live", str(src))
    a, b, lonely = (_entry(store, p) for p in ("a", "d/b", "lonely"))
    assert a is not None and b is not None and lonely is not None
    assert a == b and a.ino != 0 and a.nlink == 2
    assert lonely.ino == 0 and lonely.nlink == 1
    assert import_dir(store, "v", "live", str(src)) == first

    # Breaking the group rewrites both members as plain files.
    os.unlink(src / "d" / "b")
    (src / "d" / "b").write_bytes(b"x" * 5000)
    import_dir(store, "v", "live", str(src))
    a2, b2 = _entry(store, "a"), _entry(store, "d/b")
    assert a2 is not None and b2 is not None
    assert (a2.ino, a2.nlink, b2.ino, b2.nlink) == (0, 1, 0, 1)


def test_type_changes_and_deletions(store: LocalStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "was-dir" / "sub").mkdir(parents=True)
    (src / "was-dir" / "sub" / "x").write_bytes(b"x")
    (src / "was-file").write_bytes(b"f")
    os.symlink("target", src / "was-link")
    first = import_dir(store, "v", "live", str(src))
    shutil.rmtree(src / "was-dir")
    (src / "was-dir").write_bytes(b"now a file")
    os.unlink(src / "was-file")
    (src / "was-file").mkdir()
    (src / "was-file" / "inner").write_bytes(b"i")
    os.unlink(src / "was-link")
    (src / "was-link").write_bytes(b"now a file too")
    second = import_dir(store, "v", "live", str(src))
    kinds = {p: e.kind for p, e in Trees(store).walk(store.snapshot(second).root)}
    assert kinds == {"was-dir": K_FILE, "was-file": K_DIR, "was-file/inner": K_FILE,
                     "was-link": K_FILE}
    assert ("was-dir/sub/x", True, False) in _changed(store, first, second)


def test_progress_reports_every_non_directory(store: LocalStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(600):
        (src / "d" / f"f{i}").write_bytes(b"%d" % i)
    os.symlink("d/f1", src / "l")
    calls: list[tuple[int, int]] = []
    import_dir(store, "v", "live", str(src), progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (601, 601)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_stale_base_import_replays_or_conflicts(store: LocalStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "mine").write_bytes(b"1")
    base = import_dir(store, "v", "live", str(src))
    txn = Transaction(store, "v")
    txn.write("theirs", b"t")
    txn.commit()
    (src / "mine").write_bytes(b"22")
    head = import_dir(store, "v", "live", str(src), base=base)
    names = sorted(p for p, _ in Trees(store).walk(store.snapshot(head).root))
    assert names == ["mine", "theirs"]  # replayed; 'theirs' is not deleted
    txn = Transaction(store, "v")
    txn.write("mine", b"theirs now")
    txn.commit()
    (src / "mine").write_bytes(b"333")
    with pytest.raises(Conflict) as info:
        import_dir(store, "v", "live", str(src), base=base)
    assert info.value.paths == ["mine"]


def test_import_refuses_a_path_too_long_for_a_volume(store: LocalStore) -> None:
    top = tempfile.mkdtemp(prefix="s")  # a short prefix keeps the parents openable
    try:
        fd = os.open(top, os.O_RDONLY)
        for _ in range(17):  # 17 components of 250 bytes: over the 4096-byte limit
            os.mkdir("d" * 250, dir_fd=fd)
            nfd = os.open("d" * 250, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(fd)
        head = store.head("v", "live")
        with pytest.raises(InvalidInput, match="too long") as info:
            import_dir(store, "v", "live", top)
        assert top in str(info.value)
        assert store.head("v", "live") == head
    finally:
        shutil.rmtree(top)


def test_import_requires_the_branch_and_the_directory(store: LocalStore,
                                                      tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        import_dir(store, "v", "nobranch", str(tmp_path))
    with pytest.raises(NotFound):
        import_dir(store, "v", "live", str(tmp_path / "missing"))


def test_export_of_special_files_and_large_sparse_content(store: LocalStore,
                                                          tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(9000) + bytes(20_000) + os.urandom(3)  # 4 KiB blocks, some zero
    (src / "sparse").write_bytes(data)
    (src / "small").write_bytes(b"tiny")
    (src / "empty").write_bytes(b"")
    os.mkfifo(src / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "sock"))
    sock.close()
    devices = os.geteuid() == 0
    if devices:
        os.mknod(src / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    sid = import_dir(store, "v", "live", str(src))
    null = _entry(store, "null")
    if devices:
        assert null is not None and null.kind == K_CHR and null.rdev == os.makedev(1, 3)

    out = tmp_path / "out"
    report = export_snapshot(store, sid, str(out))
    assert (out / "sparse").read_bytes() == data
    assert (out / "small").read_bytes() == b"tiny"
    assert (out / "empty").read_bytes() == b""
    assert stat.S_ISFIFO(os.lstat(out / "fifo").st_mode)
    assert stat.S_ISSOCK(os.lstat(out / "sock").st_mode)
    if devices and not report.skipped:
        assert os.lstat(out / "null").st_rdev == os.makedev(1, 3)
    assert report.files == 3

    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(InvalidInput, match="not a directory"):
        export_snapshot(store, sid, str(tmp_path / "file"))
    with pytest.raises(InvalidInput, match="not empty"):
        export_snapshot(store, sid, str(out))


def test_names_that_are_not_utf8_and_a_symlinked_source(store: LocalStore,
                                                        tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(os.path.join(os.fsencode(src), b"caf\xe9"), "wb") as f:
        f.write(b"latin-1 name")
    os.symlink(src, tmp_path / "via-link")
    sid = import_dir(store, "v", "live", str(tmp_path / "via-link"))
    assert [p for p, _ in Trees(store).walk(store.snapshot(sid).root)] == ["caf\udce9"]
    out = tmp_path / "out"
    export_snapshot(store, sid, str(out))
    assert os.listdir(os.fsencode(out)) == [b"caf\xe9"]


# -- one reading of local files for import and the mount (strata.localfile) --------


def _can_find_holes(path: Path) -> bool:
    with open(path, "rb") as f:
        return os.lseek(f.fileno(), 0, os.SEEK_DATA) > 0


def test_import_keeps_holes_without_reading_them(store: LocalStore, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    size = 50 * 1024 * 1024
    with open(src / "sparse", "wb") as f:
        f.seek(size - 1)
        f.write(b"x")
    if not _can_find_holes(src / "sparse"):
        pytest.skip("the temporary filesystem does not report holes")
    read = 0
    real_read, real_pread = os.read, os.pread

    def counting_read(fd: int, n: int) -> bytes:
        nonlocal read
        data = real_read(fd, n)
        read += len(data)
        return data

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        nonlocal read
        data = real_pread(fd, n, offset)
        read += len(data)
        return data

    monkeypatch.setattr(os, "read", counting_read)
    monkeypatch.setattr(os, "pread", counting_pread)
    import_dir(store, "v", "live", str(src))
    monkeypatch.undo()
    assert read < 1024 * 1024  # the data block, not 50 MiB of zeros
    e = _entry(store, "sparse")
    assert e is not None and e.ref is not None and e.size == size
    node = FileNode.decode(store.get_object(e.ref))
    assert node.blocks[:-1] == (ZERO_ID,) * (len(node.blocks) - 1)
    assert node.blocks[-1] != ZERO_ID
    assert Transaction(store, "v").read("sparse", size - 2) == b"\0x"


def test_import_and_a_mount_commit_read_the_same_entries(store: LocalStore,
                                                         tmp_path: Path) -> None:
    """Both build entries from local files with strata.localfile, so they agree exactly."""
    src = tmp_path / "src"
    src.mkdir()
    bsrc = os.fsencode(src)
    (src / "small").write_bytes(b"tiny")
    (src / "zeros").write_bytes(bytes(3 * 4096))
    (src / "mixed").write_bytes(os.urandom(5000) + bytes(10_000) + b"end")
    os.symlink(b"caf\xe9/../target", os.path.join(bsrc, b"link"))
    os.mkdir(src / "d")
    os.mkfifo(src / "d" / "fifo")
    for path, name, value in [(b"small", b"user.caf\xe9", b"\xff\x00v"),
                              (b"d", b"user.dir", b"x"), (b"mixed", b"user.a", b"")]:
        os.setxattr(os.path.join(bsrc, path), name, value)
    os.setxattr(bsrc, b"user.root", b"r")
    for p in [*src.rglob("*"), src]:
        os.utime(p, ns=(T, T), follow_symlinks=False)

    base = store.snapshot(store.head("v", "live")).root
    sid = import_dir(store, "v", "live", str(src))
    root = store.snapshot(sid).root
    imported = {p: e.with_(ref=None) if e.kind == K_DIR else e
                for p, e in Trees(store).walk(root)}
    imported[""] = root.with_(ref=None)
    scanned = UpperScanner(Trees(store), base, store.block_size).scan(str(src)).changes
    assert scanned == imported
    assert imported["link"].data == b"caf\xe9/../target"
    assert imported["small"].xattrs == ((b"user.caf\xe9", b"\xff\x00v"),)
    assert imported["zeros"].ref is not None
    assert FileNode.decode(store.get_object(imported["zeros"].ref)).blocks == (ZERO_ID,)  # one hole


def test_xattrs_skip_only_what_is_absent_and_raise_on_errors(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"")
    os.setxattr(f, b"user.keep", b"1")
    if os.geteuid() == 0:
        os.setxattr(f, OVERLAY_PREFIX + b"opaque", b"y")
    assert read_xattrs(str(f), exclude=OVERLAY_PREFIX) == ((b"user.keep", b"1"),)
    with pytest.raises(FileNotFoundError):  # once swallowed by the mount's commit
        read_xattrs(str(tmp_path / "gone"))
