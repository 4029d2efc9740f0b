"""When load may override the cache: only on a real imbalance, absolute AND relative (as SGLang's router does with
balance_abs_threshold and balance_rel_threshold), counted in sequences and queued prefill (ReplicaState.load).

A bound counted in whole requests against the pool's average is a hair trigger at small counts: with 8 requests in
flight over 4 replicas, 1.25 x the average allows 3 on a replica, so a conversation's next turn was sent away from its
history whenever its replica happened to run a third request (47-52 of ~230 requests in the routing benchmark). An
absolute slack keeps small counts from ever looking imbalanced; a relative one keeps large counts from drifting apart.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_RELATIVE = 1.25
DEFAULT_ABSOLUTE = 8.0


@dataclass(frozen=True)
class LoadBound:
    relative: float = DEFAULT_RELATIVE  # `routing.load_bound`
    absolute: float = DEFAULT_ABSOLUTE  # `routing.load_slack`, in sequences

    def __post_init__(self) -> None:
        if not self.relative >= 1.0:
            raise ValueError(f"load_bound must be at least 1.0, got {self.relative}")
        if not self.absolute >= 0.0:
            raise ValueError(f"load_slack must be at least 0, got {self.absolute}")

    def too_busy(self, load: float, least: float) -> bool:
        """Whether a replica at `load` is really busier than the least loaded replica (at `least`): with this request
        it would be more than `absolute` sequences above it and more than `relative` times it."""
        after = load + 1
        return after - least > self.absolute and after > self.relative * least
