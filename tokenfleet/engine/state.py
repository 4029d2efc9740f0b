"""A snapshot of an engine's load and counters: what the router's /load and the Prometheus metrics read. The same
record whether the engine steps on a thread of this process or in an engine process of its own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.engine.request import RequestStatus


def load_report(engine: Any) -> dict[str, float]:
    """What the router needs to place the next request: work in flight and memory pressure."""
    running = list(engine.scheduler.running)
    queued = list(engine.scheduler.queue)
    return {
        "running": len(running),
        "waiting": sum(1 for r in queued if r.status is RequestStatus.WAITING),
        "swapped": sum(1 for r in queued if r.status is RequestStatus.SWAPPED),
        "queued_prefill_tokens": sum(r.num_uncomputed_tokens for r in queued)
        + sum(r.num_uncomputed_tokens for r in running if r.num_uncomputed_tokens > 1),
        "kv_usage": round(engine.blocks.usage(), 4),
        "num_blocks": engine.blocks.num_blocks,
        "kv_cache_tokens": engine.blocks.num_blocks * engine.blocks.block_size,
        "prefill_tokens_total": engine.scheduler.num_prefill_tokens,
    }


@dataclass
class SpecDecodeStats:
    """Cumulative counters, as vLLM's spec_decode metrics count them."""

    num_drafts: int = 0  # verifications of at least one proposal
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)  # accepted at position 0, 1, ... of a draft

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields on average: its accepted proposals plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if not num_proposed:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass
class EngineState:
    load: dict[str, float] = field(default_factory=dict)  # load_report()
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    stats: Any = None  # engine.StepStats: where step time went
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters; None when it is off

    @classmethod
    def of(cls, engine: Any) -> EngineState:
        scheduler = engine.scheduler
        speculator = engine.speculator
        return cls(
            load_report(engine),
            scheduler.prefix_cache_queries,
            scheduler.prefix_cache_hits,
            scheduler.num_preemptions,
            engine.stats,
            dataclasses.replace(speculator.stats, accepted_per_position=list(speculator.stats.accepted_per_position))
            if speculator is not None
            else None,
        )
