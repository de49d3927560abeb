"""Who does a store's work: request counts per store and origin, and the move policy.

Every member counts the requests its own clients send, per store; an owner
also counts, per store, the member each request entered the fleet at (its
own clients, or the `X-Strata-Forwarded` name of a forwarding member). The
policy reads the owner's counts:

- over the last `window` seconds at least `min_requests` requests reached
  the store,
- one other member originated at least `share` of them,
- and this owner has held the store for at least `cooldown` seconds (and
  for a whole window: counts from before its claim are not its own),

then the owner hands the store to that member (the planned handoff). Two
members sharing a store's work evenly never reach the share, so neither
pulls it; and a store moves at most once per cooldown, however its traffic
swings. docs/fleet.md, "Moving a store to the work", says why.

Counts live in memory only: a member that restarts starts counting afresh.
This module neither moves nor serves anything; fleet/member.py does.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from strata.fleet.lease import clock


@dataclass(frozen=True)
class MovePolicy:
    """When an owner hands a store to the member doing its work (None target: never)."""

    share: float = 0.8          # one member's fraction of the store's requests
    window: float = 10.0        # seconds over which they are counted
    min_requests: int = 50      # fewer than this in a window: too little to judge
    cooldown: float = 60.0      # an owner keeps a store at least this long
    enabled: bool = True


class Traffic:
    """Requests per store and origin member, in one-second buckets over a window."""

    def __init__(self, policy: MovePolicy) -> None:
        self.policy = policy
        self._buckets: dict[str, deque[tuple[int, Counter[str]]]] = {}
        self._since: dict[str, float] = {}

    def note(self, store: str, origin: str) -> None:
        now = clock()
        self._since.setdefault(store, now)
        q = self._buckets.setdefault(store, deque())
        sec = int(now)
        if not q or q[-1][0] != sec:
            q.append((sec, Counter()))
            while q and q[0][0] <= sec - self.policy.window - 1:
                q.popleft()
        q[-1][1][origin] += 1

    def reset(self, store: str) -> None:
        """Start counting afresh (this member just claimed the store)."""
        self._buckets.pop(store, None)
        self._since[store] = clock()

    def counts(self, store: str) -> Counter[str]:
        """Requests per origin over the last window."""
        total: Counter[str] = Counter()
        cutoff = clock() - self.policy.window
        for sec, c in self._buckets.get(store, ()):
            if sec > cutoff:
                total.update(c)
        return total

    def target(self, store: str, owner: str) -> str | None:
        """The member the owner should hand `store` to now, if the policy says so."""
        p = self.policy
        if not p.enabled:
            return None
        held = clock() - self._since.get(store, clock())
        if held < max(p.cooldown, p.window):
            return None
        counts = self.counts(store)
        total = sum(counts.values())
        if total < p.min_requests:
            return None
        top, n = counts.most_common(1)[0]
        if top == owner or n < p.share * total:
            return None
        return top

    def report(self) -> dict[str, dict[str, int]]:
        """Per store: requests per origin over the last window (for status)."""
        return {s: dict(self.counts(s)) for s in sorted(self._buckets)}
