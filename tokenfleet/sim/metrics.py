"""What a run measures: per tier, TTFT and inter-token latency distributions, goodput under SLOs, and counts of
what happened to requests (completed, cancelled, shed, refused by quota or for length, rejected, delayed in the
fair queue)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenfleet.sim.request import SimRequest

BIN = math.log(1.01)  # histogram bins 1% wide


def bin_index(value: float) -> int:
    """The bin i with exp(i x BIN) <= value < exp((i + 1) x BIN): the bounds decide, not the rounding of the log."""
    if value <= 1e-9:
        return -2100
    index = int(math.floor(math.log(value) / BIN))
    if value < math.exp(index * BIN):
        return index - 1
    return index + 1 if value >= math.exp((index + 1) * BIN) else index


class LogHistogram:
    """Counts of positive values in 1%-wide bins: exact counts, percentiles to within 1%."""

    def __init__(self) -> None:
        self.bins: dict[int, int] = {}
        self.count = 0
        self.total = 0.0

    def add(self, value: float, count: int = 1) -> None:
        self.add_at(bin_index(value), value, count)

    def add_at(self, index: int, value: float, count: int) -> None:
        self.bins[index] = self.bins.get(index, 0) + count
        self.count += count
        self.total += value * count

    def percentile(self, q: float) -> float | None:
        if not self.count:
            return None
        rank, seen = q / 100 * self.count, 0
        for index in sorted(self.bins):
            seen += self.bins[index]
            if seen >= rank:
                return math.exp((index + 0.5) * BIN)
        return math.exp((max(self.bins) + 0.5) * BIN)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass(frozen=True)
class Slo:
    ttft_s: dict  # tier -> target
    tpot_s: float  # mean time per output token after the first

    def met(self, sreq: SimRequest) -> bool:
        target = self.ttft_s.get(sreq.tier, math.inf)
        if sreq.ttft is None or sreq.ttft > target:
            return False
        if sreq.tokens_out > 1:
            return (sreq.finished - sreq.first_token) / (sreq.tokens_out - 1) <= self.tpot_s
        return True


@dataclass
class TierMetrics:
    arrived: int = 0
    completed: int = 0
    cancelled: int = 0
    shed: int = 0  # the overload ladder's 429
    quota: int = 0  # refused by the token quota
    rejected: int = 0  # could never run (too long for the replica's KV cache)
    length: int = 0  # refused by the gateway: prompt + answer exceed the model's max_model_len
    delayed: int = 0  # waited in the dispatcher's fair queue before reaching a replica
    good: int = 0  # completed within the SLO
    good_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    ttft: list = field(default_factory=list)
    queue_wait: LogHistogram = field(default_factory=LogHistogram)
    itl: LogHistogram = field(default_factory=LogHistogram)


class Metrics:
    def __init__(self, slo: Slo, since: float = 0.0) -> None:
        self.slo, self.since = slo, since  # requests arriving before `since` (warm-up) are not counted
        self.tiers: dict[str, TierMetrics] = {}
        self._last_bin = (0.0, 0.0, 0)  # [low, high) of the last inter-token bin, and its index

    def tier(self, name: str) -> TierMetrics:
        m = self.tiers.get(name)
        if m is None:
            m = self.tiers[name] = TierMetrics()
        return m

    def counts(self, sreq: SimRequest) -> bool:
        return sreq.arrival >= self.since

    def arrived(self, sreq: SimRequest) -> None:
        if self.counts(sreq):
            self.tier(sreq.tier).arrived += 1

    def refused(self, sreq: SimRequest, status: str) -> None:
        sreq.status = status
        if self.counts(sreq):
            m = self.tier(sreq.tier)
            setattr(m, status, getattr(m, status) + 1)

    def too_long(self, sreq: SimRequest) -> None:
        """A turn that arrived and was refused at once: prompt + answer exceed max_model_len (the gateway's 400)."""
        self.arrived(sreq)
        self.refused(sreq, "length")

    def ended(self, sreq: SimRequest) -> None:
        if not self.counts(sreq):
            return
        m = self.tier(sreq.tier)
        if sreq.status == "ok":
            m.completed += 1
            if self.slo.met(sreq):
                m.good += 1
                m.good_tokens += sreq.tokens_out
        else:
            m.cancelled += 1
        if sreq.first_token is not None:
            m.ttft.append(sreq.first_token - sreq.arrival)
        m.prompt_tokens += len(sreq.prompt)
        m.cached_tokens += sreq.cached_tokens
        m.output_tokens += sreq.tokens_out
        m.preemptions += sreq.preemptions
        if sreq.admitted is not None:
            wait = sreq.admitted - sreq.arrival
            m.queue_wait.add(wait)
            m.delayed += wait > 0

    def inter_token(self, tier: str, gap: float, count: int) -> None:
        self.tier(tier).itl.add(gap, count)

    def inter_tokens_many(self, gaps: list[float], per_tier: dict[str, int]) -> None:
        """inter_tokens for each gap in turn (a run of steps with the same decodes)."""
        counts: dict[int, int] = {}
        low, high, index = self._last_bin
        for gap in gaps:
            if not low <= gap < high or gap <= 1e-9:
                index = bin_index(gap)
                low, high = math.exp(index * BIN), math.exp((index + 1) * BIN)
            counts[index] = counts.get(index, 0) + 1
        self._last_bin = (low, high, index)
        total = sum(gaps)
        for tier, count in per_tier.items():
            if count:
                hist = self.tier(tier).itl
                for i, n in counts.items():
                    hist.bins[i] = hist.bins.get(i, 0) + n * count
                hist.count += len(gaps) * count
                hist.total += total * count

    def inter_tokens(self, gap: float, per_tier: dict[str, int]) -> None:
        """One step's gap for many decodes (the hot path: one call per replica step)."""
        low, high, index = self._last_bin
        if not low <= gap < high or gap <= 1e-9:  # consecutive steps mostly share a 1% bin: no logarithm then
            index = bin_index(gap)
            self._last_bin = (math.exp(index * BIN), math.exp((index + 1) * BIN), index)
        tiers = self.tiers
        for tier, count in per_tier.items():
            if count:
                hist = tiers[tier].itl if tier in tiers else self.tier(tier).itl
                hist.bins[index] = hist.bins.get(index, 0) + count
                hist.count += count
                hist.total += gap * count
