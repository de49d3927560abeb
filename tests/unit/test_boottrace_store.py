"""A boot trace stored and loaded again, whatever the shape of its file's node tree."""

from __future__ import annotations

import os

from strata.engine.local import LocalStore
from strata.engine.objects import FileNode
from strata.engine.tree import Trees
from strata.mount import boottrace


def test_a_trace_whose_file_has_inner_nodes_loads(store: LocalStore) -> None:
    # Node boundaries are content-defined (about one chunk in 128 ends a node),
    # so a trace of a few dozen chunks has an inner node about a third of the
    # time: save random traces until one has, then load it.
    sid = "cd" * 32
    for _ in range(40):
        entries = [boottrace.TraceEntry(boottrace.K_READ, os.urandom(200).hex().encode(),
                                        i * 4096, 4096) for i in range(4500)]
        snap = boottrace.save_trace(store, "v", sid, entries)
        e = Trees(store).lookup(store.snapshot(snap).root.ref, boottrace.TRACE_FILE.encode())
        assert e is not None and e.ref is not None
        if FileNode.decode(store.get_object(e.ref)).level > 0:
            break
        store.delete_branch("v", boottrace.trace_branch(sid))
    else:
        raise AssertionError("none of 40 traces had an inner node")
    assert e.size > 1 << 20
    assert boottrace.load_trace(store, "v", sid) == entries
