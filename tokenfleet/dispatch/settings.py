"""`dispatch:` in fleet.yaml: slots per replica, the fair queue's quantum, load polling, the TTFT projection."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DispatchSettings:
    slots_per_replica: int = 64  # requests a replica runs at once before the gateway queues by tier
    quantum_tokens: int = 2048  # deficit round-robin quantum across tenants of a tier
    load_interval_s: float = 1.0  # how often replica load reports are read
    prefill_tokens_per_s: float = 4000.0  # one replica's prefill rate, to project time to first token

    def __post_init__(self) -> None:
        if self.slots_per_replica < 1 or self.quantum_tokens < 1:
            raise ValueError("slots_per_replica and quantum_tokens must be at least 1")
        if not self.load_interval_s > 0 or not self.prefill_tokens_per_s > 0:
            raise ValueError("load_interval_s and prefill_tokens_per_s must be positive")
