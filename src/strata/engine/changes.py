"""Replaying a change set onto a branch head, and detecting conflicts.

A change set maps paths to final entries (None deletes). When the branch head
is still the change set's base, the changes are applied to it. When the head
has moved, each changed path is checked against what the other side did
between base and head; if no path collides the changes are applied to the new
head (replay), otherwise `Conflict` names every colliding path. The rules are
written out in docs/design.md ("Replay and conflicts").

The isolation level is snapshot isolation with first-committer-wins: a path
that both sides wrote conflicts even when both wrote the same bytes, because
two read-modify-writes that compute the same result (two increments of one
counter in the same clock tick) would otherwise both be accepted and one of
them lost without a trace. `identical=True` (an explicit opt-in for
idempotent jobs) accepts equal results instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from strata.engine.errors import Conflict, InvalidInput
from strata.engine.names import split_path
from strata.engine.objects import K_DIR, Entry, check_entry
from strata.engine.tree import Trees, encode_name


def parse_changes(changes: dict[str, Entry | None]
                  ) -> list[tuple[tuple[str, ...], Entry | None]]:
    """Validate paths and entries; return (components, entry) sorted by path."""
    out: list[tuple[tuple[str, ...], Entry | None]] = []
    for path, e in changes.items():
        parts = split_path(path)
        if e is not None:
            if not isinstance(e, Entry):
                raise InvalidInput(f"change for {path!r} is not an entry")
            check_entry(e)
        elif not parts:
            raise InvalidInput("the root directory cannot be deleted")
        out.append((parts, e))
    out.sort(key=lambda pe: pe[0])
    # Sorted as tuples, a path's descendants follow it contiguously, so only the
    # latest deleted (or non-directory) path can be an ancestor: one check per
    # path keeps this linear (a list of every one made 20k-file imports O(n^2)).
    blocker: tuple[str, ...] | None = None
    for parts, e in out:
        if blocker is not None and len(parts) > len(blocker) and (
                parts[:len(blocker)] == blocker):
            raise InvalidInput(
                f"change set both deletes {'/'.join(blocker)!r} and changes {'/'.join(parts)!r}")
        if e is None or e.kind != K_DIR:
            blocker = parts
    return out


def _is_merge_dir(e: Entry | None) -> bool:
    return e is not None and e.kind == K_DIR and e.ref is None


class _Resolver:
    """Entries by path under one root, each directory looked up once per check."""

    def __init__(self, trees: Trees, root: Entry) -> None:
        self.trees = trees
        self.memo: dict[tuple[str, ...], Entry | None] = {(): root}

    def get(self, parts: tuple[str, ...]) -> Entry | None:
        n = len(parts)
        while parts[:n] not in self.memo:
            n -= 1
        cur = self.memo[parts[:n]]
        for i in range(n, len(parts)):
            cur = self.trees.child(cur, encode_name(parts[i]))
            self.memo[parts[:i + 1]] = cur
        return cur


def find_conflicts(trees: Trees, base: Entry, head: Entry,
                   changes: Sequence[tuple[tuple[str, ...], Entry | None]], *,
                   identical: bool = False) -> list[str]:
    """Paths where our changes collide with what happened between base and head.

    `identical` accepts a path both sides set to exactly the same entry (or
    both deleted); by default that is a conflict like any other.
    """
    conflicts: list[str] = []
    at_base, at_head = _Resolver(trees, base), _Resolver(trees, head)
    for parts, mine in changes:
        path = "/".join(parts)
        # Ancestors: the other side must not have removed or replaced a
        # directory our change lives in.
        bad_ancestor = None
        untouched = False
        for i in range(1, len(parts)):
            eb = at_base.get(parts[:i])
            eh = at_head.get(parts[:i])
            if eb is not None and eb == eh:
                untouched = True  # same subtree on both sides: nothing below moved
                break
            if eh is None or eh.kind == K_DIR:
                if eb is not None and eb.kind == K_DIR and eh is None:
                    bad_ancestor = "/".join(parts[:i])
                    break
                continue
            if eb != eh:  # they made a non-directory here
                bad_ancestor = "/".join(parts[:i])
                break
        if untouched:
            continue
        if bad_ancestor is not None:
            conflicts += [bad_ancestor, path]
            continue
        eb = at_base.get(parts)
        eh = at_head.get(parts)
        if _is_merge_dir(mine):
            assert mine is not None
            if eh is None:
                if eb is not None and eb.kind == K_DIR:
                    conflicts.append(path)  # they removed the directory we changed
                continue
            if eh.kind == K_DIR:
                if eb is None or eb.kind != K_DIR:
                    # Both created it: a directory is a container, so equal
                    # attributes merge and the children are checked one by one.
                    if eh.attrs() != mine.attrs():
                        conflicts.append(path)  # both created it, differently
                elif eh.attrs() != eb.attrs() and mine.attrs() != eb.attrs() and not (
                        identical and eh.attrs() == mine.attrs()):
                    conflicts.append(path)  # both changed its attributes
                continue
            if eb != eh:
                conflicts.append(path)
            continue
        if eb == eh:
            continue  # the other side left this path (and all below it) alone
        if identical and eh == mine:
            continue  # both sides made the same change (or both deleted it), by opt-in
        conflicts.append(path)  # first committer wins, whatever the bytes
    return conflicts


def rebase(trees: Trees, base: Entry, head: Entry, changes: dict[str, Entry | None], *,
           identical: bool = False) -> Entry:
    """The new root: `changes` (made against `base`) applied to `head`."""
    parsed = parse_changes(changes)
    if base != head:
        conflicts = find_conflicts(trees, base, head, parsed, identical=identical)
        if conflicts:
            raise Conflict(conflicts)
    # With nobody else in between, a directory's mtime is ours (utimes may move it
    # back); only a concurrent publish makes the later of the two win.
    merge_time = max if base != head else _ours
    root = head
    body = [(p, e) for p, e in parsed if p]
    for parts, e in parsed:
        if not parts:
            if e is None or e.kind != K_DIR:
                raise InvalidInput("the root must stay a directory")
            root = root.with_(mode=e.mode, uid=e.uid, gid=e.gid, xattrs=e.xattrs,
                              mtime_ns=merge_time(root.mtime_ns, e.mtime_ns))
    if body:
        root = trees.apply(root, body, merge_time=merge_time)
    return root


def _ours(_theirs: int, ours: int) -> int:
    return ours
