"""The gateway's stream settings (`streams:` in fleet.yaml)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StreamSettings:
    ping_interval_s: float = 15.0
    send_timeout_s: float = 10.0
    max_lag_events: int = 2048  # a reader further behind than this is cut off (it can resume)
    disconnect_grace_s: float = 5.0  # a dropped stream nobody resumes within this is cancelled
    owner_lease_s: float = 10.0  # a gateway silent in Redis this long is dead: resumes of its streams end (fleet)

    def __post_init__(self) -> None:
        if not self.owner_lease_s > 0:
            raise ValueError("streams.owner_lease_s must be positive")
