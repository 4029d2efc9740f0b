"""The `autoscale:` section of fleet.yaml: the policy's targets and timings, per-pool bounds and forecasts, and how
decisions are carried out (a local orchestrator of replica processes, or none: metrics only, for KEDA or an HPA).
Impossible values are start-up errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from tokenfleet.autoscale.forecast import DAY_S, CurveForecast, Forecast, SeasonalForecast

ORCHESTRATORS = ("none", "local")
MODES = ("forecast", "reactive")


def _whole(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")


def _number(name: str, value: object, low: float, *, strict: bool = False, high: float = math.inf) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and not math.isnan(value)
        and (value > low if strict else value >= low)
        and value <= high
    )
    if not ok:
        bound = f"> {low:g}" if strict else f">= {low:g}"
        raise ValueError(
            f"{name} must be a number {bound}{'' if high == math.inf else f' and <= {high:g}'}, got {value!r}"
        )


@dataclass
class ForecastSpec:
    """Either `curve` (hour of the day -> requests/s, e.g. [[0, 2], [9, 40], [20, 10]]) or `learn: true` (a daily
    profile learned from the arrival rates seen, in buckets of `bucket_s`)."""

    curve: tuple = ()
    learn: bool = False
    period_s: float = DAY_S
    bucket_s: float = 900.0
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if bool(self.curve) == bool(self.learn):
            raise ValueError("forecast: give either curve (hour -> requests/s points) or learn: true")
        self.curve = tuple(tuple(point) for point in self.curve)
        self.build()  # validates

    def build(self) -> Forecast:
        if self.curve:
            return CurveForecast(self.curve, self.period_s)
        return SeasonalForecast(self.period_s, self.bucket_s, self.alpha)


@dataclass
class PoolPolicy:
    """One model pool's bounds and targets. A replica "carries" target_in_flight requests (running or queued for
    it); the pool wants enough replicas that no target is exceeded."""

    min_replicas: int = 1
    max_replicas: int = 4
    priority: int = 0  # under a shared budget, lower numbers get replicas first (as tiers' priority classes)
    target_in_flight: float = 32.0
    target_kv_usage: float = 0.8
    target_ttft_s: float = 1.0
    replica_rps: float = 0.0  # requests/s one replica serves within the targets: turns arrival rates into replicas
    forecast: ForecastSpec | None = None
    replica_args: tuple = ()  # extra `tokenfleet replica` flags for the local orchestrator (engine options)

    def __post_init__(self) -> None:
        _whole("min_replicas", self.min_replicas, 0)
        _whole("max_replicas", self.max_replicas, 1)
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        _whole("priority", self.priority, -1_000_000)
        _number("target_in_flight", self.target_in_flight, 0, strict=True)
        _number("target_kv_usage", self.target_kv_usage, 0, strict=True, high=1.0)
        _number("target_ttft_s", self.target_ttft_s, 0, strict=True)
        _number("replica_rps", self.replica_rps, 0)
        if isinstance(self.forecast, dict):
            self.forecast = ForecastSpec(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in self.forecast.items()}
            )
        if self.forecast is not None and not self.replica_rps > 0:
            raise ValueError("a forecast needs replica_rps > 0 (how many requests/s one replica serves)")
        if not all(isinstance(a, str) for a in self.replica_args):
            raise ValueError(f"replica_args must be a list of strings, got {list(self.replica_args)!r}")
        self.replica_args = tuple(self.replica_args)


@dataclass
class LocalSettings:
    """The local orchestrator: `tokenfleet replica` processes on this machine."""

    host: str = "127.0.0.1"
    log_dir: str = ""  # replica logs; default: a temporary folder
    drain_timeout_s: float = 30.0  # each replica's --drain-timeout (its SIGTERM drain limit)
    start_timeout_s: float = 600.0  # a replica not serving after this long is killed
    restart_backoff_s: float = 10.0  # after a replica failed to start, no new start of that pool for this long

    def __post_init__(self) -> None:
        _number("drain_timeout_s", self.drain_timeout_s, 0)
        _number("start_timeout_s", self.start_timeout_s, 0, strict=True)
        _number("restart_backoff_s", self.restart_backoff_s, 0)


@dataclass
class AutoscaleSettings:
    enabled: bool = False
    orchestrator: str = "none"  # local: start and stop replica processes here; none: export metrics only
    mode: str = "forecast"  # forecast: reactive signals + the forecast a cold start ahead + a warm buffer
    interval_s: float = 5.0  # how often the autoscaler decides
    cold_start_s: float = 300.0  # a new replica's time to serve (fetch and load weights): the forecast look-ahead
    warm_buffer: float = 0.2  # forecast mode: capacity kept above the need, as a fraction of it
    scale_down_delay_s: float = 300.0  # the need must stay below the replica count this long before shrinking
    cooldown_s: float = 60.0  # at least this long between a change and a step down
    scale_down_step: int = 1  # replicas removed per step down
    scale_down_utilization: float = 0.8  # shrink only when the smaller pool would run at or below this x targets
    drain_settle_s: float = 2.0  # a drained replica must look idle this long after its drain began (fresh reports)
    max_drain_s: float = 900.0  # a draining replica is stopped after this even if still busy (its SIGTERM drain)
    budget: int | None = None  # replicas across all pools (the GPUs there are); none: no shared limit
    batch_max_utilization: float = 0.5  # the batch tier runs while interactive need is at most this x ready
    batch_gate: bool = True  # batch tiers run only in the trough, paced to the spare replicas' prefill rate
    rate_window_s: float = 60.0  # smoothing of the measured arrival rate
    pools: dict = field(default_factory=dict)  # model (or model/region) -> PoolPolicy settings; else the defaults
    local: LocalSettings = field(default_factory=LocalSettings)

    def __post_init__(self) -> None:
        if self.orchestrator not in ORCHESTRATORS:
            raise ValueError(f"orchestrator must be one of {', '.join(ORCHESTRATORS)}, got {self.orchestrator!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("interval_s", "rate_window_s", "max_drain_s"):
            _number(name, getattr(self, name), 0, strict=True)
        for name in ("cold_start_s", "warm_buffer", "scale_down_delay_s", "cooldown_s", "drain_settle_s"):
            _number(name, getattr(self, name), 0)
        _whole("scale_down_step", self.scale_down_step, 1)
        _number("scale_down_utilization", self.scale_down_utilization, 0, strict=True, high=1.0)
        _number("batch_max_utilization", self.batch_max_utilization, 0, high=1.0)
        if self.budget is not None:
            _whole("budget", self.budget, 1)
        self.pools = {name: _pool(name, raw) for name, raw in (self.pools or {}).items()}
        if isinstance(self.local, dict):
            self.local = _nested(LocalSettings, self.local, "local")
        self.check_budget({key: key for key in self.pools})

    def pool(self, key: str, model: str = "") -> PoolPolicy:
        """A pool's settings: `pools` by its key (model/region), else by its model, else the defaults."""
        return self.pools.get(key) or self.pools.get(model) or PoolPolicy()

    def check_budget(self, pools: dict[str, str]) -> None:
        """The budget must at least hold every pool's minimum. `pools`: key -> model."""
        floor = sum(self.pool(key, model).min_replicas for key, model in pools.items())
        if self.budget is not None and floor > self.budget:
            raise ValueError(f"budget {self.budget} is below the pools' min_replicas together ({floor})")


def _nested(cls, raw: dict, where: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _pool(name: str, raw: object) -> PoolPolicy:
    if isinstance(raw, PoolPolicy):
        return raw
    if not isinstance(raw, dict):
        raise ValueError(f"pools.{name}: expected a mapping of settings, got {raw!r}")
    raw = dict(raw)
    if isinstance(raw.get("forecast"), dict):
        raw["forecast"] = _nested(ForecastSpec, raw["forecast"], f"pools.{name}.forecast")
    return _nested(PoolPolicy, raw, f"pools.{name}")
