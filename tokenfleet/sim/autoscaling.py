"""The project's autoscaler (tokenfleet/autoscale/policy.py) driving a simulated fleet.

Every `interval_s` of simulated time the pool's signals are read the way the gateway reads them
(`autoscale.signals.pool_signals` over the replicas' load reports and the dispatcher's snapshot; the arrival rate
by the same `RateMeter`), `Autoscaler.decide` decides, and its decision is carried out the way the local
orchestrator and the router carry it out:
- start: a replica is launched and joins the router `cold_start_s` later (fetching and loading weights); it holds
  its GPUs from the launch;
- drain / undrain: the router stops / resumes sending it requests; what it holds runs to the end;
- batch gate (`batch_gate`): the batch tiers run only while the decision allows them (the trough), at its pace
  (batch_tokens_per_s), as the gateway's admission does;
- remove: it is stopped once it is empty. The policy may ask to remove a replica still busy after `max_drain_s`;
  the simulator then waits for it to empty (a SIGTERM drain), so no request is ever dropped.

GPU-hours count every replica from its launch to its removal (starting, serving and draining alike).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.autoscale.forecast import CurveForecast, Forecast
from tokenfleet.autoscale.policy import Autoscaler, Decision, batch_gate
from tokenfleet.autoscale.settings import AutoscaleSettings
from tokenfleet.autoscale.signals import PoolSignals, RateMeter, ReplicaSignals, gateway_share, pool_signals
from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.workload import WorkloadSpec

POOL = "sim"


@dataclass
class ScalingSetup:
    settings: AutoscaleSettings  # the policy: mode, targets, look-ahead (its cold_start_s), buffer, pools["sim"]
    cold_start_s: float = 300.0  # what a start really takes in the simulation
    forecast: Forecast | None = None  # forecast mode; None: the workload's own curve (forecast_from_workload)

    def __post_init__(self) -> None:
        if not self.cold_start_s >= 0:
            raise ValueError(f"cold_start_s must be >= 0, got {self.cold_start_s!r}")


@dataclass
class ScalingRecord:
    """One decision, for the timeline."""

    t: float
    desired: int
    need: float
    ready: int
    starting: int
    draining: int
    arrival_rate: float
    forecast_rps: float | None
    projected_ttft_s: float
    kv_usage: float
    queued: int
    reason: str
    batch_allowed: bool = False
    batch_tokens_per_s: float = 0.0


@dataclass
class _Launch:
    number: int
    at: float


def forecast_from_workload(spec: WorkloadSpec, interactive_share: float, points: int = 96) -> CurveForecast:
    """The workload's diurnal curve (bursts left out: nobody forecasts a launch spike) as the autoscaler's
    `CurveForecast`, in interactive requests/s: as if learned from earlier days."""
    period = spec.diurnal_period_s
    base = WorkloadSpec(**{**{f: getattr(spec, f) for f in WorkloadSpec.__dataclass_fields__}, "bursts": ()})
    curve = [(24 * k / points, base.rate_at(period * k / points) * interactive_share) for k in range(points)]
    return CurveForecast(curve, period)


class ScaledFleet:
    """A Fleet whose replica count the autoscaler sets while it runs."""

    def __init__(self, fleet: Fleet, scaling: ScalingSetup) -> None:
        self.fleet, self.scaling, self.settings = fleet, scaling, scaling.settings
        batch = fleet.setup.overload.batch_tiers
        self.batch_tiers = tuple(batch)
        forecasts = {}
        if self.settings.mode == "forecast":
            share = _interactive_share(fleet.setup.workload, self.batch_tiers)
            forecasts[POOL] = scaling.forecast or forecast_from_workload(fleet.setup.workload, share)
        self.autoscaler = Autoscaler(self.settings, forecasts)
        self.rates = RateMeter(self.settings.rate_window_s)
        self.started_at = {r.name: 0.0 for r in fleet.replicas}
        self.launches: list[_Launch] = []
        self.stopping: set[str] = set()  # asked to be removed while still busy: stopped once empty
        self.records: list[ScalingRecord] = []
        self.events = {"started": 0, "drained": 0, "undrained": 0, "removed": 0}
        self.gpu_seconds = 0.0
        self._accounted_at = 0.0
        self._launched = 0

    def run(self) -> ScaledFleet:
        self.fleet.events.at(0.0, self._tick)
        self.fleet.run()
        self._account()
        return self

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600

    # --- reading ----------------------------------------------------------------------------------------------

    def signals(self, now: float) -> PoolSignals:
        fleet = self.fleet
        replicas = []
        for r in fleet.replicas:
            if r.name in self.stopping:
                continue
            s = r.report()
            replicas.append(
                ReplicaSignals(
                    r.name,
                    r.name in fleet.draining,
                    True,
                    s.running,
                    s.waiting,
                    s.in_flight,
                    s.kv_usage,
                    s.queued_tokens,
                    self.started_at[r.name],
                )
            )
        share = gateway_share(fleet.gateway.dispatcher.snapshot(), self.batch_tiers, self.rates, POOL, now)
        return pool_signals(POOL, replicas, share, fleet.prefill_tokens_per_s, starting=len(self.launches))

    # --- deciding and acting ----------------------------------------------------------------------------------

    def _tick(self) -> None:
        now = self.fleet.clock.now
        self._stop_emptied()
        signals = self.signals(now)
        decision = self.autoscaler.decide(now, {POOL: signals})[POOL]
        if self.settings.batch_gate:  # as the gateway's service: the ladder applies it at its next load update
            self.fleet.gateway.batch_pace = sum(batch_gate({POOL: signals}, {POOL: decision}).values())
        self._apply(decision, now)
        self._record(now, signals, decision)
        if now + self.settings.interval_s <= self.fleet.end_s:
            self.fleet.events.after(self.settings.interval_s, self._tick)

    def _apply(self, d: Decision, now: float) -> None:
        fleet = self.fleet
        for name in d.undrain:
            fleet.set_draining(name, False)
        for name in d.drain:
            fleet.set_draining(name, True)
        for name in d.remove:
            self.stopping.add(name)
        self.events["undrained"] += len(d.undrain)
        self.events["drained"] += len(d.drain)
        self._stop_emptied()
        for _ in range(d.start):
            self._launch(now)

    def _launch(self, now: float) -> None:
        self._account()
        self._launched += 1
        launch = _Launch(self._launched, now)
        self.launches.append(launch)
        self.events["started"] += 1
        self.fleet.events.after(self.scaling.cold_start_s, self._serving, launch)

    def _serving(self, launch: _Launch) -> None:
        """Its weights are loaded: it joins the router."""
        self._account()
        self.launches.remove(launch)
        replica = self.fleet.add_replica()
        self.started_at[replica.name] = launch.at

    def _stop_emptied(self) -> None:
        for name in sorted(self.stopping):
            if self.fleet.idle(name):
                self._account()
                self.fleet.remove_replica(name)
                self.stopping.discard(name)
                self.events["removed"] += 1

    def _account(self) -> None:
        """GPU time up to now of every replica holding GPUs (serving, draining, stopping or starting)."""
        now = self.fleet.clock.now
        held = len(self.fleet.replicas) + len(self.launches)
        self.gpu_seconds += held * self.fleet.setup.gpus_per_replica * (now - self._accounted_at)
        self._accounted_at = now

    def _record(self, now: float, s: PoolSignals, d: Decision) -> None:
        self.records.append(
            ScalingRecord(
                round(now, 6),
                d.desired,
                round(d.need, 4),
                s.ready,
                s.starting,
                s.draining,
                round(s.arrival_rate, 4),
                None if d.forecast_rps is None else round(d.forecast_rps, 4),
                round(min(s.projected_ttft_s, 1e9), 4),
                round(s.kv_usage_mean, 4),
                s.queued_requests,
                d.reason,
                d.batch_allowed,
                round(d.batch_tokens_per_s, 4),
            )
        )


def _interactive_share(spec: WorkloadSpec, batch_tiers: tuple[str, ...]) -> float:
    total = sum(spec.tiers.values())
    return sum(w for t, w in spec.tiers.items() if t not in batch_tiers) / total
