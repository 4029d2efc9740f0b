"""Hot tenants: one tenant's buckets split into N slices, so its traffic spreads over N Redis Cluster shards.

How it works
------------
A tenant configured hot with N slices keeps every scope's keys under N hash tags, ``{acme#0}`` .. ``{acme#N-1}``.
Each gateway is given a slice index and draws from slice ``index % N`` only, so one request still touches one
cluster slot and stays one atomic script call.

- Per-minute buckets (requests and tokens) are what moves. Slice k holds a share ``s_k`` of every scope's bucket
  capacity and refill rate; the shares of a tenant sum to at most 1 at every instant, so all slices together never
  admit more than one unsplit bucket would: over any window T at most ``capacity + rate * T``.
  Each slice keeps ``s`` in a small hash (``{acme#k}:share``) together with the integral of ``s`` over time
  (share-seconds, ``acc`` up to the last change at ``since``). A bucket remembers the integral's value at its last
  read and refills by ``limit/60 * (integral now - integral then)``: exact however often the share changed in
  between, with no history kept. Its capacity is ``limit * s`` now (a level above it is cut when the share shrinks).
- Concurrency and the daily budget do not refill, so moving them safely would mean moving only what is unused, in
  every user's scope; instead they are split once, evenly (``limit // N``, the remainder to the first slices).
  That is exact and costs nothing at run time; the price is that a slice whose gateway sees more than its share of
  traffic hits them early. Give a hot tenant limits of at least N.
- Every reserve adds its tokens (at least 1) to its slice's ``demand`` counter, admitted or not.

Rebalancing (rebalance.py), every ``interval_s`` by whichever gateway takes the tenant's lock (``SET NX PX``):
read and reset each slice's demand, set shares proportional to it with a floor of ``min_share / N`` each (a quiet
slice can still serve its first requests), keeping the total at exactly 1. The slices are on different shards, so
the new shares cannot be written in one transaction: shares that shrink are written first, then the ones that grow.
Between the two steps the total is below 1 (safe); a gateway that dies in between leaves it below 1 until the next
round, which writes all N shares again. No demand anywhere: shares stay as they are.

Judging size: a request larger than ``limit * max_share`` (the most one slice can ever hold) is request_too_large;
one that fits that but not the slice's current capacity is refused on tokens_per_minute (the share may grow).
A user scope of a hot tenant is split the same way as its organisation (it shares the tenant's hash tag).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.quota.limits import Limits


@dataclass(frozen=True)
class SlicePlan:
    """Where one request of a tenant is kept: the hash tag and the part of the limits that slice enforces."""

    tenant: str
    index: int | None = None  # None: not sliced
    count: int = 1
    min_share: float = 0.25  # the smallest share, as a fraction of the even share 1/N

    @property
    def tag(self) -> str:
        return self.tenant if self.index is None else f"{self.tenant}#{self.index}"

    @property
    def sliced(self) -> bool:
        return self.index is not None

    @property
    def initial_share(self) -> float:
        return 1.0 / self.count

    @property
    def floor(self) -> float:
        return self.min_share / self.count

    @property
    def max_share(self) -> float:
        return 1.0 - (self.count - 1) * self.floor if self.sliced else 1.0

    def limits(self, limits: Limits) -> Limits:
        """What this slice enforces of a scope's limits: per-minute ones whole (scaled by the share in the script),
        concurrency and the daily budget split evenly."""
        index = self.index
        if index is None:
            return limits
        return Limits(
            limits.requests_per_minute,
            limits.tokens_per_minute,
            even_part(limits.concurrent_requests, self.count, index),
            even_part(limits.tokens_per_day, self.count, index),
        )


def even_part(total: int | None, count: int, index: int) -> int | None:
    if total is None:
        return None
    return total // count + (1 if index < total % count else 0)


def target_shares(demand: list[float], current: list[float], floor: float) -> list[float]:
    """New shares (summing to 1, each at least `floor`) proportional to `demand`; without demand, the current ones,
    topped up evenly if they lost some (a round that died half way)."""
    n = len(demand)
    total = sum(max(0.0, d) for d in demand)
    if total <= 0:
        missing = 1.0 - sum(current)
        if abs(missing) < 1e-12:
            return list(current)
        return [max(floor, s + missing / n) for s in current] if missing > 0 else [1.0 / n] * n
    spare = 1.0 - n * floor
    return [floor + spare * max(0.0, d) / total for d in demand]


def apply_order(current: list[float], target: list[float]) -> list[int]:
    """Slice indices in the order to write their new share: every shrinking one before any growing one."""
    shrinking = [k for k in range(len(target)) if target[k] < current[k]]
    rest = [k for k in range(len(target)) if target[k] >= current[k] and target[k] != current[k]]
    return shrinking + rest
