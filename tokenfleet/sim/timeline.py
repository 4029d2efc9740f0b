"""A run over time: per time bin and tier, what arrived, was shed or delayed, finished within the SLO or not, and
the TTFTs (by arrival bin); and gauges sampled on the simulated clock (overload level, replicas, queue, KV usage).
What the overload and autoscaling experiments plot. It records alongside the run's own metrics, changing none."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenfleet.sim.events import EventQueue
from tokenfleet.sim.metrics import Metrics, Slo
from tokenfleet.sim.request import SimRequest


@dataclass
class TierBin:
    arrived: int = 0
    shed: int = 0
    quota: int = 0
    length: int = 0  # prompt + answer over max_model_len (the gateway's 400)
    rejected: int = 0
    completed: int = 0
    cancelled: int = 0
    good: int = 0  # completed within the SLO (TTFT and time per output token)
    missed: int = 0  # completed outside it
    delayed: int = 0  # waited in the fair queue
    capped: int = 0  # its max_tokens cut by the overload ladder (free tier at level 2)
    ttft: list = field(default_factory=list)

    def row(self) -> dict:
        return {
            "arrived": self.arrived,
            "shed": self.shed,
            "quota": self.quota,
            "length": self.length,
            "rejected": self.rejected,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "good": self.good,
            "missed": self.missed,
            "delayed": self.delayed,
            "capped": self.capped,
            "ttft_p50_s": percentile(self.ttft, 50),
            "ttft_p99_s": percentile(self.ttft, 99),
        }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 4)


class TimelineMetrics(Metrics):
    """The run's Metrics, plus the same events binned by the request's arrival time (warm-up included)."""

    def __init__(self, slo: Slo, since: float = 0.0, bin_s: float = 10.0) -> None:
        super().__init__(slo, since)
        if not bin_s > 0:
            raise ValueError(f"bin_s must be positive, got {bin_s!r}")
        self.bin_s = bin_s
        self.bins: dict[int, dict[str, TierBin]] = {}

    def _bin(self, sreq: SimRequest) -> TierBin:
        tiers = self.bins.setdefault(int(sreq.arrival // self.bin_s), {})
        return tiers.get(sreq.tier) or tiers.setdefault(sreq.tier, TierBin())

    def arrived(self, sreq: SimRequest) -> None:
        super().arrived(sreq)
        self._bin(sreq).arrived += 1

    def refused(self, sreq: SimRequest, status: str) -> None:
        super().refused(sreq, status)
        b = self._bin(sreq)
        setattr(b, status, getattr(b, status) + 1)

    def ended(self, sreq: SimRequest) -> None:
        super().ended(sreq)
        b = self._bin(sreq)
        if sreq.status == "ok":
            b.completed += 1
            if self.slo.met(sreq):
                b.good += 1
            else:
                b.missed += 1
        else:
            b.cancelled += 1
        if sreq.first_token is not None:
            b.ttft.append(sreq.first_token - sreq.arrival)
        if sreq.admitted is not None and sreq.admitted > sreq.arrival:
            b.delayed += 1
        if sreq.max_tokens < len(sreq.output):
            b.capped += 1

    def rows(self) -> list[dict]:
        """One row per bin: its start time and, per tier, the counts and TTFT percentiles."""
        return [
            {"t": i * self.bin_s, "tiers": {tier: b.row() for tier, b in sorted(tiers.items())}}
            for i, tiers in sorted(self.bins.items())
        ]

    def totals(self, tiers: tuple[str, ...] | None = None) -> TierBin:
        """Every bin's counts together (TTFTs left out), over `tiers` (default: all)."""
        total = TierBin()
        for by_tier in self.bins.values():
            for tier, b in by_tier.items():
                if tiers is None or tier in tiers:
                    for name in (
                        "arrived",
                        "shed",
                        "quota",
                        "length",
                        "rejected",
                        "completed",
                        "cancelled",
                        "good",
                        "missed",
                        "delayed",
                        "capped",
                    ):
                        setattr(total, name, getattr(total, name) + getattr(b, name))
        return total


class Sampler:
    """Calls `read()` every `interval_s` of simulated time until `until`, keeping what it returns (with `t`)."""

    def __init__(self, events: EventQueue, interval_s: float, read: Callable[[], dict], until: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self.events, self.interval_s, self.read, self.until = events, interval_s, read, until
        self.samples: list[dict] = []
        events.at(0.0, self._sample)

    def _sample(self) -> None:
        now = self.events.clock.now
        self.samples.append({"t": round(now, 6), **self.read()})
        if now + self.interval_s <= self.until + 1e-9:
            self.events.after(self.interval_s, self._sample)


def fleet_gauges(fleet) -> dict:
    """What the gateway and the replicas show right now (fleet: tokenfleet.sim.fleet.Fleet)."""
    ladder = fleet.gateway.ladder
    reports = [r.report() for r in fleet.replicas]
    ttft = ladder.projected_ttft_s
    return {
        "level": ladder.level,
        "projected_ttft_s": round(ttft, 4) if math.isfinite(ttft) else None,
        "serving": len(fleet.states),
        "replicas": len(fleet.replicas),
        "in_flight": fleet.in_flight,
        "gateway_queued": fleet.gateway.queued,
        "kv_usage": round(sum(s.kv_usage for s in reports) / len(reports), 4) if reports else 0.0,
    }
