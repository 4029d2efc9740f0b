"""The gateway's stream settings (`streams:` in fleet.yaml)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StreamSettings:
    ping_interval_s: float = 15.0
    send_timeout_s: float = 10.0
    max_lag_events: int = 2048  # a reader further behind than this is cut off (it can resume)
    disconnect_grace_s: float = 5.0  # a dropped stream nobody resumes within this is cancelled
