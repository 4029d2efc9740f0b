"""`dispatch:` in fleet.yaml: slots per replica, the fair queue's quantum, load polling, the TTFT projection."""

from __future__ import annotations

from dataclasses import dataclass

# what a replica runs at once unless told otherwise: the engine's default max_num_seqs (and vLLM's)
REPLICA_MAX_NUM_SEQS = 256


@dataclass
class DispatchSettings:
    # requests a replica runs at once before the gateway queues by tier. None: as many as the replica runs at once
    # (`tokenfleet serve` knows its engine's max_num_seqs; a fleet assumes the engine's default, 256). Fewer gives
    # the fair queue more say in who goes first, at the price of time to first token in a burst: a request waits
    # at the gateway while the engine has room (docs/benchmarks/served_load.md has the numbers)
    slots_per_replica: int | None = None
    quantum_tokens: int = 2048  # deficit round-robin quantum across tenants of a tier
    load_interval_s: float = 1.0  # how often replica load reports are read
    # one replica's prefill rate, to project time to first token until the replicas' own reports measure it
    prefill_tokens_per_s: float = 4000.0

    def __post_init__(self) -> None:
        if (self.slots_per_replica is not None and self.slots_per_replica < 1) or self.quantum_tokens < 1:
            raise ValueError("slots_per_replica and quantum_tokens must be at least 1")
        if not self.load_interval_s > 0 or not self.prefill_tokens_per_s > 0:
            raise ValueError("load_interval_s and prefill_tokens_per_s must be positive")

    @property
    def replica_slots(self) -> int:
        return self.slots_per_replica or REPLICA_MAX_NUM_SEQS
