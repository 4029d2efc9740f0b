"""Inter-token gaps recorded a run of steps at a time land in the same bins as one step at a time."""

from __future__ import annotations

import math
import random

from tokenfleet.sim.metrics import Metrics, Slo

SLO = Slo(ttft_s={"paid": 1.0}, tpot_s=0.1)


def _itl(metrics: Metrics) -> dict:
    return {tier: (m.itl.bins, m.itl.count, round(m.itl.total, 9)) for tier, m in metrics.tiers.items()}


def test_many_gaps_at_once_count_as_each_gap_in_turn() -> None:
    rng = random.Random(3)
    one, many = Metrics(SLO), Metrics(SLO)
    for _ in range(200):
        per_tier = {"paid": rng.randint(0, 40), "free": rng.randint(0, 5)}
        start = rng.uniform(0.005, 0.08)
        gaps = [start * (1 + 0.0007 * k) for k in range(rng.randint(1, 60))]  # a run: slowly growing steps
        for gap in gaps:
            one.inter_tokens(gap, per_tier)
        many.inter_tokens_many(gaps, per_tier)
    assert _itl(one) == _itl(many)
    assert sum(m.itl.count for m in many.tiers.values()) > 1000
    assert math.isclose(many.tiers["paid"].itl.percentile(50), one.tiers["paid"].itl.percentile(50))
