"""The autoscaling policy: pure and deterministic, with the clock passed in, so the gateway's service and a fleet
simulator drive the very same object (`Autoscaler.decide(now, signals)`).

Per pool, each decision:
1. Need, in (fractional) replicas, is the largest of: interactive requests in flight or queued over
   target_in_flight; ready x KV usage over target_kv_usage; ready x projected TTFT over target_ttft_s (these two
   at their interactive share: the requests in flight that are not batch). In forecast mode also: the measured
   arrival rate, and the forecast's peak between now and a cold start ahead, over replica_rps; then the warm buffer
   is added on top.
2. The target goes up at once when the need asks for more. It goes down only when, for the whole of
   scale_down_delay_s, even the need at scale_down_utilization x the targets stayed below it, and cooldown_s after
   the last change, by scale_down_step at most: hysteresis in size and in time, so noise does not flap it.
3. Under a shared budget the targets are cut by priority (every pool keeps its min_replicas).
4. Actions: draining replicas this policy drained are put back first (warm, no cold start), then new ones are
   started if the budget has room. Shrinking drains the least busy (newest on ties) removable replicas; a drained
   replica is removed only once it reports nothing running or waiting (or after max_drain_s).
5. The batch tier may run while the pool's interactive need is at most batch_max_utilization of its ready
   replicas and nothing is being scaled up: the trough. It then gets batch_tokens_per_s, the spare replicas'
   prefill rate, as its pace: a backlog that piled up outside the trough is let go at that pace, not all at once
   (the replicas' queued prefill is the projected TTFT the overload ladder sheds free requests on).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenfleet.autoscale.forecast import Forecast
from tokenfleet.autoscale.settings import AutoscaleSettings, PoolPolicy
from tokenfleet.autoscale.signals import PoolSignals, ReplicaSignals

FORECAST_SAMPLES = 5  # points between now and now + cold start at which the forecast is read


@dataclass
class Decision:
    pool: str
    desired: int  # replicas the pool should have serving (what KEDA / an HPA scales to)
    reason: str
    start: int = 0  # new replicas to launch now
    drain: list[str] = field(default_factory=list)  # stop sending them new requests
    undrain: list[str] = field(default_factory=list)  # back into rotation (drained earlier, still warm)
    remove: list[str] = field(default_factory=list)  # drained and empty: stop them
    batch_allowed: bool = False
    spare_replicas: float = 0.0  # ready replicas beyond the interactive need (with the warm buffer)
    batch_tokens_per_s: float = 0.0  # the batch tiers' pace: spare_replicas x prefill rate (0 outside the trough)
    need: float = 0.0  # replicas the signals call for, before the buffer, min and max
    forecast_rps: float | None = None  # the forecast's peak over the look-ahead


@dataclass
class Need:
    replicas: float
    term: str  # the signal that set it
    forecast_rps: float | None = None

    def describe(self) -> str:
        forecast = "" if self.forecast_rps is None else f" (forecast peak {self.forecast_rps:.2f} req/s)"
        return f"{self.term} needs {self.replicas:.2f} replicas{forecast}"


@dataclass
class _PoolState:
    target: int
    created_at: float
    changed_at: float
    window: deque = field(default_factory=deque)  # (time, replicas wanted at the scale-down utilisation)
    drained: dict[str, float] = field(default_factory=dict)  # replicas this policy drained -> when
    batch_since: float | None = None


class Autoscaler:
    def __init__(self, settings: AutoscaleSettings, forecasts: Mapping[str, Forecast | None] | None = None) -> None:
        """`forecasts`: pool -> Forecast, overriding the pools' configured ones (a simulator's own curve)."""
        self.settings = settings
        self.forecasts: dict[str, Forecast | None] = dict(forecasts or {})
        self._state: dict[str, _PoolState] = {}

    def policy_for(self, s: PoolSignals) -> PoolPolicy:
        return self.settings.pool(s.pool, s.model)

    def forecast(self, s: PoolSignals) -> Forecast | None:
        if s.pool not in self.forecasts:
            spec = self.policy_for(s).forecast
            self.forecasts[s.pool] = spec.build() if spec is not None else None
        return self.forecasts[s.pool]

    def decide(self, now: float, signals: Mapping[str, PoolSignals]) -> dict[str, Decision]:
        names = sorted(signals)
        plans = {name: self._retarget(name, now, signals[name]) for name in names}
        policies = {name: self.policy_for(signals[name]) for name in names}
        desired = allocate({n: plan[0] for n, plan in plans.items()}, policies, self.settings.budget)
        free = (
            math.inf
            if self.settings.budget is None
            else self.settings.budget - sum(s.occupied for s in signals.values())
        )
        decisions = {}
        for name in sorted(names, key=lambda n: (policies[n].priority, n)):
            target, need, reason = plans[name]
            if desired[name] < target:
                reason += f"; budget {self.settings.budget} allows {desired[name]}"
            decisions[name] = self._act(name, now, signals[name], desired[name], need, reason, max(0, free))
            free -= decisions[name].start
        return {name: decisions[name] for name in names}

    # --- how many ---------------------------------------------------------------------------------------------

    def _retarget(self, name: str, now: float, s: PoolSignals) -> tuple[int, Need, str]:
        p, st = self.policy_for(s), self._pool_state(name, now, s)
        forecast = self.forecast(s)
        if forecast is not None:
            forecast.observe(now, s.arrival_rate)
        need = self.need(now, s)
        up = self._replicas(need.replicas, p)
        down = self._replicas(need.replicas / self.settings.scale_down_utilization, p)
        self._sample(st, now, down)
        if up > st.target:
            reason = f"up {st.target} -> {up}: {need.describe()}"
            st.target, st.changed_at = up, now
        elif self._may_shrink(st, now):
            cfg = self.settings
            new = max(max(d for _, d in st.window), st.target - cfg.scale_down_step)
            reason = (
                f"down {st.target} -> {new}: {need.describe()}, under {cfg.scale_down_utilization:.0%} of "
                f"targets for {cfg.scale_down_delay_s:g}s"
            )
            st.target, st.changed_at = new, now
        else:
            reason = f"hold {st.target}: {need.describe()}"
        return st.target, need, reason

    def _pool_state(self, name: str, now: float, s: PoolSignals) -> _PoolState:
        p = self.policy_for(s)
        serving = min(s.ready + s.starting, p.max_replicas)
        st = self._state.get(name)
        if st is None:
            st = self._state[name] = _PoolState(max(serving, p.min_replicas), now, now)
        elif now - st.created_at < self.settings.scale_down_delay_s and serving > st.target:
            # A restarted gateway may decide before it has read the replica registry (ready 0): the replicas that
            # show up later are what is there, to be shrunk through the delay and the steps, not all at once.
            st.target = serving
        return st

    def _sample(self, st: _PoolState, now: float, down: int) -> None:
        """Keeps the samples covering the last scale_down_delay_s: those in it and the newest one before it, which
        stands for the time from the window's start to the next sample (after a gap, that may be long ago)."""
        st.window.append((now, down))
        start = now - self.settings.scale_down_delay_s
        while len(st.window) > 1 and st.window[1][0] <= start:
            st.window.popleft()

    def _may_shrink(self, st: _PoolState, now: float) -> bool:
        s = self.settings
        covered = st.window[0][0] <= now - s.scale_down_delay_s
        return covered and max(d for _, d in st.window) < st.target and now - st.changed_at >= s.cooldown_s

    def need(self, now: float, s: PoolSignals) -> Need:
        """Replicas the pool's signals call for now (fractional; no buffer, no bounds)."""
        p = self.policy_for(s)
        terms = {"in_flight": s.interactive_demand / p.target_in_flight}
        if s.ready:
            share = 1.0 if not s.in_flight else max(0, s.in_flight - s.batch_in_flight) / s.in_flight
            terms["kv_usage"] = s.ready * s.kv_usage_mean * share / p.target_kv_usage
            ttft = s.projected_ttft_s
            terms["ttft"] = s.ready * ttft * share / p.target_ttft_s if math.isfinite(ttft) else float(p.max_replicas)
        forecast_rps = None
        if self.settings.mode == "forecast" and p.replica_rps > 0:
            terms["arrivals"] = s.arrival_rate / p.replica_rps
            forecast_rps = self._forecast_peak(s, now)
            if forecast_rps is not None:
                terms["forecast"] = forecast_rps / p.replica_rps
        term = max(terms, key=lambda t: terms[t])
        return Need(terms[term], term, forecast_rps)

    def _forecast_peak(self, s: PoolSignals, now: float) -> float | None:
        """The highest forecast rate between now and a cold start ahead: what replicas started now must meet."""
        forecast = self.forecast(s)
        if forecast is None:
            return None
        ahead = self.settings.cold_start_s
        rates = [forecast.rate(now + ahead * k / (FORECAST_SAMPLES - 1)) for k in range(FORECAST_SAMPLES)]
        rates = [r for r in rates if r is not None]
        return max(rates) if rates else None

    def _buffer(self) -> float:
        return 1.0 + (self.settings.warm_buffer if self.settings.mode == "forecast" else 0.0)

    def _replicas(self, need: float, p: PoolPolicy) -> int:
        wanted = math.ceil(need * self._buffer() - 1e-9)
        return min(max(wanted, p.min_replicas), p.max_replicas)

    # --- which ------------------------------------------------------------------------------------------------

    def _act(
        self, name: str, now: float, s: PoolSignals, desired: int, need: Need, reason: str, free: float
    ) -> Decision:
        st = self._state[name]
        draining = {r.name for r in s.replicas if r.draining}
        st.drained = {n: t for n, t in st.drained.items() if n in draining}  # removed, undrained, or never applied
        d = Decision(name, desired, reason, need=need.replicas, forecast_rps=need.forecast_rps)
        serving = s.ready + s.starting
        if desired > serving:
            d.undrain = sorted(st.drained, key=lambda n: (-st.drained[n], n))[: desired - serving]
            for replica in d.undrain:
                del st.drained[replica]
            d.start = int(min(desired - serving - len(d.undrain), free))
        elif desired < s.ready:  # replicas still starting are not traded for ready ones: drained once they serve
            d.drain = [r.name for r in victims(s.replicas, s.ready - desired)]
            st.drained.update({replica: now for replica in d.drain})
        d.remove = [
            r.name
            for r in s.replicas
            if r.name in st.drained and r.name not in d.drain and self._drained_out(r, now - st.drained[r.name])
        ]
        for replica in d.remove:  # on its way out: never put back, even if it still shows up draining for a while
            del st.drained[replica]
        self._batch(st, now, s, d)
        return d

    def _drained_out(self, replica: ReplicaSignals, draining_s: float) -> bool:
        settled = replica.busy == 0 and draining_s >= self.settings.drain_settle_s
        return settled or draining_s >= self.settings.max_drain_s

    def _batch(self, st: _PoolState, now: float, s: PoolSignals, d: Decision) -> None:
        buffered = d.need * self._buffer()
        d.spare_replicas = max(0.0, s.ready - buffered)
        trough = s.ready > 0 and d.desired <= s.ready and buffered <= self.settings.batch_max_utilization * s.ready
        if not trough:
            st.batch_since = None
        elif st.batch_since is None:
            st.batch_since = now
        d.batch_allowed = trough and now - st.batch_since >= self.settings.cooldown_s
        if d.batch_allowed:
            d.batch_tokens_per_s = d.spare_replicas * s.prefill_tokens_per_s


def batch_gate(signals: Mapping[str, PoolSignals], decisions: Mapping[str, Decision]) -> dict[str, float]:
    """Model -> its batch tiers' pace in tokens/s (OverloadLadder.apply holds them to it): its pools' paces
    together, but 0 unless every pool of the model allows batch (the router sends a request to the nearest pool with
    room, which may be the busy one)."""
    pace: dict[str, float] = {}
    closed: set[str] = set()
    for key, d in decisions.items():
        model = signals[key].model or key
        pace[model] = pace.get(model, 0.0) + d.batch_tokens_per_s
        if not d.batch_allowed:
            closed.add(model)
    return {model: 0.0 if model in closed else rate for model, rate in pace.items()}


def victims(replicas: list[ReplicaSignals], count: int) -> list[ReplicaSignals]:
    """Whom to drain: removable replicas taking requests, the least busy first (they empty soonest), then the
    newest (older ones hold warmer prefix caches)."""
    candidates = [r for r in replicas if not r.draining and r.healthy and r.removable]
    return sorted(candidates, key=lambda r: (r.busy, -r.started_at, r.name))[: max(0, count)]


def allocate(targets: Mapping[str, int], policies: Mapping[str, PoolPolicy], budget: int | None) -> dict[str, int]:
    """Targets cut to a shared budget: every pool keeps its minimum, then replicas go by priority (lower first),
    one at a time to the pool of the class furthest below its target."""
    if budget is None or sum(targets.values()) <= budget:
        return dict(targets)
    alloc = {n: min(policies[n].min_replicas, t) for n, t in targets.items()}
    left = budget - sum(alloc.values())
    for priority in sorted({policies[n].priority for n in targets}):
        group = sorted(n for n in targets if policies[n].priority == priority)
        while left > 0:
            short = [n for n in group if alloc[n] < targets[n]]
            if not short:
                break
            pick = min(short, key=lambda n: (alloc[n] / targets[n], n))
            alloc[pick] += 1
            left -= 1
    return alloc
