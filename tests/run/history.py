"""A history checker for concurrent steps, in the spirit of Jepsen's Elle.

Steps ("transactions") read keys and write them; each key is a file in one
branch of one volume, named `volume@branch:name`. Two kinds of key:

- list keys hold one element per line; a step reads the whole list or
  appends a unique element. The final list orders every append that landed.
- counter keys hold an integer; a step reads n and writes n + 1. Two
  increments that read the same n and write the same n + 1 (with equal
  mtimes: written in one clock tick, or set from the content the way
  reproducible-build tools do) are exactly the equal-results race that a
  "same bytes, no conflict" rule accepts and loses an update to.

Each step writes a marker file into every branch it publishes to, so the
final state says which steps committed, including those whose outcome the
test could not see (runner killed, answer lost). A fork appears as a
read-only pseudo-step that read the parent's keys at the fork point.

`check` verifies, against the final state and every recorded read:

- every acknowledged step (exit 0) committed, on every branch it wrote, with
  every append and increment; no refused or failed step left anything;
- every read is a state that existed (a prefix of the key's final list, and
  only elements of committed steps); counters count every committed
  increment exactly once (no two committed increments read the same value);
- one commit order explains every read: the write-write, write-read and
  read-write (anti-)dependencies inferred from the lists and counters have
  no cycle made of write-write and write-read edges alone (G0, G1c) and no
  cycle with exactly one read-write edge (G-single). That is snapshot
  isolation as Adya defines it; it includes "a step that read several
  volumes saw another step's multi-volume publish on all of them or none".

Write skew (cycles with two or more read-write edges) is allowed: strata
promises snapshot isolation, not serializability.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

OK, CONFLICT, FAIL, INFO = "ok", "conflict", "fail", "info"


@dataclass
class Op:
    f: str              # "r" read a list, "a" append, "i" increment, "rc" read a counter
    key: str            # "volume@branch:name"
    value: object = None  # r: list[str] seen; a: the element; i/rc: the int seen (None: unknown)


@dataclass
class Txn:
    id: str
    status: str                      # OK, CONFLICT, FAIL or INFO (outcome unknown)
    ops: list[Op] = field(default_factory=list)
    branches: list[str] = field(default_factory=list)  # "volume@branch" it publishes to


@dataclass
class Final:
    lists: dict[str, list[str]]          # list key -> final elements
    counters: dict[str, int]             # counter key -> final value
    markers: dict[str, set[str]]         # "volume@branch" -> ids of steps with a marker there
    counter_start: dict[str, tuple[str | None, int]] = field(default_factory=dict)
    # counter key -> (the key it was forked from, value at the fork); absent: (None, 0)


def branch_of(key: str) -> str:
    return key.rpartition(":")[0]


def check(txns: Iterable[Txn], final: Final) -> list[str]:
    """Every anomaly found, as readable sentences; empty when the history is valid."""
    txns = list(txns)
    by_id = {t.id: t for t in txns}
    bad: list[str] = []
    committed = _committed(txns, final, bad)

    # -- appends: acknowledged ones present once, aborted ones nowhere -----------------
    writer: dict[str, str] = {}   # element -> the step that appended it
    for t in txns:
        for op in t.ops:
            if op.f == "a":
                writer[str(op.value)] = t.id
    seen_in: dict[str, list[str]] = defaultdict(list)
    for key, elems in final.lists.items():
        if len(set(elems)) != len(elems):
            dup = sorted({e for e in elems if elems.count(e) > 1})
            bad.append(f"{key}: elements appear twice: {dup}")
        for e in elems:
            seen_in[e].append(key)
            w = writer.get(e)
            if w is None:
                bad.append(f"{key}: element {e!r} was never appended by any step")
            elif w not in committed:
                bad.append(f"{key}: element {e!r} of {w} ({by_id[w].status}, not committed) "
                        "is visible")
    for t in txns:
        if t.id not in committed:
            continue
        for op in t.ops:
            if op.f == "a" and op.key not in seen_in[str(op.value)]:
                bad.append(f"{t.id} ({t.status}) committed but its append {op.value!r} "
                        f"to {op.key} is missing")

    # -- reads: states that existed ------------------------------------------------------
    for t in txns:
        for op in t.ops:
            if op.f != "r" or op.value is None:
                continue
            seen = list(op.value)  # type: ignore[call-overload]
            whole = final.lists.get(op.key, [])
            if whole[:len(seen)] != seen:
                bad.append(f"{t.id} read {op.key} = {seen}, which is not a prefix of its final "
                        f"history {whole}: a state that never existed")
            for e in seen:
                w = writer.get(e)
                if w is not None and w not in committed:
                    bad.append(f"{t.id} read {e!r} of {w}, which never committed (aborted read)")

    # -- counters: every committed increment counted once ---------------------------------
    versions = _counter_versions(txns, final, committed, bad)

    # -- one commit order explains every read ---------------------------------------------
    _check_order(txns, final, committed, writer, versions, bad)
    return bad


def _committed(txns: list[Txn], final: Final, bad: list[str]) -> set[str]:
    """Steps whose marker is in the final state, checked against their exit status."""
    committed: set[str] = set()
    for t in txns:
        if not t.branches:  # read-only: publishes nothing, commits trivially
            if t.status == OK:
                committed.add(t.id)
            continue
        where = [b for b in t.branches if t.id in final.markers.get(b, set())]
        if where and len(where) != len(t.branches):
            missing = sorted(set(t.branches) - set(where))
            bad.append(f"{t.id} ({t.status}) is on {where} but not on {missing}: "
                    "a publish that landed in part")
        if where:
            committed.add(t.id)
            if t.status in (CONFLICT, FAIL):
                bad.append(f"{t.id} ended {t.status} but its writes are visible")
        elif t.status == OK:
            bad.append(f"{t.id} exited 0 but nothing of it is in the final state "
                    "(an acknowledged publish was lost)")
    return committed


def _counter_versions(txns: list[Txn], final: Final, committed: set[str],
                      bad: list[str]) -> dict[tuple[str, int], str]:
    """(counter key, value) -> the step that wrote that value; checks every count."""
    incs: dict[str, list[tuple[int | None, str]]] = defaultdict(list)
    for t in txns:
        if t.id not in committed:
            continue
        for op in t.ops:
            if op.f == "i":
                incs[op.key].append((op.value, t.id))  # type: ignore[arg-type]
    versions: dict[tuple[str, int], str] = {}
    # Parents before their forks: a fork's early values were written on the parent.
    keys = sorted(set(final.counters) | set(incs),
                  key=lambda k: (final.counter_start.get(k, (None, 0))[0] is not None, k))
    for key in keys:
        parent, start = final.counter_start.get(key, (None, 0))
        if parent is not None:  # values up to the fork were written on the parent
            for v in range(1, start + 1):
                if (parent, v) in versions:
                    versions[(key, v)] = versions[(parent, v)]
        got = final.counters.get(key, start)
        reads = sorted((v, tid) for v, tid in incs.get(key, []) if v is not None)
        unknown = [tid for v, tid in incs.get(key, []) if v is None]
        values = [v for v, _ in reads]
        for v in sorted(set(values)):
            if values.count(v) > 1:
                who = [tid for x, tid in reads if x == v]
                bad.append(f"{key}: committed steps {who} all read {v} and wrote {v + 1}: "
                        "a lost update")
        expected = got - start
        if len(reads) + len(unknown) != expected:
            bad.append(f"{key}: {len(reads) + len(unknown)} committed increment(s) but the "
                    f"counter moved by {expected} (from {start} to {got})")
        if not unknown and sorted(set(values)) != list(range(start, got)):
            bad.append(f"{key}: committed increments read {values}, not each of "
                    f"{start}..{got - 1} once")
        for v, tid in reads:
            versions[(key, v + 1)] = tid
    return versions


def _check_order(txns: list[Txn], final: Final, committed: set[str], writer: dict[str, str],
                 versions: dict[tuple[str, int], str], bad: list[str]) -> None:
    dep: dict[str, set[str]] = defaultdict(set)     # ww and wr edges
    anti: dict[str, set[str]] = defaultdict(set)    # rw edges
    why: dict[tuple[str, str], str] = {}

    def edge(kind: str, a: str | None, b: str | None, reason: str) -> None:
        if a is None or b is None or a == b:
            return
        (anti if kind == "rw" else dep)[a].add(b)
        why.setdefault((a, b), f"{kind} on {reason}")

    for key, elems in final.lists.items():
        for x, y in zip(elems, elems[1:], strict=False):
            edge("ww", writer.get(x), writer.get(y), key)
    for t in txns:
        for op in t.ops:
            if op.f == "r" and op.value is not None:
                seen = list(op.value)  # type: ignore[call-overload]
                whole = final.lists.get(op.key, [])
                if seen:
                    edge("wr", writer.get(seen[-1]), t.id, op.key)
                if len(seen) < len(whole) and whole[:len(seen)] == seen:
                    edge("rw", t.id, writer.get(whole[len(seen)]), op.key)
            elif op.f in ("i", "rc") and isinstance(op.value, int):
                v = op.value
                edge("wr", versions.get((op.key, v)), t.id, op.key)  # it read v
                if op.f == "rc":
                    edge("rw", t.id, versions.get((op.key, v + 1)), op.key)
    nodes = {t.id for t in txns if t.id in committed or any(
        op.f in ("r", "rc") for op in t.ops)}

    # G0 / G1c: a cycle of write-write and write-read edges alone.
    for scc in _sccs(nodes, dep):
        if len(scc) > 1:
            bad.append(f"steps {sorted(scc)} depend on each other in a cycle (G1c): "
                    + "; ".join(f"{a}->{b} {why[(a, b)]}" for a in sorted(scc)
                                for b in sorted(dep[a] & scc)))
    # G-single: one read-write edge closed by write-write/write-read edges.
    for a in sorted(anti):
        for b in sorted(anti[a]):
            path = _path(dep, b, a)
            if path is not None:
                chain = " -> ".join(path)
                bad.append(f"{a} missed {b}'s write ({why[(a, b)]}) but depends on it through "
                        f"{chain} (G-single: no commit order explains {a}'s reads)")


def _sccs(nodes: set[str], edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                out.append(comp)
    return out


def _path(edges: dict[str, set[str]], src: str, dst: str) -> list[str] | None:
    """A shortest path src -> dst along `edges`, or None."""
    prev: dict[str, str] = {src: src}
    frontier = [src]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w in prev:
                    continue
                prev[w] = v
                if w == dst:
                    path = [w]
                    while path[-1] != src:
                        path.append(prev[path[-1]])
                    return path[::-1]
                nxt.append(w)
        frontier = nxt
    return None
