"""Weighted fair queuing across tiers: start-time fair queuing (SFQ) over token cost.

Each tier has a virtual finish tag; a backlogged tier's next start tag is max(virtual time, its finish tag), the
tier with the smallest start tag goes next, and dispatching `cost` tokens moves its finish tag by cost / weight.
So when tiers are backlogged together each gets tokens in proportion to its weight, and a tier that was idle (or
paused) starts at the current virtual time: it gets no credit for the time it did not ask."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class TierFairQueue:
    def __init__(self, weights: Mapping[str, int], priorities: Mapping[str, int]) -> None:
        self._weights = dict(weights)
        self._rank = {name: (priorities[name], name) for name in weights}  # ties: lower priority class first
        self._finish = {name: 0.0 for name in weights}
        self.virtual_time = 0.0

    def start_tag(self, tier: str) -> float:
        return max(self.virtual_time, self._finish[tier])

    def choose(self, backlogged: Iterable[str]) -> str | None:
        return min(backlogged, key=lambda tier: (self.start_tag(tier), self._rank[tier]), default=None)

    def charge(self, tier: str, cost: int) -> None:
        start = self.start_tag(tier)
        self._finish[tier] = start + cost / self._weights[tier]
        self.virtual_time = start

    def adjust(self, tier: str, delta_tokens: int) -> None:
        """Reconcile an estimate: the tier used delta_tokens more (or fewer) than it was charged."""
        self._finish[tier] += delta_tokens / self._weights[tier]
