"""`tokenfleet simulate --config sim.yaml`: the YAML, checked before anything runs. Every mistake is a ValueError
naming the setting (negative rates, unknown GPUs or models, a model that does not fit its GPUs at that tensor
parallel degree, unknown keys).

Three layouts: a fixed fleet (`fleet.replicas`), one whose size the project's autoscaler sets while it runs
(`autoscale:`), and separate prefill and decode pools (`disagg:`). `experiment:` is left to the bench scripts that
read the same file (bench/sim_experiments.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from tokenfleet.autoscale.settings import AutoscaleSettings
from tokenfleet.dispatch.overload import OverloadSettings
from tokenfleet.dispatch.tiers import default_tiers
from tokenfleet.engine.scheduler import SchedulerConfig
from tokenfleet.router.policy import POLICIES
from tokenfleet.settings import section
from tokenfleet.sim.autoscaling import POOL, ScalingSetup
from tokenfleet.sim.cost_model import (
    CostModel,
    SpeculativeCostModel,
    StepCoefficients,
    kv_cache_blocks,
    roofline,
)
from tokenfleet.sim.disagg import DisaggFleet, DisaggSpec
from tokenfleet.sim.fleet import Fleet, FleetSetup
from tokenfleet.sim.hardware import GB, Hardware, hardware
from tokenfleet.sim.levers import MEASUREMENTS, Speculation, measured_kv_capacity, measured_speculation
from tokenfleet.sim.metrics import Slo
from tokenfleet.sim.models import ModelShape, dtype_bytes, model_shape
from tokenfleet.sim.numbers import is_finite, is_whole
from tokenfleet.sim.replica import ReplicaSpec
from tokenfleet.sim.workload import REAL, TIERS, WHOLE, Burst, WorkloadSpec

TOP = {
    "seed",
    "duration_s",
    "warmup_s",
    "drain_s",
    "fleet",
    "engine",
    "routing",
    "workload",
    "gateway",
    "slo",
    "autoscale",
    "disagg",
    "experiment",
    "levers",
}
FLEET = {
    "replicas",
    "gpu",
    "tensor_parallel",
    "model",
    "weight_dtype",
    "kv_dtype",
    "hardware",
    "cost",
    "swap_space_gib",
}
ENGINE = {
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "swap_threshold_tokens",
    "watermark",
    "enable_prefix_caching",
    "num_blocks",
    "fast",
}
ROUTING = {"policy", "load_bound", "affinity"}
GATEWAY = {"quota", "slots_per_replica", "quantum_tokens", "load_interval_s", "overload"}
SLO = {"ttft_s", "tpot_s"}
AUTOSCALE = {"cold_start_s", "settings"}
DISAGG = {
    "prefill_replicas",
    "decode_replicas",
    "link_gb_per_s",
    "link_efficiency",
    "transfer_latency_s",
    "prefill_batched_tokens",
}
LEVERS = {"speculative", "kv_capacity", "measurements"}
MIN_LOAD_INTERVAL_S = 0.001  # the router's load poll: shorter ones only multiply the simulated events (1e-9 hung)
DEFAULT_TTFT = {"enterprise": 1.0, "paid": 2.0, "free": 5.0, "batch": 600.0}


@dataclass
class Simulation:
    """A checked config: the fleet's setup and its layout (at most one of scaling and disagg)."""

    setup: FleetSetup
    scaling: ScalingSetup | None = None
    disagg: DisaggSpec | None = None

    def fleet(self) -> Fleet:
        return DisaggFleet(self.setup, self.disagg) if self.disagg else Fleet(self.setup)


def load_simulation(path: str | Path, seed: int | None = None) -> Simulation:
    return parse_simulation(_read(path), seed)


def parse_simulation(raw: dict, seed: int | None = None) -> Simulation:
    setup = parse(raw, seed)
    scaling, disagg = raw.get("autoscale"), raw.get("disagg")
    if scaling is not None and disagg is not None:
        raise ValueError("autoscale and disagg cannot be combined: the autoscaler sizes one pool")
    if scaling is not None:
        return Simulation(setup, scaling=_scaling(scaling))
    if disagg is not None:
        return Simulation(setup, disagg=_disagg(disagg, setup))
    return Simulation(setup)


def load(path: str | Path, seed: int | None = None) -> FleetSetup:
    return parse(_read(path), seed)


def _read(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no simulation config at {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a simulation config is a mapping of settings")
    return raw


def _keys(raw: dict | None, known: set[str], where: str) -> dict:
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return raw


def _number(
    value,
    where: str,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    above: bool = False,
    below: bool = False,
):
    """`value` as a finite number (a whole one when `integer`) from `low` to `high` (excluded when `above` /
    `below`), else a ValueError naming `where`. PyYAML reads 1e6 and 8.0e9 as strings (YAML 1.1): a string that
    float() reads is that number."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if integer and isinstance(number, float) and number.is_integer():
        number = int(number)
    ok = is_whole(number) if integer else is_finite(number)
    if ok and low is not None:
        ok = number > low if above else number >= low
    if ok and high is not None:
        ok = number < high if below else number <= high
    if not ok:
        kind = "a whole number" if integer else "a finite number"
        if low is not None and high is not None:
            bound = f" in {'(' if above else '['}{low}, {high}{')' if below else ']'}"
        elif low is not None:
            bound = f" {'>' if above else '>='} {low}"
        else:
            bound = ""
        raise ValueError(f"{where} must be {kind}{bound}, got {value!r}")
    return number


def _positive(value, where: str, integer: bool = False, zero: bool = False):
    return _number(value, where, integer, low=0, above=not zero)


def _flag(value, where: str) -> bool:
    """A YAML boolean (true / false): bool("false") would be True."""
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {value!r}")
    return value


def parse(raw: dict, seed: int | None = None) -> FleetSetup:
    raw = _keys(raw, TOP, "simulation config")
    fleet = _keys(raw.get("fleet"), FLEET, "fleet")
    engine = _keys(raw.get("engine"), ENGINE, "engine")
    routing = _keys(raw.get("routing"), ROUTING, "routing")
    gateway = _keys(raw.get("gateway"), GATEWAY, "gateway")
    duration = _positive(raw.get("duration_s", 600), "duration_s")
    warmup = _positive(raw.get("warmup_s", 0), "warmup_s", zero=True)
    if warmup >= duration:
        raise ValueError("warmup_s must be shorter than duration_s")
    model = _model(fleet.get("model", "llama-70b"))
    spec, cost, describe = _replica(fleet, engine, model, _levers(raw.get("levers")))
    workload = _workload(raw.get("workload"), model.max_model_len)
    policy = routing.get("policy", "cache_aware")
    if policy not in POLICIES:
        raise ValueError(f"routing.policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return FleetSetup(
        replicas=_positive(fleet.get("replicas", 1), "fleet.replicas", integer=True),
        spec=spec,
        cost=cost,
        workload=workload,
        tiers=default_tiers(),
        slo=_slo(raw.get("slo")),
        duration_s=float(duration),
        seed=_number(raw.get("seed", 0), "seed", integer=True) if seed is None else seed,
        warmup_s=float(warmup),
        drain_s=float(_positive(raw.get("drain_s", 120), "drain_s", zero=True)),
        policy=policy,
        load_bound=float(_number(routing.get("load_bound", 1.25), "routing.load_bound", low=1)),
        affinity=_flag(routing.get("affinity", True), "routing.affinity"),
        overload=section(OverloadSettings, gateway.get("overload"), "gateway.overload"),
        slots_per_replica=_positive(gateway.get("slots_per_replica", 256), "gateway.slots_per_replica", True),
        quantum_tokens=_positive(gateway.get("quantum_tokens", 2048), "gateway.quantum_tokens", True),
        load_interval_s=float(
            _number(gateway.get("load_interval_s", 1.0), "gateway.load_interval_s", low=MIN_LOAD_INTERVAL_S)
        ),
        quota=_flag(gateway.get("quota", True), "gateway.quota"),
        fast=_flag(engine.get("fast", True), "engine.fast"),
        gpus_per_replica=describe["tensor_parallel"],
        kv_bytes_per_token=describe.pop("_kv_token_bytes"),
        describe=describe,
    )


def _scaling(raw) -> ScalingSetup:
    raw = _keys(raw, AUTOSCALE, "autoscale")
    settings = section(AutoscaleSettings, raw.get("settings"), "autoscale.settings")
    unknown = sorted(set(settings.pools) - {POOL})
    if unknown:
        raise ValueError(
            f"autoscale.settings.pools: the simulated fleet is one pool named {POOL!r}, not {', '.join(unknown)}"
        )
    cold = _positive(raw.get("cold_start_s", settings.cold_start_s), "autoscale.cold_start_s", zero=True)
    return ScalingSetup(settings, cold_start_s=float(cold))


def _disagg(raw, setup: FleetSetup) -> DisaggSpec:
    raw = _keys(raw, DISAGG, "disagg")
    for name in ("prefill_replicas", "decode_replicas"):
        if name not in raw:
            raise ValueError(f"disagg.{name} is required (fleet.replicas is not used with disagg)")
    budget = raw.get("prefill_batched_tokens")
    spec = DisaggSpec(
        _positive(raw["prefill_replicas"], "disagg.prefill_replicas", integer=True),
        _positive(raw["decode_replicas"], "disagg.decode_replicas", integer=True),
        setup.kv_bytes_per_token,
        float(_positive(raw.get("link_gb_per_s", 50), "disagg.link_gb_per_s")) * GB,
        float(_number(raw.get("link_efficiency", 0.8), "disagg.link_efficiency", low=0, high=1, above=True)),
        float(_positive(raw.get("transfer_latency_s", 0.002), "disagg.transfer_latency_s", zero=True)),
        None if budget is None else _positive(budget, "disagg.prefill_batched_tokens", integer=True),
    )
    if setup.workload.cancel_probability > 0:
        raise ValueError("disagg does not model cancellations: set workload.cancel_probability to 0")
    return spec


def _model(raw) -> ModelShape:
    if isinstance(raw, str):
        return model_shape(raw)
    raw = _keys(
        raw,
        {"name", "params", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "max_model_len"},
        "fleet.model",
    )
    raw = {k: v if k == "name" else _positive(v, f"fleet.model.{k}", integer=k != "params") for k, v in raw.items()}
    try:
        return ModelShape(**{"name": "custom", **raw})
    except (TypeError, ValueError) as e:
        raise ValueError(f"fleet.model: {e}") from None


@dataclass(frozen=True)
class Levers:
    """The `levers:` section: speculative decoding and the FP8 KV cache's size, from the engine's measurements.
    Off by default, so a config without it prices nothing new."""

    speculation: Speculation | None = None
    fp8_kv_bytes_ratio: float | None = None  # measured bytes per token of an FP8 KV cache over a 16-bit one


def _levers(raw) -> Levers:
    raw = _keys(raw, LEVERS, "levers")
    folder = Path(str(raw.get("measurements", MEASUREMENTS)))
    speculation = None
    given = raw.get("speculative")
    if isinstance(given, str):
        speculation = measured_speculation(folder, given).speculation
    elif given is not None:
        speculation = _speculation(given)
    ratio = None
    capacity = raw.get("kv_capacity", "dtype")
    if capacity == "measured":
        ratio = measured_kv_capacity(folder).fp8_bytes_ratio()
    elif capacity != "dtype":
        raise ValueError(f"levers.kv_capacity must be dtype or measured, got {capacity!r}")
    return Levers(speculation, ratio)


def _speculation(raw) -> Speculation:
    raw = _keys(raw, {"num_speculative_tokens", "mean_accepted_length", "acceptance_rate"}, "levers.speculative")
    if ("mean_accepted_length" in raw) == ("acceptance_rate" in raw):
        raise ValueError("levers.speculative: give one of mean_accepted_length and acceptance_rate")
    k = _number(raw.get("num_speculative_tokens"), "levers.speculative.num_speculative_tokens", integer=True, low=1)
    try:
        if "acceptance_rate" in raw:
            rate = _number(raw["acceptance_rate"], "levers.speculative.acceptance_rate", low=0, high=1)
            return Speculation.from_acceptance_rate(k, float(rate), "levers.speculative")
        length = _number(raw["mean_accepted_length"], "levers.speculative.mean_accepted_length", low=1)
        return Speculation(k, float(length), "levers.speculative")
    except ValueError as e:
        raise ValueError(f"levers.speculative: {e}") from None


def _kv_token_bytes(model: ModelShape, kv_dtype: str, levers: Levers) -> float | None:
    """A measured KV size per token where the levers give one (an FP8 cache), else None: the dtype's bytes."""
    if levers.fp8_kv_bytes_ratio is None or kv_dtype != "fp8":
        return None
    return model.kv_bytes_per_token("fp16") * levers.fp8_kv_bytes_ratio


def _replica(
    fleet: dict, engine: dict, model: ModelShape, levers: Levers = Levers()
) -> tuple[ReplicaSpec, CostModel, dict]:
    gpu = hardware(str(fleet.get("gpu", "h100")))
    overrides = fleet.get("hardware")
    overrides = {} if overrides is None else overrides
    if not isinstance(overrides, dict):
        raise ValueError(f"fleet.hardware must be a mapping of hardware settings, got {overrides!r}")
    overrides = {
        k: _number(v, f"fleet.hardware.{k}", integer=k == "max_tp")
        if k in Hardware.__dataclass_fields__ and k != "name"
        else v
        for k, v in overrides.items()
    }
    try:
        gpu = gpu.with_overrides(**overrides)  # checks the values (division by zero, shares above 1)
    except ValueError as e:
        raise ValueError(f"fleet.hardware: {e}") from None
    tp = _number(fleet.get("tensor_parallel", 1), "fleet.tensor_parallel", integer=True)
    weight_dtype, kv_dtype = str(fleet.get("weight_dtype", "fp8")), str(fleet.get("kv_dtype", "fp16"))
    dtype_bytes(weight_dtype), dtype_bytes(kv_dtype)
    block_size = _positive(engine.get("block_size", 16), "engine.block_size", integer=True)
    try:
        measured_kv = _kv_token_bytes(model, kv_dtype, levers)
        blocks = kv_cache_blocks(model, gpu, weight_dtype, kv_dtype, tp, block_size, measured_kv)  # + tp, the fit
    except ValueError as e:
        raise ValueError(f"fleet: {e}") from None
    if "num_blocks" in engine:
        blocks = _positive(engine["num_blocks"], "engine.num_blocks", integer=True)
        one_sequence = -(-model.max_model_len // block_size)
        if blocks < one_sequence:
            raise ValueError(
                f"engine.num_blocks must be at least {one_sequence}: one {model.max_model_len}-token "
                f"sequence needs {one_sequence} blocks of {block_size} tokens, got {blocks}"
            )
    cost = fleet.get("cost")
    if cost is not None:
        cost = _keys(cost, set(StepCoefficients.__dataclass_fields__), "fleet.cost")
        cost = {k: v if k == "combine" else _number(v, f"fleet.cost.{k}", low=0) for k, v in cost.items()}
        try:
            coefficients = StepCoefficients(**cost)
        except (TypeError, ValueError) as e:
            raise ValueError(f"fleet.cost: {e}") from None
    else:
        coefficients = roofline(model, gpu, weight_dtype, kv_dtype, tp, block_size, measured_kv)
    swap_gib = _positive(fleet.get("swap_space_gib", 4 * tp), "fleet.swap_space_gib", zero=True)
    kv_token = model.kv_bytes_per_token(kv_dtype) if measured_kv is None else measured_kv
    host_blocks = int(swap_gib * (1 << 30) // (block_size * kv_token))
    scheduler = SchedulerConfig(
        max_num_seqs=_positive(engine.get("max_num_seqs", 256), "engine.max_num_seqs", integer=True),
        max_num_batched_tokens=_positive(
            engine.get("max_num_batched_tokens", 2048), "engine.max_num_batched_tokens", integer=True
        ),
        swap_threshold_tokens=_positive(
            engine.get("swap_threshold_tokens", 512), "engine.swap_threshold_tokens", integer=True, zero=True
        ),
    )
    watermark = float(_number(engine.get("watermark", 0.01), "engine.watermark", low=0, high=1, below=True))
    spec = ReplicaSpec(
        blocks,
        block_size,
        host_blocks,
        watermark,
        _flag(engine.get("enable_prefix_caching", True), "engine.enable_prefix_caching"),
        model.max_model_len,
        scheduler,
    )
    cost_model = (
        CostModel(coefficients)
        if levers.speculation is None
        else SpeculativeCostModel(coefficients, levers.speculation)
    )
    if not cost_model.prefill_time(2048) > 0:  # the fleet's prefill rate is 2048 tokens / this
        raise ValueError(
            "fleet.cost: a 2048-token prefill takes no time with these coefficients; give overhead_s, "
            "per_token_s or weights_s a value > 0"
        )
    describe = {
        "model": model.name,
        "gpu": gpu.name,
        "tensor_parallel": tp,
        "weight_dtype": weight_dtype,
        "kv_dtype": kv_dtype,
        "kv_cache_tokens_per_replica": blocks * block_size,
        "weights_gb": round(model.weight_bytes(weight_dtype) / GB, 1),
        "decode_step_ms_batch64_ctx2k": round(cost_model.decode_step_time(64, 2000) * 1000, 2),
        "prefill_ms_2048_tokens": round(cost_model.prefill_time(2048) * 1000, 2),
        **_describe_levers(levers, measured_kv),
        "_kv_token_bytes": kv_token,  # for the setup (parse pops it), not the report
    }
    return spec, cost_model, describe


def _describe_levers(levers: Levers, measured_kv: float | None) -> dict:
    """What the report says about the levers: nothing when none is on, so those reports stay as they were."""
    described: dict = {}
    if levers.speculation is not None:
        s = levers.speculation
        described["speculation"] = (
            f"k={s.num_speculative_tokens}, mean accepted length {s.mean_accepted_length:.3g} ({s.source})"
        )
    if measured_kv is not None:
        described["kv_bytes_per_token_measured"] = measured_kv
    return described


def _workload(raw: dict | None, max_model_len: int) -> WorkloadSpec:
    if raw is not None and not isinstance(raw, dict):
        raise ValueError("workload must be a mapping")
    raw = dict(raw or {})
    bursts = raw.pop("bursts", None) or []
    if not isinstance(bursts, list):
        raise ValueError("workload.bursts must be a list of {at_s, duration_s, multiplier}")
    parsed = []
    for i, b in enumerate(bursts):
        b = _keys(b, {"at_s", "duration_s", "multiplier"}, f"workload.bursts[{i}]")
        missing = sorted({"at_s", "duration_s", "multiplier"} - set(b))
        if missing:
            raise ValueError(f"workload.bursts[{i}]: missing {', '.join(missing)}")
        where = f"workload.bursts[{i}]"
        parsed.append(
            Burst(
                float(_positive(b["at_s"], f"{where}.at_s", zero=True)),
                float(_positive(b["duration_s"], f"{where}.duration_s")),
                float(_positive(b["multiplier"], f"{where}.multiplier", zero=True)),
            )
        )
    if "tiers" in raw and not isinstance(raw["tiers"], dict):
        raise ValueError("workload.tiers must map tier names to shares")
    for name in set(WHOLE) & set(raw):  # the types here (YAML's 1e6 is a string); the ranges in WorkloadSpec
        raw[name] = _number(raw[name], f"workload.{name}", integer=True)
    for name in set(REAL) & set(raw):
        raw[name] = _number(raw[name], f"workload.{name}")
    if "tiers" in raw:
        raw["tiers"] = {t: _positive(v, f"workload.tiers.{t}", zero=True) for t, v in raw["tiers"].items()}
    tokens = raw.get("system_prompt_tokens")
    if isinstance(tokens, list):
        raw["system_prompt_tokens"] = [_number(t, "workload.system_prompt_tokens", integer=True) for t in tokens]
    if raw.setdefault("max_model_len", max_model_len) > max_model_len:
        raise ValueError(
            f"workload.max_model_len must be at most the model's context, {max_model_len} tokens, "
            f"got {raw['max_model_len']}"
        )
    workload = section(WorkloadSpec, raw, "workload")
    return WorkloadSpec(
        **{**{f: getattr(workload, f) for f in WorkloadSpec.__dataclass_fields__}, "bursts": tuple(parsed)}
    )


def _slo(raw: dict | None) -> Slo:
    raw = _keys(raw, SLO, "slo")
    ttft = dict(DEFAULT_TTFT)
    given = raw.get("ttft_s", {})
    if not isinstance(given, dict):
        raise ValueError("slo.ttft_s must map tiers to seconds")
    for tier, value in given.items():
        if tier not in TIERS:
            raise ValueError(f"slo.ttft_s: unknown tier {tier!r}; known: {', '.join(TIERS)}")
        ttft[tier] = float(_positive(value, f"slo.ttft_s.{tier}"))
    return Slo(ttft, float(_positive(raw.get("tpot_s", 0.1), "slo.tpot_s")))
