"""Backoff for the metering loops, and one log line per outage instead of one per failed try."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field


@dataclass
class Outage:
    what: str  # e.g. "usage shipper: event log"
    logger: logging.Logger
    base_s: float = 0.5
    max_s: float = 30.0
    failures: int = 0
    since: float = field(default=0.0)

    def failed(self, error: BaseException) -> float:
        """Records a failed try; returns how long to wait before the next one (doubling up to max_s)."""
        if self.failures == 0:
            self.since = time.monotonic()
            self.logger.warning("%s unavailable, retrying with backoff: %s: %s", self.what, type(error).__name__, error)
        self.failures += 1
        return min(self.max_s, self.base_s * 2 ** min(self.failures - 1, 30))

    def recovered(self) -> None:
        if self.failures:
            self.logger.warning(
                "%s available again after %.1f s (%d failed tries)",
                self.what,
                time.monotonic() - self.since,
                self.failures,
            )
        self.failures = 0

    @property
    def ongoing(self) -> bool:
        return self.failures > 0


def raise_if_cancelled(error: BaseException | None = None) -> None:
    """A client library may turn a cancellation into a connection error while cleaning up, or lose it and return
    normally (redis-py's XREADGROUP BLOCK cancelled as its reply arrives: 2-3 cancels in a hundred); a loop that
    went on would never end, so a cancellation requested of this task is raised (again). The loops call this
    after every round as well as on errors."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from error
