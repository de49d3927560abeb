"""The stat cache: status and commit read only files changed since the last commit.

Every test runs on a real mount and checks two things: which files a scan
read again (`strata status --json` reports it), and that what status shows
and commit publishes is right whatever the cache held.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mount_harness import MountEnv

from strata_harness import STRATA


def _status(menv: MountEnv, m: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(menv.run("status", str(m), "--json").stdout)
    return out


def _cat(menv: MountEnv, path: str) -> bytes:
    p = subprocess.run([*STRATA, "cat", "v", path], env=menv.env, capture_output=True,
                       check=True, timeout=60)
    return p.stdout


def _scratch_of(menv: MountEnv) -> Path:
    (mid,) = os.listdir(menv.env["STRATA_SCRATCH"])
    return Path(menv.env["STRATA_SCRATCH"]) / mid


def _older_than_now(directory: Path) -> None:
    """Wait until the filesystem of `directory` stamps a time later than anything in it.

    Files written just before a commit are in the commit's timestamp tick and
    are (rightly) read again by the next scan; the tests that count reads
    let the clock move on first.
    """
    newest = max(os.lstat(os.path.join(d, n)).st_ctime_ns
                 for d, ds, fs in os.walk(directory) for n in ds + fs)
    while True:
        with tempfile.NamedTemporaryFile(dir=directory.parent) as probe:
            if os.fstat(probe.fileno()).st_mtime_ns > newest:
                return
        time.sleep(0.001)


def test_only_files_changed_since_the_commit_are_read(menv: MountEnv) -> None:
    menv.run("volume", "create", "v")
    m = menv.mount("v")
    (m / "d").mkdir()
    for i in range(20):
        (m / "d" / f"small{i}").write_bytes(b"s%d" % i)
    for name in ("a", "b", "c"):
        (m / name).write_bytes(os.urandom(100_000))  # file nodes and blocks, not inline
    name = b"odd \xff\x01 name"
    with open(os.path.join(os.fsencode(m), name), "wb") as f:
        f.write(b"bytes name")
    upper = _scratch_of(menv) / "upper" / "_"
    _older_than_now(upper)
    assert json.loads(menv.run("commit", str(m), "--json").stdout)["read"]["files"] == 24
    st = _status(menv, m)
    assert st["uncommitted"] == []
    assert st["read"] == {"files": 0, "bytes": 0, "from_stat_cache": 24,
                          "stat_cache_ignored": ""}

    # An append: one file read again, and published.
    with open(m / "a", "ab") as f:
        f.write(b"tail")
    st = _status(menv, m)
    assert st["uncommitted"] == ["a"] and st["read"]["files"] == 1
    # chmod moves only ctime: the remembered entry (with the old mode) is not used.
    os.chmod(m / "d" / "small3", 0o600)
    # Same size, mtime set back to the nanosecond: ctime still moves.
    before = os.stat(m / "b")
    data_b = bytearray((m / "b").read_bytes())
    data_b[5000] ^= 0xFF
    (m / "b").write_bytes(bytes(data_b))
    os.utime(m / "b", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(m / "b").st_size == before.st_size
    # A file replaced by rename (same size, same mtime): another inode.
    c_before = os.stat(m / "c")
    new_c = os.urandom(100_000)
    (m / "c.tmp").write_bytes(new_c)
    os.utime(m / "c.tmp", ns=(c_before.st_atime_ns, c_before.st_mtime_ns))
    os.rename(m / "c.tmp", m / "c")
    st = _status(menv, m)
    assert st["uncommitted"] == ["", "a", "b", "c", "d/small3"]  # "": the root's mtime
    assert st["read"]["files"] == 4 and st["read"]["from_stat_cache"] == 20
    assert json.loads(menv.run("commit", str(m), "--json").stdout)["read"]["files"] == 4
    assert _cat(menv, "a").endswith(b"tail")
    assert _cat(menv, "b") == bytes(data_b)
    assert _cat(menv, "c") == new_c
    assert json.loads(menv.run("stat", "v", "d/small3", "--json").stdout)["mode"] == "0600"

    # Inode reuse: delete and make again with the same size and mtime.
    s_before = os.stat(m / "d" / "small7")
    os.unlink(m / "d" / "small7")
    (m / "d" / "small7").write_bytes(b"S7")
    os.utime(m / "d" / "small7", ns=(s_before.st_atime_ns, s_before.st_mtime_ns))
    st = _status(menv, m)
    assert st["uncommitted"] == ["d", "d/small7"]
    menv.run("commit", str(m))
    assert menv.run("cat", "v", "d/small7").stdout == "S7"
    menv.unmount(m)


def test_a_damaged_or_foreign_stat_cache_is_ignored(menv: MountEnv) -> None:
    menv.run("volume", "create", "v")
    m = menv.mount("v")
    for i in range(5):
        (m / f"f{i}").write_bytes(b"one %d" % i)
    index = _scratch_of(menv) / "index" / "_"
    upper = _scratch_of(menv) / "upper" / "_"
    _older_than_now(upper)
    menv.run("commit", str(m))
    assert _status(menv, m)["read"]["from_stat_cache"] == 5
    good = index.read_bytes()
    assert good[:8] == b"STRATASC" and good[8:10] == b"\1\0"

    from strata.engine.objects import unpackb

    def read_with(raw: bytes) -> dict[str, Any]:
        index.write_bytes(raw)
        return _status(menv, m)

    flipped = bytearray(good)
    flipped[-3] ^= 0x40
    st = read_with(bytes(flipped))
    assert st["read"]["stat_cache_ignored"] == "checksum mismatch"
    assert st["read"]["files"] == 5 and st["uncommitted"] == []
    st = read_with(good[:8] + b"\x63\0" + good[10:])
    assert st["read"]["stat_cache_ignored"].startswith("unknown version 99")
    assert st["read"]["files"] == 5
    assert read_with(good[:-20])["read"]["stat_cache_ignored"] == "checksum mismatch"
    assert read_with(b"junk")["read"]["stat_cache_ignored"] == "truncated"

    # A cache of the previous base: f0 changed since, with the same stat fields it had
    # then; the cache must not be believed (it names the base the state moved off).
    index.write_bytes(good)
    old = os.stat(upper / "f0")
    (m / "f0").write_bytes(b"two 0")
    menv.run("commit", str(m))
    assert menv.run("cat", "v", "f0").stdout == "two 0"
    # Forge the stale cache to claim f0's current stat key: only its base gives it away.
    doc = unpackb(good[44:])
    now = os.stat(upper / "f0")
    for rec in doc[4]:
        if rec[0] == b"f0":
            assert rec[1:5] == [old.st_size, old.st_mtime_ns, old.st_ctime_ns, old.st_ino]
            rec[1:6] = [now.st_size, now.st_mtime_ns, now.st_ctime_ns, now.st_ino, now.st_dev]
    st = read_with(_sealed(doc))
    assert st["read"]["stat_cache_ignored"].startswith("made for v at ")
    assert st["uncommitted"] == [] and st["read"]["files"] == 5
    # The forgery is a working one: labelled with the current base it is believed
    # (and status is wrong), so the base check above is what kept status right.
    doc[2] = json.loads(menv.run("status", str(m), "--json").stdout)["base"]
    st = read_with(_sealed(doc))
    assert st["read"]["stat_cache_ignored"] == "" and st["uncommitted"] == ["f0"]
    index.unlink()
    menv.unmount(m)


def _sealed(doc: Any) -> bytes:
    """A stat cache file holding `doc`, with a valid header and checksum."""
    import blake3

    from strata.engine.objects import packb
    from strata.mount import statcache

    body = packb(doc)
    return statcache._HEAD.pack(statcache.MAGIC, statcache.VERSION, 0,
                                blake3.blake3(body).digest()) + body


@pytest.fixture
def coarse_scratch(menv: MountEnv, tmp_path: Path) -> Iterator[Path]:
    """STRATA_SCRATCH on an ext4 with one-second timestamps (128-byte inodes)."""
    if os.geteuid() != 0 or not os.path.exists("/dev/loop-control") \
            or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root, loop devices and mkfs.ext4")
    img, mnt = tmp_path / "coarse.img", tmp_path / "coarse"
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(img)], check=True,
                   capture_output=True)
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
    menv.env["STRATA_SCRATCH"] = str(mnt / "scratch")
    try:
        yield mnt
    finally:
        for target in list(menv.mounts):
            menv.run("unmount", str(target), "--discard", rc=None)
            menv.mounts.remove(target)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_racy_clean_rewrite_in_the_commits_second_is_seen(menv: MountEnv,
                                                          coarse_scratch: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Write, commit and rewrite (same size) within one timestamp tick.

    On this filesystem a tick is a whole second, so the rewrite leaves size,
    mtime, ctime and inode exactly as the commit saw them: only the
    racy-clean rule (a file not older than the scan is not remembered) makes
    status and the next commit see the new bytes.
    """
    from strata.mount.session import commit
    from strata.mount.state import find_mount
    from strata.server.client import RemoteStore

    menv.run("volume", "create", "v")
    m = menv.mount("v")
    monkeypatch.setenv("STRATA_SCRATCH", menv.env["STRATA_SCRATCH"])
    state = find_mount(str(m))
    store = RemoteStore(state.server, state.token)
    upper = Path(state.upper(state.volumes[0]))
    try:
        for attempt in range(10):
            name = f"racy{attempt}"
            # Start just after a second begins, so the three steps fit in it.
            time.sleep(1.02 - time.time() % 1)
            (m / name).write_bytes(b"first")
            st0 = os.stat(upper / name)
            commit(store, find_mount(str(m)))
            (m / name).write_bytes(b"again")
            st1 = os.stat(upper / name)
            key = ("st_size", "st_mtime_ns", "st_ctime_ns", "st_ino")
            if all(getattr(st0, k) == getattr(st1, k) for k in key):
                break  # the racy case happened
        else:
            pytest.fail("could not write, commit and rewrite within one second")
    finally:
        store.close()
    assert name in _status(menv, m)["uncommitted"]
    menv.run("commit", str(m))
    assert menv.run("cat", "v", name).stdout == "again"
    assert _status(menv, m)["uncommitted"] == []
