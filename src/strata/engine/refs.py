"""Branch heads, volumes, leases and policies in memory: the pending view and the served view.

Every change to them is a commit record's ops (docs/format.md). `Refs` holds
them twice (docs/design.md, crash-safety rule 3): the *pending* view takes
each commit as it is appended and is what compare-and-swap checks against;
the *served* view takes a commit only once the fsync covering it returned,
and is what every reader sees. The journal drives both (`check` and `stage`
under its append lock, `advance` when a position becomes durable); the
store's volume, branch, lease and publish calls read them.
"""

from __future__ import annotations

import collections
import hmac
from collections.abc import Sequence
from typing import Any

import blake3

from strata.engine.errors import NotFound
from strata.engine.index import Index
from strata.engine.interface import Lease

Pos = tuple[int, int]
Key = tuple[str, str]  # (volume, branch)


class Refs:
    def __init__(self, index: Index) -> None:
        self.served_vols, self.served = index.load_state()
        self.leases = {k: Lease(*v) for k, v in index.load_leases().items()}
        self.vol_ids = index.load_volume_ids()  # volume -> id drawn at its creation
        self.pending_vols = set(self.served_vols)
        self.pending = dict(self.served)
        # Retention policies ("policy" ops): (volume, branch or "") -> fields.
        self.policies = index.load_policies()
        self.pending_policies = dict(self.policies)
        self._undurable: collections.deque[tuple[Pos, list[list[Any]]]] = collections.deque()

    def check(self, ops: list[list[Any]], expect: Sequence[tuple[str, str, str | None]]) -> None:
        """Refuse a commit whose expected heads moved or whose volume is gone."""
        for vol, br, old in expect:
            cur = self.pending.get((vol, br))
            if cur != old:
                raise CasMismatch(vol, br, old, cur)
        created = {op[1] for op in ops if op[0] == "vol+"}
        for op in ops:
            if op[0] in ("ref", "lease", "policy") and op[1] not in self.pending_vols | created:
                raise NotFound(f"no volume {op[1]!r}")  # deleted under our feet

    def stage(self, end: Pos, ops: list[list[Any]]) -> None:
        """A commit ending at `end` was appended: pending now, served once durable."""
        for op in ops:
            apply_op(op, self.pending_vols, self.pending)
            apply_policy_op(op, self.pending_policies)
            if op[0] == "state":
                self.leases.clear()
                self.vol_ids.clear()
            elif op[0] == "lease":
                self.leases[(op[1], op[2])] = Lease(op[3], op[4], op[5], op[6])
            elif op[0] == "vol+":
                self.vol_ids[op[1]] = op[2]
            elif op[0] == "vol-":
                self.vol_ids.pop(op[1], None)
        self._undurable.append((end, ops))

    def advance(self, durable: Pos) -> None:
        """Serve every staged commit up to `durable`."""
        if self._undurable and self._undurable[0][0] <= durable:
            # Copy, change, swap: readers iterate the old dicts without a lock.
            vols, refs = set(self.served_vols), dict(self.served)
            policies = dict(self.policies)
            while self._undurable and self._undurable[0][0] <= durable:
                _p, ops = self._undurable.popleft()
                for op in ops:
                    apply_op(op, vols, refs)
                    apply_policy_op(op, policies)
            self.served_vols, self.served, self.policies = vols, refs, policies


def apply_policy_op(op: list[Any], policies: dict[Key, dict[str, Any]]) -> None:
    kind = op[0]
    if kind == "state":
        policies.clear()
    elif kind == "policy":
        key = (str(op[1]), str(op[2] or ""))
        if op[3]:
            policies[key] = dict(op[3])
        else:
            policies.pop(key, None)
    elif kind == "vol-":
        for key in [k for k in policies if k[0] == op[1]]:
            del policies[key]


def apply_op(op: list[Any], vols: set[str], refs: dict[Key, str]) -> None:
    kind = op[0]
    if kind == "state":  # the whole state follows in the same commit
        vols.clear()
        refs.clear()
    elif kind == "vol+":
        vols.add(op[1])
    elif kind == "vol-":
        vols.discard(op[1])
        for key in [k for k in refs if k[0] == op[1]]:
            del refs[key]
    elif kind == "ref":
        if op[4] is None:
            refs.pop((op[1], op[2]), None)
        else:
            refs[(op[1], op[2])] = op[4]


def state_ops(refs: Refs) -> list[list[Any]]:
    """One commit's ops that set the whole ref state as it is pending now.

    Garbage collection appends it before deleting packs, whose commit records an
    index rebuild would otherwise miss. Caller holds the journal's append lock.
    """
    ops: list[list[Any]] = [["state"]]
    ops += [["vol+", v, refs.vol_ids.get(v, "")] for v in sorted(refs.pending_vols)]
    ops += [["ref", v, b, None, sid] for (v, b), sid in sorted(refs.pending.items())]
    ops += [["lease", v, b, *lease[:4]] for (v, b), lease in sorted(refs.leases.items())]
    ops += [["policy", v, b or None, fields]
            for (v, b), fields in sorted(refs.pending_policies.items())]
    return ops


class CasMismatch(NotFound):
    # Retried by LocalStore._commit_retry. Elsewhere the branch locks rule it out except
    # when the volume was deleted meanwhile, which is what callers then see: NotFound.
    def __init__(self, vol: str, br: str, old: str | None, cur: str | None) -> None:
        super().__init__(f"{vol}@{br} was moved or deleted meanwhile "
                         f"(expected {old}, found {cur})")


def lease_key(secret: bytes) -> bytes:
    return blake3.blake3(b"strata lease\0" + secret).digest(length=16)


def lease_fencing(lease: object) -> int:
    """The fencing number a lease id names (0 if it is not a lease id)."""
    if not isinstance(lease, str):
        return 0
    head, _, _ = lease.partition(".")
    return int(head) if head.isdigit() and len(head) < 20 else 0


def lease_matches(cur: Lease, lease: object) -> bool:
    """True if `lease` is the id of `cur`: its fencing number and its secret."""
    if not isinstance(lease, str) or not cur.key:
        return False
    head, _, secret_hex = lease.partition(".")
    if not head.isdigit() or int(head) != cur.fencing or len(secret_hex) != 32:
        return False
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        return False
    return hmac.compare_digest(lease_key(secret), cur.key)
