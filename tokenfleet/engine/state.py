"""A snapshot of an engine's load and counters: what the router's /load and the Prometheus metrics read. The same
record whether the engine steps on a thread of this process or in an engine process of its own."""

from __future__ import annotations

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
    }


@dataclass
class EngineState:
    load: dict[str, float] = field(default_factory=dict)  # load_report()
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    stats: Any = None  # engine.StepStats: where step time went

    @classmethod
    def of(cls, engine: Any) -> EngineState:
        scheduler = engine.scheduler
        return cls(
            load_report(engine),
            scheduler.prefix_cache_queries,
            scheduler.prefix_cache_hits,
            scheduler.num_preemptions,
            engine.stats,
        )
