"""fsck names what a damaged pack costs: the paths and the snapshots that reach the damage.

A real store, one bit flipped in a pack on disk, and `strata fsck` run as a
process (through the server it starts): the report must name the damaged
object and every branch head and kept snapshot whose tree reaches it, as
VOLUME@BRANCH:PATH and VOLUME#SNAPSHOT:PATH, showing at most 20 and counting
the rest. The same holds once the index is rebuilt and the object is missing
rather than damaged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from strata.engine.filetree import cut
from strata.engine.local import LocalStore, init_store
from strata.engine.objects import BLOCK, object_id
from strata.engine.txn import Transaction
from test_crash import flip_record_of

STRATA = [sys.executable, "-m", "strata"]
COPIES = 25  # identical files in a second volume: more places than fsck shows (20)


def _strata(store: Path, *args: str, rc: int = 0) -> str:
    p = subprocess.run([*STRATA, "--store", str(store), *args], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == rc, (args, p.returncode, p.stdout, p.stderr)
    return p.stdout


@pytest.fixture
def damaged(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """proj: S1 adds src/victim.bin, S2 adds other, live removes it, exp forked at S2.

    second@live holds COPIES files with the same bytes (the same blocks).
    """
    store = tmp_path / "store"
    init_store(str(store))
    victim = os.urandom(200_000)
    with LocalStore(str(store)) as s:
        s.create_volume("proj")
        s.create_volume("second")
        t = Transaction(s, "proj")
        t.mkdir("src")
        t.write("src/victim.bin", victim)
        t.write("keep.txt", b"fine")
        s1 = t.commit("add the victim")
        t = Transaction(s, "proj")
        t.write("other", b"more")
        s2 = t.commit("another file")
        s.fork("proj", "exp", at=s2)
        t = Transaction(s, "proj")
        t.remove("src/victim.bin")
        s3 = t.commit("victim gone")
        t = Transaction(s, "second")
        t.mkdir("copies")
        for i in range(COPIES):
            t.write(f"copies/c{i:02}.bin", victim)
        t.commit("copies")
    off, n = next(cut(victim))  # its first content-defined chunk (at least 16 KiB)
    block = object_id(BLOCK, victim[off:off + n])
    pack, offset = flip_record_of(store, block)
    yield {"store": store, "block": block.hex(), "pack": pack, "offset": offset,
           "s1": s1, "s2": s2, "s3": s3}
    _strata(store, "serve", "--stop")


def _places(entry: dict[str, Any]) -> list[str]:
    return [f"{p['volume']}@{p['branch']}:{p['path']}" if "branch" in p
            else f"{p['volume']}#{p['snapshot']}:{p['path']}" for p in entry["affected"]]


def test_fsck_names_the_paths_and_snapshots_a_damaged_record_reaches(
        damaged: dict[str, Any]) -> None:
    store = damaged["store"]
    report = json.loads(_strata(store, "fsck", "--json", rc=1))
    assert not report["ok"]
    [entry] = [d for d in report["damaged"]
               if (d.get("pack"), d.get("offset")) == (damaged["pack"], damaged["offset"])]
    assert entry["object"] == damaged["block"] and entry["kind"] == "block"
    places = _places(entry)
    # proj: the fork's head and the first snapshot (kept history) reach it, live does not.
    assert places[:2] == ["proj@exp:/src/victim.bin",
                          f"proj#{damaged['s1']}:/src/victim.bin"], places
    assert not any(p.startswith("proj@live") for p in places)
    assert len(places) == 20 and entry["affected_more"] == 2 + COPIES - 20
    assert places[2:] == [f"second@live:/copies/c{i:02}.bin" for i in range(18)]  # name order
    # Known damaged, the object is not also reported missing.
    assert all(m["object"] != damaged["block"] for m in report["missing"])

    out = _strata(store, "fsck", rc=1)
    assert f"damaged: {damaged['pack']} at offset {damaged['offset']} " \
           f"(block {damaged['block']})" in out, out
    assert "  proj@exp:/src/victim.bin\n" in out
    assert f"  proj#{damaged['s1'][:12]}:/src/victim.bin\n" in out
    assert f"  ... and {2 + COPIES - 20} more\n" in out
    assert out.splitlines()[-1].startswith("NOT OK: ")


def test_fsck_names_the_places_of_an_object_lost_to_an_index_rebuild(
        damaged: dict[str, Any]) -> None:
    # Rebuilt from the packs, the index no longer knows the damaged record's object:
    # it is missing, and the same places are named.
    report = json.loads(_strata(damaged["store"], "fsck", "--rebuild-index", "--json", rc=1))
    [missing] = [m for m in report["missing"] if m["object"] == damaged["block"]]
    places = _places(missing)
    assert places[:2] == ["proj@exp:/src/victim.bin",
                          f"proj#{damaged['s1']}:/src/victim.bin"], places
    assert missing["affected_more"] == 2 + COPIES - 20
