"""Graceful degradation under overload: a projected time to first token, and a fixed ladder of steps.

Level 0: normal. 1: pause the batch tiers. 2: free requests get a smaller max_tokens cap and the smaller model.
3: new free requests are shed (429 with retry-after). 4: paid requests queue, with the projected delay reported.
Paid requests are never shed by the ladder. The gateway applies a plan before prefill, so nothing shed has used
GPU time. Levels move one step per update; going down needs the projected TTFT to stay well below the step's
threshold for a cool-down, so the ladder does not flap at a boundary."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from typing import Protocol

log = logging.getLogger(__name__)

MAX_LEVEL = 4


@dataclass
class LoadSignal:
    """What the gateway knows right now."""

    queued_tokens: int  # waiting in the dispatcher, all tiers
    replica_waiting_tokens: int  # sum over replicas of queued prefill tokens (their /load reports)
    running: int
    slots: int
    prefill_tokens_per_s: float  # the pool's prefill throughput (an EWMA the caller measures)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"LoadSignal.{f.name} must be a number >= 0, got {value!r}")


def projected_ttft_s(signal: LoadSignal) -> float:
    """Seconds until a request arriving now would start its prefill: every token queued ahead of it, in the
    dispatcher and on the replicas, at the pool's prefill rate. Infinite when work waits and nothing is measured."""
    backlog = signal.queued_tokens + signal.replica_waiting_tokens
    if backlog == 0:
        return 0.0
    if signal.prefill_tokens_per_s <= 0:
        return math.inf
    return backlog / signal.prefill_tokens_per_s


@dataclass(frozen=True)
class OverloadSettings:
    ttft_target_s: float = 1.0
    # projected TTFT, as multiples of the target, at which levels 1, 2, 3 and 4 engage
    thresholds: tuple[float, float, float, float] = (0.5, 0.75, 1.0, 1.5)
    step_down_ratio: float = 0.8  # a level is left only below this fraction of its threshold ...
    cool_down_s: float = 10.0  # ... held for this long
    free_max_tokens: int = 256
    free_model: str | None = None  # the smaller model for free requests at level >= 2; None: no smaller model
    shed_retry_after_s: float = 5.0
    batch_tiers: tuple[str, ...] = ("batch",)
    free_tiers: tuple[str, ...] = ("free",)

    def __post_init__(self) -> None:
        if not self.ttft_target_s > 0:
            raise ValueError(f"ttft_target_s must be positive, got {self.ttft_target_s!r}")
        if len(self.thresholds) != MAX_LEVEL:
            raise ValueError(f"thresholds needs {MAX_LEVEL} values (levels 1..{MAX_LEVEL}), got {self.thresholds!r}")
        if not all(t > 0 for t in self.thresholds) or any(a >= b for a, b in zip(self.thresholds, self.thresholds[1:])):
            raise ValueError(f"thresholds must be positive and strictly increasing, got {self.thresholds!r}")
        if not 0 < self.step_down_ratio < 1:
            raise ValueError(f"step_down_ratio must be in (0, 1), got {self.step_down_ratio!r}")
        if not self.cool_down_s >= 0:
            raise ValueError(f"cool_down_s must be >= 0, got {self.cool_down_s!r}")
        if (
            isinstance(self.free_max_tokens, bool)
            or not isinstance(self.free_max_tokens, int)
            or self.free_max_tokens < 1
        ):
            raise ValueError(f"free_max_tokens must be a positive whole number, got {self.free_max_tokens!r}")
        if not self.shed_retry_after_s > 0:
            raise ValueError(f"shed_retry_after_s must be positive, got {self.shed_retry_after_s!r}")
        both = sorted(set(self.batch_tiers) & set(self.free_tiers))
        if both:
            raise ValueError(f"a tier cannot be both batch and free: {', '.join(both)}")

    def threshold_s(self, level: int) -> float:
        """Projected TTFT at which `level` (1..4) engages."""
        return self.thresholds[level - 1] * self.ttft_target_s


@dataclass(frozen=True)
class Plan:
    """What to do with a new request of a tier at the current level."""

    action: str  # admit | queue | shed
    max_tokens_cap: int | None  # the most max_tokens to allow (also the default when the request gives none)
    model_override: str | None  # serve it with this model instead
    retry_after_s: float | None  # with shed: the Retry-After to send
    level: int
    queue_delay_s: float | None = None  # with queue at level 4: the projected wait


class Pausable(Protocol):
    @property
    def tier_names(self) -> tuple[str, ...]: ...

    def pause(self, tier: str, paused: bool = True) -> None: ...

    def set_limit(self, tiers: Collection[str], max_tokens: int | None, window_s: float = 1.0) -> None: ...


class OverloadLadder:
    def __init__(self, settings: OverloadSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or OverloadSettings()
        self._clock = clock
        self.level = 0
        self.projected_ttft_s = 0.0
        self._calm_since: float | None = None  # when the TTFT went below the current level's step-down mark

    def update(self, signal: LoadSignal) -> int:
        """Take a new load reading; returns the level (0..4), changed by at most one step."""
        ttft = self.projected_ttft_s = projected_ttft_s(signal)
        now = self._clock()
        if self.level < MAX_LEVEL and ttft >= self.settings.threshold_s(self.level + 1):
            self._move(self.level + 1, ttft)
        elif self.level > 0 and ttft < self.settings.step_down_ratio * self.settings.threshold_s(self.level):
            if self._calm_since is None:
                self._calm_since = now
            elif now - self._calm_since >= self.settings.cool_down_s:
                self._move(self.level - 1, ttft)
        else:
            self._calm_since = None
        return self.level

    def plan(self, tier: str) -> Plan:
        s, level = self.settings, self.level
        if tier in s.batch_tiers:
            return Plan("queue" if level >= 1 else "admit", None, None, None, level)
        if tier in s.free_tiers:
            if level >= 3:
                return Plan("shed", None, None, s.shed_retry_after_s, level)
            if level == 2:
                return Plan("admit", s.free_max_tokens, s.free_model, None, level)
            return Plan("admit", None, None, None, level)
        if level >= MAX_LEVEL:
            return Plan("queue", None, None, None, level, queue_delay_s=self.projected_ttft_s)
        return Plan("admit", None, None, None, level)

    def apply(self, dispatcher: Pausable, batch_tokens_per_s: float | None = None) -> None:
        """Pause the dispatcher's batch tiers from level 1 up, resume them below. `batch_tokens_per_s` (the
        autoscaler's batch gate: the spare replicas' prefill rate) paces them: within any window as long as the
        level-1 TTFT threshold they get at most that rate x the window, so a backlog let go when the gate opens
        raises the projected TTFT by at most the spare replicas' share of that threshold. 0 pauses them; None: no
        gate, no pace."""
        tiers = [tier for tier in self.settings.batch_tiers if tier in dispatcher.tier_names]
        if not tiers:
            return
        window = self.settings.threshold_s(1)
        limit = None if batch_tokens_per_s is None else math.ceil(batch_tokens_per_s * window)
        dispatcher.set_limit(tiers, limit, window)
        for tier in tiers:
            dispatcher.pause(tier, self.level >= 1 or limit == 0)

    def _move(self, level: int, ttft: float) -> None:
        up = level > self.level
        (log.warning if up else log.info)(
            "overload level %d -> %d (projected TTFT %.2f s, target %.2f s)",
            self.level,
            level,
            ttft,
            self.settings.ttft_target_s,
        )
        self.level = level
        self._calm_since = None
