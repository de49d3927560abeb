"""Finding 8 of the hardening issue: a store and a mount's scratch are their owner's alone.

Directories are 0700 and files 0600 (sealed packs 0400): packs hold every
byte of every volume, tokens.json the token hashes, a mount's state.json a
bearer token. Nothing may be readable by other users.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from serverutil import Server, cli
from strata.engine.local import LocalStore, StoreConfig, init_store
from strata.engine.txn import Transaction
from strata.mount.state import VolumeState, new_state


def _open_to_others(root: Path) -> list[str]:
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                continue
            if mode & 0o077:
                bad.append(f"{p} {stat.filemode(mode)}")
    return bad


def test_store_files_are_private(tmp_path: Path) -> None:
    store = tmp_path / "store"
    init_store(str(store))
    with LocalStore(str(store), StoreConfig(pack_size_limit=64 * 1024)) as s:
        s.create_volume("v")
        t = Transaction(s, "v")
        t.write("f", os.urandom(200_000))  # several packs: sealed ones too
        t.commit()
    server = Server(store).start()
    try:
        assert cli("token", "create", "v", "--ro", store=store).returncode == 0
        assert _open_to_others(store) == []
    finally:
        server.stop()
    sealed = [p for p in (store / "packs").glob("*.pack") if not os.access(p, os.W_OK)
              or stat.S_IMODE(p.stat().st_mode) == 0o400]
    assert sealed, "expected sealed packs"


def test_an_old_store_is_made_private_when_opened(tmp_path: Path) -> None:
    store = tmp_path / "store"
    init_store(str(store))
    os.chmod(store, 0o755)
    os.chmod(store / "packs", 0o755)
    LocalStore(str(store)).close()
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    assert stat.S_IMODE((store / "packs").stat().st_mode) == 0o700


def test_mount_scratch_and_its_token_are_private(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_SCRATCH", str(tmp_path / "scratch"))
    st = new_state(str(tmp_path / "mnt"), "http://127.0.0.1:1", [
        VolumeState("", "v", "live", "0" * 64, "0" * 64)], single=True, save=False)
    st.token = "strata_secret"
    st.save()
    state = Path(st.scratch) / "state.json"
    assert "strata_secret" in state.read_text()
    # Nothing under a 0700 directory is reachable by others; the upper directory
    # inside keeps the volume root's own mode (0755), which the overlay shows.
    for p in (tmp_path / "scratch", Path(st.scratch)):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    assert stat.S_IMODE(state.stat().st_mode) == 0o600


def test_the_servers_log_is_private_even_one_an_older_strata_made(tmp_path: Path) -> None:
    """Hardening II, finding 12: serve.log names volumes and paths; it was 0644."""
    store = tmp_path / "store"
    assert cli("init", store=store).returncode == 0
    (store / "serve.log").write_text("from an older strata\n")
    os.chmod(store / "serve.log", 0o644)
    try:
        assert cli("volume", "list", store=store).returncode == 0  # starts the server
        assert stat.S_IMODE((store / "serve.log").stat().st_mode) == 0o600
    finally:
        cli("serve", "--stop", store=store)


def test_the_content_cache_is_private(tmp_path: Path) -> None:
    """Hardening II, finding 12: the shared content cache holds every volume's bytes."""
    from strata.engine.objects import BLOCK, object_id
    from strata.mount.cache import ContentCache
    old = tmp_path / "old-cache"
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    for path in (tmp_path / "cache", old):
        cache = ContentCache(str(path), measure=False)
        data = b"another volume's secret"
        cache.keep(object_id(BLOCK, data), data)
        assert _open_to_others(path) == [], path
